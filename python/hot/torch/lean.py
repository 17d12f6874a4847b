"""Layers that keep less for their backward than torch's, with the exact gradients (SPEC §2): ``hot.torch.ReLU`` and
``hot.torch.MaxPool2d``. ``hot.torch.convert`` swaps ``nn.ReLU`` and ``nn.MaxPool2d`` modules for them
(``keep_less=True``).

ReLU: its gradient needs only where its output is ``<= 0`` (``g_x = 0`` there and ``g_y`` elsewhere; torch's own
backward, ``threshold_backward``, reads the output for nothing else, and a NaN output passes its gradient). Exact
training keeps the whole output for that, and a converted layer that reads it (the convolution after a ReLU) cannot
shrink what the ReLU keeps. ``hot.torch.ReLU`` keeps those positions packed 8 to a byte, so that the converted layer's
int8 copy replaces the output: per element 1 + 1/8 bytes against 2 (bf16) or 4 (fp32). Bit for bit the same gradient
(the same selection: a non-finite g_y where the output is 0 gives 0, a NaN input passes its g_y).

MaxPool2d: torch's max-pool keeps its input and the int64 position of each window's maximum, but its backward reads
only the positions (the input serves for its shape). ``hot.torch.MaxPool2d`` keeps each maximum's offset inside its
window, one byte per output element (windows of at most 256 elements), and rebuilds the positions in the backward for
torch's own max-pool backward: the same gradient, bit for bit. With a ``hot.torch.ReLU`` before it (ResNet's stem)
nothing keeps the ReLU's output any more: the pair keeps one bit per input and one byte per output element, where
torch keeps the output (4 or 2 bytes per element) and 8 bytes per pooled element.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

_BITS: Dict[torch.device, Tensor] = {}
_BIT_VALUES = [1 << j for j in range(8)]


def _bits(device: torch.device) -> Tensor:
    """The uint8 vector (1, 2, 4, ..., 128) on device (cached; made afresh while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=device)
    b = _BITS.get(device)
    if b is None:
        b = _BITS[device] = torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=device)
    return b


def pack_bits(mask: Tensor) -> Tensor:
    """The bool tensor ``mask`` in its logical (row-major) order, 8 elements to a uint8 byte, element ``8k + j`` in bit
    j of byte k; the last byte is padded with zeros. ``unpack_bits`` inverts it."""
    if mask.dtype != torch.bool:
        raise TypeError(f"hot.torch.lean.pack_bits: mask has dtype {mask.dtype}, expected torch.bool")
    flat = mask.reshape(-1)
    tail = flat.numel() % 8
    if tail:
        flat = torch.cat([flat, flat.new_zeros(8 - tail)])
    return (flat.view(-1, 8) * _bits(flat.device)).sum(1, dtype=torch.uint8)  # bool x uint8: the bits' values


def unpack_bits(bits: Tensor, shape) -> Tensor:
    """The bool tensor of ``shape`` that ``pack_bits`` packed into ``bits``."""
    n = 1
    for s in shape:
        n *= s
    if bits.dtype != torch.uint8 or bits.dim() != 1 or bits.numel() != (n + 7) // 8:
        raise ValueError(f"hot.torch.lean.unpack_bits: bits must be a uint8 vector of {(n + 7) // 8} bytes for "
                         f"shape {tuple(shape)}, got {bits.dtype} of shape {tuple(bits.shape)}")
    flat = (bits.unsqueeze(1) & _bits(bits.device)).view(-1)
    return (flat[:n] != 0).view(shape)


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
        ctx.perm = perm  # (the output's shape comes back with grad_y)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (bits,) = ctx.saved_tensors
        shape = grad_y.shape if ctx.perm is None else [grad_y.shape[d] for d in ctx.perm]
        zero = unpack_bits(bits, shape)
        if ctx.perm is not None:
            zero = zero.permute(sorted(range(len(ctx.perm)), key=ctx.perm.__getitem__))  # the inverse permutation
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


def _pair(v) -> Tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


