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


def lqs_errors(g: torch.Tensor, bits: int = 4):
    """(e_tensor, e_token) of one layer's output gradient g (..., O) or a conv gradient (N, O, H, W)."""
    if g.dim() == 4:
        g = g.permute(0, 2, 3, 1)
    O = g.shape[-1]
    g2 = g.reshape(-1, O).float().contiguous()
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
        if len(gs) == 1:
            g = gs[0]
        else:  # a layer called several times: measure on all its calls together
            O = gs[0].shape[1] if gs[0].dim() == 4 else gs[0].shape[-1]
            g = torch.cat([(x.permute(0, 2, 3, 1) if x.dim() == 4 else x).reshape(-1, O) for x in gs])
        e_tensor, e_token = lqs_errors(g)
        choice = "token" if e_token < LQS_THRESHOLD * e_tensor else "tensor"
        m.set_lqs(choice, e_tensor, e_token)
        result[name] = dict(m.hot_lqs)
    return result
