"""Layers that keep less for their backward than torch's, with the exact gradients (SPEC §2): ``hot.torch.ReLU`` and
``hot.torch.MaxPool2d``. ``hot.torch.convert`` swaps ``nn.ReLU`` and ``nn.MaxPool2d`` modules for them
(``keep_less=True``).

ReLU: its gradient needs only where its output is ``<= 0`` (``g_x = 0`` there and ``g_y`` elsewhere; torch's own
backward, ``threshold_backward``, reads the output for nothing else, and a NaN output passes its gradient). Exact
training keeps the whole output for that, and a converted layer that reads it (the convolution after a ReLU) cannot
shrink what the ReLU keeps. ``hot.torch.ReLU`` keeps those positions packed 8 to a byte, so that the converted layer's
int8 copy replaces the output: per element 1 + 1/8 bytes against 2 (bf16) or 4 (fp32). Bit for bit the same output and
gradient (the same selection: a non-finite g_y where the output is 0 gives 0, a NaN input passes its g_y). The engine
does both passes (``hot.relu_mask``: the ReLU and its mask in one pass over x, in x's memory order, so a channels-last
map needs no copy; ``hot.relu_mask_backward``: one pass over g_y); float64 and other devices keep torch's ReLU. The
ReLU's pass also takes its output's amax, which a converted convolution that quantises that output next takes instead
of a pass of its own over it (SPEC §2; eager and recorded steps: ``hot.torch.ops.note_amax``).

MaxPool2d: torch's max-pool keeps its input and the int64 position of each window's maximum, but its backward reads
only the positions (the input serves for its shape). ``hot.torch.MaxPool2d`` keeps each maximum's offset inside its
window, one byte per output element (windows of at most 128 elements): the engine's ``max_pool2d_offsets`` writes the
output and the offsets in one pass over the input (torch's choice of maximum: the first of equal ones, the last NaN),
and its backward gathers g_y onto the input in one pass, each input element's terms added in fp32 in output order and
rounded once, as torch's CUDA backward adds them (torch's CPU backward rounds after each add in float16 / bfloat16; in
float32 the two are the same bits). With a ``hot.torch.ReLU`` before it (ResNet's stem) nothing keeps the ReLU's
output any more: the pair keeps one bit per input and one byte per output element, where torch keeps the output (4 or
2 bytes per element) and 8 bytes per pooled element.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from hot import _api
from hot.torch.ops import ENGINE_FLOATS, _call, _nchw_rows, conv_node, define_op, hand_amax, note_amax

# Traced by torch.compile, the in-place masked ReLU (an autograd.Function that writes its input) got a wrong gradient
# from torch 2.11 (g_y passed unmasked) when the compiled function returned both its output and its input; right on
# 2.13, the oldest release checked since. Before 2.13 a compiled in-place ReLU is torch's own (it keeps its output).
_TRACES_INPLACE = torch.__version__ >= "2.13"


# ---- the engine's relu_mask on 1-D tensors: the bodies, and the torch.library ops that call them (torch.compile) ----
def _mask_body(x: Tensor, inplace: bool, amax: bool = False, out: Optional[Tensor] = None):
    """(y, bits) of hot.relu_mask of the 1-D x (y is x itself when inplace, else out or a new tensor), the others
    allocated here; with amax, (y, bits, y's amax)."""
    bits = torch.empty(((x.numel() + 7) // 8,), dtype=torch.int8, device=x.device)
    m = torch.empty((1,), dtype=torch.float32, device=x.device) if amax else False
    y = x if inplace else torch.empty_like(x) if out is None else out
    return _api._relu_mask(_call("relu_mask", x), x, y, bits, amax=m)


def _mask_backward_body(g: Tensor, bits: Tensor) -> Tensor:
    return _api._relu_mask_backward(_call("relu_mask_backward", g), g, bits, torch.empty_like(g))


relu_mask_op = define_op("relu_mask(Tensor x) -> (Tensor, Tensor)", lambda x: _mask_body(x, False),
                         lambda x: (torch.empty_like(x), x.new_empty(((x.numel() + 7) // 8,), dtype=torch.int8)))
relu_mask_inplace_op = define_op("relu_mask_inplace(Tensor(a!) x) -> Tensor", lambda x: _mask_body(x, True)[1],
                                 lambda x: x.new_empty(((x.numel() + 7) // 8,), dtype=torch.int8))
relu_mask_backward_op = define_op("relu_mask_backward(Tensor g, Tensor bits) -> Tensor", _mask_backward_body,
                                  lambda g, bits: torch.empty_like(g))


def _relu_mask(x: Tensor, inplace: bool, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """(y, bits, y's amax) for a 1-D x: the torch.library ops under torch.compile (a new y; no amax: None), else the
    bodies directly (no dispatcher; y into out where given)."""
    if torch.compiler.is_compiling():
        if inplace:
            return x, relu_mask_inplace_op(x), None
        return (*relu_mask_op(x), None)
    return _mask_body(x, inplace, True, out)


def _relu_mask_backward(g: Tensor, bits: Tensor) -> Tensor:
    if torch.compiler.is_compiling():
        return relu_mask_backward_op(g, bits)
    return _mask_backward_body(g, bits)


_NHWC, _NCHW = [0, 2, 3, 1], [0, 3, 1, 2]  # the channels-last order of an (N, C, H, W) tensor, and its inverse


def _memory_order(t: Tensor) -> Optional[List[int]]:
    """The permutation of t's dims that lists them from the largest stride to the smallest (t.permute(perm) is then
    contiguous for a dense t, e.g. a channels-last map), or None when t is contiguous already."""
    if t.is_contiguous():
        return None
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return _NHWC
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))


def _inverse(perm: List[int]) -> List[int]:
    if perm is _NHWC:
        return _NCHW
    return sorted(range(len(perm)), key=perm.__getitem__)


def _masked_grad(g: Tensor, bits: Tensor, perm: Optional[List[int]]) -> Tensor:
    """g_x = g_y where the bit is clear, 0 where set, with g_y laid out by the mask's permutation."""
    gp = g if perm is None else g.permute(perm)
    # contiguous: a copy only for another layout, or for a broadcast g_y (the expanded ones of a sum's backward)
    gx = _relu_mask_backward(gp.contiguous().view(-1), bits).view(gp.shape)
    return gx if perm is None else gx.permute(_inverse(perm))


class _MaskedGrad(torch.autograd.Function):
    """:func:`_masked_grad` recorded for a double backward (create_graph=True): linear in g_y, so its own backward is
    the same selection."""

    @staticmethod
    def forward(ctx, g: Tensor, bits: Tensor, perm: Optional[List[int]]) -> Tensor:
        ctx.save_for_backward(bits)
        ctx.perm = perm
        return _masked_grad(g, bits, perm)

    @staticmethod
    def backward(ctx, gg: Tensor):
        (bits,) = ctx.saved_tensors
        return _MaskedGrad.apply(gg, bits, ctx.perm), None, None


def _fused_masked_grad(g: Tensor, bits: Tensor, bn) -> Optional[Tensor]:
    """The ReLU's g_x where its input is the output of a handing BatchNorm (``bn``, its backward node, whose backward
    comes next): the engine's batch_norm_backward_reduce with the ReLU's bits forms g_x and the BatchNorm's sums in one
    pass, and hands the sums to ``bn`` with g_x (SPEC §2); None where the shapes do not allow it (then nothing is
    handed)."""
    x, weight, _, _, mean, invstd, _ = bn.saved_tensors
    if g.shape != x.shape or g.dtype != x.dtype or not x.is_contiguous(memory_format=torch.channels_last):
        return None
    g = g.contiguous(memory_format=torch.channels_last)
    gx = torch.empty_like(x, memory_format=torch.channels_last)
    sums = _api._batch_norm_backward_reduce(_call("batch_norm_backward_reduce", g), _nchw_rows(g), _nchw_rows(x),
                                            mean.float(), invstd.float(), grad_weight=weight is not None,
                                            relu_bits=bits, g_relu=_nchw_rows(gx))
    bn.grad_sums = (gx, gx._version) + tuple(sums)
    return gx


class _MaskedReLU(torch.autograd.Function):
    """(y, y's amax or None): the amax (no gradient) for the converted layer that quantises y next (note_amax). bn: the
    backward node of the handing BatchNorm whose output x is, or None (see :func:`_fused_masked_grad`)."""

    @staticmethod
    def forward(ctx, x: Tensor, inplace: bool, bn=None):
        perm = _memory_order(x)
        xp = x if perm is None else x.permute(perm)
        if not xp.is_contiguous():  # not dense (a strided view): through a row-major copy, masked in place
            perm, xp = None, x.contiguous()
            _, bits, amax = _relu_mask(xp.view(-1), True)
            y = x.copy_(xp) if inplace else xp
        elif inplace:
            y = x
            _, bits, amax = _relu_mask(xp.view(-1), True)
        elif torch.compiler.is_compiling():
            yf, bits, amax = _relu_mask(xp.view(-1), False)
            y = yf.view(xp.shape) if perm is None else yf.view(xp.shape).permute(_inverse(perm))
        else:  # y allocated in x's layout and written through a flat view: y is no view, so it may be changed in place
            y = torch.empty_like(x)
            _, bits, amax = _relu_mask(xp.view(-1), False, (y if perm is None else y.permute(perm)).view(-1))
        if inplace:
            ctx.mark_dirty(x)
        if amax is not None:
            ctx.mark_non_differentiable(amax)
        ctx.save_for_backward(bits)
        ctx.perm = perm
        ctx.bn = bn if perm is _NHWC else None  # the bits in the map's channels-last order
        return y, amax

    @staticmethod
    def backward(ctx, grad_y: Tensor, _grad_amax):
        (bits,) = ctx.saved_tensors
        bn, ctx.bn = ctx.bn, None
        if torch.is_grad_enabled():  # create_graph=True: the gradient itself is differentiated
            return _MaskedGrad.apply(grad_y, bits, ctx.perm), None, None
        if bn is not None and bn.impl == 0:  # the handing BatchNorm's engine backward comes next
            gx = _fused_masked_grad(grad_y, bits, bn)
            if gx is not None:
                return gx, None, None
        return _masked_grad(grad_y, bits, ctx.perm), None, None


def _handing_batch_norm_of(x: Tensor):
    """The backward node of the handing BatchNorm that receives the ReLU's g_x itself, the very tensor: x's producer,
    or the first input of a residual add producing x (``out += identity``, ``out + identity``; alpha 1: the add's
    backward hands its gradient to both inputs as that tensor), where it is a handing BatchNorm; else None."""
    fn = x.grad_fn
    if type(fn).__name__ == "AddBackward0" and getattr(fn, "_saved_alpha", None) == 1:
        fn = next((f for f, _ in fn.next_functions if isinstance(f, _HandingBatchNorm._backward_cls)), None)
    return fn if isinstance(fn, _HandingBatchNorm._backward_cls) else None


def relu(x: Tensor, inplace: bool = False) -> Tensor:
    """``F.relu(x, inplace)`` whose backward keeps a 1-bit mask (the engine's ``hot.relu_mask``, one pass over x); the
    plain ReLU where no gradient is recorded (grad mode off, x not requiring grad), for an empty x, for dtypes other
    than float32, float16 and bfloat16, and on devices other than the CPU and CUDA GPUs; in place under torch.compile
    with torch older than 2.13 (see ``_TRACES_INPLACE``)."""
    if not (torch.is_grad_enabled() and x.requires_grad) or x.dtype not in ENGINE_FLOATS or x.numel() == 0 \
            or x.device.type not in ("cpu", "cuda"):
        return F.relu(x, inplace=inplace)
    if inplace and torch.compiler.is_compiling() and not _TRACES_INPLACE:
        return F.relu(x, inplace=True)
    bn = None if torch.compiler.is_compiling() else _handing_batch_norm_of(x)  # eager only: it hands nothing compiled
    y, amax = _MaskedReLU.apply(x, inplace, bn)
    if amax is not None:  # eager: the conv after the ReLU takes y's amax instead of a pass over y (SPEC §8)
        note_amax(y, amax)
    return y


class ReLU(nn.ReLU):
    """``nn.ReLU`` (same arguments, no state) whose backward keeps one bit per element instead of its output."""

    def forward(self, x: Tensor) -> Tensor:
        return relu(x, self.inplace)

    def extra_repr(self) -> str:
        return nn.ReLU.extra_repr(self) + (", " if self.inplace else "") + "hot=1-bit mask"


def _pair(v) -> Tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _pool_out(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's max_pool2d output size along one side (floor, or ceil without a window that starts in the padding)."""
    n = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (n - 1) * s >= size + p:
        n -= 1
    return n


def _pool_shapes(x: Tensor, kernel, stride, padding, dilation, ceil_mode: bool):
    """(y's shape, its memory format) of the max-pool of the (N, C, H, W) map x: x's format, as torch's max_pool2d."""
    N, C, H, W = x.shape
    Ho = _pool_out(H, kernel[0], stride[0], padding[0], dilation[0], ceil_mode)
    Wo = _pool_out(W, kernel[1], stride[1], padding[1], dilation[1], ceil_mode)
    return (N, C, Ho, Wo), _memory_format(x)


def _pool_body(x: Tensor, kernel, stride, padding, dilation, ceil_mode: bool) -> Tuple[Tensor, Tensor]:
    """(y, the int8 window offsets) of hot.max_pool2d_offsets on the 4-D x, in x's memory format."""
    shape, fmt = _pool_shapes(x, kernel, stride, padding, dilation, ceil_mode)
    y = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    off = torch.empty(shape, dtype=torch.int8, device=x.device, memory_format=fmt)
    _api._max_pool2d_offsets(_call("max_pool2d_offsets", x), x, y, off, kernel, stride, padding, dilation)
    return y, off


def _pool_backward_body(g: Tensor, off: Tensor, x_shape: List[int], channels_last: bool, kernel, stride, padding,
                        dilation) -> Tensor:
    """g_x (x_shape, channels-last or contiguous as x was) of hot.max_pool2d_offsets_backward."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    gx = torch.empty(x_shape, dtype=g.dtype, device=g.device, memory_format=fmt)
    _api._max_pool2d_offsets_backward(_call("max_pool2d_offsets_backward", g), g, off, gx, kernel, stride, padding,
                                      dilation)
    return gx


def _pool_fake(x, kernel, stride, padding, dilation, ceil_mode):
    shape, fmt = _pool_shapes(x, kernel, stride, padding, dilation, ceil_mode)
    return (torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt),
            torch.empty(shape, dtype=torch.int8, device=x.device, memory_format=fmt))


def _pool_backward_fake(g, off, x_shape, channels_last, kernel, stride, padding, dilation):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(x_shape, dtype=g.dtype, device=g.device, memory_format=fmt)


max_pool_op = define_op("max_pool2d_offsets(Tensor x, SymInt[] kernel, SymInt[] stride, SymInt[] padding, "
                        "SymInt[] dilation, bool ceil_mode) -> (Tensor, Tensor)", _pool_body, _pool_fake)
max_pool_backward_op = define_op(
    "max_pool2d_offsets_backward(Tensor g, Tensor off, SymInt[] x_shape, bool channels_last, SymInt[] kernel, "
    "SymInt[] stride, SymInt[] padding, SymInt[] dilation) -> Tensor", _pool_backward_body, _pool_backward_fake)


class _OffsetMaxPool2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, kernel, stride, padding, dilation, ceil_mode: bool) -> Tensor:
        if torch.compiler.is_compiling():
            y, off = max_pool_op(x, kernel, stride, padding, dilation, ceil_mode)
        else:
            y, off = _pool_body(x, kernel, stride, padding, dilation, ceil_mode)
        ctx.save_for_backward(off)
        ctx.geometry = (kernel, stride, padding, dilation)
        ctx.x_shape, ctx.channels_last = list(x.shape), _memory_format(x) is torch.channels_last
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (off,) = ctx.saved_tensors
        args = (ctx.x_shape, ctx.channels_last) + ctx.geometry
        if torch.compiler.is_compiling():
            g = max_pool_backward_op(grad_y, off, *args)
        else:
            g = _pool_backward_body(grad_y, off, *args)
        return g, None, None, None, None, None


def _memory_format(t: Tensor):
    return torch.channels_last if t.dim() == 4 and not t.is_contiguous() and \
        t.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format


def max_pool2d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False) -> Tensor:
    """``F.max_pool2d`` whose backward keeps one byte per output element (each maximum's offset in its window; the
    engine's ``max_pool2d_offsets``: y and the offsets in one pass over x, g_x in one pass over g_y); the plain
    max-pool where no gradient is recorded, for dtypes other than float32, float16 and bfloat16, devices other than the
    CPU and CUDA GPUs, windows of more than 128 elements, inputs that are not (N, C, H, W) / (C, H, W), and arguments
    torch refuses (it raises)."""
    k = _pair(kernel_size)
    s = k if stride is None or (not isinstance(stride, int) and len(stride) == 0) else _pair(stride)
    p, d = _pair(padding), _pair(dilation)
    if not (torch.is_grad_enabled() and x.requires_grad) or k[0] * k[1] > 128 or x.dim() not in (3, 4) \
            or x.dtype not in ENGINE_FLOATS or x.device.type not in ("cpu", "cuda") or x.numel() == 0 \
            or min(s) < 1 or min(d) < 1 or p[0] > k[0] // 2 or p[1] > k[1] // 2 \
            or min(_pool_out(x.shape[-2], k[0], s[0], p[0], d[0], ceil_mode),
                   _pool_out(x.shape[-1], k[1], s[1], p[1], d[1], ceil_mode)) < 1:
        return F.max_pool2d(x, k, s, p, d, ceil_mode=ceil_mode)
    if x.dim() == 3:
        return _OffsetMaxPool2d.apply(x.unsqueeze(0), list(k), list(s), list(p), list(d), ceil_mode).squeeze(0)
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


# ---- BatchNorm2d: G~'s amax handed to the converted convolution before it ----------------------------------------
class _HandingBatchNorm(torch.autograd.Function):
    """Training-mode batch norm of a channels-last x. The forward is the engine's where the running statistics are
    float32 or untracked and there is more than one value per channel: the batch statistics ``batch_norm_stats`` (fp32
    sums in a fixed order, the running statistics updated as torch updates them) and y ``batch_norm_transform``;
    otherwise torch's own kernels, chosen as ``F.batch_norm`` chooses them (``_batch_norm_impl_index``). Where the
    forward is the engine's or torch's native kernels, the backward is the engine's: the per-channel sums
    ``batch_norm_backward_reduce`` (fp32 in a fixed order; g_w = sum_dy_xmu * invstd, g_b = sum_dy, as torch's up to
    the order of the adds) and g_x ``batch_norm_backward_input`` (torch's float32 evaluation), which also gives G~'s
    amax of g_x, handed to the converted convolution whose output x is (``node``); otherwise (cuDNN) the backward is
    torch's, without a hand-over."""

    @staticmethod
    def forward(ctx, x: Tensor, weight, bias, running_mean, running_var, momentum: float, eps: float, node):
        f32 = lambda t: t is None or t.dtype == torch.float32  # noqa: E731
        if x.numel() > x.shape[1] and f32(running_mean) and f32(running_var):
            rows = _nchw_rows(x)  # a view: x is channels-last
            mean, invstd = _api._batch_norm_stats(_call("batch_norm_stats", x), rows, float(eps), running_mean,
                                                  running_var, float(momentum))
            y = torch.empty_like(x, memory_format=torch.channels_last)
            w32, b32 = (None if t is None else t.detach().float() for t in (weight, bias))
            _api._batch_norm_transform(_call("batch_norm_transform", x), rows, mean, invstd, w32, b32, _nchw_rows(y))
            reserve, impl = x.new_empty(0, dtype=torch.uint8), 0
        else:
            y, mean, invstd, reserve, impl = torch.ops.aten._batch_norm_impl_index(
                x, weight, bias, running_mean, running_var, True, momentum, eps, torch.backends.cudnn.enabled)
        ctx.save_for_backward(x, weight, running_mean, running_var, mean, invstd, reserve)
        ctx.eps, ctx.impl, ctx.node = eps, impl, node
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight, rm, rv, mean, invstd, reserve = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        node, ctx.node = ctx.node, None
        if ctx.impl != 0 or torch.is_grad_enabled():  # torch's backward (differentiable again for create_graph=True)
            if ctx.impl == 0:
                gx, gw, gb = torch.ops.aten.native_batch_norm_backward(g, x, weight, rm, rv, mean, invstd, True,
                                                                       ctx.eps, [nx, nw, nb])
            else:
                gx, gw, gb = torch.ops.aten._batch_norm_impl_index_backward(
                    ctx.impl, x, g, weight, rm, rv, mean, invstd, True, ctx.eps, [nx, nw, nb], reserve)
            return gx, gw, gb, None, None, None, None, None
        handed, ctx.grad_sums = getattr(ctx, "grad_sums", None), None
        affine = weight is not None
        if handed is not None and handed[0] is g and g._version == handed[1]:  # the ReLU after it formed the sums
            sum_dy, sum_dy_xmu, gw = handed[2:]
            gw = gw if nw else None
        else:
            g = g.contiguous(memory_format=torch.channels_last)
            sum_dy, sum_dy_xmu, gw = _api._batch_norm_backward_reduce(
                _call("batch_norm_backward_reduce", g), _nchw_rows(g), _nchw_rows(x), mean.float(), invstd.float(),
                grad_weight=nw and affine)
        gb = sum_dy if nb and affine else None
        if affine and weight.dtype != torch.float32:  # in the parameters' dtype, as torch's
            gw, gb = (None if t is None else t.to(weight.dtype) for t in (gw, gb))
        gx = None
        if nx:
            gx = torch.empty_like(x, memory_format=torch.channels_last)
            w32 = None if weight is None else weight.float()  # torch's kernels read it as float32 too
            # g, x, gx channels-last: their (N*H*W, C) rows are views
            _, amax = _api._batch_norm_backward_input(_call("batch_norm_backward_input", g), _nchw_rows(g),
                                                      _nchw_rows(x), mean.float(), invstd.float(), w32, sum_dy,
                                                      sum_dy_xmu, _nchw_rows(gx))
            if node is not None:
                hand_amax(node, gx, amax)
        return gx, gw, gb, None, None, None, None, None


class BatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` (same arguments and state) that, training after a converted convolution on a channels-last
    CUDA map, forms its forward with the engine where its running statistics are float32 or untracked (the batch
    statistics from fp32 sums in a fixed order: torch's up to their last bits) and its backward with the engine (the
    per-channel sums in fp32 in a fixed order, so its gradients are torch's up to the order of those adds), and hands
    the convolution G~'s amax of g_x, so that the convolution's g_y pass needs no pass of its own over g_y to find it
    (SPEC §2, "BatchNorm's hand-over", "BatchNorm's statistics"). Everywhere else (evaluation, another producer, NCHW,
    the CPU, torch.compile, float64) it is nn.BatchNorm2d."""

    def forward(self, x: Tensor) -> Tensor:
        node = None
        if self.training and torch.is_grad_enabled() and x.is_cuda and x.dtype in ENGINE_FLOATS and x.dim() == 4 \
                and x.numel() > 0 and not torch.compiler.is_compiling() and _memory_format(x) is torch.channels_last:
            node = conv_node(x)
        if node is None:
            return nn.BatchNorm2d.forward(self, x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:  # as nn.BatchNorm2d counts
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        stats = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        return _HandingBatchNorm.apply(x, self.weight, self.bias, *stats, momentum, self.eps, node)

    def extra_repr(self) -> str:
        return nn.BatchNorm2d.extra_repr(self) + ", hot=hands G~'s amax to the conv before it"
