#!/usr/bin/env python3
"""Per-convolution g_w relative error (against float64) of the columns' path (``hot``'s linear numerics on the
columns: rotation along the pixels, HLA at rank 16, hot's convolution default until 2026-11-29) and of ``hot-gxcodes``
(g_w from the codes of G~ against the int8 map's columns, no rotation along the pixels: the convolution default since
then, SPEC §4; benchmarks/NOTES.md plan item 22), on a small
bottleneck ResNet with BatchNorm trained exact on the synthetic 32x32 images (hot.experiments.synth) for STEPS steps
of batch 32; one captured batch of 32, the mean over 4 rounding seeds per layer. CPU, one thread (~5 minutes at 100
steps on a busy 2-core VM).

Usage: python benchmarks/conv_gw_fidelity.py [STEPS]   (default 100)
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot.experiments.analysis as ha
from hot.experiments.synth import load_synth

METHODS = ("hot", "hot-gxcodes")
SEEDS = (100, 101, 102, 103)


def conv_bn(ci: int, co: int, k: int, s: int = 1, relu: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(ci, co, k, s, k // 2, bias=False), nn.BatchNorm2d(co)]
    return nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)


class Bottleneck(nn.Module):
    def __init__(self, ci: int, mid: int, co: int, s: int):
        super().__init__()
        self.a, self.b, self.c = conv_bn(ci, mid, 1), conv_bn(mid, mid, 3, s), conv_bn(mid, co, 1, relu=False)
        self.sc = conv_bn(ci, co, 1, s, relu=False) if (s != 1 or ci != co) else nn.Identity()

    def forward(self, x):
        return F.relu(self.c(self.b(self.a(x))) + self.sc(x))


def model() -> nn.Module:
    return nn.Sequential(conv_bn(3, 32, 3), Bottleneck(32, 32, 128, 1), Bottleneck(128, 32, 128, 1),
                         Bottleneck(128, 64, 256, 2), Bottleneck(256, 64, 256, 1), Bottleneck(256, 128, 512, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))


def capture(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """{conv name: (its input, its output's gradient)} of one exact backward."""
    caps = {}

    def hook(name):
        def fwd(m, inp, out):
            caps[name] = [inp[0].detach()]
            out.register_hook(lambda gy: caps[name].append(gy.detach()))
        return fwd

    hs = [m.register_forward_hook(hook(n)) for n, m in net.named_modules() if isinstance(m, nn.Conv2d)]
    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    for h in hs:
        h.remove()
    return caps


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = model()
    xtr, ytr, _, _ = load_synth(n_train=20000, n_test=10)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(1)
    t = time.time()
    loss = torch.zeros(())
    for _ in range(steps):
        idx = torch.randint(0, len(xtr), (32,), generator=g)
        loss = F.cross_entropy(net(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"trained {steps} exact steps in {time.time() - t:.0f} s, last loss {loss.item():.3f}", flush=True)
    idx = torch.randint(0, len(xtr), (32,), generator=g)
    caps = capture(net, xtr[idx], ytr[idx])
    print("| conv | L x CKK x O | " + " | ".join(f"{m} g_w error" for m in METHODS) + " |")
    print("|---|---|" + "---|" * len(METHODS))
    res = {m: [] for m in METHODS}
    for n, m in net.named_modules():
        if not isinstance(m, nn.Conv2d) or n not in caps:
            continue
        x, gy = caps[n]
        cols = F.unfold(x.double(), m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
        X = cols.transpose(1, 2).reshape(-1, cols.shape[1])
        G = gy.double().permute(0, 2, 3, 1).reshape(-1, m.out_channels)
        ref = (G.T @ X).numpy()
        W = m.weight.detach().reshape(m.out_channels, -1).float().numpy()
        for meth in METHODS:
            errs = []
            for seed in SEEDS:
                _, gw = ha.method_fn(meth)(X.float().numpy(), W, G.float().numpy(), seed)
                errs.append(np.linalg.norm(np.asarray(gw, dtype=np.float64) - ref) / np.linalg.norm(ref))
            res[meth].append(float(np.mean(errs)))
        cells = " | ".join(f"{res[meth][-1]:.4f}" for meth in METHODS)
        print(f"| {n} | {X.shape[0]}x{X.shape[1]}x{m.out_channels} | {cells} |", flush=True)
    for what, f in (("mean", np.mean), ("median", np.median)):
        print(f"| {what} | | " + " | ".join(f"{f(res[meth]):.4f}" for meth in METHODS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
