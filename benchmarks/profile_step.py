#!/usr/bin/env python3
"""Where a training step's GPU time goes: torch.profiler over a few steps of one model (bench_models' tasks), exact
against HOT, kernels grouped by kind and split into forward / backward / optimizer.

For each mode the script runs warm-up steps, then profiles N steps with ``record_function`` ranges around the forward,
the backward and the optimizer step, and reports per range: wall time (host, synchronised), summed GPU kernel time
and the GPU kernels grouped (hot's own kernels, integer GEMMs, cuBLAS/cuDNN float GEMMs, attention, elementwise and
the rest). Host time not covered by GPU work shows as wall - GPU.

Usage (GPU): python benchmarks/profile_step.py --model vit_b16 --batch 64 --dtype bf16 --modes exact,hot --out DIR
[--cpu N]: pin to one core; the report gives a host speed probe (a fixed Python loop, ms) beside the step times, since
an eager HOT step is host-bound and the shared machines' cores differ in speed by up to ~2x.
[--compile reduce-overhead]: inductor's CUDA graphs (GPU-bound steps); each step is marked with
``torch.compiler.cudagraph_mark_step_begin()`` and the gradients are set to None after the optimizer step, as a
training loop with those graphs must do.
Writes DIR/profile_<model>_<dtype>_b<batch>[_compile-<mode>][_cl].md (DIR = --out, else $OUT, else .).
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as bm  # noqa: E402

import hot  # noqa: E402
import hot.torch as ht  # noqa: E402

RANGES = ("fwd", "bwd", "opt")


def kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("qgo", "hadamard", "fwht", "hla", "quantize", "compress", "hot::", "quant")):
        return "hot passes"
    if "cutlass" in n and ("s8" in n or "int8" in n or "i8" in n or "s32" in n):
        return "integer GEMM"
    if "cutlass" in n or "gemm" in n or "sm90_xmma" in n or "nvjet" in n or "cublas" in n:
        return "float GEMM"
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if "elementwise" in n or "vectorized" in n or "unrolled" in n:
        return "elementwise"
    if "reduce" in n or "norm" in n or "softmax" in n:
        return "reduce / norm"
    if "memcpy" in n or "memset" in n:
        return "copy / set"
    return "other"


def host_probe_ms() -> float:
    """Milliseconds of a fixed pure-Python loop: how fast this host core runs Python right now. On the shared GPU
    machines it varies up to ~2x from core to core and minute to minute (NOTES, 2026-11-27), and an eager HOT step,
    which is host-bound, varies with it; exact training, GPU-bound, does not."""
    t = time.perf_counter()
    s = 0
    for i in range(300_000):
        s += i
    return (time.perf_counter() - t) * 1e3


def profile_mode(task, mode: str, batch: int, dtype: str, steps: int, device, host_profile: bool = False,
                 compile_mode: str = "none", kernels: bool = True, no_gc: bool = False, gc_freeze: bool = False,
                 channels_last: bool = False):
    torch.manual_seed(0)
    model = bm.layout(task.build().to(device), channels_last)
    if mode == "hot":
        ht.convert(model)
    elif mode == "hot-paper":
        ht.convert(model, hot.Config.paper())
    elif mode != "exact":
        raise ValueError(f"mode must be exact, hot or hot-paper, got {mode!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if compile_mode != "none":
        model = torch.compile(model, mode=None if compile_mode == "default" else compile_mode)
    x, y = task.make_batch(batch, device)
    x = bm.layout(x, channels_last)
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cuda", enabled=False)
    host = collections.defaultdict(list)
    # With inductor's CUDA graphs (mode="reduce-overhead"), a replay overwrites the previous step's outputs; each
    # step says where it begins (torch's documented remedy; a no-op for the other modes)
    begin = torch.compiler.cudagraph_mark_step_begin if compile_mode != "none" else (lambda: None)
    # ... and the gradients are the backward graph's outputs: kept as .grad across a step (zero_grad without
    # set_to_none), the next replay would overwrite them, so they are dropped after each optimizer step
    to_none = compile_mode in ("reduce-overhead", "max-autotune")

    def clear():
        opt.zero_grad(set_to_none=to_none)
        x.grad = None  # an input that requires grad (llama_block's): its gradient is the step's, not a running sum

    def step():
        begin()
        with ac:
            loss = task.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        clear()

    if no_gc:  # Python's cyclic collector off for the timed steps (its pauses show up as slow steps)
        gc.collect()
        gc.disable()
    if gc_freeze:  # everything alive now (model, optimizer, torch's own objects) out of the collector's scans
        gc.collect()
        gc.freeze()
    t_c = time.perf_counter()
    for _ in range(3):  # warm-up (with torch.compile: compilation, and CUDA graph recording)
        step()
    torch.cuda.synchronize()
    host["warmup_s"] = time.perf_counter() - t_c
    # Without the profiler: host time to enqueue each range (perf_counter before the synchronize) and its time to
    # completion (after it). Enqueue close to completion: the host, not the GPU, sets the pace of that range.
    for _ in range(steps):
        t0 = time.perf_counter()
        begin()
        with ac:
            loss = task.loss_fn(model(x), y)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        opt.step()
        clear()
        torch.cuda.synchronize()
        host["fwd"].append(((t1 - t0) * 1e3, (t2 - t0) * 1e3))
        host["bwd"].append(((t3 - t2) * 1e3, (t4 - t2) * 1e3))
    for _ in range(steps):  # free-running steps, one synchronize after each: the step time a training loop sees
        host["probe"].append(host_probe_ms())
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        host["step"].append((time.perf_counter() - t0) * 1e3)
    if kernels:
        walls, by, top = profile_kernels(steps, ac, task, model, x, y, opt, host, begin, clear)
    else:
        walls, by, top = collections.defaultdict(float), {}, {}  # no kernel tables in the report then
    if host_profile:  # where the host's time goes: cProfile over the same steps (GPU work is asynchronous)
        import cProfile
        import io
        import pstats
        # the backward on the caller's thread (the autograd engine's device thread is invisible to cProfile)
        torch.autograd.set_multithreading_enabled(False)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        pr.disable()
        torch.autograd.set_multithreading_enabled(True)
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(40)
        host["cprofile"] = buf.getvalue()
    gc.enable()
    gc.unfreeze()
    return walls, by, top, host


def profile_kernels(steps, ac, task, model, x, y, opt, host, begin, clear):
    """torch.profiler over `steps` steps, each range synchronised: (wall ms per range, GPU kernel us per range by kind,
    per range by kernel name); the CUDA API calls per step go into host["api"]."""
    walls = collections.defaultdict(float)
    by = {r: collections.Counter() for r in RANGES}
    top = {r: collections.Counter() for r in RANGES}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):  # each range ends with a synchronize inside it: its window holds all its GPU work
            t0 = time.perf_counter()
            with torch.profiler.record_function("fwd"):
                begin()
                with ac:
                    loss = task.loss_fn(model(x), y)
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            with torch.profiler.record_function("bwd"):
                loss.backward()
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            with torch.profiler.record_function("opt"):
                opt.step()
                clear()
                torch.cuda.synchronize()
            t3 = time.perf_counter()
            walls["fwd"] += (t1 - t0) * 1e3 / steps
            walls["bwd"] += (t2 - t1) * 1e3 / steps
            walls["opt"] += (t3 - t2) * 1e3 / steps
    # CUDA runtime / driver API calls per step (count, host us): synchronisations and allocations show here
    for e in prof.key_averages():
        if e.key.startswith("cu") and not e.key.startswith("cudnn"):
            host["api"].append((e.key, e.count / steps, e.cpu_time_total / steps))
    # GPU kernels by the range whose window holds their start on the GPU timeline
    events = prof.events()
    windows = [(e.name, e.time_range.start, e.time_range.end) for e in events
               if e.name in RANGES and e.device_type != torch.autograd.DeviceType.CUDA]
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name in RANGES:  # kernels, not range markers
            continue
        rng = next((name for name, t0, t1 in windows if t0 <= e.time_range.start <= t1), None)
        if rng is None:
            continue
        us = e.time_range.elapsed_us()
        by[rng][kind(e.name)] += us / steps
        top[rng][e.name[:90]] += us / steps
    return walls, by, top


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vit_b16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--modes", default="exact,hot")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--host-profile", action="store_true", help="also cProfile the host side of whole steps")
    ap.add_argument("--compile", default="none", choices=("none", "default", "reduce-overhead",
                                                           "max-autotune-no-cudagraphs"),
                    help="torch.compile the model with this mode first")
    ap.add_argument("--no-kernels", action="store_true", help="skip the torch.profiler steps (timings only)")
    ap.add_argument("--no-gc", action="store_true", help="Python's garbage collector off during the steps")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the model and optimizer are built")
    ap.add_argument("--channels-last", action="store_true", help="model and images in torch.channels_last")
    ap.add_argument("--cpu", type=int, default=None,
                    help="pin the process to this CPU core (eager steps are host-bound: compare runs on one core)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    task = bm.gpu_task("profile_step", a)
    if task is None:
        return 2
    dev = torch.device("cuda")
    lines = [f"# Step profile: {a.model}, {a.dtype}, batch {a.batch}, torch.compile: {a.compile}"
             + (", channels-last" if a.channels_last else "") + (", gc off" if a.no_gc else "") + (", gc.freeze()" if a.gc_freeze else ""), "",
             f"{torch.cuda.get_device_name()}; torch {torch.__version__}; hot {hot.__version__}; "
             f"mean of {a.steps} profiled steps (profiler overhead included in wall times)", ""]
    for mode in a.modes.split(","):
        if a.compile != "none":
            torch._dynamo.reset()  # the previous mode's graphs (and the model they hold) go
        torch.cuda.empty_cache()
        walls, by, top, host = profile_mode(task, mode, a.batch, a.dtype, a.steps, dev, a.host_profile, a.compile,
                                            not a.no_kernels, a.no_gc, a.gc_freeze, a.channels_last)
        lines += [f"## {mode}", ""]
        lines += [f"Step (median of {a.steps} free-running steps, without the profiler): "
                  f"{statistics.median(host['step']):.2f} ms (all: {', '.join(f'{t:.1f}' for t in host['step'])}); "
                  f"warm-up of 3 steps {host['warmup_s']:.1f} s; host speed probe (`host_probe_ms`, before each "
                  f"step) {min(host['probe']):.1f}-{max(host['probe']):.1f} ms"
                  + (f", pinned to CPU {a.cpu}" if a.cpu is not None else "") + ".", ""]
        lines += ["Without the profiler (median of the steps): " + "; ".join(
            f"{r} enqueued in {statistics.median(h[0] for h in host[r]):.2f} ms, done in "
            f"{statistics.median(h[1] for h in host[r]):.2f} ms" for r in ("fwd", "bwd")) + ".", ""]
        if not a.no_kernels:  # the profiled steps' tables
            lines += ["| range | wall ms | GPU kernels ms | " +
                      " | ".join(k for k in ("hot passes", "integer GEMM", "float GEMM", "attention", "elementwise",
                                             "reduce / norm", "copy / set", "other")) + " |",
                      "|---" * 11 + "|"]
            for r in RANGES:
                tot = sum(by[r].values()) / 1e3
                cells = [f"{by[r][k] / 1e3:.2f}" for k in ("hot passes", "integer GEMM", "float GEMM", "attention",
                                                             "elementwise", "reduce / norm", "copy / set", "other")]
                lines.append(f"| {r} | {walls[r]:.2f} | {tot:.2f} | " + " | ".join(cells) + " |")
            for r in ("fwd", "bwd"):
                lines += ["", f"Top kernels, {mode} {r} (ms per step):", ""]
                for name, us in top[r].most_common(a.top):
                    lines.append(f"- {us / 1e3:.3f}  `{name}`")
            lines += ["", f"CUDA API calls per step, {mode} (profiled steps; count, host ms):", ""]
            for name, n, us in sorted(host["api"], key=lambda t: -t[2])[:a.top]:
                lines.append(f"- {name}: {n:.0f} calls, {us / 1e3:.2f} ms")
        if "cprofile" in host:
            lines += ["", f"Host time by function, {mode} ({a.steps} whole steps, cProfile, by own time):", "", "```",
                      host["cprofile"].strip(), "```"]
        lines.append("")
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    out = a.out or os.environ.get("OUT") or "."
    os.makedirs(out, exist_ok=True)
    suffix = ("" if a.compile == "none" else f"_compile-{a.compile}") + ("_cl" if a.channels_last else "")
    with open(os.path.join(out, f"profile_{a.model}_{a.dtype}_b{a.batch}{suffix}.md"), "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
