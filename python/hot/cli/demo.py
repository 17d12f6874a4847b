"""``hot demo``: train a small vision transformer on scikit-learn's digits (8x8 images), once exact and
once with HOT (hot.torch.convert + LQS), and print accuracy, bytes kept for backward, peak memory and
step time side by side."""
from __future__ import annotations

import copy
import statistics
import sys

from hot.experiments.train import load_digits, train  # noqa: F401  (the task and loop the demo runs)


def _fmt_bytes(b) -> str:
    if b is None:
        return "n/a"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b} B"


def run_demo(args) -> int:
    from ._extras import require

    require("demo", "demo", "torch", "sklearn")
    import torch
    import torch.nn.functional as F

    import hot
    import hot.torch as ht
    from hot.experiments import models

    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not hot.cuda_available():
        print(f"hot demo: torch sees a GPU but hot's CUDA backend is unavailable "
              f"({hot.cuda_unavailable_reason()}); running on cpu", file=sys.stderr)
        device = "cpu"
    data = load_digits(device, seed=args.seed)
    print(f"hot demo: {args.model} on scikit-learn digits ({len(data[0])} train / {len(data[2])} test 8x8 images), "
          f"{args.steps} steps of batch {args.batch}, device {device}"
          + (f" ({torch.cuda.get_device_name(torch.device(device))})" if device.startswith("cuda") else
             f" ({torch.get_num_threads()} threads)") + (f", autocast {args.amp}" if args.amp != "off" else ""))
    torch.manual_seed(args.seed)
    base = models.build(args.model).to(device)
    results = []
    for name in ("exact", "HOT"):
        model = copy.deepcopy(base)
        torch.manual_seed(args.seed + 1)
        note = ""
        if name == "HOT":
            cfg = hot.Config.paper() if args.paper else hot.Config()
            cfg = cfg.replace(**{k: v for k, v in (("rank", args.rank), ("gx_bits", args.gx_bits)) if v is not None})
            # The input layer (ViT patch embedding / CNN stem) stays exact unless asked: its input needs no
            # gradient and its K = C*kh*kw is tiny (4 or 9).
            exclude = None if args.hot_input_layer else ["patch", "stem"]
            report = ht.convert(model, cfg, exclude=exclude)
            xb, yb = data[0][:args.batch], data[1][:args.batch]
            if args.paper:
                choices = ht.lqs(model, (xb, yb), F.cross_entropy)
                n_tok = sum(1 for v in choices.values() if v["choice"] == "token")
                note = f"LQS: {n_tok}/{len(choices)} layers per-token"
            if args.calibrate:
                choices = ht.calibrate(model, (xb, yb), F.cross_entropy)
                note = (note + "; " if note else "") + "calibrated: " + ", ".join(
                    f"{n} {v['config'].gx_bits}-bit r{v['config'].rank}" for n, v in choices.items())
            print(f"converted {len(report.converted)} layers to HOT ({cfg.describe()})"
                  + (f"; {note}" if note else "")
                  + ("" if args.hot_input_layer else "; input layer kept exact (--hot-input-layer to convert it)"))
        bar = None
        if tqdm is not None and not args.no_progress:
            bar = tqdm(total=args.steps, desc=f"{name:>5}", unit="step", leave=True, dynamic_ncols=True, mininterval=0.5)
        r = train(model, data, args.steps, args.batch, args.lr, args.seed, device, amp=args.amp, progress=bar)
        if bar is not None:
            bar.close()
        r.name = name
        results.append(r)
    ex, ho = results
    rows = [
        ("test accuracy (%)", f"{ex.accuracy:.2f}", f"{ho.accuracy:.2f}", f"{ho.accuracy - ex.accuracy:+.2f} pt"),
        ("final train loss", f"{statistics.mean(ex.losses[-20:]):.4f}", f"{statistics.mean(ho.losses[-20:]):.4f}", ""),
        ("kept for backward / step", _fmt_bytes(ex.kept_bytes), _fmt_bytes(ho.kept_bytes),
         f"{ho.kept_bytes / ex.kept_bytes:.3f}x" if ex.kept_bytes else ""),
    ]
    if ho.layer_bytes is not None:
        h, e = ho.layer_bytes
        rows.append((" of which inputs of converted layers", _fmt_bytes(e), _fmt_bytes(h), f"{h / e:.3f}x" if e else ""))
    rows += [
        (ex.peak_kind or "peak memory", _fmt_bytes(ex.peak_bytes), _fmt_bytes(ho.peak_bytes),
         f"{ho.peak_bytes / ex.peak_bytes:.3f}x" if ex.peak_bytes and ho.peak_bytes is not None else ""),
        ("step time (median, ms)", f"{ex.step_ms:.1f}", f"{ho.step_ms:.1f}", f"{ho.step_ms / ex.step_ms:.2f}x"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows + [("", "exact")])
    w2 = max(len(r[2]) for r in rows + [("", "", "HOT")])
    print()
    print(f"{'':<{w0}}  {'exact':>{w1}}  {'HOT':>{w2}}  HOT/exact")
    for r in rows:
        print(f"{r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]:>{w2}}  {r[3]}")
    if torch.device(device).type == "cpu":
        print("\nnote: on CPU hot runs its bit-exact reference backend; the speed-ups of HOT need a GPU's integer "
              "tensor cores. 'kept for backward' counts every tensor autograd saves (parameters excluded).")
    return 0
