#!/usr/bin/env python3
"""Host time per call of hot.torch's layers against torch's own, on tensors so small that the GPU is idle most of
the time: the time per call is then what the host spends enqueueing it (Python, dispatch, launches). Each figure is
the best of 5 rounds of N calls, synchronised once per round.

Usage (GPU): python benchmarks/host_time.py [--device cuda] [--n 300] [--profile] [--api]

--api lists, per call, the CUDA runtime and driver API calls each case makes (torch.profiler's CUPTI trace: kernel
launches, stream-ordered allocations, attribute queries), torch's and hot's side by side.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch import nn

import hot.torch as ht


def per_call_us(f, n: int, sync) -> float:
    for _ in range(20):
        f()
    sync()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        sync()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def converted(m: nn.Module) -> nn.Module:
    s = nn.Sequential(m)
    ht.convert(s, verbose=False) if "verbose" in ht.convert.__code__.co_varnames else ht.convert(s)
    return s[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="cProfile the HOT calls (top functions by own time)")
    ap.add_argument("--api", action="store_true", help="CUDA API calls per call (torch.profiler), torch and hot")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    xl = torch.randn(64, 64, device=dev, requires_grad=True)
    xc = torch.randn(2, 16, 8, 8, device=dev, requires_grad=True)
    cases = []
    lin = nn.Linear(64, 64).to(dev)
    hlin = converted(nn.Linear(64, 64).to(dev))
    cases.append(("Linear 64x64, forward", lambda: lin(xl), lambda: hlin(xl)))
    cases.append(("Linear 64x64, forward + backward", lambda: lin(xl).sum().backward(),
                  lambda: hlin(xl).sum().backward()))
    for k, p in ((1, 0), (3, 1)):
        c = nn.Conv2d(16, 16, k, padding=p, bias=False).to(dev)
        hc = converted(nn.Conv2d(16, 16, k, padding=p, bias=False).to(dev))
        cases.append((f"Conv2d {k}x{k} 16->16 8x8, forward", lambda c=c: c(xc), lambda hc=hc: hc(xc)))
        cases.append((f"Conv2d {k}x{k} 16->16 8x8, forward + backward", lambda c=c: c(xc).sum().backward(),
                      lambda hc=hc: hc(xc).sum().backward()))
    xcl = xc.detach().to(memory_format=torch.channels_last).requires_grad_()
    for k, p in ((1, 0), (3, 1)):  # a channels-last network's layers (ResNet-50 as graph_step runs it)
        c = nn.Conv2d(16, 16, k, padding=p, bias=False).to(dev).to(memory_format=torch.channels_last)
        hc = converted(nn.Conv2d(16, 16, k, padding=p, bias=False).to(dev).to(memory_format=torch.channels_last))
        cases.append((f"Conv2d {k}x{k} 16->16 8x8 channels-last, forward + backward",
                      lambda c=c: c(xcl).sum().backward(), lambda hc=hc: hc(xcl).sum().backward()))
    for k, p in ((1, 0), (3, 1)):  # ResNet-50's pattern: a ReLU's output into a conv (the eager forward is host-bound)
        pair = nn.Sequential(nn.ReLU(), nn.Conv2d(16, 16, k, padding=p, bias=False)).to(dev).to(
            memory_format=torch.channels_last)
        hpair = nn.Sequential(nn.ReLU(), nn.Conv2d(16, 16, k, padding=p, bias=False)).to(dev).to(
            memory_format=torch.channels_last)
        ht.convert(hpair)
        cases.append((f"ReLU + Conv2d {k}x{k} 16->16 8x8 channels-last, forward", lambda m=pair: m(xcl),
                      lambda m=hpair: m(xcl)))
    r, hr = nn.ReLU(), ht.ReLU()
    cases.append(("ReLU, forward + backward", lambda: r(xc).sum().backward(), lambda: hr(xc).sum().backward()))
    print(f"# host time per call, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}, "
          f"torch {torch.__version__}, best of 5 x {a.n} calls\n")
    print("| call | torch us | hot us | extra us |\n|---|---|---|---|")
    for name, fe, fh in cases:
        for amp in (False, True):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                te, th = per_call_us(fe, a.n, sync), per_call_us(fh, a.n, sync)
            print(f"| {name}{', bf16 autocast' if amp else ''} | {te:.1f} | {th:.1f} | {th - te:.1f} |")
    if a.profile:
        # the autograd engine runs a CUDA backward on a thread of its own, which cProfile does not see: on the caller's
        # thread for the profile
        torch.autograd.set_multithreading_enabled(False)
        for name, _, fh in cases:
            pr = cProfile.Profile()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                pr.enable()
                for _ in range(a.n):
                    fh()
                sync()
                pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
            print(f"\n## cProfile, hot: {name}, bf16 autocast, {a.n} calls\n```")
            print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[:6000])
            print("```")
    if a.api and dev.type == "cuda":
        for name, fe, fh in cases:
            print(f"\n## CUDA API calls per call: {name}, bf16 autocast ({a.n} calls; count and host us per call)\n")
            print("| API | torch count | torch us | hot count | hot us |\n|---|---|---|---|---|")
            rows = {}
            for col, f in ((0, fe), (1, fh)):
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    for _ in range(20):
                        f()
                    sync()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(a.n):
                            f()
                        sync()
                for e in prof.key_averages():
                    if e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudnn"):
                        row = rows.setdefault(e.key, [0.0, 0.0, 0.0, 0.0])
                        row[2 * col] += e.count / a.n
                        row[2 * col + 1] += e.cpu_time_total / a.n
            for k, v in sorted(rows.items(), key=lambda kv: -kv[1][3]):
                print(f"| {k} | {v[0]:.1f} | {v[1]:.1f} | {v[2]:.1f} | {v[3]:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
