"""``hot.torch.summary``: per-layer table of a converted model (what each path runs and why, bytes kept)."""
from __future__ import annotations

import sys
from typing import Any, List, Optional

import torch
import torch.nn as nn

from . import ops
from .layers import Linear, TransposedLinear, conv_geom
from .convert import hot_layers


def _elt(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kept_bytes(m: nn.Module):
    """(hot_bytes, exact_bytes, unit) kept for backward by layer m for its last seen input, or per token
    (linear) / per input pixel (conv) when no input has been seen. Frozen weights keep nothing."""
    c = m.hot_config
    trainable = m.weight.requires_grad
    seen = m._hot_seen
    # it keeps the input its producer keeps, or another layer's ABC buffer of that input (SPEC §2): no bytes of its own
    shared = seen is not None and (getattr(m, "_hot_keeps_input", False) or getattr(m, "_hot_shares_buffer", False))
    if isinstance(m, (Linear, TransposedLinear)):
        I = m.in_features
        if seen is None:
            elt = _elt(m.weight.dtype)
            exact = I * elt
            hot_b = exact if c.exact else I * c.rank / 16
            return (hot_b if trainable else 0, exact if trainable else 0, "per token")
        rows, shape, dtype = seen
        exact = rows * I * _elt(dtype)
        hot_b = exact if c.exact else 0 if shared else I * ops.padded_k(rows, c.rank) + 4
        return (hot_b if trainable else 0, exact if trainable else 0, "batch")
    C = m.in_channels
    if seen is None:
        elt = _elt(m.weight.dtype)
        exact = C * elt
        hot_b = exact if c.exact else C
        return (hot_b if trainable else 0, exact if trainable else 0, "per pixel")
    rows, shape, dtype = seen
    n = 1
    for s in shape:
        n *= s
    exact = n * _elt(dtype)
    pw = getattr(ops, "pointwise", None)
    k, _, p, _ = conv_geom(m)
    if pw is not None and pw(k, p):  # the codes or ABC buffer of its pixel rows (I = C_in; the same bytes)
        hot_b = exact if c.exact else 0 if shared else C * ops.padded_k(rows, c.rank) + 4
    else:  # the int8 input feature map and its scale
        hot_b = exact if c.exact else 0 if shared else n + 4
    return (hot_b if trainable else 0, exact if trainable else 0, "batch")


def _fmt_bytes(b: float) -> str:
    if b == 0:
        return "0"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:g} B"


def summary_rows(model: nn.Module) -> List[dict]:
    rows = []
    for name, m in hot_layers(model):
        c = m.hot_config
        if isinstance(m, (Linear, TransposedLinear)):
            shape = f"{m.out_features}x{m.in_features}"
        else:
            shape = f"{m.out_channels}x{m.in_channels}x" + "x".join(str(v) for v in m.kernel_size)
        hot_b, exact_b, unit = kept_bytes(m)
        why = m.hot_config_source()
        if m.hot_lqs is not None:
            why += f"; LQS {m.hot_lqs['choice']} (e_tok/e_ten {m.hot_lqs['e_token']:.3g}/{m.hot_lqs['e_tensor']:.3g})"
        if c.exact:
            gx = gw = "exact"
        else:
            gx = f"int{c.gx_bits} {c.gx_scale}"
            gw = (("int8 full rank" if c.rank == 16 else f"int8 HLA r={c.rank}") if m.weight.requires_grad
                  else "none (frozen)")
        rows.append(dict(name=name or "<root>", type=type(m).__name__, shape=shape, gx=gx, gw=gw, why=why,
                         hot_bytes=hot_b, exact_bytes=exact_b, unit=unit))
    return rows


