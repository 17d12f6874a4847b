#!/usr/bin/env python3
"""ResNet-50's convolutions one shape at a time: the backward's GPU kernels of each distinct conv shape of
torchvision's ResNet-50 (channels-last, bf16, the model's batch), exact (cuDNN) against HOT at the default
configuration, HOT's kernels grouped by pass, and the totals weighted by how often each shape occurs in the model.
Where a whole-model step's gap to exact is, shape by shape (torch.profiler; the stem's g_x is not formed, as in the
model, where the image needs no gradient).

Usage (GPU): python benchmarks/resnet_layers.py [--batch 128] [--iters 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import os

import torch
from torch import nn

import hot.torch as ht

GROUPS = (("integer GEMMs", ("GemmUniversal", "ImplicitGemmConvolution", "reduce_s32", "apply_s32", "conv_setup")),
          ("g_y pass", ("qgo",)), ("columns", ("compress_columns",)), ("W~", ("weight_",)),
          ("map, col2im", ("quantize_flat", "amax_flat", "transpose", "col2im")))


def group(name: str) -> str:
    for g, keys in GROUPS:
        if any(k in name for k in keys):
            return g
    return "other"


def shapes(batch: int):
    """(N, C, H, W, O, k, stride, pad) -> count, of every Conv2d of torchvision's ResNet-50."""
    import torchvision
    m = torchvision.models.resnet50().to("cuda", torch.bfloat16).to(memory_format=torch.channels_last)
    seen = collections.Counter()

    def hook(mod, inp, out):
        N, C, H, W = inp[0].shape
        seen[(N, C, H, W, mod.out_channels, mod.kernel_size[0], mod.stride[0], mod.padding[0])] += 1
    hs = [c.register_forward_hook(hook) for c in m.modules() if isinstance(c, nn.Conv2d)]
    with torch.no_grad():
        m(torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last))
    for h in hs:
        h.remove()
    return seen


def backward_kernels(m, x, iters: int):
    """GPU kernel time (us per backward) by kernel name, over iters backward passes of m at x."""
    y = m(x)
    g = torch.randn_like(y)
    for _ in range(3):
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
            per[e.name] += e.device_time_total
    return {k: v / iters for k, v in per.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("resnet_layers: needs a CUDA GPU")
        return 2
    cl, bf = torch.channels_last, torch.bfloat16
    names = [g for g, _ in GROUPS] + ["other"]
    lines = [f"# ResNet-50's conv shapes, backward kernels (us per backward), b{a.batch}, bf16, channels-last",
             "", f"{torch.cuda.get_device_name()}; torch {torch.__version__}; mean of {a.iters} backward passes", "",
             "| C, H, W -> O, k / s | count | exact us | HOT us | HOT / exact | " + " | ".join(names) + " |",
             "|---" * (5 + len(names)) + "|"]
    tot = collections.Counter()
    for (N, C, H, W, O, k, s, p), n in sorted(shapes(a.batch).items(), key=lambda kv: (-kv[0][2], kv[0][1])):
        torch.manual_seed(0)
        exact = nn.Conv2d(C, O, k, s, p, bias=False).to("cuda", bf).to(memory_format=cl)
        seq = nn.Sequential(nn.Conv2d(C, O, k, s, p, bias=False).to("cuda", bf).to(memory_format=cl))
        ht.convert(seq)
        x = torch.randn(N, C, H, W, device="cuda", dtype=bf).contiguous(memory_format=cl)
        x.requires_grad_(C != 3)  # the stem's image needs no gradient
        te = sum(backward_kernels(exact, x, a.iters).values())
        per = collections.Counter()
        for name, us in backward_kernels(seq[0], x, a.iters).items():
            per[group(name)] += us
        th = sum(per.values())
        tot["exact"] += n * te
        tot["HOT"] += n * th
        for g in names:
            tot[g] += n * per[g]
        lines.append(f"| {C}, {H}x{W} -> {O}, {k}x{k} / {s} | {n} | {te:.1f} | {th:.1f} | {th / te:.2f} | "
                     + " | ".join(f"{per[g]:.1f}" for g in names) + " |")
    lines.append(f"| all convs (count-weighted), ms | | {tot['exact'] / 1e3:.2f} | {tot['HOT'] / 1e3:.2f} | "
                 f"{tot['HOT'] / tot['exact']:.2f} | " + " | ".join(f"{tot[g] / 1e3:.2f}" for g in names) + " |")
    text = "\n".join(lines)
    print(text)
    out = a.out or os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"resnet_layers_b{a.batch}.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
