"""LQS: layer-wise quantiser selection (SPEC §7).

``calibrate(model, batch, loss_fn)`` runs one forward and one exact backward on a training batch,
takes every HOT layer's output gradient ``g_y`` (flattened to L x O; for a convolution L = N*H_out*W_out),
forms ``G~ = g_y · blockdiag(H_b)`` (b = 16, or the largest power of two <= 16 dividing O) and measures

    e_tensor = ||G~ - deq(Q4_tensor(G~))||_F,   e_token = ||G~ - deq(Q4_token(G~))||_F

with 4-bit round-to-nearest quantisation (``hot.quantize``). The layer uses per-token scales on its g_x
path iff ``e_token < 0.5 * e_tensor``. The choice is stored in ``layer.hot_config.gx_scale`` and
``layer.hot_lqs`` and travels with the state_dict. Parameter ``.grad`` fields are not touched.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch
import torch.nn as nn

import hot

from .convert import hot_layers

LQS_THRESHOLD = 0.5


def block_size(O: int) -> int:
    b = 16
    while b > 1 and O % b:
        b //= 2
    return b


def _rows(g: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """g as L x O rows, O being its dim channel_dim."""
    return g.movedim(channel_dim, -1).reshape(-1, g.shape[channel_dim])


def _layer_rows(layer: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """A layer's output gradient as L x O rows: O is a Linear's last dim, a Conv2d's dim 1 (N, O, H, W) or, for an
    unbatched call, dim 0 (O, H, W)."""
    if isinstance(layer, nn.Conv2d):
        return _rows(g, 1 if g.dim() == 4 else 0)
    return _rows(g, -1)


def lqs_errors(g: torch.Tensor, bits: int = 4, channel_dim: int = -1):
    """(e_tensor, e_token) of one layer's output gradient g, whose dim channel_dim holds the O outputs: -1 for a
    Linear's (..., O), 1 for a Conv2d's (N, O, H, W)."""
    g2 = _rows(g, channel_dim).float().contiguous()
    O = g2.shape[-1]
    gt = hot.hadamard_transform(g2, block=block_size(O), axis=-1)
    errs = []
    for mode in ("tensor", "token"):
        q, s = hot.quantize(gt, bits=bits, scale=mode, rounding="nearest")
        deq = hot.dequantize(q, s)
        errs.append(float(torch.linalg.vector_norm((gt - deq).double())))
    return errs[0], errs[1]


def _run_loss(model: nn.Module, batch: Any, loss_fn: Callable):
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, target = batch
        return loss_fn(model(inputs), target)
    if isinstance(batch, dict):
        return loss_fn(model(**batch))
    return loss_fn(model(batch))


def calibrate(model: nn.Module, batch: Any, loss_fn: Callable) -> Dict[str, Dict[str, Any]]:
    """Run LQS once (SPEC §7) and fix every HOT layer's g_x scale choice.

    batch: ``(inputs, target)`` -> ``loss_fn(model(inputs), target)``; a dict -> ``loss_fn(model(**batch))``;
    anything else -> ``loss_fn(model(batch))``. Returns {layer name: {"choice", "e_tensor", "e_token"}}.
    """
    layers = hot_layers(model)
    if not layers:
        raise ValueError("hot.torch.calibrate: the model has no HOT layers; run hot.torch.convert(model) first")
    captures = {}
    try:
        for name, m in layers:
            captures[name] = []
            m._hot_capture = captures[name]
        with torch.enable_grad():
            loss = _run_loss(model, batch, loss_fn)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"hot.torch.calibrate: loss_fn must return a scalar tensor, got "
                                 f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
            outs = [(name, y) for name, _ in layers for y in captures[name] if y.requires_grad]
            grads = torch.autograd.grad(loss, [y for _, y in outs], allow_unused=True)
    finally:
        for _, m in layers:
            m._hot_capture = None
    per_layer: Dict[str, list] = {}
    for (name, _), g in zip(outs, grads):
        if g is not None:
            per_layer.setdefault(name, []).append(g)
    result = {}
    for name, m in layers:
        gs = per_layer.get(name)
        if not gs:
            result[name] = {"choice": m.hot_config.gx_scale, "e_tensor": float("nan"), "e_token": float("nan"),
                            "note": "no gradient reached this layer; choice unchanged"}
            continue
        # L x O rows of all the layer's calls (several for a layer called more than once)
        e_tensor, e_token = lqs_errors(torch.cat([_layer_rows(m, g) for g in gs]))
        choice = "token" if e_token < LQS_THRESHOLD * e_tensor else "tensor"
        m.set_lqs(choice, e_tensor, e_token)
        result[name] = dict(m.hot_lqs)
    return result