class _OffsetMaxPool2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, kernel, stride, padding, dilation, ceil_mode: bool) -> Tensor:
        y, idx = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
        ctx.save_for_backward(_window_offsets(idx, x.shape[-1], kernel, stride, padding, dilation))
        ctx.geometry = (kernel, stride, padding, dilation, ceil_mode)
        ctx.x_shape, ctx.x_format = x.shape, _memory_format(x)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (off,) = ctx.saved_tensors
        kernel, stride, padding, dilation, ceil_mode = ctx.geometry
        idx = _window_positions(off, ctx.x_shape[-1], kernel, stride, padding, dilation)
        shape_only = torch.empty(ctx.x_shape, dtype=grad_y.dtype, device=grad_y.device,  # never read: its shape
                                 memory_format=ctx.x_format)                            # and layout only
        g = torch.ops.aten.max_pool2d_with_indices_backward(grad_y, shape_only, kernel, stride, padding, dilation,
                                                             ceil_mode, idx)
        return g, None, None, None, None, None


def _memory_format(t: Tensor):
    return torch.channels_last if t.dim() == 4 and not t.is_contiguous() and \
        t.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format


def _window_origins(out_h: int, out_w: int, stride, padding, device):
    """(top row, left column) of each output position's window, shaped to broadcast over (..., out_h, out_w)."""
    h0 = torch.arange(out_h, device=device).mul_(stride[0]).sub_(padding[0]).view(out_h, 1)
    w0 = torch.arange(out_w, device=device).mul_(stride[1]).sub_(padding[1]).view(1, out_w)
    return h0, w0


def _window_offsets(idx: Tensor, in_w: int, kernel, stride, padding, dilation) -> Tensor:
    """uint8 offset (i * kw + j) inside its window of each maximum's flat input position idx (h * W + w)."""
    h0, w0 = _window_origins(idx.shape[-2], idx.shape[-1], stride, padding, idx.device)
    h = torch.div(idx, in_w, rounding_mode="floor")
    i = (h - h0).div_(dilation[0], rounding_mode="floor")
    j = (idx - h * in_w - w0).div_(dilation[1], rounding_mode="floor")
    return i.mul_(kernel[1]).add_(j).to(torch.uint8)


def _window_positions(off: Tensor, in_w: int, kernel, stride, padding, dilation) -> Tensor:
    """The flat input positions (int64) that _window_offsets encoded."""
    h0, w0 = _window_origins(off.shape[-2], off.shape[-1], stride, padding, off.device)
    o = off.to(torch.int64)
    i = torch.div(o, kernel[1], rounding_mode="floor")
    j = o - i * kernel[1]
    return (i.mul_(dilation[0]).add_(h0)).mul_(in_w).add_(j.mul_(dilation[1]).add_(w0))


def max_pool2d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False) -> Tensor:
    """``F.max_pool2d`` whose backward keeps one byte per output element (each maximum's offset in its window); the
    plain max-pool where no gradient is recorded, for windows of more than 256 elements, or for inputs that are not
    (N, C, H, W) / (C, H, W)."""
    k = _pair(kernel_size)
    s = k if stride is None or (not isinstance(stride, int) and len(stride) == 0) else _pair(stride)
    p, d = _pair(padding), _pair(dilation)
    if not (torch.is_grad_enabled() and x.requires_grad) or k[0] * k[1] > 256 or x.dim() not in (3, 4):
        return F.max_pool2d(x, k, s, p, d, ceil_mode=ceil_mode)
    return _OffsetMaxPool2d.apply(x, list(k), list(s), list(p), list(d), ceil_mode)


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` (same arguments; ``return_indices=False``) whose backward keeps one byte per output element
    instead of its input and int64 indices."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False) -> None:
        if return_indices:
            raise ValueError("hot.torch.MaxPool2d: return_indices=True is not supported (use nn.MaxPool2d, whose "
                             "indices it returns)")
        nn.MaxPool2d.__init__(self, kernel_size, stride, padding, dilation, return_indices, ceil_mode)

    def forward(self, x: Tensor) -> Tensor:
        if self.return_indices:  # a module swapped in by class (convert skips these; a later change of the flag)
            return nn.MaxPool2d.forward(self, x)
        return max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)

    def extra_repr(self) -> str:
        return nn.MaxPool2d.extra_repr(self) + ", hot=1-byte window offsets"
