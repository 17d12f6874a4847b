"""Per-layer configuration from measured gradients (SPEC §7).

Both functions run one forward and one exact backward pass on a training batch, with every HOT layer computing
exactly, and capture each layer's input ``x`` and output gradient ``g_y``. Parameter ``.grad`` fields, buffers
(BatchNorm running statistics) and the random number generators are left as they were, so a calibration does not
change the training run around it.

- ``calibrate`` (SPEC §7.2, the automatic configuration): for every layer, run the layer's own HOT backward with each
  candidate setting on the captured operands, measure the relative errors of g_x and g_w against the exact
  gradients (and g_w's error from the HLA projection alone), and pick the cheapest setting on this device within the
  budgets (``budget`` for the whole error, ``bias_budget`` for the projection's).
- ``lqs`` (SPEC §7.1, the paper's LQS): per layer, per-token or per-tensor scales on the 4-bit g_x path.

``Recalibrator`` repeats ``calibrate`` every N steps during training (gradients change as a model trains).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import hot

from .convert import hot_layers
from .layers import Conv1d, Conv2d, TransposedLinear, as_2d, conv_geom, hot_conv2d, hot_linear

LQS_THRESHOLD = 0.5

DEFAULT_BUDGET = 0.1
"""Default noise budget of ``calibrate``: the largest relative error ‖ĝ − g‖_F / ‖g‖_F of a layer's g_x or g_w against
the exact gradient on the calibration batch that a cheaper setting may have. The quantisers' error is unbiased noise
(stochastic rounding), which training averages over steps: 8-bit per-tensor g_x measured up to 0.39 per layer on the
synthetic ViT at initialisation and trained as well as exact; 4-bit per-tensor g_x (0.6-1.0) did not
(docs/results/accuracy.md)."""

DEFAULT_BIAS_BUDGET = 0.02
"""Default bias budget of ``calibrate``: the largest relative error of a layer's g_w that the HLA projection alone
(no quantisation) may cause. Unlike quantisation noise, the projection removes the same part of every step's
gradient, and training does not average it out: rank 4 on the synthetic ViT's qkv layers (a projection error of
0.04-0.10 at initialisation) cost 1.5 points (docs/results/accuracy.md)."""

RANKS = (4, 8, 12, 16)
"""HLA ranks ``calibrate`` considers; 16 is full rank (the g_w GEMM's length and the ABC buffer scale with it)."""


def _rows(g: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """g as L x O rows, O being its dim channel_dim."""
    return g.movedim(channel_dim, -1).reshape(-1, g.shape[channel_dim])


def _layer_rows(layer: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """A layer's output gradient as L x O rows: O is a Linear's last dim, a Conv2d's dim 1 (N, O, H, W) or, for an
    unbatched call, dim 0 (O, H, W)."""
    if isinstance(layer, nn.Conv2d):
        return _rows(g, 1 if g.dim() == 4 else 0)
    return _rows(g, -1)


def _run_loss(model: nn.Module, batch: Any, loss_fn: Callable):
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, target = batch
        return loss_fn(model(inputs), target)
    if isinstance(batch, dict):
        return loss_fn(model(**batch))
    return loss_fn(model(batch))


def _rng_devices(model: nn.Module) -> List[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


@contextlib.contextmanager
def _untouched(model: nn.Module):
    """Restore the model's buffers (BatchNorm statistics) and the CPU/CUDA generators after the block."""
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    with torch.random.fork_rng(devices=_rng_devices(model)):
        try:
            yield
        finally:
            with torch.no_grad():
                for n, b in model.named_buffers():
                    if n in saved:
                        b.copy_(saved[n])


def capture(model: nn.Module, batch: Any, loss_fn: Callable, what: str) -> Dict[str, List[Tuple[torch.Tensor,
                                                                                             torch.Tensor, bool]]]:
    """{layer name: [(x, g_y, whether x needs a gradient) for each call of the layer]} (x and g_y detached) from one
    exact forward/backward pass of ``model`` on ``batch`` (see ``calibrate`` for the batch forms). ``what`` names the
    caller in errors."""
    layers = hot_layers(model)
    if not layers:
        raise ValueError(f"hot.torch.{what}: the model has no HOT layers; run hot.torch.convert(model) first")
    captures: Dict[str, list] = {}
    with _untouched(model):
        try:
            for name, m in layers:
                captures[name] = []
                m._hot_capture = captures[name]
            with torch.enable_grad():
                loss = _run_loss(model, batch, loss_fn)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"hot.torch.{what}: loss_fn must return a scalar tensor, got "
                                     f"{type(loss).__name__}"
                                     f"{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
                outs = [(name, x, y) for name, _ in layers for x, y in captures[name] if y.requires_grad]
                grads = torch.autograd.grad(loss, [y for _, _, y in outs], allow_unused=True)
        finally:
            for _, m in layers:
                m._hot_capture = None
    per_layer: Dict[str, list] = {name: [] for name, _ in layers}
    for (name, x, _), g in zip(outs, grads):
        if g is not None:
            per_layer[name].append((x.detach(), g.detach(), x.requires_grad))
    return per_layer


# ---- LQS (SPEC §7.1) ------------------------------------------------------------------------------------


def lqs_errors(g: torch.Tensor, bits: int = 4, channel_dim: int = -1):
    """(e_tensor, e_token) of one layer's output gradient g, whose dim channel_dim holds the O outputs: -1 for a
    Linear's (..., O), 1 for a Conv2d's (N, O, H, W)."""
    g2 = _rows(g, channel_dim).float().contiguous()
    O = g2.shape[-1]
    gt = hot.hadamard_transform(g2, block=hot._api._hq_block(O), axis=-1)
    errs = []
    for mode in ("tensor", "token"):
        q, s = hot.quantize(gt, bits=bits, scale=mode, rounding="nearest")
        deq = hot.dequantize(q, s)
        errs.append(float(torch.linalg.vector_norm((gt - deq).double())))
    return errs[0], errs[1]


def lqs(model: nn.Module, batch: Any, loss_fn: Callable) -> Dict[str, Dict[str, Any]]:
    """The paper's LQS (SPEC §7.1): fix every HOT layer's g_x scale choice from 4-bit errors of its G~.

    batch: ``(inputs, target)`` -> ``loss_fn(model(inputs), target)``; a dict -> ``loss_fn(model(**batch))``;
    anything else -> ``loss_fn(model(batch))``. Returns {layer name: {"choice", "e_tensor", "e_token"}}.
    """
    per_layer = capture(model, batch, loss_fn, "lqs")
    result = {}
    for name, m in hot_layers(model):
        pairs = per_layer.get(name)
        if not pairs:
            result[name] = {"choice": m.hot_target_config.gx_scale, "e_tensor": float("nan"),
                            "e_token": float("nan"), "note": "no gradient reached this layer; choice unchanged"}
            continue
        # L x O rows of all the layer's calls (several for a layer called more than once)
        e_tensor, e_token = lqs_errors(torch.cat([_layer_rows(m, g) for _, g, _ in pairs]))
        choice = "token" if e_token < LQS_THRESHOLD * e_tensor else "tensor"
        m.set_lqs(choice, e_tensor, e_token)
        result[name] = dict(m.hot_lqs)
    return result


# ---- automatic configuration (SPEC §7.2) ----------------------------------------------------------------


def int4_tensor_cores(device) -> bool:
    """Whether 4-bit GEMMs run faster than 8-bit ones on ``device``: NVIDIA sm_80-sm_89 (Ampere, Ada) have s4
    tensor cores (SPEC §6); Hopper and the CPU run 4-bit values through the 8-bit GEMM, at the 8-bit cost."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == 8


def _gx_candidates(int4: bool) -> List[Tuple[int, str]]:
    """(bits, scale) settings of the g_x path, cheapest first."""
    return ([(4, "tensor"), (4, "token")] if int4 else []) + [(8, "tensor"), (8, "token")]


@contextlib.contextmanager
def _full_fp32():
    """float32 reference GEMMs without TF32, whatever the caller set."""
    m, c = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = m, c


def _grads(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, config) -> Tuple[torch.Tensor, torch.Tensor]:
    """(g_x, g_w) of ``layer`` at input x for output gradient g, by the layer's HOT backward with ``config`` (None:
    the exact float32 backward), all in float32."""
    w = layer.weight.detach().float().requires_grad_(True)
    xi = x.float().requires_grad_(True)
    with torch.autocast(x.device.type, enabled=False), torch.enable_grad():
        if isinstance(layer, (Conv2d, Conv1d)):  # a Conv1d as the 2-D convolution it runs as (unit height)
            _, st, pad, dil = conv_geom(layer)
            x2, w2 = as_2d(layer, xi), as_2d(layer, w)
            y = (F.conv2d(x2, w2, None, st, pad, dil) if config is None
                 else hot_conv2d(x2, w2, None, st, pad, dil, config=config))
            g = as_2d(layer, g)
        else:
            wl = w.t() if isinstance(layer, TransposedLinear) else w  # O x I
            y = F.linear(xi, wl) if config is None else hot_linear(xi, wl, None, config)
        gx, gw = torch.autograd.grad(y, (xi, w), g.float())
    return gx, gw


def _rel_errors(layer: nn.Module, pairs, configs: Sequence) -> List[Tuple[float, float]]:
    """(e_x, e_w) of each config over all the layer's calls: ‖ĝ − g‖_F / ‖g‖_F with the exact g."""
    num = [[0.0, 0.0] for _ in configs]
    den = [0.0, 0.0]
    for x, g, _ in pairs:
        with _full_fp32():
            ref = _grads(layer, x, g, None)
        for k in range(2):
            den[k] += float(torch.linalg.vector_norm(ref[k].double())) ** 2
        for i, cfg in enumerate(configs):
            est = _grads(layer, x, g, cfg)
            for k in range(2):
                num[i][k] += float(torch.linalg.vector_norm((est[k].double() - ref[k].double()))) ** 2
    return [tuple(math.sqrt(n[k] / den[k]) if den[k] > 0 else (0.0 if n[k] == 0 else math.inf) for k in range(2))
            for n in num]


def _projection_bias(layer: nn.Module, pairs, ranks: Sequence[int]) -> Dict[str, float]:
    """{"r<rank>": ‖g_yᵀ P_r x − g_yᵀ x‖_F / ‖g_yᵀ x‖_F}: the HLA projection's error of g_w without quantisation (SPEC §4),
    over all the layer's calls (x as im2col columns for a convolution)."""
    num = {r: 0.0 for r in ranks}
    den = 0.0
    for x, g, _ in pairs:
        x, g = x.detach(), g.detach()
        x, g = x.float(), g.float()
        if isinstance(layer, (Conv2d, Conv1d)):
            x, g = as_2d(layer, x), as_2d(layer, g)
            x4, g4 = (x, g) if x.dim() == 4 else (x.unsqueeze(0), g.unsqueeze(0))
            k, st, pad, dil = conv_geom(layer)
            cols = F.unfold(x4, k, dilation=dil, padding=pad, stride=st)
            X = cols.transpose(1, 2).reshape(-1, cols.shape[1])
            G = g4.permute(0, 2, 3, 1).reshape(-1, g4.shape[1])
        else:
            X, G = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        X, G = X.contiguous(), G.contiguous()
        with _full_fp32():
            ref = (G.t() @ X).double()
            den += float(torch.linalg.vector_norm(ref)) ** 2
            for r in ranks:
                proj = (hot.hla(G, r).t() @ hot.hla(X, r)).double() / 16
                num[r] += float(torch.linalg.vector_norm(proj - ref)) ** 2
    return {f"r{r}": (math.sqrt(num[r] / den) if den > 0 else 0.0) for r in ranks}


def _choose_layer(layer: nn.Module, pairs, budget: float, bias_budget: float, ranks: Sequence[int],
                  int4: bool) -> Dict[str, Any]:
    base = layer.hot_target_config
    gxc = _gx_candidates(int4)
    # One backward per candidate pair: g_x depends only on (bits, scale), g_w only on the rank (SPEC §3, §4), so
    # candidate i carries the i-th g_x setting and the i-th rank (the lists padded with their last entry).
    n = max(len(gxc), len(ranks))
    gx_list = [gxc[min(i, len(gxc) - 1)] for i in range(n)]
    r_list = [ranks[min(i, len(ranks) - 1)] for i in range(n)]
    configs = [base.replace(gx_bits=b, gx_scale=s, rank=r, exact=False) for (b, s), r in zip(gx_list, r_list)]
    errs = _rel_errors(layer, pairs, configs)
    e_gx = {f"{b}-bit {s}": errs[i][0] for i, (b, s) in enumerate(gx_list)}
    e_gw = {f"r{r}": errs[i][1] for i, r in enumerate(r_list)}
    need_gx = any(needs for _, _, needs in pairs)
    need_gw = layer.weight.requires_grad
    # g_x: the cheapest bit width within budget (4-bit only where it is cheaper), then the smaller error
    if need_gx:
        ok = [(b, e_gx[f"{b}-bit {s}"], s) for b, s in gxc if e_gx[f"{b}-bit {s}"] <= budget]
        bits, _, scale = min(ok) if ok else min(((b, e_gx[f"{b}-bit {s}"], s) for b, s in gxc if b == 8),
                                                key=lambda t: t[1])
    else:  # nothing reads this layer's g_x (its input needs no gradient): keep the setting
        bits, scale = base.gx_bits, base.gx_scale
    # g_w: the lowest rank within both budgets (the projection's bias, and the whole error); full rank when none is
    b_gw = _projection_bias(layer, pairs, ranks) if need_gw else {}
    if need_gw:
        ok_r = [r for r in ranks if e_gw[f"r{r}"] <= budget and b_gw[f"r{r}"] <= bias_budget]
        rank = min(ok_r) if ok_r else 16
    else:
        rank = base.rank
    chosen = base.replace(gx_bits=bits, gx_scale=scale, rank=rank, exact=False)
    return {"config": chosen, "e_gx": e_gx, "e_gw": e_gw, "bias_gw": b_gw, "need_gx": need_gx, "need_gw": need_gw}


def calibrate(model: nn.Module, batch: Any, loss_fn: Callable, budget: float = DEFAULT_BUDGET,
              bias_budget: float = DEFAULT_BIAS_BUDGET, ranks: Sequence[int] = RANKS,
              int4: Optional[bool] = None) -> Dict[str, Dict[str, Any]]:
    """The automatic per-layer configuration (SPEC §7.2).

    On one training batch with exact gradients, measure for every HOT layer the relative error
    ‖ĝ − g‖_F / ‖g‖_F of its g_x for each g_x setting (8-bit, and 4-bit where ``int4``; per-tensor and per-token
    scales) and of its g_w for each HLA rank in ``ranks`` (16 = full rank), each by the layer's own HOT backward on
    the captured operands against the exact float32 gradients; and for each rank the error of g_w that the HLA
    projection alone causes (no quantisation: a bias, which training does not average out). Each layer then runs
    the cheapest setting within the budgets: for g_x, 4-bit only where it is cheaper than 8-bit (``int4``: default,
    INT4 tensor cores on the model's GPU, see ``int4_tensor_cores``) and its error is within ``budget``, between
    equal costs the smaller error; for g_w, the lowest rank whose error is within ``budget`` and whose projection
    error is within ``bias_budget``. A path with no candidate within budget gets its most accurate setting (8-bit,
    full rank). Layers whose weight is frozen keep their rank (nothing is kept for g_w); layers whose input needs no
    gradient keep their g_x setting.

    batch: ``(inputs, target)`` -> ``loss_fn(model(inputs), target)``; a dict -> ``loss_fn(model(**batch))``;
    anything else -> ``loss_fn(model(batch))``. The choice is stored per layer (``layer.hot_calibration``, saved in
    the state_dict); during a warm-up (``hot.torch.Warmup``) it takes effect when the warm-up ends. Returns
    {layer name: {"config": hot.Config, "e_gx": {setting: error}, "e_gw": {"r<rank>": error}, "bias_gw": {"r<rank>":
    projection error}, ...}}.
    """
    for name, v in (("budget", budget), ("bias_budget", bias_budget)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"hot.torch.calibrate: {name} must be a positive number (a relative error), got {v!r}")
    ranks = tuple(ranks)
    if not ranks or any(not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= 16 for r in ranks):
        raise ValueError(f"hot.torch.calibrate: ranks must be integers in 1..16, got {ranks!r}")
    ranks = tuple(sorted(set(ranks) | {16}))
    per_layer = capture(model, batch, loss_fn, "calibrate")
    if int4 is None:
        p = next(iter(model.parameters()), None)
        int4 = p is not None and int4_tensor_cores(p.device)
    result = {}
    with _untouched(model):
        for name, m in hot_layers(model):
            pairs = per_layer.get(name)
            if not pairs:
                result[name] = {"config": m.hot_target_config, "note": "no gradient reached this layer; unchanged"}
                continue
            r = _choose_layer(m, pairs, float(budget), float(bias_budget), ranks, bool(int4))
            m.set_hot_config(r["config"])
            m.hot_calibration = {"budget": float(budget), "bias_budget": float(bias_budget), "e_gx": r["e_gx"],
                                 "e_gw": r["e_gw"], "bias_gw": r["bias_gw"], "choice": r["config"].describe(),
                                 "int4": bool(int4)}
            result[name] = r
    return result


class Recalibrator:
    """Repeats ``calibrate`` during training: call ``step(batch)`` once per training step; every ``every`` steps
    (the first call included) it recalibrates on that batch. Under ``torch.compile`` a layer is recompiled only
    when its choice changes."""

    def __init__(self, model: nn.Module, loss_fn: Callable, every: int, budget: float = DEFAULT_BUDGET,
                 bias_budget: float = DEFAULT_BIAS_BUDGET, ranks: Sequence[int] = RANKS,
                 int4: Optional[bool] = None) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"hot.torch.Recalibrator: every must be a positive integer (steps), got {every!r}")
        self.model, self.loss_fn, self.every = model, loss_fn, every
        self.kw = dict(budget=budget, bias_budget=bias_budget, ranks=ranks, int4=int4)
        self.steps = 0
        self.last: Optional[Dict[str, Dict[str, Any]]] = None

    def step(self, batch: Any) -> Optional[Dict[str, Dict[str, Any]]]:
        """Count one training step; recalibrate on ``batch`` when due (returns the result then, else None)."""
        due = self.steps % self.every == 0
        self.steps += 1
        if not due:
            return None
        self.last = calibrate(self.model, batch, self.loss_fn, **self.kw)
        return self.last

    def state_dict(self) -> Dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.steps = int(state["steps"])
