#!/usr/bin/env python3
"""HLA on convolution feature maps: 16 consecutive rows of the flattened N*H*W dimension (what the engine does) against
16 rows that form a 4x4 spatial patch of one image (issue 17, item 3), measured on real gradients.

For every Conv2d of a CNN trained for a while (exact training: the gradients a layer sees mid-training), one batch's
layer input x and output gradient g_y are captured. The weight gradient g_w = g_y^T X (X: the im2col columns,
F.unfold's matrix, rows (n, h, w)) is computed exactly in float64, and again from the HLA projections of both operands
(hot.hla, ranks 4, 8, 12; rank 16 is an orthogonal rotation and loses nothing), rows in either order. A common row
permutation leaves g_y^T X unchanged, so the difference is the projection's alone. Reported: the relative Frobenius
error ||g_w~ - g_w|| / ||g_w|| per layer and its mean over the layers, per order and rank (no quantisation: that noise
is unbiased and the same for both orders).

Usage (CPU): python benchmarks/hla_patch_order.py [--task digits|synth] [--steps N] [--seeds 0,1,2]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot
from hot.experiments import models

RANKS = (4, 8, 12)


def patch_order(n: int, h: int, w: int) -> np.ndarray:
    """Row indices (into rows ordered n, h, w) that list each image's 4x4 patches one after another, patch rows
    in raster order, patches in raster order; h and w multiples of 4."""
    idx = np.arange(n * h * w).reshape(n, h // 4, 4, w // 4, 4)
    return idx.transpose(0, 1, 3, 2, 4).reshape(-1)


def hla_gw(gy: np.ndarray, cols: np.ndarray, rank: int) -> np.ndarray:
    """g_w from the HLA projections of both operands (float64 of hot.hla's float32 output); hot.hla's blocks are
    H_16 rows without the 1/4 normalisation, so the product carries a factor 16."""
    a = np.asarray(hot.hla(gy.astype(np.float32), rank), dtype=np.float64)
    b = np.asarray(hot.hla(cols.astype(np.float32), rank), dtype=np.float64)
    return a.T @ b / 16.0


def capture(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """[(name, conv, input, output gradient)] for every Conv2d of model on one batch."""
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    ins, outs = {}, {}
    hooks = []
    for n, m in convs:
        def fwd(mod, args, out, n=n):
            ins[n] = args[0].detach()
            out.retain_grad()
            outs[n] = out
        hooks.append(m.register_forward_hook(fwd))
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for h in hooks:
        h.remove()
    return [(n, m, ins[n], outs[n].grad.detach()) for n, m in convs]


def measure(model, x, y):
    rows = []
    for name, conv, xin, gy in capture(model, x, y):
        N, O, Ho, Wo = gy.shape
        if Ho % 4 or Wo % 4:
            continue
        cols = F.unfold(xin.double(), conv.kernel_size, dilation=conv.dilation, padding=conv.padding,
                        stride=conv.stride)  # N x C*kh*kw x Ho*Wo
        X = cols.transpose(1, 2).reshape(N * Ho * Wo, -1).numpy()
        G = gy.double().permute(0, 2, 3, 1).reshape(N * Ho * Wo, O).numpy()
        exact = G.T @ X
        nrm = np.linalg.norm(exact)
        perm = patch_order(N, Ho, Wo)
        r = {"layer": name, "L": N * Ho * Wo, "hw": f"{Ho}x{Wo}"}
        for rank in RANKS:
            r[("rows", rank)] = np.linalg.norm(hla_gw(G, X, rank) - exact) / nrm
            r[("patch", rank)] = np.linalg.norm(hla_gw(G[perm], X[perm], rank) - exact) / nrm
        rows.append(r)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="digits", choices=("digits", "synth"))
    ap.add_argument("--steps", type=int, default=300, help="exact training steps before the measurement")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batch", type=int, default=128)
    a = ap.parse_args()
    if a.task == "digits":
        from hot.experiments.train import load_digits
        xtr, ytr, _, _ = load_digits("cpu")
        name = "cnn"
    else:
        from hot.experiments.synth import load_synth
        xtr, ytr, _, _ = load_synth("cpu", n_train=8192, n_test=16)
        name = "cnn_synth"
    means = {}
    for seed in [int(s) for s in a.seeds.split(",")]:
        torch.manual_seed(seed)
        model = models.build(name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed)
        for _ in range(a.steps):
            i = torch.randint(0, len(xtr), (a.batch,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(xtr[i]), ytr[i]).backward()
            opt.step()
        i = torch.randint(0, len(xtr), (a.batch,), generator=g)
        model.zero_grad()
        rows = measure(model, xtr[i], ytr[i])
        print(f"seed {seed}: {name}, {a.steps} exact steps, batch {a.batch}; relative g_w error of the projection")
        print("| layer | L | H x W | " + " | ".join(f"rows r{r} | patch r{r}" for r in RANKS) + " |")
        print("|---" * (3 + 2 * len(RANKS)) + "|")
        for r in rows:
            print(f"| {r['layer']} | {r['L']} | {r['hw']} | " +
                  " | ".join(f"{r[('rows', k)]:.3f} | {r[('patch', k)]:.3f}" for k in RANKS) + " |")
            for k in RANKS:
                for o in ("rows", "patch"):
                    means.setdefault((o, k), []).append(r[(o, k)])
        print()
    print("Mean over layers and seeds: " + "; ".join(
        f"rank {k}: rows {statistics.mean(means[('rows', k)]):.3f}, patch {statistics.mean(means[('patch', k)]):.3f}"
        for k in RANKS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
