"""``hot gradnoise``: end-to-end gradient error of HOT variants against exact, next to the batch-sampling
noise (``hot.experiments.gradnoise``); writes <name>.md, .json and .png."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    from hot.experiments.parity import TASKS

    from . import int_in, torch_device

    p = sub.add_parser("gradnoise", help="end-to-end gradient error of HOT variants vs exact and vs batch noise",
                       description="Backpropagate one training batch through a whole model, exact and with each "
                       "method (hot.experiments.parity names), several stochastic-rounding draws each, and compare every "
                       "Linear/Conv2d weight's gradient with the exact one and with the batch-sampling noise.")
    p.add_argument("--task", choices=list(TASKS), default="synth")
    p.add_argument("--model", choices=["vit", "cnn", "bneck"], default="vit")
    p.add_argument("--methods", default="hot,hot-r8,hot+lqs,hot-token,hot-gx8", help="comma-separated (default: %(default)s)")
    p.add_argument("--draws", type=int, default=6, help="backward passes per method (default 6)")
    p.add_argument("--batch", type=int_in(1), default=64)
    p.add_argument("--ref-batches", type=int, default=16, help="batches for the batch-noise reference (default 16)")
    p.add_argument("--trained-steps", type=int, default=0, help="exact training steps first (0 or >= 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=torch_device, default="cpu")
    p.add_argument("--threads", type=int_in(0), default=None, help="torch and hot CPU threads (0: their default)")
    p.add_argument("--out", default="gradnoise_out")
    p.add_argument("--name", default="gradnoise", help="file stem (default: %(default)s)")
    p.set_defaults(fn=cmd_gradnoise)


def cmd_gradnoise(args) -> int:
    from ._extras import require

    digits = args.task == "digits"  # scikit-learn's digits; every task writes a plot (matplotlib)
    require("gradnoise", "analysis,demo" if digits else "analysis", "torch", "matplotlib",
            *(("sklearn",) if digits else ()))
    import torch

    import hot
    import hot.experiments.gradnoise as hg

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
        hot.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda" and not hot.cuda_available():
        print(f"hot gradnoise: --device {args.device}, but hot's CUDA backend is unavailable "
              f"({hot.cuda_unavailable_reason()})", file=sys.stderr)
        return 2
    try:
        rep = hg.gradient_noise(args.model, args.task, methods, args.draws, args.batch, args.ref_batches,
                                args.trained_steps, args.seed, args.device,
                                progress=lambda line: print(line, flush=True))
    except ValueError as e:
        print(f"hot gradnoise: {e}", file=sys.stderr)
        return 2
    cmd = (f"hot gradnoise --task {args.task} --model {args.model} --methods {','.join(methods)} --draws "
           f"{args.draws} --batch {args.batch} --ref-batches {args.ref_batches} --trained-steps "
           f"{args.trained_steps} --seed {args.seed}")
    paths = hg.save(rep, args.out, args.name, cmd)
    print(rep.summary_markdown())
    print("wrote " + ", ".join(paths))
    return 0