def summary(model: nn.Module, input: Any = None, file=None, *, cost: bool = False, config=None,
            format: str = "text", plot: Optional[str] = None, time: Optional[bool] = None) -> str:
    """Print (to ``file``, default stdout) and return a per-layer table of the HOT layers of ``model``:
    weight shape, what the g_x and g_w paths run and why (default, calibrated, LQS, warm-up, given), and bytes kept for
    the backward pass against an exact layer, for ``input`` (run through the model once, no backward)
    or the last input the model saw; per token (Linear) / per input pixel (Conv2d) if none was seen.

    ``cost=True`` (implied by ``format`` other than "text", ``plot`` or ``config``): the cost report of
    :mod:`hot.torch.cost` instead, for ``input`` (needed): per layer and in total, exact against the configuration
    each layer would run (``config``: None, each layer's own; "default"; "paper"; a hot.Config), bytes kept for
    backward, backward operations by precision and GBOPs as the paper counts them, and on a CUDA device the measured
    forward and backward times per distinct layer shape (``time``: default on CUDA), with a verdict per layer.
    ``format``: "text", "markdown" or "csv"; ``plot``: a path for a figure (time or GBOPs, and bytes, per layer; needs
    matplotlib)."""
    if cost or format != "text" or plot is not None or config is not None:
        return _cost_summary(model, input, file, config, format, plot, time)
    if input is not None:
        with torch.no_grad():
            if isinstance(input, (tuple, list)):
                model(*input)
            elif isinstance(input, dict):
                model(**input)
            else:
                model(input)
    rows = summary_rows(model)
    if not rows:
        text = "hot.torch.summary: no HOT layers (run hot.torch.convert first)"
    else:
        head = dict(name="layer", type="type", shape="weight", gx="g_x path", gw="g_w path",
                    hot="kept (HOT)", exact="kept (exact)", ratio="ratio", unit="for", why="why")
        table = []
        tot_h = tot_e = 0.0
        units = set()
        for r in rows:
            tot_h += r["hot_bytes"]
            tot_e += r["exact_bytes"]
            units.add(r["unit"])
            ratio = f"{r['hot_bytes'] / r['exact_bytes']:.3f}" if r["exact_bytes"] else "-"
            table.append(dict(name=r["name"], type=r["type"], shape=r["shape"], gx=r["gx"], gw=r["gw"],
                              hot=_fmt_bytes(r["hot_bytes"]), exact=_fmt_bytes(r["exact_bytes"]),
                              ratio=ratio, unit=r["unit"], why=r["why"]))
        keys = list(head)
        widths = {k: max(len(str(x[k])) for x in [head] + table) for k in keys}
        lines = ["  ".join(f"{str(head[k]):<{widths[k]}}" for k in keys)]
        lines.append("  ".join("-" * widths[k] for k in keys))
        for t in table:
            lines.append("  ".join(f"{str(t[k]):<{widths[k]}}" for k in keys))
        if units == {"batch"}:
            ratio = f"{tot_h / tot_e:.3f}" if tot_e else "-"
            lines.append(f"total kept for backward: HOT {_fmt_bytes(tot_h)} vs exact {_fmt_bytes(tot_e)} "
                         f"(ratio {ratio})")
        text = "\n".join(lines)
    print(text, file=file if file is not None else sys.stdout)
    return text


def _cost_summary(model, input, file, config, format, plot, time) -> str:
    from . import cost as _cost  # the module (hot.torch.summary is this function)

    if format not in ("text", "markdown", "csv"):
        raise ValueError(f"hot.torch.summary: format must be 'text', 'markdown' or 'csv', got {format!r}")
    if input is None:
        raise ValueError("hot.torch.summary: the cost report (cost=True, format, plot or config) needs an example "
                         "input, got input=None")
    if not any(True for _ in hot_layers(model)):
        text = "hot.torch.summary: no HOT layers (run hot.torch.convert first)"
        print(text, file=file if file is not None else sys.stdout)
        return text
    rep = _cost.report(model, input, config=config, time=time)
    text = rep.render(format)
    if plot is not None:
        why = rep.plot(plot)
        msg = why if why is not None else f"plot written to {plot}"
        if format == "csv":  # the CSV stays a CSV
            print(msg, file=sys.stderr)
        else:
            text += "\n" + msg
    print(text, file=file if file is not None else sys.stdout)
    return text
