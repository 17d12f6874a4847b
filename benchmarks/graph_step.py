#!/usr/bin/env python3
"""A training step recorded in one CUDA graph (torch.cuda.graph: forward, backward and AdamW(capturable=True)), exact
against HOT, against the same steps run eagerly, all in one process. A replay costs the host one launch, so the
graphed step time is the GPU's; the eager one includes whatever the host adds (HOT's layers cost more host time per
call than torch's). HOT's stochastic-rounding seeds are drawn on the GPU inside the graph, so every replay rounds
with new seeds (SPEC §5).

Usage (GPU): python benchmarks/graph_step.py --model vit_b16 --batch 128 [--modes exact,hot] [--steps 20]
Modes: exact, hot (the default configuration), hot-paper (`hot.Config.paper()`), and exact-wiring (exact autograd with every nn.MultiheadAttention running
hot.torch.MultiheadAttention's forward with plain nn.Linear projections: the baseline for models whose attention
hot converts, which separates that module's forward from HOT's backward).
                [--channels-last]  (the model's 4-D parameters and the images in torch.channels_last)
Prints a markdown table (median and range of the step times, ms).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as bm  # noqa: E402

import hot  # noqa: E402
import hot.torch as ht  # noqa: E402
from hot.torch.layers import attach_in_proj  # noqa: E402


def timed(fn, steps: int):
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def run_mode(task, mode: str, batch: int, steps: int, dev, channels_last: bool = False):
    torch.manual_seed(0)
    model = bm.layout(task.build().to(dev), channels_last)
    if mode == "hot":
        ht.convert(model)
    elif mode == "hot-paper":
        ht.convert(model, hot.Config.paper())
    elif mode == "exact-wiring":  # exact autograd through hot.torch.MultiheadAttention's forward (plain nn.Linear
        for m in model.modules():  # projections): the baseline that separates its attention wiring from HOT
            if type(m) is torch.nn.MultiheadAttention:
                attach_in_proj(m, None)
    elif mode != "exact":
        raise ValueError(f"mode must be exact, exact-wiring, hot or hot-paper, got {mode!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)
    x, y = task.make_batch(batch, dev)
    x = bm.layout(x, channels_last)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = task.loss_fn(model(x), y)
        loss.backward()
        opt.step()

    side = torch.cuda.Stream()  # warm-up on a side stream (torch.cuda.graph's requirement), then eager timings
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def eager():
        opt.zero_grad(set_to_none=False)
        x.grad = None  # an input that requires grad (llama_block's): its gradient is the step's, not a running sum
        step()

    eager_ms = timed(eager, steps)
    opt.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients in its pool
    x.grad = None
    g = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(g):
        step()
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    graph_ms = timed(g.replay, steps)
    finite = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    return eager_ms, graph_ms, capture_s, finite


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vit_b16")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--modes", default="exact,hot")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--channels-last", action="store_true", help="model and images in torch.channels_last")
    a = ap.parse_args()
    task = bm.gpu_task("graph_step", a)
    if task is None:
        return 2
    dev = torch.device("cuda")
    layout = ", channels-last" if a.channels_last else ""
    print(f"# {a.model}{layout}, bf16 autocast, batch {a.batch}: eager step against one CUDA graph per step\n")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; hot {hot.__version__}; median (min-max) of "
          f"{a.steps} steps, each synchronised\n")
    print("| mode | eager ms | CUDA graph ms | capture s | gradients finite |\n|---|---|---|---|---|")
    res = {}
    for mode in a.modes.split(","):
        e, g, cap, fin = run_mode(task, mode, a.batch, a.steps, dev, a.channels_last)
        torch.cuda.empty_cache()  # the mode's model, optimizer and graph are gone
        res[mode] = (statistics.median(e), statistics.median(g))
        print(f"| {mode} | {res[mode][0]:.2f} ({min(e):.1f}-{max(e):.1f}) | {res[mode][1]:.2f} "
              f"({min(g):.1f}-{max(g):.1f}) | {cap:.1f} | {fin} |", flush=True)
    if "exact" in res and "hot" in res:
        print(f"\nexact / hot step time: eager {res['exact'][0] / res['hot'][0]:.3f}x, "
              f"CUDA graph {res['exact'][1] / res['hot'][1]:.3f}x; HOT graphed / HOT eager "
              f"{res['hot'][0] / res['hot'][1]:.3f}x")
    if "exact-wiring" in res and "hot" in res:
        print(f"exact-wiring / hot step time: eager {res['exact-wiring'][0] / res['hot'][0]:.3f}x, "
              f"CUDA graph {res['exact-wiring'][1] / res['hot'][1]:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
