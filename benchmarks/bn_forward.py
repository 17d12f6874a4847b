"""BatchNorm's training forward on the GPU: torch's kernels against the engine's, on ResNet-50's BatchNorm shapes.

For every BatchNorm2d shape of torchvision's ResNet-50 at the given batch (channels-last bf16), the GPU time of one
call (10 calls recorded in a CUDA graph, the median of 5 replays) of torch.batch_norm_stats (the batch statistics of
exact training's forward), torch.native_batch_norm (its whole forward: statistics, running statistics, y),
torch.batch_norm_elemt (y from the statistics), hot.batch_norm_stats (SPEC §2 "BatchNorm's statistics"), the engine's
whole forward as the converted BatchNorm runs it (statistics with the running statistics' update, then y),
hot.batch_norm_transform, and a bf16 copy of the map (the bytes the transform moves); the largest differences of the
engine's mean and invstd from torch's (relative), and how many elements of the engine's y differ from torch's
batch_norm_elemt of the engine's statistics.

    python benchmarks/bn_forward.py [--batch 128] [--out DIR]
"""
from __future__ import annotations

import argparse

import torch

import hot
from hot import _api
from hot.torch.ops import _call
from bn_backward import bn_shapes, report, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--out", default=None, help="directory for bn_forward.md (default: print only)")
    args = ap.parse_args()
    torch.manual_seed(0)
    lines = [f"# BatchNorm's training forward, ResNet-50's shapes at batch {args.batch}, channels-last bf16 "
             "(us a call)", "", f"{torch.cuda.get_device_name()}; torch {torch.__version__}; hot {hot.__version__}",
             "", "| N,C,H,W | BNs | torch stats | torch forward | torch elemt | hot stats | hot forward | "
             "hot transform | copy | mean, invstd vs torch's | y unequal to torch's elemt |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = ("stats", "forward", "elemt", "hstats", "hforward", "htransform", "copy")
    total = dict.fromkeys(keys, 0.0)
    eps = 1e-5
    for shape, n in bn_shapes(args.batch).items():
        N, C, H, W = shape
        x = (torch.randn(shape, device="cuda") * 2 + 0.3).to(torch.bfloat16).to(memory_format=torch.channels_last)
        w, b = torch.rand(C, device="cuda") + 0.5, torch.randn(C, device="cuda")
        rm, rv = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")
        rows = x.permute(0, 2, 3, 1).reshape(-1, C)  # a view of the channels-last map
        y = torch.empty_like(x)
        yrows = y.permute(0, 2, 3, 1).reshape(-1, C)
        mean, invstd = hot.batch_norm_stats(rows, eps)

        def hforward():  # as the converted BatchNorm calls the engine (the call's stream: the current one)
            m, i = _api._batch_norm_stats(_call("batch_norm_stats", x), rows, eps, rm, rv, 0.1)
            _api._batch_norm_transform(_call("batch_norm_transform", x), rows, m, i, w, b, yrows)

        fns = {"stats": lambda: torch.batch_norm_stats(x, eps),
               "forward": lambda: torch.native_batch_norm(x, w, b, rm, rv, True, 0.1, eps),
               "elemt": lambda: torch.batch_norm_elemt(x, w, b, mean, invstd, eps),
               "hstats": lambda: hot.batch_norm_stats(rows, eps),
               "hforward": hforward,
               "htransform": lambda: _api._batch_norm_transform(_call("batch_norm_transform", x), rows, mean, invstd,
                                                                w, b, yrows),
               "copy": lambda: y.copy_(x)}
        t = {k: timed(f) for k, f in fns.items()}
        tm, ti = torch.batch_norm_stats(x, eps)
        rel = max(float(((a - r).abs() / r.abs().clamp_min(1e-30)).max()) for a, r in ((mean, tm), (invstd, ti)))
        ref = fns["elemt"]()
        got = hot.batch_norm_transform(rows, mean, invstd, w, b)
        unequal = int((got.view(torch.int16) != ref.permute(0, 2, 3, 1).reshape(-1, C).view(torch.int16)).sum())
        for k in keys:
            total[k] += n * t[k]
        lines.append(f"| {N},{C},{H},{W} | {n} | " + " | ".join(f"{t[k]:.1f}" for k in keys) +
                     f" | {rel:.1e} | {unequal} of {got.numel()} |")
    lines.append("| a step (x BNs) | | " + " | ".join(f"{total[k]:.0f}" for k in keys) + " | | |")
    report(lines, args.out, "bn_forward.md")


if __name__ == "__main__":
    main()
