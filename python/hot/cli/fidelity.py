"""``hot fidelity``: per-layer gradient fidelity (g_x and g_w against exact) of HOT and the baselines on a
built-in model, at initialisation and after some exact training on digits; writes fidelity.md and PNGs."""
from __future__ import annotations

import os
import sys
from typing import List, Sequence


def add_parser(sub) -> None:
    from hot.experiments.analysis import DEFAULT_METHODS

    from . import int_in

    p = sub.add_parser("fidelity", help="per-layer cosine similarity / relative error of g_x and g_w vs exact",
                       description="Capture one batch of a built-in model (optionally trained exact on digits "
                       "first) and compare every Linear/Conv2d layer's g_x and g_w from HOT and from the "
                       "baselines with the exact float64 gradients.")
    p.add_argument("--model", choices=["vit", "cnn", "cnn_bneck"], default="vit")
    p.add_argument("--batch", type=int_in(1), default=128, help="images in the captured batch (default 128)")
    p.add_argument("--trained-steps", type=int, default=300,
                   help="exact training steps on digits before the capture (0: random init only; default 300). "
                        "With N > 0 the report also gives the random-init model.")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="fidelity_out", help="output directory (default: %(default)s)")
    p.set_defaults(fn=cmd_fidelity)


def _summary(rep, methods: Sequence[str]) -> str:
    import numpy as np

    lines = ["| method | g_x rel. err. (median / worst layer) | g_w rel. err. (median / worst layer) | "
             "g_x cos (min) | g_w cos (min) |", "|---|---|---|---|---|"]
    for m in methods:
        rows = [rep.get(l, m) for l in rep.layers]
        gx = np.array([r.gx_rel for r in rows])
        gw = np.array([r.gw_rel for r in rows])
        lines.append(f"| {m} | {np.median(gx):.4f} / {gx.max():.4f} | {np.median(gw):.4f} / {gw.max():.4f} | "
                     f"{min(r.gx_cos for r in rows):.4f} | {min(r.gw_cos for r in rows):.4f} |")
    return "\n".join(lines) + "\n"


def _target_check(rep, against: Sequence[str] = ("naive-int4", "lbp-wht"), hots: Sequence[str] = ("paper", "hot+lqs", "hot")) -> str:
    """Per HOT variant, baseline and path: on how many layers HOT's relative error is below the baseline's,
    and where not."""
    methods = set(rep.methods)
    out = ["| HOT closer to exact than | g_x: layers | g_w: layers | layers where not (HOT err / baseline err) |",
           "|---|---|---|---|"]
    pairs = [(h, b) for h in hots for b in against if h in methods and b in methods]
    if not pairs:
        return ""
    for hm, b in pairs:
        fails = []
        n_gx = n_gw = 0
        for l in rep.layers:
            h, o = rep.get(l, hm), rep.get(l, b)
            if h.gx_rel < o.gx_rel:
                n_gx += 1
            else:
                fails.append(f"{l} g_x ({h.gx_rel:.4f} / {o.gx_rel:.4f})")
            if h.gw_rel < o.gw_rel:
                n_gw += 1
            else:
                fails.append(f"{l} g_w ({h.gw_rel:.4f} / {o.gw_rel:.4f})")
        n = len(rep.layers)
        out.append(f"| {hm} vs {b} | {n_gx}/{n} | {n_gw}/{n} | {'; '.join(fails) if fails else '-'} |")
    return "\n".join(out) + "\n"


def _section(title: str, rep, methods, png: str) -> List[str]:
    return [f"## {title}", "", f"![{title}]({png})", "", "### Summary over layers", "", _summary(rep, methods),
            "### HOT against the baselines (relative error, per layer)", "", _target_check(rep),
            "### Per layer", "", rep.to_markdown()]


def cmd_fidelity(args) -> int:
    from ._extras import require

    require("fidelity", "demo,analysis", "torch", "sklearn", "matplotlib")  # the digits task; the report's plots
    import torch
    import torch.nn.functional as F

    import hot.experiments.analysis as ha
    from hot.experiments import models
    from hot.experiments.train import load_digits, train

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        for m in methods:
            ha.method_fn(m)
    except ValueError as e:
        print(f"hot fidelity: {e}", file=sys.stderr)
        return 2
    if args.batch < 1 or args.trained_steps < 0 or 0 < args.trained_steps < 20:
        print("hot fidelity: --batch must be >= 1 and --trained-steps 0 or >= 20", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    data = load_digits("cpu")
    torch.manual_seed(args.seed)
    model = models.build(args.model)
    batch = (data[0][:args.batch], data[1][:args.batch])
    header = [f"# Gradient fidelity: {args.model}", "",
              f"One training batch of {args.batch} digits images; every Linear / Conv2d layer's g_x = g_y W and "
              f"g_w = g_yᵀ x recomputed with each method from the layer's captured x, W, g_y (engine operations, "
              f"`hot.experiments.analysis`), against the exact float64 products. Relative error = ‖ĝ − g‖_F / ‖g‖_F. "
              f"Methods: " + ", ".join(f"`{m}`" for m in methods) + ". Seed {0} for every stochastic rounding. "
              f"Command: `hot fidelity --model {args.model} --batch {args.batch} --trained-steps "
              f"{args.trained_steps} --seed {args.seed}`.".replace("{0}", str(args.seed)), ""]
    sections = []
    print(f"hot fidelity: {args.model}, batch {args.batch}, methods {methods}", flush=True)
    rep_init = ha.fidelity(model, batch, F.cross_entropy, methods=methods, seed=args.seed)
    if args.trained_steps > 0:
        rep_init.plot(os.path.join(args.out, "fidelity_init.png"))
        print(f"training exact for {args.trained_steps} steps ...", flush=True)
        r = train(model, data, args.trained_steps, 128, 3e-3, args.seed, "cpu", measure=False)
        print(f"exact model: test accuracy {r.accuracy:.2f}%", flush=True)
        rep = ha.fidelity(model, batch, F.cross_entropy, methods=methods, seed=args.seed)
        rep.plot(os.path.join(args.out, "fidelity.png"))
        sections += _section(f"Trained model ({args.trained_steps} exact steps, test accuracy {r.accuracy:.2f}%)",
                             rep, methods, "fidelity.png")
        sections += _section("Random initialisation", rep_init, methods, "fidelity_init.png")
    else:
        rep = rep_init
        rep.plot(os.path.join(args.out, "fidelity.png"))
        sections += _section("Random initialisation", rep, methods, "fidelity.png")
    path = os.path.join(args.out, "fidelity.md")
    with open(path, "w") as f:
        f.write("\n".join(header + sections))
    print(_summary(rep, methods))
    print(_target_check(rep))
    print(f"wrote {path} and PNG(s) in {args.out}")
    return 0
