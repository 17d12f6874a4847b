"""Training parity: exact vs HOT vs the baselines the paper compares with, on scikit-learn's digits.

Each method trains the same model (same initial weights, same batch order for a given seed) with the
optimiser and schedule of ``hot demo`` (AdamW, one-cycle, ``hot.cli.demo.train``) and reports the final
test accuracy (mean ± std over seeds) and the training-loss curves.

How a method changes the model's backward pass:

- ``exact``: nothing (torch autograd).
- HOT configurations (``hot``, ``hot+lqs``, ``hq-only``, ``hot-r<r>``, ``hot-gx8``, ``hot-token``,
  ``hot-gx8-r16``, ``hot-all``): the real ``hot.torch`` layers (``hot.torch.convert``; ``+lqs`` runs
  ``hot.torch.calibrate`` on the first training batch). ``hq-only`` is HOT at rank 16 (full-rank 8-bit
  g_w: Hadamard quantisation without the low-rank projection).
- Baselines and single-path variants (``naive-int4``, ``lbp-wht``, ``hot-gx-only``, ``hot-gw-only``,
  ``sim-hot``): a simulation. Linear / Conv2d (groups = 1) layers get an autograd function whose forward
  is ``F.linear`` / ``F.conv2d`` and whose backward calls ``hot.analysis.method_fn(name)`` on the kept raw
  input x (im2col columns for a convolution), W and g_y. That reproduces the baseline's numerics with the
  engine's operations (it keeps x in float, so it says nothing about memory). ``sim-hot`` runs HOT itself
  through this path: for Linear layers it is bit-identical to the real layers (same seed draws), a check
  that the simulation harness is faithful.

As in ``hot demo``, the input layer (ViT patch embedding ``patch``, CNN stem ``stem``) stays exact for
every method except ``hot-all``, which converts it too; ``hot-nohead`` also keeps the classifier head exact.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import hot

INPUT_LAYERS = ("patch", "stem")


@dataclasses.dataclass(frozen=True)
class Method:
    """How one parity method trains: ``kind`` is 'exact', 'layers' (real hot.torch layers with ``config``)
    or 'sim' (backward through ``hot.analysis.method_fn(sim)``)."""

    name: str
    kind: str
    description: str
    config: Optional[dict] = None
    lqs: bool = False
    sim: Optional[str] = None
    input_layer: bool = False
    exclude: Tuple[str, ...] = ()


def _m(name, kind, description, **kw):
    return Method(name, kind, description, **kw)


METHODS: Dict[str, Method] = {m.name: m for m in [
    _m("exact", "exact", "torch autograd, float32"),
    _m("hot", "layers", "HOT, hot.Config() (g_x 4-bit HQ per tensor, g_w 8-bit HLA r=8), no LQS", config={}),
    _m("hot+lqs", "layers", "HOT with LQS (hot.torch.calibrate on the first batch)", config={}, lqs=True),
    _m("naive-int4", "sim", "per-tensor INT4 of g_y (stochastic), W, x; no Hadamard, full rank", sim="naive-int4"),
    _m("lbp-wht", "sim", "LBP-WHT-style: HLA rank-8 projection of g_y (and x) on both paths, no quantisation",
       sim="lbp-wht"),
    _m("hq-only", "layers", "Hadamard quantisation only: HOT at rank 16 (full-rank 8-bit g_w)", config={"rank": 16}),
    _m("hot-r2", "layers", "HOT, HLA rank 2", config={"rank": 2}),
    _m("hot-r4", "layers", "HOT, HLA rank 4", config={"rank": 4}),
    _m("hot-r8", "layers", "HOT, HLA rank 8 (= hot)", config={"rank": 8}),
    _m("hot-r16", "layers", "HOT, HLA rank 16 (= hq-only)", config={"rank": 16}),
    # accuracy-gap variants
    _m("hot-gx-only", "sim", "HOT's g_x path (4-bit HQ), exact g_w", sim="hot-gx-only"),
    _m("hot-gw-only", "sim", "exact g_x, HOT's g_w path (8-bit HLA r=8)", sim="hot-gw-only"),
    _m("hot-gx8", "layers", "HOT with an 8-bit g_x path", config={"gx_bits": 8}),
    _m("hot-token", "layers", "HOT with per-token g_x scales on every layer", config={"gx_scale": "token"}),
    _m("hot-gx8-r16", "layers", "HOT with 8-bit g_x and rank 16 (8-bit quantisation only)",
       config={"gx_bits": 8, "rank": 16}),
    _m("hot-all", "layers", "HOT, input layer (patch embedding / stem) converted too", config={}, input_layer=True),
    _m("hot-nohead", "layers", "HOT with the classifier head kept exact (its rows are images, not tokens)",
       config={}, exclude=("head",)),
    _m("sim-hot", "sim", "HOT through the simulation harness (checks the harness)", sim="hot"),
]}

DEFAULT_METHODS = ("exact", "hot", "hot+lqs", "naive-int4", "lbp-wht", "hq-only", "hot-r2", "hot-r4")
GAP_METHODS = ("exact", "hot", "hot-gx-only", "hot-gw-only", "hot-gx8", "hot-r16", "hot-gx8-r16", "hot-token",
               "hot+lqs", "hot-all", "hot-nohead", "sim-hot")


def method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"hot.parity: unknown method {name!r}, expected one of {list(METHODS)}")
    return METHODS[name]


# ---- simulation layers --------------------------------------------------------------------------------


def _sim_fn_class():
    import torch

    class _SimLinearFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, seed, fn):
            ctx.save_for_backward(x, weight)
            ctx.fn, ctx.seed, ctx.has_bias = fn, seed, bias is not None
            return torch.nn.functional.linear(x, weight, bias)

        @staticmethod
        def backward(ctx, gy):
            x, w = ctx.saved_tensors
            O, I = w.shape
            g2 = gy.reshape(-1, O).float()
            x2 = x.reshape(-1, I).float()
            gx, gw = ctx.fn(x2.detach().cpu().contiguous().numpy(), w.detach().float().cpu().contiguous().numpy(),
                            g2.detach().cpu().contiguous().numpy(), ctx.seed)
            gx = torch.as_tensor(np.asarray(gx, dtype=np.float32)).to(x).reshape(x.shape)
            gw = torch.as_tensor(np.asarray(gw, dtype=np.float32)).to(w)
            gb = g2.sum(0).to(w) if ctx.has_bias else None
            return gx, gw, gb, None, None

    class _SimConv2dFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, seed, fn, stride, padding, dilation):
            ctx.save_for_backward(x, weight)
            ctx.fn, ctx.seed, ctx.has_bias = fn, seed, bias is not None
            ctx.geom = (stride, padding, dilation)
            return torch.nn.functional.conv2d(x, weight, bias, stride, padding, dilation)

        @staticmethod
        def backward(ctx, gy):
            F = torch.nn.functional
            x, w = ctx.saved_tensors
            stride, padding, dilation = ctx.geom
            N, C, H, W = x.shape
            O = w.shape[0]
            k = w.shape[2:]
            cols = F.unfold(x.float(), k, dilation=dilation, padding=padding, stride=stride)  # N x CKK x P
            P = cols.shape[2]
            X = cols.transpose(1, 2).reshape(N * P, -1)
            G = gy.float().permute(0, 2, 3, 1).reshape(N * P, O)
            gcols, gw = ctx.fn(X.detach().cpu().contiguous().numpy(),
                               w.detach().float().reshape(O, -1).cpu().contiguous().numpy(),
                               G.detach().cpu().contiguous().numpy(), ctx.seed)
            gcols = torch.as_tensor(np.asarray(gcols, dtype=np.float32)).to(x.device)
            gx = F.fold(gcols.reshape(N, P, -1).transpose(1, 2), (H, W), k, dilation=dilation, padding=padding,
                        stride=stride).to(x.dtype)
            gw = torch.as_tensor(np.asarray(gw, dtype=np.float32)).to(w).reshape(w.shape)
            gb = G.sum(0).to(w) if ctx.has_bias else None
            return gx, gw, gb, None, None, None, None, None

    return _SimLinearFn, _SimConv2dFn


_SIM_CLASSES = {}


def _sim_layer_classes():
    """nn.Linear / nn.Conv2d subclasses whose backward is ``self.sim_fn`` (built once, torch imported lazily)."""
    if _SIM_CLASSES:
        return _SIM_CLASSES["linear"], _SIM_CLASSES["conv"]
    import torch
    import torch.nn as nn

    from hot.torch import ops

    lin_fn, conv_fn = _sim_fn_class()

    def _seed():
        # One seed per call from torch's default generator, drawn in the forward like hot.torch's layers.
        return int(ops.draw_seed())

    class SimLinear(nn.Linear):
        def forward(self, x):
            if not torch.is_grad_enabled():
                return nn.functional.linear(x, self.weight, self.bias)
            return lin_fn.apply(x, self.weight, self.bias, _seed(), self.sim_fn)

    class SimConv2d(nn.Conv2d):
        def forward(self, x):
            if not torch.is_grad_enabled():
                return nn.functional.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)
            return conv_fn.apply(x, self.weight, self.bias, _seed(), self.sim_fn, self.stride, self.padding,
                                 self.dilation)

    _SIM_CLASSES.update(linear=SimLinear, conv=SimConv2d)
    return SimLinear, SimConv2d


def simulate(model, name: str, exclude: Sequence[str] = INPUT_LAYERS) -> List[str]:
    """Swap (in place) every nn.Linear and nn.Conv2d (groups = 1, zero padding, not named in ``exclude``)
    of ``model`` for a layer whose backward is ``hot.analysis.method_fn(name)``; returns the names."""
    import torch.nn as nn

    from hot.analysis import method_fn

    fn = method_fn(name)
    SimLinear, SimConv2d = _sim_layer_classes()
    done = []
    for n, m in model.named_modules():
        if n.split(".")[0] in exclude:
            continue
        if type(m) is nn.Linear:
            m.__class__ = SimLinear
        elif type(m) is nn.Conv2d and m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str):
            m.__class__ = SimConv2d
        else:
            continue
        m.sim_fn = fn
        done.append(n)
    if not done:
        raise ValueError(f"hot.parity.simulate: no Linear/Conv2d layer to simulate {name!r} on")
    return done


def prepare(model, name: str, calib_batch=None) -> str:
    """Apply method ``name`` to ``model`` in place; returns a one-line note."""
    import torch.nn.functional as F

    import hot.torch as ht

    m = method(name)
    if m.kind == "exact":
        return "exact"
    if m.kind == "sim":
        layers = simulate(model, m.sim)
        return f"{len(layers)} layers simulated ({m.sim})"
    cfg = hot.Config(**m.config)
    exclude = list(m.exclude) + ([] if m.input_layer else list(INPUT_LAYERS))
    report = ht.convert(model, cfg, exclude=exclude or None)
    note = f"{len(report.converted)} layers converted"
    if m.lqs:
        if calib_batch is None:
            raise ValueError(f"hot.parity.prepare: method {name!r} needs a calibration batch")
        choices = ht.calibrate(model, calib_batch, F.cross_entropy)
        note += f", LQS: {sum(v['choice'] == 'token' for v in choices.values())}/{len(choices)} per-token"
    return note


# ---- runs and report ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    method: str
    seed: int
    accuracy: float
    losses: List[float]
    seconds: float
    note: str = ""


def _mean_std(v: Sequence[float]) -> Tuple[float, float]:
    v = list(v)
    return statistics.mean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


@dataclasses.dataclass
class ParityResult:
    model: str
    steps: int
    batch: int
    lr: float
    seeds: Tuple[int, ...]
    methods: Tuple[str, ...]
    runs: List[Run]
    device: str = "cpu"

    def of(self, m: str) -> List[Run]:
        return [r for r in self.runs if r.method == m]

    def accuracy(self, m: str) -> Tuple[float, float]:
        return _mean_std(r.accuracy for r in self.of(m))

    def final_loss(self, m: str, last: int = 20) -> Tuple[float, float]:
        return _mean_std(statistics.mean(r.losses[-last:]) for r in self.of(m))

    def paired_gap(self, m: str, ref: str = "exact") -> Optional[Tuple[float, float]]:
        """Mean ± std over seeds of accuracy(m) - accuracy(ref), paired by seed."""
        a = {r.seed: r.accuracy for r in self.of(m)}
        b = {r.seed: r.accuracy for r in self.of(ref)}
        common = sorted(set(a) & set(b))
        if not common:
            return None
        return _mean_std(a[s] - b[s] for s in common)

    def to_markdown(self) -> str:
        head = (f"**{self.model}** on scikit-learn digits (1438 train / 359 test), {self.steps} steps of batch "
                f"{self.batch}, AdamW lr {self.lr:g} one-cycle, seeds {list(self.seeds)}, device {self.device}.\n\n"
                "| method | test accuracy (%) mean ± std | vs exact (paired, pt) | per seed | final train loss "
                "| s / run | what |\n|---|---|---|---|---|---|---|")
        rows = [head]
        for m in self.methods:
            if not self.of(m):
                continue
            am, asd = self.accuracy(m)
            lm, lsd = self.final_loss(m)
            gap = self.paired_gap(m) if m != "exact" else None
            gap_s = f"{gap[0]:+.2f} ± {gap[1]:.2f}" if gap is not None else "-"
            per = ", ".join(f"{r.accuracy:.1f}" for r in self.of(m))
            secs = statistics.mean(r.seconds for r in self.of(m))
            desc = METHODS[m].description if m in METHODS else ""
            rows.append(f"| {m} | {am:.2f} ± {asd:.2f} | {gap_s} | {per} | {lm:.4f} ± {lsd:.4f} | {secs:.1f} | {desc} |")
        return "\n".join(rows) + "\n"

    def plot(self, path: str, smooth: int = 15) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(13, 4.8))
        k = max(1, smooth)
        for m in self.methods:
            runs = self.of(m)
            if not runs:
                continue
            L = np.array([r.losses for r in runs], dtype=np.float64)
            if L.shape[1] >= k:
                ker = np.ones(k) / k
                L = np.array([np.convolve(l, ker, mode="valid") for l in L])
            x = np.arange(L.shape[1]) + (k - 1 if L.shape[1] < len(runs[0].losses) else 0)
            mean = L.mean(0)
            for a in ax:
                line, = a.plot(x, mean, label=f"{m} ({self.accuracy(m)[0]:.1f}%)", lw=1.3)
                a.fill_between(x, L.min(0), L.max(0), color=line.get_color(), alpha=0.12)
        ax[0].set_yscale("log")
        ax[0].set_title(f"{self.model}: training loss (mean over {len(self.seeds)} seeds, min-max band; "
                        f"moving avg {k})", fontsize=9)
        half = len(self.runs[0].losses) // 2 if self.runs else 0
        ax[1].set_xlim(left=half)
        ax[1].set_yscale("log")
        ax[1].set_title("second half of training (zoom)", fontsize=9)
        for a in ax:
            a.set_xlabel("step")
            a.grid(alpha=0.3, which="both")
        ax[0].set_ylabel("cross-entropy")
        ax[1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def to_json(self) -> dict:
        return dict(model=self.model, steps=self.steps, batch=self.batch, lr=self.lr, seeds=list(self.seeds),
                    methods=list(self.methods), device=self.device,
                    runs=[dataclasses.asdict(r) for r in self.runs])

    @classmethod
    def from_json(cls, d: dict) -> "ParityResult":
        return cls(d["model"], d["steps"], d["batch"], d["lr"], tuple(d["seeds"]), tuple(d["methods"]),
                   [Run(**r) for r in d["runs"]], d.get("device", "cpu"))

    def save(self, out_dir: str, stem: str) -> List[str]:
        import os

        os.makedirs(out_dir, exist_ok=True)
        paths = [os.path.join(out_dir, f"{stem}.{e}") for e in ("md", "json", "png")]
        with open(paths[0], "w") as f:
            f.write(self.to_markdown())
        with open(paths[1], "w") as f:
            json.dump(self.to_json(), f, indent=1)
        self.plot(paths[2])
        return paths


def build_model(model: str):
    import hot.torch as ht

    return ht.models.build(model)


def run_parity(model: str = "vit", methods: Sequence[str] = DEFAULT_METHODS, seeds: Sequence[int] = (0, 1, 2),
               steps: int = 300, batch: int = 128, lr: float = 3e-3, device: str = "cpu", data=None,
               progress: Optional[Callable[[str], None]] = None, model_fn: Optional[Callable] = None,
               checkpoint: Optional[str] = None) -> ParityResult:
    """Train ``model`` ('vit' or 'cnn', or ``model_fn()``) once per (method, seed); see the module docstring.

    For seed s: the initial weights come from ``torch.manual_seed(s)`` (the same for every method), the
    batch order from s, and the stochastic-rounding seeds from ``torch.manual_seed(s + 1)`` as in hot demo.
    ``checkpoint``: a JSON path rewritten after every run with the runs so far (``ParityResult.from_json``).
    """
    import torch

    from hot.cli.demo import load_digits, train

    for m in methods:
        method(m)
    if steps < 20:
        raise ValueError(f"hot.parity: steps must be at least 20 (one-cycle schedule), got {steps}")
    if not seeds:
        raise ValueError("hot.parity: at least one seed is needed")
    if data is None:
        data = load_digits(device)
    runs = []
    for s in seeds:
        torch.manual_seed(s)
        base = (model_fn() if model_fn is not None else build_model(model)).to(device)
        for m in methods:
            net = copy.deepcopy(base)
            torch.manual_seed(s + 1)
            t0 = time.perf_counter()
            note = prepare(net, m, calib_batch=(data[0][:batch], data[1][:batch]))
            r = train(net, data, steps, batch, lr, s, device, measure=False)
            runs.append(Run(m, s, r.accuracy, r.losses, time.perf_counter() - t0, note))
            if checkpoint is not None:
                with open(checkpoint, "w") as f:
                    json.dump(ParityResult(model, steps, batch, lr, tuple(seeds), tuple(methods), runs,
                                           str(device)).to_json(), f)
            if progress is not None:
                bad = "" if all(math.isfinite(v) for v in r.losses) else " (non-finite loss)"
                progress(f"{model} seed {s} {m:<12} acc {r.accuracy:6.2f}%  final loss "
                         f"{statistics.mean(r.losses[-20:]):.4f}  {runs[-1].seconds:5.1f}s  [{note}]{bad}")
    return ParityResult(model, steps, batch, lr, tuple(seeds), tuple(methods), runs, str(device))
