"""BatchNorm's input gradient on the GPU: torch's kernels against the engine's, on ResNet-50's BatchNorm shapes.

For every BatchNorm2d shape of torchvision's ResNet-50 at the given batch (channels-last bf16), the GPU time of one
call (10 calls recorded in a CUDA graph, the median of 5 replays) of torch.batch_norm_backward_reduce (exact training's
per-channel sums), hot.batch_norm_backward_reduce (the converted BatchNorm's, SPEC §2), torch.batch_norm_backward_elemt
(exact training's g_x), hot.batch_norm_backward_input (g_x and G~'s amax, SPEC §2 "BatchNorm's hand-over") and a bf16
add that moves the same bytes as the element-wise kernels (two tensors read, one written); how many elements of hot's
g_x differ from torch's given torch's sums (SPEC: none), and the largest difference between hot's sums and torch's,
relative to the sum of the terms' magnitudes.

    python benchmarks/bn_backward.py [--batch 128] [--out DIR]
"""
from __future__ import annotations

import argparse
import os

import torch
import torchvision

import hot


def timed(fn, reps: int = 10, replays: int = 5) -> float:
    """GPU microseconds of one call of fn: reps calls recorded in a CUDA graph, the median of the replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / reps * 1000.0)
    return sorted(ts)[len(ts) // 2]


def report(lines, out, name: str) -> None:
    """Prints the table's lines and, with a directory `out`, writes them to out/name."""
    text = "\n".join(lines)
    print(text)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            f.write(text + "\n")


def bn_shapes(batch: int):
    """{(N, C, H, W): how many of ResNet-50's BatchNorm2d modules see that input shape}."""
    m = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    seen = []
    hooks = [mod.register_forward_hook(lambda mod, i, o: seen.append(tuple(i[0].shape[1:])))
             for mod in m.modules() if isinstance(mod, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        m(torch.randn(1, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last))
    for h in hooks:
        h.remove()
    count = {}
    for s in seen:
        count[(batch,) + s] = count.get((batch,) + s, 0) + 1
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--out", default=None, help="directory for bn_backward.md (default: print only)")
    args = ap.parse_args()
    torch.manual_seed(0)
    lines = [f"# BatchNorm's input gradient, ResNet-50's shapes at batch {args.batch}, channels-last bf16 (us a call)",
             "", f"{torch.cuda.get_device_name()}; torch {torch.__version__}; hot {hot.__version__}", "",
             "| N,C,H,W | BNs | torch reduce | hot reduce | torch elemt | hot | copy-bytes | g_x elements unequal to "
             "torch's | sums vs torch's |",
             "|---|---|---|---|---|---|---|---|---|"]
    total = {"reduce": 0.0, "hreduce": 0.0, "elemt": 0.0, "hot": 0.0, "copy": 0.0}
    for shape, n in bn_shapes(args.batch).items():
        N, C, H, W = shape
        x = (torch.randn(shape, device="cuda") * 2 + 0.3).to(torch.bfloat16).to(memory_format=torch.channels_last)
        gy = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        w = torch.rand(C, device="cuda") + 0.5
        _, mean, invstd = torch.native_batch_norm(x, w, torch.zeros_like(w), None, None, True, 0.1, 1e-5)
        count = torch.tensor([N * H * W], device="cuda", dtype=torch.int32)
        sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(gy, x, mean, invstd, w, True, True, True)
        rows = lambda t: t.permute(0, 2, 3, 1).reshape(-1, C)  # noqa: E731 (a view of the channels-last map)
        dst = torch.empty_like(rows(gy))
        fns = {"reduce": lambda: torch.batch_norm_backward_reduce(gy, x, mean, invstd, w, True, True, True),
               "hreduce": lambda: hot.batch_norm_backward_reduce(rows(gy), rows(x), mean, invstd),
               "elemt": lambda: torch.batch_norm_backward_elemt(gy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count),
               "hot": lambda: hot.batch_norm_backward_input(rows(gy), rows(x), mean, invstd, sum_dy, sum_dy_xmu,
                                                            weight=w),
               "copy": lambda: torch.add(rows(gy), rows(x), out=dst)}
        t = {k: timed(f) for k, f in fns.items()}
        ref = rows(fns["elemt"]())
        gx, _ = fns["hot"]()
        unequal = int((gx.view(torch.int16) != ref.view(torch.int16)).sum().item())
        hs = fns["hreduce"]()
        g64, xm64 = rows(gy).double(), rows(x).double() - mean.double()
        mags = (g64.abs().sum(0), (g64 * xm64).abs().sum(0))
        sums_rel = max(float(((h.double() - t.double()).abs() / m).max()) for h, t, m in zip(hs, (sum_dy, sum_dy_xmu),
                                                                                               mags))
        for k in total:
            total[k] += n * t[k]
        lines.append(f"| {N},{C},{H},{W} | {n} | {t['reduce']:.1f} | {t['hreduce']:.1f} | {t['elemt']:.1f} | "
                     f"{t['hot']:.1f} | {t['copy']:.1f} | {unequal} of {gx.numel()} | {sums_rel:.1e} |")
    lines.append(f"| a step (x BNs) | | {total['reduce']:.0f} | {total['hreduce']:.0f} | {total['elemt']:.0f} | "
                 f"{total['hot']:.0f} | {total['copy']:.0f} | | |")
    report(lines, args.out, "bn_backward.md")


if __name__ == "__main__":
    main()
