#!/usr/bin/env python3
"""Where one layer's backward spends its GPU time: torch.profiler over a few backward passes of a single nn.Conv2d or
nn.Linear, exact against HOT (default configuration), kernels listed by total GPU time with their share.

Usage (GPU): python benchmarks/profile_layer.py conv N,C,H,W,O,k,stride,pad [--dtype bf16] [--iters 5]
                                                [--channels-last]
             python benchmarks/profile_layer.py linear L,I,O [--dtype bf16]
e.g. ResNet-50 layer1.0.conv2 at batch 64: conv 64,64,56,56,64,3,1,1; its conv1: conv 64,64,56,56,64,1,1,0.
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch import nn

import hot.torch as ht


def build(kind: str, spec: str, dtype, device):
    v = [int(s) for s in spec.split(",")]
    if kind == "conv":
        N, C, H, W, O, k, s, p = v
        return nn.Conv2d(C, O, k, s, p, bias=False).to(device, dtype), torch.randn(N, C, H, W, device=device, dtype=dtype)
    L, I, O = v
    return nn.Linear(I, O).to(device, dtype), torch.randn(L, I, device=device, dtype=dtype)


def profile(m, x, iters: int):
    x.requires_grad_(True)
    y = m(x)
    g = torch.randn_like(y)
    for _ in range(3):  # warm-up
        m(x).backward(g)
    torch.cuda.synchronize()
    ys = [m(x) for _ in range(iters)]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for y in ys:
            y.backward(g)
        torch.cuda.synchronize()
    per = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {k: v / iters for k, v in per.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["conv", "linear"])
    ap.add_argument("spec")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--channels-last", action="store_true", help="conv: the input and both layers channels-last")
    a = ap.parse_args()
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    torch.manual_seed(0)
    exact, x = build(a.kind, a.spec, dt, "cuda")
    seq = nn.Sequential(build(a.kind, a.spec, dt, "cuda")[0])
    ht.convert(seq)
    if a.channels_last and a.kind == "conv":
        cl = torch.channels_last
        exact, seq, x = exact.to(memory_format=cl), seq.to(memory_format=cl), x.contiguous(memory_format=cl)
    layout = " channels-last" if a.channels_last and a.kind == "conv" else ""
    print(f"# {a.kind} {a.spec} {a.dtype}{layout} on {torch.cuda.get_device_name()}, torch {torch.__version__}: backward "
          f"kernels, mean us per backward over {a.iters}")
    for name, m in (("exact", exact), ("HOT", seq[0])):
        per = profile(m, x.detach().clone(), a.iters)
        tot = sum(per.values())
        print(f"\n## {name}: {tot:.1f} us of GPU kernels per backward\n\n| kernel | us | share |\n|---|---|---|")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:a.top]:
            print(f"| {k[:110]} | {v:.1f} | {100 * v / tot:.0f}% |")


if __name__ == "__main__":
    main()
