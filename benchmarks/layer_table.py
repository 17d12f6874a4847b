#!/usr/bin/env python3
"""A model's converted layers one shape at a time: for every distinct Conv2d (groups = 1) and Linear shape of a
bench_models task (torchvision's ResNet-50 channels-last, timm's ViT-B/16; bf16 autocast, the task's batch), the GPU
kernels of the layer's forward and of its backward, exact (cuDNN / cuBLAS) against HOT at the default
configuration, HOT's backward kernels grouped by pass, and the totals weighted by how often each shape occurs.
Where a whole-model step's gap to exact is, shape by shape (torch.profiler). Each layer runs alone on a leaf input,
so its forward keeps its own compressed copy (in the model, an input its producer keeps is compressed in the
backward instead); an input that needs no gradient in the model (the image) gets none here.

Usage (GPU): python benchmarks/layer_table.py --model resnet50|vit_b16 [--batch 128] [--iters 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as bm  # noqa: E402

import hot.torch as ht  # noqa: E402

GROUPS = (("integer GEMMs", ("GemmUniversal", "ImplicitGemmConvolution", "reduce_s32", "apply_s32", "conv_setup")),
          ("g_y pass", ("qgo",)), ("columns", ("compress_columns",)), ("W~", ("weight_",)),
          ("map, col2im", ("quantize_flat", "amax_flat", "transpose", "col2im", "im2col")))
NAMES = [g for g, _ in GROUPS] + ["other"]


def group(name: str) -> str:
    for g, keys in GROUPS:
        if any(k in name for k in keys):
            return g
    return "other"


def shapes(task, batch: int, channels_last: bool):
    """(kind, input shape, layer arguments, input needs grad, input dtype) -> count, of the model's Conv2d (groups = 1) and Linear
    layers, from one forward."""
    m = bm.layout(task.build().to("cuda"), channels_last)
    seen = collections.Counter()

    def hook(mod, inp, out):
        x = inp[0]
        if isinstance(mod, nn.Conv2d):
            key = ("conv", tuple(x.shape), (mod.out_channels, mod.kernel_size[0], mod.stride[0], mod.padding[0]))
        else:
            key = ("linear", tuple(x.shape), (mod.out_features, mod.bias is not None))
        seen[key + (x.requires_grad, str(x.dtype).replace("torch.", ""))] += 1
    hs = [c.register_forward_hook(hook) for c in m.modules()
          if isinstance(c, nn.Linear) or (isinstance(c, nn.Conv2d) and c.groups == 1)]
    x, _ = task.make_batch(batch, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        m(bm.layout(x, channels_last))
    for h in hs:
        h.remove()
    return seen


def build(kind, xshape, args, channels_last: bool):
    if kind == "conv":
        O, k, s, p = args
        m = nn.Conv2d(xshape[1], O, k, s, p, bias=False)
    else:
        O, bias = args
        m = nn.Linear(xshape[-1], O, bias=bias)
    return bm.layout(m.to("cuda"), channels_last)


def kernels(m, x, iters: int):
    """GPU kernel time (us per call) by kernel name, of the forward and of the backward, over iters calls each."""
    ac = torch.autocast("cuda", dtype=torch.bfloat16)
    with ac:
        g = torch.randn_like(m(x))
    for _ in range(3):
        with ac:
            y = m(x)
        y.backward(g)
        x.grad = None  # no accumulation into x.grad (an add the model's step does not have)
    torch.cuda.synchronize()
    per = {"fwd": collections.Counter(), "bwd": collections.Counter()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with ac:
            ys = [m(x) for _ in range(iters)]
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per["fwd"][e.name] += e.device_time_total / iters
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for y in ys:
            y.backward(g)
            x.grad = None
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per["bwd"][e.name] += e.device_time_total / iters
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50", choices=("resnet50", "vit_b16"))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    task = bm.gpu_task("layer_table", a)
    if task is None:
        return 2
    cl = a.model == "resnet50"
    lines = [f"# {a.model}'s converted layer shapes, GPU kernels per call (us), b{a.batch}, bf16 autocast"
             + (", channels-last" if cl else ""), "",
             f"{torch.cuda.get_device_name()}; torch {torch.__version__}; mean of {a.iters} calls", "",
             "| layer (input -> O, kernel / stride) | count | exact fwd | HOT fwd | exact bwd | HOT bwd | "
             "HOT / exact (fwd + bwd) | " + " | ".join(f"bwd: {n}" for n in NAMES) + " |",
             "|---" * (7 + len(NAMES)) + "|"]
    tot = collections.Counter()
    for (kind, xs, args, needs, dt), n in sorted(shapes(task, a.batch, cl).items(), key=lambda kv: str(kv[0])):
        torch.manual_seed(0)
        exact = build(kind, xs, args, cl)
        seq = nn.Sequential(build(kind, xs, args, cl))
        ht.convert(seq)
        x = bm.layout(torch.randn(xs, device="cuda", dtype=getattr(torch, dt)), cl).requires_grad_(needs)
        pe, ph = kernels(exact, x, a.iters), kernels(seq[0], x, a.iters)
        ef, eb, hf, hb = (sum(p[r].values()) for p in (pe, ph) for r in ("fwd", "bwd"))
        by = collections.Counter()
        for name, us in ph["bwd"].items():
            by[group(name)] += us
        for k, v in (("exact fwd", ef), ("HOT fwd", hf), ("exact bwd", eb), ("HOT bwd", hb)):
            tot[k] += n * v
        for g in NAMES:
            tot[g] += n * by[g]
        what = (f"{xs[1]}, {xs[2]}x{xs[3]} -> {args[0]}, {args[1]}x{args[1]} / {args[2]}" if kind == "conv" else
                f"linear {'x'.join(map(str, xs))} -> {args[0]}") + f" ({dt})"
        lines.append(f"| {what} | {n} | {ef:.1f} | {hf:.1f} | {eb:.1f} | {hb:.1f} | {(hf + hb) / (ef + eb):.2f} | "
                     + " | ".join(f"{by[g]:.1f}" for g in NAMES) + " |")
    lines.append(f"| all (count-weighted), ms | | {tot['exact fwd'] / 1e3:.2f} | {tot['HOT fwd'] / 1e3:.2f} | "
                 f"{tot['exact bwd'] / 1e3:.2f} | {tot['HOT bwd'] / 1e3:.2f} | "
                 f"{(tot['HOT fwd'] + tot['HOT bwd']) / (tot['exact fwd'] + tot['exact bwd']):.2f} | "
                 + " | ".join(f"{tot[g] / 1e3:.2f}" for g in NAMES) + " |")
    text = "\n".join(lines)
    print(text)
    out = a.out or os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"layer_table_{a.model}_b{a.batch}.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
