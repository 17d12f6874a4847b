#!/usr/bin/env python3
"""What keep_less costs in time (SPEC §2): hot.torch.ReLU and hot.torch.MaxPool2d against nn.ReLU and nn.MaxPool2d
on ResNet-50's shapes, forward and backward each, with a memory copy of the input in the same run as the floor's
yardstick (a ReLU reads and writes its map once, as a copy does). Median of CUDA-event timings, in us.

Usage (GPU): python benchmarks/bench_lean.py [--batch 128] [--dtype bf16] [--reps 20]
"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

import hot.torch as ht


def _time(fn, reps: int, setup=None) -> float:
    """Median us of fn() over reps calls, each after its own untimed setup() (whose result fn receives)."""
    out = []
    for _ in range(reps + 3):
        arg = setup() if setup else None
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(arg)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(out[3:])


def bench(mod, x: torch.Tensor, reps: int):
    """(forward us, backward us) of mod on a non-leaf copy of x, channels-last kept."""
    base = x.detach().requires_grad_(True)
    g = torch.randn_like(mod(x.detach()))

    def fresh():
        return base * 1  # a non-leaf input, as in a network (the in-place ReLU needs one)

    fwd = _time(lambda h: mod(h), reps, fresh)
    bwd = _time(lambda y: y.backward(g), reps, lambda: mod(fresh()))
    return fwd, bwd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; {a.dtype}, "
          f"batch {a.batch}; median of {a.reps}, us\n")
    print("| op | input (N, C, H, W) | layout | MB | copy | exact fwd | hot fwd | exact bwd | hot bwd | hot / exact (fwd+bwd) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    N = a.batch
    cases = [("ReLU (stem)", (N, 64, 112, 112), nn.ReLU(True), ht.ReLU(True)),
             ("ReLU (layer1 in)", (N, 64, 56, 56), nn.ReLU(True), ht.ReLU(True)),
             ("ReLU (layer1 out)", (N, 256, 56, 56), nn.ReLU(True), ht.ReLU(True)),
             ("ReLU (layer4 out)", (N, 2048, 7, 7), nn.ReLU(True), ht.ReLU(True)),
             ("MaxPool2d 3/2/1 (stem)", (N, 64, 112, 112), nn.MaxPool2d(3, 2, 1), ht.MaxPool2d(3, 2, 1))]
    cases = [c + (torch.channels_last,) for c in cases] + [cases[0] + (torch.contiguous_format,),
                                                             cases[-1] + (torch.contiguous_format,)]
    for name, shape, exact, lean, fmt in cases:
        x = torch.randn(shape, device=dev, dtype=dt).contiguous(memory_format=fmt)
        dst = torch.empty_like(x)
        copy = _time(lambda _: dst.copy_(x), a.reps)
        ef, eb = bench(exact, x, a.reps)
        hf, hb = bench(lean, x, a.reps)
        mb = x.numel() * x.element_size() / 1e6
        lay = "channels-last" if fmt == torch.channels_last else "NCHW"
        print(f"| {name} | {shape} | {lay} | {mb:.0f} | {copy:.0f} | {ef:.0f} | {hf:.0f} | {eb:.0f} | {hb:.0f} | "
              f"{(hf + hb) / (ef + eb):.2f}x |")


if __name__ == "__main__":
    main()
