#!/usr/bin/env python3
"""The cost of a seed in device memory (SPEC §5): hot.backward_linear with an integer seed (the g_y pass's round keys
in its kernel parameters) against the same call with a one-element int64 seed tensor on the GPU (pass 2 reads the
seed and forms the round keys per Philox call), ViT-B and LLaMA shapes, bf16, same run, interleaved. The results
are the same bits (tested); only the time differs.

Usage (GPU): python benchmarks/seed_source.py [--iters 50]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import hot

SHAPES = {"ViT-B qkv": (25216, 2304, 768), "ViT-B fc1": (25216, 3072, 768), "ViT-B fc2": (25216, 768, 3072),
          "LLaMA-8B up": (2048, 14336, 4096)}


def time_ms(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("seed_source: needs a CUDA GPU")
        return 2
    print(f"# hot.backward_linear, bf16, integer seed against a seed tensor on the GPU\n\n{torch.cuda.get_device_name()};"
          f" torch {torch.__version__}; hot {hot.__version__}; median of {a.rounds} rounds of {a.iters} calls (CUDA "
          f"events), the two interleaved\n")
    print("| layer (L, O, I) | integer seed us | seed tensor us | tensor / integer |\n|---|---|---|---|")
    for name, (L, O, I) in SHAPES.items():
        torch.manual_seed(0)
        gy = torch.randn(L, O, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(O, I, device="cuda") * 0.02).to(torch.bfloat16)
        saved = hot.compress_activation(torch.randn(L, I, device="cuda", dtype=torch.bfloat16))
        seed_t = torch.tensor(12345, dtype=torch.int64, device="cuda")
        runs = {"int": [], "tensor": []}
        for _ in range(a.rounds):
            runs["int"].append(time_ms(lambda: hot.backward_linear(gy, w, saved, seed=12345, bias=True), a.iters))
            runs["tensor"].append(time_ms(lambda: hot.backward_linear(gy, w, saved, seed=seed_t, bias=True), a.iters))
        ti, tt = statistics.median(runs["int"]) * 1e3, statistics.median(runs["tensor"]) * 1e3
        print(f"| {name} ({L}, {O}, {I}) | {ti:.1f} | {tt:.1f} | {tt / ti:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
