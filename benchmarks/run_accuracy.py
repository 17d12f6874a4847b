#!/usr/bin/env python3
"""Training evidence for the default configuration (SPEC §10): ``hot.experiments.parity`` runs of several tasks, methods and
seeds, as many at a time as the machine allows, merged into one report per (task, model).

Each job is one (task, model, method, seed) in its own process: the same initial weights and batch order for every
method of a seed (``hot.experiments.parity.run_parity``). A synthetic task's data is generated once and shared through a file.
Results: DIR/<task>_<model>.md / .json / .png (``ParityResult.save``) and DIR/summary.md (gaps to exact, paired by
seed). Jobs that do not finish by the deadline are left out and listed.

Usage (GPU):  python benchmarks/run_accuracy.py --out DIR [--tasks synth:vit,synth:cnn,digits:vit,digits:cnn]
              [--methods exact,hot,hot+auto,paper,hot-gx8] [--seeds 3] [--jobs 12] [--deadline-s 480]
              [--amp off|bf16|fp16]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Tuple


def _job(args) -> int:
    import torch

    import hot.experiments.parity as hp

    torch.set_num_threads(1)
    data = None
    if args.data:
        data = tuple(t.to(args.device) for t in torch.load(args.data, weights_only=True))
    res = hp.run_parity(args.model, [args.method], seeds=[args.seed], device=args.device, data=data, task=args.task,
                        steps=args.steps, amp=args.amp)
    with open(args.result, "w") as f:
        json.dump(res.to_json(), f)
    r = res.runs[0]
    print(f"{args.task}:{args.model} {args.method} seed {args.seed}: {r.accuracy:.4f} in {r.seconds:.1f} s [{r.note}]",
          flush=True)
    return 0


def _merge(out: str, results: Dict[Tuple[str, str], List[str]], methods: List[str]) -> str:
    import hot.experiments.parity as hp

    lines = ["# Accuracy of each configuration against exact training", ""]
    for (task, model), paths in sorted(results.items()):
        runs, first = [], None
        for p in sorted(paths):
            with open(p) as f:
                d = json.load(f)
            first = first or d
            runs += d["runs"]
        if first is None:
            continue
        d = dict(first, runs=runs, methods=[m for m in methods if any(r["method"] == m for r in runs)],
                 seeds=sorted({r["seed"] for r in runs}))
        res = hp.ParityResult.from_json(d)
        res.save(out, f"{task}_{model}")
        lines += [f"## {task} / {model}", "", res.to_markdown(), ""]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "accuracy_out"))
    ap.add_argument("--tasks", default="synth:vit,synth:cnn,digits:vit,digits:cnn")
    ap.add_argument("--methods", default="exact,hot,hot+auto,paper,hot-gx8")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="override every task's steps (smoke tests)")
    ap.add_argument("--plan", default=None, help="explicit jobs task:model:method:seed,... (instead of the product of "
                    "--tasks, --methods and --seeds), run in this order")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off",
                    help="train every method under torch.autocast of this dtype (evaluation stays float32)")
    ap.add_argument("--deadline-s", type=float, default=480.0)
    # one job (internal)
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return _job(args)

    import torch

    import hot.experiments.parity as hp

    t0 = time.time()
    os.makedirs(os.path.join(args.out, "jobs"), exist_ok=True)
    tasks = [tuple(t.split(":")) for t in args.tasks.split(",") if t]
    methods = [m for m in args.methods.split(",") if m]
    plan = None
    if args.plan:
        plan = []
        for e in args.plan.split(","):
            task, model, m, s = e.split(":")
            plan.append((task, model, m, int(s)))
        tasks = sorted({(t, mo) for t, mo, _, _ in plan})
        methods = list(dict.fromkeys([m for _, _, m, _ in plan] + methods))
    for m in methods:
        hp.method(m)
    data_files = {}
    for task, _ in tasks:
        t = hp.get_task(task)
        if task in data_files or t.n_train is None:
            continue
        path = os.path.join(args.out, "jobs", f"data_{task}.pt")
        torch.save(tuple(hp.load_data(task, "cpu")), path)
        data_files[task] = path
        print(f"data of {task}: {time.time() - t0:.1f} s", flush=True)
    # longest first: the GPU tasks' runs, seeds interleaved so that partial results hold every method
    queue = plan or [(task, model, m, s) for s in range(args.seeds) for task, model in tasks for m in methods]
    running: List[Tuple[subprocess.Popen, tuple, str, float]] = []
    results: Dict[Tuple[str, str], List[str]] = {}
    failed, skipped = [], []
    logf = open(os.path.join(args.out, "jobs.log"), "a")
    while queue or running:
        while queue and len(running) < args.jobs and time.time() - t0 < args.deadline_s - 30:
            job = queue.pop(0)
            task, model, m, s = job
            res = os.path.join(args.out, "jobs", f"{task}_{model}_{m.replace('+', 'p')}_s{s}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--job", "--task", task, "--model", model, "--method", m,
                   "--seed", str(s), "--result", res, "--device", args.device]
            if args.steps:
                cmd += ["--steps", str(args.steps)]
            if args.amp != "off":
                cmd += ["--amp", args.amp]
            if task in data_files:
                cmd += ["--data", data_files[task]]
            p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
            running.append((p, job, res, time.time()))
        if queue and time.time() - t0 >= args.deadline_s - 30:
            skipped += queue
            queue = []
        time.sleep(0.5)
        for item in list(running):
            p, job, res, st = item
            if p.poll() is None:
                if time.time() - t0 > args.deadline_s:
                    p.kill()
                    p.wait()
                    skipped.append(job)
                    running.remove(item)
                continue
            running.remove(item)
            if p.returncode == 0 and os.path.exists(res):
                results.setdefault(job[:2], []).append(res)
                print(f"done {job} in {time.time() - st:.0f} s ({time.time() - t0:.0f} s)", flush=True)
            else:
                failed.append(job)
                print(f"FAILED {job} rc={p.returncode}", flush=True)
        if results and int(time.time()) % 30 == 0:
            _merge(args.out, results, methods)
    text = _merge(args.out, results, methods)
    print(text)
    if failed or skipped:
        print(f"failed: {failed}\nnot run by the deadline: {skipped}")
    print(f"total {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
