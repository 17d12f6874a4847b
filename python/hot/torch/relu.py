"""``hot.torch.ReLU``: ``nn.ReLU`` that keeps one bit per element for its backward instead of its output (SPEC §2).

A ReLU's gradient needs only where its output is ``<= 0``: ``g_x = 0`` there and ``g_y`` elsewhere (torch's own
backward, ``threshold_backward``, reads the output for nothing else; a NaN output passes its gradient). Exact training keeps the whole output for that, and a converted layer that reads
it (the convolution after a ReLU) cannot shrink what the ReLU keeps. This ReLU keeps those positions packed 8 to a byte,
so that the converted layer's int8 copy replaces the output: per element 1 + 1/8 bytes against 2 (bf16) or 4 (fp32).
The gradient is the exact one, bit for bit (the same selection: a non-finite g_y where the output is 0 gives 0, and
a NaN input passes its g_y, as in torch's backward). ``hot.torch.convert`` swaps ``nn.ReLU`` modules for it (``relu_masks=True``).
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

_SHIFTS: Dict[torch.device, Tensor] = {}


def _shifts(device: torch.device) -> Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return s


def pack_bits(mask: Tensor) -> Tensor:
    """The bool tensor ``mask`` in its logical (row-major) order, 8 elements to a uint8 byte, element ``8k + j`` in bit
    j of byte k; the last byte is padded with zeros. ``unpack_bits`` inverts it."""
    if mask.dtype != torch.bool:
        raise TypeError(f"hot.torch.relu.pack_bits: mask has dtype {mask.dtype}, expected torch.bool")
    flat = mask.reshape(-1).view(torch.uint8)
    tail = flat.numel() % 8
    if tail:
        flat = torch.cat([flat, flat.new_zeros(8 - tail)])
    return (flat.view(-1, 8) << _shifts(flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(bits: Tensor, shape) -> Tensor:
    """The bool tensor of ``shape`` that ``pack_bits`` packed into ``bits``."""
    n = 1
    for s in shape:
        n *= s
    if bits.dtype != torch.uint8 or bits.dim() != 1 or bits.numel() != (n + 7) // 8:
        raise ValueError(f"hot.torch.relu.unpack_bits: bits must be a uint8 vector of {(n + 7) // 8} bytes for "
                         f"shape {tuple(shape)}, got {bits.dtype} of shape {tuple(bits.shape)}")
    flat = ((bits.unsqueeze(1) >> _shifts(bits.device)) & 1).view(-1)
    return flat[:n].view(torch.bool).view(shape)


def _memory_order(t: Tensor):
    """The permutation of t's dims that lists them from the largest stride to the smallest (t.permute(perm) is then
    contiguous for a dense t, e.g. a channels-last map), or None when t is contiguous already."""
    if t.is_contiguous():
        return None
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))


class _MaskedReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, inplace: bool) -> Tensor:
        if inplace:
            torch.relu_(x)
            ctx.mark_dirty(x)
            y = x  # the dirty input itself is returned (torch.compile requires it)
        else:
            y = torch.relu(x)
        zero = y <= 0  # where the gradient is 0 (threshold_backward's rule); laid out as y
        perm = _memory_order(zero)
        if perm is not None:  # pack in memory order (no copy for a dense layout such as channels-last)
            zero = zero.permute(perm)
        ctx.save_for_backward(pack_bits(zero))
        ctx.packed_shape, ctx.perm = zero.shape, perm
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (bits,) = ctx.saved_tensors
        zero = unpack_bits(bits, ctx.packed_shape)
        if ctx.perm is not None:
            inverse = [0] * len(ctx.perm)
            for i, d in enumerate(ctx.perm):
                inverse[d] = i
            zero = zero.permute(inverse)
        return torch.where(zero, 0, grad_y), None


def relu(x: Tensor, inplace: bool = False) -> Tensor:
    """``F.relu(x, inplace)`` whose backward keeps a 1-bit mask; the plain ReLU where no gradient is recorded (grad
    mode off, x not requiring grad) or for dtypes without gradients."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.relu(x, inplace=inplace)
    return _MaskedReLU.apply(x, inplace)


class ReLU(nn.ReLU):
    """``nn.ReLU`` (same arguments, no state) whose backward keeps one bit per element instead of its output."""

    def forward(self, x: Tensor) -> Tensor:
        return relu(x, self.inplace)

    def extra_repr(self) -> str:
        return nn.ReLU.extra_repr(self) + (", " if self.inplace else "") + "hot=1-bit mask"
