"""``hot parity``: train the digits model with exact, HOT and the baselines over several seeds; write
a markdown table (accuracy mean ± std), the raw runs (JSON) and the loss curves (PNG)."""
from __future__ import annotations

import os
import sys


def add_parser(sub) -> None:
    from hot.parity import DEFAULT_METHODS, GAP_METHODS, METHODS

    p = sub.add_parser("parity", help="training parity on digits: exact vs HOT vs baselines, several seeds",
                       description="Train the digits model once per (method, seed) and report the final test "
                       "accuracy (mean ± std over seeds) and the loss curves. Methods: " + ", ".join(METHODS)
                       + ". '--methods gap' selects the accuracy-gap variants: " + ", ".join(GAP_METHODS) + ".")
    p.add_argument("--model", choices=["vit", "cnn"], default="vit")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds, 0..N-1 (default 3)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300, at least 20)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated method names, or 'gap' (default: %(default)s)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch and hot CPU threads")
    p.add_argument("--out", default="parity_out", help="output directory (default: %(default)s)")
    p.add_argument("--name", default=None, help="file stem (default: parity_<model>)")
    p.set_defaults(fn=cmd_parity)


def cmd_parity(args) -> int:
    import torch

    import hot
    import hot.parity as hp

    methods = list(hp.GAP_METHODS) if args.methods == "gap" else [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        for m in methods:
            hp.method(m)
    except ValueError as e:
        print(f"hot parity: {e}", file=sys.stderr)
        return 2
    if args.seeds < 1 or args.steps < 20:
        print("hot parity: --seeds must be >= 1 and --steps >= 20", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
        hot.set_num_threads(args.threads)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    print(f"hot parity: {args.model}, methods {methods}, seeds {seeds}, {args.steps} steps of batch {args.batch}",
          flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = args.name or f"parity_{args.model}"
    res = hp.run_parity(args.model, methods, seeds, args.steps, args.batch, args.lr, args.device,
                        progress=lambda line: print(line, flush=True),
                        checkpoint=os.path.join(args.out, f"{stem}.partial.json"))
    try:
        os.remove(os.path.join(args.out, f"{stem}.partial.json"))
    except OSError:
        pass
    paths = res.save(args.out, stem)
    print()
    print(res.to_markdown())
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths))
    return 0
