"""The public functions of hot: argument checks, output allocation in the caller's framework, and
the call into hot._C (which translates DLPack arrays for the C++ core)."""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import numpy as np

from . import _C
from . import _frameworks as fws

_ROUNDINGS = ("stochastic", "nearest")
_SCALES = ("tensor", "token")
_FLOATS = ("float32", "float16", "bfloat16")
_UINT64_MAX = (1 << 64) - 1


# ---- configuration ---------------------------------------------------------------------------------


class Config(_C.Config):
    """HOT configuration of one layer (SPEC §3-§5, §7, §10).

    gx_bits: bit width of the activation-gradient path (4 or 8); rank: HLA rank of the weight-gradient
    path (1..16; 16 is full rank: no low-rank projection); rounding: of the g_y-derived operands
    ("stochastic" or "nearest"); gx_scale: scale granularity of the g_x path ("tensor" or "token");
    exact: unquantised backward from the raw input.

    The default, ``Config()``, is the accurate one (SPEC §10): 8-bit g_x, full-rank 8-bit g_w. It trained as
    well as exact on every task measured, and on the GPUs hot runs fastest on (Hopper) and on the CPU a 4-bit
    g_x costs as much as an 8-bit one (the values ride in int8 through the same GEMM). Cheaper settings per
    layer come from ``hot.torch.calibrate`` (measured against exact gradients) or by name:
    ``Config.paper()`` is the paper's configuration (4-bit g_x, rank-8 HLA).

    A Config is the core's ``hot::Config`` (cpp/include/hot/config.h, bound as ``hot._C.Config``): the core
    validates it when it is made, and the operations take it whole. Immutable; equality, hashing, ``repr``,
    ``describe()``, pickling and ``code`` / ``from_code`` (the one-integer encoding that crosses the
    torch.library ops' schemas) come from the core type.
    """

    __slots__ = ()

    @classmethod
    def paper(cls, **changes) -> "Config":
        """The paper's configuration (SPEC §10): g_x 4-bit HQ, g_w 8-bit HLA rank 8; its full recipe adds LQS
        (``hot.torch.lqs``) and an INT8 warm-up (``hot.torch.Warmup``). Measured gaps to exact training:
        docs/results/accuracy.md."""
        return cls(**{"gx_bits": 4, "rank": 8, **changes})

    def replace(self, **changes) -> "Config":
        return type(self)(**{**self.to_dict(), **changes})

    def to_dict(self) -> dict:
        return {"gx_bits": self.gx_bits, "rank": self.rank, "rounding": self.rounding, "gx_scale": self.gx_scale,
                "exact": self.exact}

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        unknown = sorted(set(d) - set(_CONFIG_FIELDS))
        if unknown:
            raise ValueError(f"Config.from_dict: unknown fields {unknown}, expected a subset of "
                             f"{sorted(_CONFIG_FIELDS)}")
        return cls(**d)

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


_CONFIG_FIELDS = ("gx_bits", "rank", "rounding", "gx_scale", "exact")


def _is_int(v) -> bool:
    if type(v) is int:  # the common case, without the numbers.Integral ABC check
        return True
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _hq_block(O: int) -> int:
    """The g_x path's Hadamard block b for O output features (SPEC §3): 16, or the largest power of two <= 16 dividing
    O (1: no transform)."""
    b = 16
    while b > 1 and O % b:
        b //= 2
    return b


_DEFAULT_CONFIG = Config()  # immutable: one shared instance serves every call without a config


def _config(op, config) -> Config:
    """The core configuration of a call: hot.Config (any hot._C.Config) or None for the default."""
    if config is None:
        return _DEFAULT_CONFIG
    if not isinstance(config, _C.Config):
        raise TypeError(f"{op}: config is a {type(config).__name__}, expected hot.Config or None")
    return config


def _seed_array(op, c, seed):
    """A seed array (checked on grad_output's device by the call): one int64 element."""
    dt, shape = c.fw.dtype_name(seed), fws.shape(seed)
    if dt != "int64" or fws.prod(shape) != 1:
        raise ValueError(f"{op}: seed must be an integer or a one-element int64 array, got an array of dtype {dt} and "
                         f"shape {tuple(shape)}")
    return seed


def _seed(op, seed, name="seed") -> int:
    if not _is_int(seed):
        raise TypeError(f"{op}: {name} must be an integer, got {type(seed).__name__}")
    if not 0 <= int(seed) <= _UINT64_MAX:
        raise ValueError(f"{op}: {name} must be in 0..2**64-1, got {seed}")
    return int(seed)


def _int_arg(op, name, v, lo, hi) -> int:
    if not _is_int(v):
        raise TypeError(f"{op}: {name} must be an integer, got {type(v).__name__}")
    if not lo <= int(v) <= hi:
        raise ValueError(f"{op}: {name} must be in {lo}..{hi}, got {v}")
    return int(v)


def _choice(op, name, v, allowed) -> str:
    if v not in allowed:
        raise ValueError(f"{op}: {name} must be one of {allowed}, got {v!r}")
    return v


def _dtype_name(op, dtype) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        s = str(dtype)
        if s.startswith("torch."):
            name = s[len("torch."):]
        else:
            try:
                name = np.dtype(dtype).name
            except TypeError:
                name = s
    if name not in ("float32", "float16", "bfloat16"):
        raise TypeError(f"{op}: dtype must be float32, float16 or bfloat16, got {dtype!r}")
    return name


# ---- helpers ---------------------------------------------------------------------------------------


class _Call:
    """Framework, device and stream of one call, fixed by its first array argument."""

    __slots__ = ("op", "dev", "like", "fw", "stream", "export")

    def __init__(self, op, **arrays):
        self.op = op
        self.dev, first = fws.check_arrays_first(op, arrays)
        if first is None:
            raise TypeError(f"{op}: {', '.join(arrays)} is None, expected an array")
        self.like = first
        self.fw = fw = fws.of(first)
        self.stream = fw.stream(first) if self.dev[0] != 1 else 0
        self.export = fw.exporter()

    @classmethod
    def known(cls, op, fw, like, stream):
        """A call whose framework, device and stream its caller already knows (hot.torch's ops, for CPU or CUDA
        tensors of one device): no per-array checks here, the core checks devices, dtypes and shapes."""
        c = cls.__new__(cls)
        c.op, c.dev, c.like, c.fw, c.stream, c.export = op, None, like, fw, stream, fw.exporter()
        return c

    def call(self, fn, *args):
        """fn(*args): the framework's arrays go to hot._C as capsules where it has a fast exporter, else
        through __dlpack__ with the call's device current in its framework."""
        if self.export is not None:
            return fn(*self.export(args))
        with self.fw.device_scope(self.like):
            return fn(*args)

    def empty(self, shape, dtype):
        if not self.fw.can_allocate:
            return None
        return self.fw.empty(tuple(shape), dtype, self.like)

    def empty_as(self, shape, a):
        """empty(shape, a's dtype) for an array a of the call's framework."""
        if not self.fw.can_allocate:
            return None
        return self.fw.empty_as(shape, a, self.like)

    def result(self, given, returned, shape=None):
        """The caller's array: the output it allocated, or hot's array imported with from_dlpack."""
        if given is not None:
            return given
        if returned is None:
            return None
        out = self.fw.from_dlpack(returned, self.like)
        if shape is not None and tuple(out.shape) != tuple(shape):
            out = self.fw.reshape(out, tuple(shape))
        return out


def _prep(x):
    if x is None:
        return None
    return fws.of(x).prepare(x)


def _need_ndim(op, name, x, lo, expected=None, shape=None):
    s = fws.shape(x) if shape is None else shape
    nd = len(s)
    if nd < lo:
        raise ValueError(f"{op}: {name} has {nd} dims, expected {expected or f'at least {lo}'} "
                         f"(got shape {s})")
    return nd


def _nonempty(op, name, x, shape=None):
    s = fws.shape(x) if shape is None else shape
    if fws.prod(s) == 0:
        raise ValueError(f"{op}: {name} is empty (shape {s})")


# ---- building blocks -------------------------------------------------------------------------------


def hadamard_transform(x, block: int = 16, axis: int = -1):
    """Block Hadamard transform (unnormalised) along `axis` in blocks of `block`; float32 result of
    x's shape."""
    op = "hadamard_transform"
    x = _prep(x)
    c = _Call(op, x=x)
    nd = _need_ndim(op, "x", x, 1)
    _nonempty(op, "x", x)
    axis = _int_arg(op, "axis", axis, -nd, nd - 1) % nd
    block = _int_arg(op, "block", block, 1, 256)
    if block & (block - 1):
        raise ValueError(f"{op}: block must be a power of two in 1..256, got {block}")
    n = fws.shape(x)[axis]
    if n % block:
        raise ValueError(f"{op}: block {block} does not divide axis {axis} of x (size {n}, shape {fws.shape(x)})")
    if axis == nd - 1:
        split, core_axis = nd - 1, 1
    else:
        split, core_axis = axis + 1, 0
    out = c.empty(fws.shape(x), "float32")
    r = c.call(_C.hadamard_transform, x, out, block, split, core_axis, c.stream)
    return c.result(out, r, fws.shape(x))


def hla(x, rank: int = 8):
    """HLA projection (SPEC §4 step 1) of x (L x C, or (..., C) flattened): float32,
    ceil(L/16)*rank x C."""
    op = "hla"
    x = _prep(x)
    c = _Call(op, x=x)
    _need_ndim(op, "x", x, 1)
    _nonempty(op, "x", x)
    rank = _int_arg(op, "rank", rank, 1, 16)
    s = fws.shape(x)
    L, C = fws.prod(s[:-1]), s[-1]
    out = c.empty((_C.hla_rows(L, rank), C), "float32")
    return c.result(out, c.call(_C.hla, x, out, rank, c.stream))


def quantize(x, bits: int = 8, scale: str = "tensor", rounding: str = "nearest", seed: int = 0, rng_stream: int = 0,
             amax=None):
    """Symmetric quantisation (SPEC §5) of x (..., C): (q int8 of x's shape, scale float32 of shape
    (1,) for scale="tensor" or (rows,) for scale="token", rows = prod(x.shape[:-1])). amax: x's amax when it is known
    (float32 (1,) on x's device, as :func:`relu_mask` gives it with ``amax=True``; scale="tensor" only), which replaces
    the pass that finds it: the same result when it is x's amax (not checked)."""
    op = "quantize"
    x = _prep(x)
    amax = None if amax is None else _prep(amax)
    c = _Call(op, x=x) if amax is None else _Call(op, x=x, amax=amax)
    _need_ndim(op, "x", x, 1)
    _nonempty(op, "x", x)
    if bits not in (4, 8) or not _is_int(bits):
        raise ValueError(f"{op}: bits must be 4 or 8, got {bits!r}")
    _choice(op, "scale", scale, _SCALES)
    _choice(op, "rounding", rounding, _ROUNDINGS)
    seed = _seed(op, seed)
    rng_stream = _int_arg(op, "rng_stream", rng_stream, 0, (1 << 32) - 1)
    return _quantize(c, x, fws.shape(x), bits, scale, rounding, seed, rng_stream, amax)


def dequantize(q, scale, dtype="float32"):
    """q (..., C) int8 times scale ((1,) or (rows,) float32), in `dtype`."""
    op = "dequantize"
    q, scale = _prep(q), _prep(scale)
    c = _Call(op, q=q, scale=scale)
    _need_ndim(op, "q", q, 1)
    _nonempty(op, "q", q)
    name = _dtype_name(op, dtype)
    if name == "bfloat16" and c.fw.name == "numpy":
        raise TypeError(f"{op}: dtype bfloat16 needs arrays of a framework that has it (torch, jax, cupy); numpy has "
                        f"no bfloat16, use float32 or float16")
    s = fws.shape(q)
    out = c.empty(s, name)
    return c.result(out, c.call(_C.dequantize, q, scale, out, name, c.stream), s)


def _pair(op, name, v, lo):
    t = (v, v) if _is_int(v) else tuple(v) if isinstance(v, (tuple, list)) else None
    if t is None or len(t) != 2 or not all(_is_int(e) for e in t):
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {v!r}")
    if min(t) < lo:
        raise ValueError(f"{op}: {name} must be >= {lo}, got {v!r}")
    return int(t[0]), int(t[1])


def col2im(cols, x_shape, kernel, stride=1, padding=0, dilation=1, patches: bool = False):
    """The adjoint of im2col (SPEC §8): cols ((N*Ho*Wo) x (kh*kw*C), float; rows (n, ho, wo), or 4 x 4 patch order
    (n, ho // 4, wo // 4, ho % 4, wo % 4) with ``patches``; columns (i, j, c): each kernel offset's channels together)
    summed onto the (N, C, H, W) input map ``x_shape`` they were read from (channels-last in memory: a permuted view
    where the framework has views), in cols' dtype: each pixel's
    contributions added in float32 in kernel-offset order and rounded once (one contribution taken as it is where
    windows cannot overlap). Deterministic and the same bits on every backend."""
    op = "col2im"
    cols = _prep(cols)
    c = _Call(op, cols=cols)
    _need_ndim(op, "cols", cols, 2, 2)
    if not isinstance(x_shape, (tuple, list)) or len(x_shape) != 4 or not all(_is_int(v) and v >= 0 for v in x_shape):
        raise ValueError(f"{op}: x_shape must be (N, C, H, W) of non-negative ints, got {x_shape!r}")
    geom = (_pair(op, "kernel", kernel, 1), _pair(op, "stride", stride, 1), _pair(op, "padding", padding, 0),
            _pair(op, "dilation", dilation, 1))
    return _col2im(c, cols, tuple(int(v) for v in x_shape), *geom, bool(patches))


def im2col(x, kernel, stride=1, padding=0, dilation=1, patches: bool = False):
    """The im2col matrix of a conv2d input given channels-last, x (N, H, W, C) float (SPEC §8): (N*Ho*Wo) x
    (kh*kw*C) in x's dtype, rows (n, ho, wo) (or 4 x 4 patch order with ``patches``), columns (i, j, c): each kernel
    offset's channels together, zeros where a window reaches into the padding. A copy, the same bits on every backend;
    :func:`col2im` is its adjoint."""
    op = "im2col"
    x = _prep(x)
    c = _Call(op, x=x)
    _need_ndim(op, "x", x, 4, 4)
    _nonempty(op, "x", x)
    N, H, W, C = fws.shape(x)
    geom = (_pair(op, "kernel", kernel, 1), _pair(op, "stride", stride, 1), _pair(op, "padding", padding, 0),
            _pair(op, "dilation", dilation, 1))
    return _im2col(c, x, (N, C, H, W), *geom, bool(patches))


def compress_columns(q_map, kernel, stride=1, padding=0, dilation=1, patches: bool = False,
                     config: Optional[Config] = None) -> SavedActivation:
    """ABC (SPEC §2, §8) of a convolution's im2col columns, formed from the integers of its int8 input map without
    the columns: q_map (N, H, W, C) int8 (channels-last; e.g. ``hot.quantize``'s q of the map); the result equals
    ``compress_activation(im2col(q_map as floats), config)`` bit for bit, a buffer of x shape (N*Ho*Wo, kh*kw*C) (rows
    in 4 x 4 patch order with ``patches``). A layer's g_w from it is in units of the map's scale."""
    op = "compress_columns"
    config = _config(op, config)
    c, q_map, xs, geom, cols_shape = _map_args(op, q_map, kernel, stride, padding, dilation)
    q, scale = _compress_columns(c, q_map, xs, *geom, bool(patches), config.rank)
    return SavedActivation(q, scale, cols_shape, config.rank)


def _map_args(op: str, q_map, kernel, stride, padding, dilation):
    """The checked arguments of an operation on a convolution's int8 map q_map (N, H, W, C): (the call, q_map, x's
    shape (N, C, H, W), (kernel, stride, padding, dilation) as pairs, the columns' shape (N*Ho*Wo, kh*kw*C))."""
    q_map = _prep(q_map)
    c = _Call(op, q_map=q_map)
    _need_ndim(op, "q_map", q_map, 4, 4)
    _nonempty(op, "q_map", q_map)
    if c.fw.dtype_name(q_map) != "int8":
        raise TypeError(f"{op}: q_map has dtype {c.fw.dtype_name(q_map)}, expected int8")
    N, H, W, C = fws.shape(q_map)
    kernel, stride = _pair(op, "kernel", kernel, 1), _pair(op, "stride", stride, 1)
    padding, dilation = _pair(op, "padding", padding, 0), _pair(op, "dilation", dilation, 1)
    Ho, Wo = _conv_out_hw(H, W, kernel, stride, padding, dilation)
    return c, q_map, (N, C, H, W), (kernel, stride, padding, dilation), (N * Ho * Wo, kernel[0] * kernel[1] * C)


def gw_from_codes(config: Config) -> bool:
    """Whether a convolution that keeps its int8 map takes g_w from the codes of G~ and of the map's columns (SPEC §4
    "g_w from G~'s codes", §8): at full rank with 8-bit g_x and one g_x scale (the default), not in exact mode."""
    return not config.exact and config.rank == 16 and config.gx_bits == 8 and config.gx_scale == "tensor"


def column_codes(q_map, scale, kernel, stride=1, padding=0, dilation=1, patches: bool = False) -> SavedActivation:
    """The g_w operand of a convolution at full rank (SPEC §4 "g_w from G~'s codes", §8): the im2col columns of the
    int8 map q_map (N, H, W, C, channels-last; e.g. ``hot.quantize``'s q of the map) as they are, transposed
    (``hot::im2col_t``: (kh*kw*C, padded_k(N*Ho*Wo)) int8, zero past N*Ho*Wo), with the map's scale (a (1,) float32
    array), as a SavedActivation of x shape (N*Ho*Wo, kh*kw*C) at rank 16 with ``codes`` set: ``backward_linear`` of
    the columns' g_y rows then takes g_w from the codes of G~ (rank 16, 8-bit per-tensor g_x) with the map's scale
    applied."""
    c, q_map, xs, geom, cols_shape = _map_args("column_codes", q_map, kernel, stride, padding, dilation)
    return SavedActivation(_im2col_t(c, q_map, xs, *geom, bool(patches)), scale, cols_shape, 16, codes=True)


def relu_mask(x, amax: bool = False):
    """ReLU that records where its gradient is zero, one bit per element (SPEC §2, keep_less): returns (y, bits) with
    y = x's negative elements replaced by +0 (NaN and -0 pass, as torch's ReLU), x's shape and dtype; bits: int8
    (ceil(n / 8),), bit j of byte k set where element 8k + j of x (in row-major order) is <= 0 (a NaN's bit clear), the
    last byte's unused bits zero. One pass over x. amax: also return y's amax, (y, bits, amax) with amax float32 (1,),
    max |y| (NaN where y has a NaN), for :func:`quantize` and :func:`activation_codes` of y (SPEC §8)."""
    op = "relu_mask"
    x = _prep(x)
    c = _Call(op, x=x)
    _nonempty(op, "x", x)
    if not isinstance(amax, bool):
        raise TypeError(f"{op}: amax must be a bool, got {type(amax).__name__}")
    s = fws.shape(x)
    n = fws.prod(s)
    y, bits, *m = _relu_mask(c, c.fw.reshape(x, (n,)), None, amax=amax)
    return (c.fw.reshape(y, s), bits, *m)


def relu_mask_backward(grad_output, bits):
    """The backward of :func:`relu_mask`: the gradient with +0 where ``bits`` has the element's bit set, grad_output
    elsewhere (torch's ReLU backward selects the same; a non-finite gradient at a zero output gives 0)."""
    op = "relu_mask_backward"
    gy, bits = _prep(grad_output), _prep(bits)
    c = _Call(op, grad_output=gy, bits=bits)
    _nonempty(op, "grad_output", gy)
    s = fws.shape(gy)
    n = fws.prod(s)
    if fws.shape(bits) != ((n + 7) // 8,):
        raise ValueError(f"{op}: bits has shape {fws.shape(bits)}, expected ({(n + 7) // 8},) for grad_output of shape "
                         f"{s}")
    return c.fw.reshape(_relu_mask_backward(c, c.fw.reshape(gy, (n,)), bits, None), s)


def batch_norm_stats(x, eps=1e-5):
    """BatchNorm's batch statistics in training for x (..., C) with channels last (SPEC §2 "BatchNorm's statistics"):
    (mean, invstd), each float32 (C,), from the sums of x - K and (x - K)^2 (K: x's first row) in fp32 in a fixed
    order (the same bits on the CPU and the GPU); invstd = 1 / sqrt(biased variance + eps)."""
    op = "batch_norm_stats"
    xa = _prep(x)
    c = _Call(op, x=xa)
    s = fws.shape(xa)
    _need_ndim(op, "x", xa, 1, shape=s)
    _nonempty(op, "x", xa, shape=s)
    return _batch_norm_stats(c, c.fw.reshape(xa, (fws.prod(s[:-1]), s[-1])), float(eps))


def batch_norm_transform(x, mean, invstd, weight=None, bias=None):
    """BatchNorm's output for x (..., C) with channels last (SPEC §2 "BatchNorm's statistics"): y = fma(x - mean,
    weight * invstd, bias) per element in fp32, then rounded to x's dtype; mean, invstd, weight, bias: float32 (C,)
    (weight, bias None: absent)."""
    op = "batch_norm_transform"
    xa = _prep(x)
    stats = {k: None if v is None else _prep(v)
             for k, v in {"mean": mean, "invstd": invstd, "weight": weight, "bias": bias}.items()}
    c = _Call(op, x=xa, **{k: v for k, v in stats.items() if v is not None})
    s = fws.shape(xa)
    _need_ndim(op, "x", xa, 1, shape=s)
    _nonempty(op, "x", xa, shape=s)
    rows = c.fw.reshape(xa, (fws.prod(s[:-1]), s[-1]))
    return c.fw.reshape(_batch_norm_transform(c, rows, stats["mean"], stats["invstd"], stats["weight"],
                                              stats["bias"]), s)


def batch_norm_backward_reduce(grad_output, x, mean, invstd, grad_weight=True):
    """BatchNorm's per-channel sums in training for x (..., C) with channels last (SPEC §2 "BatchNorm's hand-over"):
    (sum_dy, sum_dy_xmu, grad_weight), each float32 (C,): the sums over the rows of grad_output and of grad_output
    (x - mean), in fp32 in a fixed order (the same bits on the CPU and the GPU), and grad_weight = sum_dy_xmu * invstd
    (None where grad_weight=False). mean, invstd: the forward's batch statistics, float32 (C,)."""
    op = "batch_norm_backward_reduce"
    gy, xa, m, i = _prep(grad_output), _prep(x), _prep(mean), _prep(invstd)
    c = _Call(op, grad_output=gy, x=xa, mean=m, invstd=i)
    s = fws.shape(gy)
    _need_ndim(op, "grad_output", gy, 1, shape=s)
    _nonempty(op, "grad_output", gy, shape=s)
    if fws.shape(xa) != s:
        raise ValueError(f"{op}: x has shape {fws.shape(xa)}, expected grad_output's {s}")
    rows = (fws.prod(s[:-1]), s[-1])
    return _batch_norm_backward_reduce(c, c.fw.reshape(gy, rows), c.fw.reshape(xa, rows), m, i,
                                       grad_weight=bool(grad_weight))


def batch_norm_backward_input(grad_output, x, mean, invstd, sum_dy, sum_dy_xmu, weight=None):
    """BatchNorm's input gradient in training for x (..., C) with channels last (SPEC §2 "BatchNorm's hand-over"):
    (grad_input, gt_amax). mean, invstd: the forward's batch statistics, sum_dy, sum_dy_xmu: the per-channel sums of
    g_y and g_y (x - mean) (:func:`batch_norm_backward_reduce`'s or torch's), weight: the affine scale or None, each
    float32 (C,). grad_input in grad_output's dtype (torch's CUDA kernels' float32 evaluation: from torch's sums, their
    bits); gt_amax, float32 (1,):
    the max |.| of grad_input's block Hadamard transform along C (G~ of a layer whose grad_output it is), which
    :func:`backward_linear` takes as grad_output_amax."""
    op = "batch_norm_backward_input"
    gy, xa = _prep(grad_output), _prep(x)
    stats = {"mean": mean, "invstd": invstd, "sum_dy": sum_dy, "sum_dy_xmu": sum_dy_xmu, "weight": weight}
    stats = {k: None if v is None else _prep(v) for k, v in stats.items()}
    c = _Call(op, grad_output=gy, x=xa, **{k: v for k, v in stats.items() if v is not None})
    s = fws.shape(gy)
    _need_ndim(op, "grad_output", gy, 1, shape=s)
    _nonempty(op, "grad_output", gy, shape=s)
    if fws.shape(xa) != s:
        raise ValueError(f"{op}: x has shape {fws.shape(xa)}, expected grad_output's {s}")
    C = s[-1]
    rows = (fws.prod(s[:-1]), C)
    gx, amax = _batch_norm_backward_input(c, c.fw.reshape(gy, rows), c.fw.reshape(xa, rows), stats["mean"],
                                          stats["invstd"], stats["weight"], stats["sum_dy"], stats["sum_dy_xmu"])
    return c.fw.reshape(gx, s), amax


def pack_int4(q):
    """Packs int8 values in [-8, 7] two per byte (SPEC §5): uint8 (..., C/2)."""
    op = "pack_int4"
    q = _prep(q)
    c = _Call(op, q=q)
    _need_ndim(op, "q", q, 1)
    _nonempty(op, "q", q)
    s = fws.shape(q)
    if s[-1] % 2:
        raise ValueError(f"{op}: q needs an even last dim to pack two values per byte, got shape {s}")
    shape = s[:-1] + (s[-1] // 2,)
    out = c.empty(shape, "uint8")
    return c.result(out, c.call(_C.pack_int4, q, out, c.stream), shape)


def unpack_int4(packed):
    """Inverse of pack_int4: int8 (..., 2C)."""
    op = "unpack_int4"
    packed = _prep(packed)
    c = _Call(op, packed=packed)
    _need_ndim(op, "packed", packed, 1)
    _nonempty(op, "packed", packed)
    s = fws.shape(packed)
    shape = s[:-1] + (2 * s[-1],)
    out = c.empty(shape, "int8")
    return c.result(out, c.call(_C.unpack_int4, packed, out, c.stream), shape)


def _gemm(op, fn, a, b, k_factor):
    a, b = _prep(a), _prep(b)
    c = _Call(op, a=a, b=b)
    for name, t in (("a", a), ("b", b)):
        if fws.ndim(t) != 2:
            raise ValueError(f"{op}: {name} has {fws.ndim(t)} dims, expected 2 (got shape {fws.shape(t)})")
        _nonempty(op, name, t)
    (M, Ka), (N, Kb) = fws.shape(a), fws.shape(b)
    if Ka != Kb:
        raise ValueError(f"{op}: a is {(M, Ka)} and b is {(N, Kb)}; the inner dims (K) must agree")
    out = c.empty((M, N), "int32")
    return c.result(out, c.call(fn, a, b, out, c.stream))


def gemm_s8(a, b):
    """a (M x K int8) @ b (N x K int8).T with exact int32 accumulation."""
    return _gemm("gemm_s8", _C.gemm_s8, a, b, 1)


def gemm_s4(a_packed, b_packed):
    """Packed-int4 GEMM: a (M x K/2 uint8) and b (N x K/2 uint8) hold K int4 values per row;
    returns the int32 M x N product a @ b.T."""
    return _gemm("gemm_s4", _C.gemm_s4, a_packed, b_packed, 2)


# ---- layer operations ------------------------------------------------------------------------------


class SavedActivation:
    """The compressed copy of a layer input (ABC, SPEC §2): q (int8, I x K_pad) and scale (float32,
    (1,)) as arrays of the caller's framework and device, plus x's original shape."""

    __slots__ = ("q", "scale", "shape", "rows", "cols", "rank", "codes", "_c")

    def __init__(self, q, scale, shape, rank: int, _c=None, codes: bool = False):
        self.q = q
        self.scale = scale
        self.shape = tuple(map(int, shape))
        self.rows = fws.prod(self.shape[:-1])
        self.cols = self.shape[-1]
        self.rank = int(rank)
        self.codes = bool(codes)  # q holds x's own codes, transposed (column_codes), scale their scale (SPEC §4)
        self._c = _c

    @property
    def nbytes(self) -> int:
        """Bytes of q and scale."""
        return fws.prod(fws.shape(self.q)) * 1 + fws.prod(fws.shape(self.scale)) * 4

    def __repr__(self):
        return (f"hot.SavedActivation(shape={self.shape}, rank={self.rank}, q={fws.shape(self.q)} int8, "
                f"nbytes={self.nbytes}{', codes' if self.codes else ''})")

    def _core(self, op, c):
        """The core's SavedActivation (the one compress_activation made, or a view of q and scale), for
        the call c on the arrays' device."""
        if self._c is not None:
            return self._c
        fws.check_arrays(op, **{"saved.q": self.q, "saved.scale": self.scale})
        want = (self.cols, _C.padded_k(_C.hla_rows(self.rows, self.rank)))
        if fws.shape(self.q) != want:
            raise ValueError(f"{op}: saved.q has shape {fws.shape(self.q)}, expected {want} for x of shape "
                             f"{self.shape} at rank {self.rank}")
        if fws.shape(self.scale) != (1,):
            raise ValueError(f"{op}: saved.scale has shape {fws.shape(self.scale)}, expected (1,)")
        core = _wrap_saved(c, self.q, self.scale, self.rows, self.cols, self.rank, op, self.codes)
        self._c = core
        return core


def compress_activation(x, config: Optional[Config] = None) -> SavedActivation:
    """ABC (SPEC §2): Q8(HLA(x)) of x (..., I), flattened to L x I."""
    op = "compress_activation"
    config = _config(op, config)
    x = _prep(x)
    c = _Call(op, x=x)
    xs = fws.shape(x)
    _need_ndim(op, "x", x, 1, shape=xs)
    _nonempty(op, "x", x, shape=xs)
    q, scale, core = _compress(c, x, xs, config)
    return SavedActivation(q, scale, xs, config.rank, core)


def activation_codes(x, amax=None) -> SavedActivation:
    """x's own codes (SPEC §2 "codes"): Q8(x) of x (..., I) flattened to L x I, per tensor with round-to-nearest,
    stored transposed (q: int8, I x padded_k(L), zero past L; scale: float32 (1,)), without HLA's rotation along the
    rows: the g_w operand from which :func:`backward_linear` takes g_w against G~'s codes (SPEC §4, "g_w from G~'s
    codes"; rank 16, 8-bit per-tensor g_x), as hot's pointwise convolutions keep their input at the default. amax: x's
    amax when known, as :func:`quantize`'s."""
    op = "activation_codes"
    x = _prep(x)
    amax = None if amax is None else _prep(amax)
    c = _Call(op, x=x) if amax is None else _Call(op, x=x, amax=amax)
    xs = fws.shape(x)
    _need_ndim(op, "x", x, 1, shape=xs)
    _nonempty(op, "x", x, shape=xs)
    q, scale, core = _compress(c, x, xs, _config(op, None), codes=True, amax=amax)
    return SavedActivation(q, scale, xs, 16, core, codes=True)


class QuantizedWeight:
    """W~ of the g_x path (SPEC §3): the weight's rows mixed by block Hadamard matrices along O and quantised per tensor
    to config.gx_bits, K-major: q_wt (int8, I x padded_k(O)) and s_w (float32, (1,)) as arrays of the caller's
    framework and device. Made by :func:`quantize_weight`; backward_linear(..., weight_q=) uses it instead of forming
    it again, with the same result bits, for as long as the weight it came from is unchanged (the caller's promise)."""

    __slots__ = ("q_wt", "s_w", "shape", "gx_bits", "_c")

    def __init__(self, q_wt, s_w, shape, gx_bits: int, _c):
        self.q_wt, self.s_w, self.shape, self.gx_bits, self._c = q_wt, s_w, tuple(shape), int(gx_bits), _c

    @property
    def nbytes(self) -> int:
        """Bytes of q_wt and s_w."""
        return int(self._c.nbytes)

    def __repr__(self):
        return f"hot.QuantizedWeight(shape={self.shape}, gx_bits={self.gx_bits}, nbytes={self.nbytes})"


def quantize_weight(weight, config: Optional[Config] = None) -> QuantizedWeight:
    """W~ of weight (O x I) for the g_x path at config.gx_bits (not in exact mode): what every backward_linear call
    with this weight forms, formed once; pass it as backward_linear's weight_q while the weight is unchanged (several
    micro-batches of one optimizer step, activation recomputation)."""
    op = "quantize_weight"
    config = _config(op, config)
    if config.exact:
        raise ValueError(f"{op}: config.exact is set; an exact backward uses the weight as it is")
    w = _prep(weight)
    c = _Call(op, weight=w)
    ws = fws.shape(w)
    if len(ws) != 2:
        raise ValueError(f"{op}: weight has {len(ws)} dims, expected 2 (O x I) (got shape {ws})")
    _nonempty(op, "weight", w, shape=ws)
    return _quantize_weight(c, w, ws, config)


def backward_linear(grad_output, weight, saved, *, bias: bool = False, config: Optional[Config] = None,
                    seed=0, need_grad_input: bool = True, need_grad_weight: bool = True, weight_q=None,
                    grad_output_amax=None):
    """HOT backward of y = x W^T (+ b) (SPEC §3, §4): (grad_input, grad_weight, grad_bias), None for
    what was not requested. grad_output (..., O); weight O x I; saved a SavedActivation or the raw x.
    A batch of any length is one backward (SPEC §4: a g_w contraction past one int32 GEMM is summed in int64).
    weight_q: the weight's :func:`quantize_weight` at config.gx_bits, used instead of forming W~ again (same bits).
    seed: the stochastic-rounding seed, an integer or a one-element int64 array on grad_output's device, which the
    kernels read when they run (SPEC §5: a CUDA graph that draws it on the GPU rounds with a new seed per replay).
    grad_output_amax: G~'s amax of grad_output, float32 (1,), when known (:func:`batch_norm_backward_input` gives it):
    taken instead of the g_y pass's own pass over grad_output where that pass would find nothing else (per-tensor g_x
    scale, g_w from x's codes or none, no bias), else not read; the results are the same bits either way."""
    op = "backward_linear"
    config = _config(op, config)
    seed_arr = None if _is_int(seed) else _prep(seed)
    gy, w = _prep(grad_output), _prep(weight)
    is_saved = isinstance(saved, SavedActivation)
    raw = None if (saved is None or is_saved or not need_grad_weight) else _prep(saved)
    saved_arr = (saved.q if is_saved else raw) if need_grad_weight else None
    c = _Call(op, grad_output=gy, weight=w, saved=saved_arr, seed=seed_arr)
    seed = _seed(op, seed) if seed_arr is None else _seed_array(op, c, seed_arr)
    gs, ws = fws.shape(gy), fws.shape(w)
    _need_ndim(op, "grad_output", gy, 1, shape=gs)
    _nonempty(op, "grad_output", gy, shape=gs)
    if len(ws) != 2:
        raise ValueError(f"{op}: weight has {len(ws)} dims, expected 2 (O x I) (got shape {ws})")
    _nonempty(op, "weight", w, shape=ws)
    O, I = ws
    if gs[-1] != O:
        raise ValueError(f"{op}: weight has shape {(O, I)} (O x I) but grad_output has {gs[-1]} columns "
                         f"(shape {gs}); O must agree")
    lead = gs[:-1]
    L = fws.prod(lead)
    if weight_q is not None:
        if not isinstance(weight_q, QuantizedWeight):
            raise TypeError(f"{op}: weight_q must be a hot.QuantizedWeight (hot.quantize_weight) or None, got "
                            f"{type(weight_q).__name__}")
        if config.exact:
            raise ValueError(f"{op}: config.exact takes no weight_q (the weight is used as it is)")
        if weight_q.shape != (O, I) or weight_q.gx_bits != config.gx_bits:
            raise ValueError(f"{op}: weight_q was formed from a {weight_q.shape} weight at {weight_q.gx_bits} bits, "
                             f"but weight has shape {(O, I)} and config.gx_bits is {config.gx_bits}")
        weight_q = weight_q._c

    g_w_operand = None
    if need_grad_weight:
        if saved is None:
            raise ValueError(f"{op}: need_grad_weight=True needs saved (a hot.SavedActivation or the raw x), got None")
        if is_saved:
            if config.exact:
                raise ValueError(f"{op}: config.exact needs the raw input x as saved, got a hot.SavedActivation")
            if saved.rows != L or saved.cols != I:
                raise ValueError(f"{op}: saved holds x of shape {saved.shape} ({saved.rows} x {saved.cols}) but "
                                 f"grad_output has {L} rows and weight has {I} columns")
            if saved.rank != config.rank:
                raise ValueError(f"{op}: saved activation was compressed with rank {saved.rank} but config.rank is "
                                 f"{config.rank}")
            g_w_operand = saved._core(op, c)
        else:
            xs = fws.shape(raw)
            if len(xs) < 1 or xs[-1] != I or fws.prod(xs[:-1]) != L:
                raise ValueError(f"{op}: saved (the raw x) has shape {xs}, expected {L} rows of {I} (..., I) to "
                                 f"match grad_output {gs} and weight {(O, I)}")
            g_w_operand = raw
    # g_w from the codes (SPEC §4) is transformed along O in float32 and comes back in float32
    gw_dtype = "float32" if need_grad_weight and is_saved and saved.codes else None
    amax = None if grad_output_amax is None else _prep(grad_output_amax)
    if amax is not None and fws.shape(amax) != (1,):
        raise ValueError(f"{op}: grad_output_amax has shape {fws.shape(amax)}, expected (1,)")
    return _backward_linear(c, gy, w, g_w_operand, lead + (I,), bool(need_grad_input), bool(need_grad_weight),
                            bool(bias), config, seed, weight_q, gw_dtype, gy_amax=amax)


# ---- the one entry per layer operation ------------------------------------------------------------------
# The public functions above (any DLPack framework, every argument checked in Python for clear messages) and
# hot.torch's ops (eager and compiled: torch tensors whose layout their own forward fixed) reach the core through
# these, and only these. They take a _Call (framework, device, stream) and arrays the core can read; the core checks
# dtypes, devices and shapes again, and runs the operation whole.


def _compress(c: _Call, x, xs, config, x_cast=None, codes: bool = False, amax=None):
    """compress_activation of x (shape xs, (..., I), non-empty): (q, scale, the core's SavedActivation), q and
    scale arrays of c's framework (hot's own, imported, where it cannot allocate). With x_cast (an array of c's
    framework, x's shape, another float dtype; only where c can allocate): x rounded to x_cast's dtype is written
    there and the buffer is x_cast's (the core's compress_activation_cast: one pass over x on the GPU). codes: x's
    own codes instead (the core's activation_codes, SPEC §2: rank 16, no rotation; the buffer's shape is the same),
    with amax (codes only) x's amax when known: no pass to find it."""
    rank = 16 if codes else config.rank
    q = c.empty((xs[-1], _C.padded_k(_C.hla_rows(fws.prod(xs[:-1]), rank))), "int8")
    scale = c.empty((1,), "float32") if q is not None else None
    core = c.call(_C.compress_activation, x, config, c.stream, c.op, "x", q, scale, x_cast, codes, amax)
    if q is None:  # hot allocated them: the caller's framework imports them
        q, scale = c.result(None, core.q), c.result(None, core.scale)
    return q, scale, core


def _conv_out_hw(H: int, W: int, kernel, stride, padding, dilation):
    """(Ho, Wo) of a convolution over an H x W map (may be <= 0: the core names the geometry then)."""
    return tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip((H, W), kernel, stride, padding,
                                                                                dilation))


def _quantize(c: _Call, x, s, bits: int, scale: str, rounding: str, seed: int = 0, rng_stream: int = 0, amax=None):
    """quantize of the non-empty array x of shape s (checked arguments): (q, scale) in c's framework; amax: x's amax
    when known (per-tensor scale)."""
    rows = fws.prod(s[:-1])
    q = c.empty(s, "int8")
    sc = c.empty((1 if scale == "tensor" else rows,), "float32")
    rq, rs = c.call(_C.quantize, x, q, sc, bits, scale, rounding, seed, rng_stream, c.stream, amax)
    return c.result(q, rq, s), c.result(sc, rs)


def _col2im(c: _Call, cols, x_shape, kernel, stride, padding, dilation, patches: bool):
    """col2im of a 2-D cols array: the (N, C, H, W) map of c's framework, channels-last in memory (a permuted view of
    the engine's (N, H, W, C) result where the framework has views)."""
    N, C, H, W = x_shape
    out = c.empty_as((N * H * W, C), cols)
    r = c.call(_C.col2im, cols, out, list(x_shape), list(kernel), list(stride), list(padding), list(dilation),
               patches, c.stream)
    return c.fw.permute(c.fw.reshape(c.result(out, r), (N, H, W, C)), (0, 3, 1, 2))


def _transpose(c: _Call, x3):
    """The batched transpose (B, S, R) of the 3-D array x3 (B, R, S), unit stride in its last dim (hot._C.transpose):
    an NCHW map viewed as (N, C, H*W) becomes its channels-last rows (N, H*W, C), and back."""
    B, R, S = fws.shape(x3)
    out = c.empty_as((B, S, R), x3)
    return c.result(out, c.call(_C.transpose, x3, out, c.stream))


def _im2col(c: _Call, xh, x_shape, kernel, stride, padding, dilation, patches: bool):
    """im2col of the channels-last map xh (N, H, W, C) of the input x_shape (N, C, H, W)."""
    N, C, H, W = x_shape
    Ho, Wo = _conv_out_hw(H, W, kernel, stride, padding, dilation)
    out = c.empty_as((N * Ho * Wo, kernel[0] * kernel[1] * C), xh) if Ho > 0 and Wo > 0 else None
    r = c.call(_C.im2col, xh, out, list(x_shape), list(kernel), list(stride), list(padding), list(dilation), patches,
               c.stream)
    return c.result(out, r)


def _compress_columns(c: _Call, q_map, x_shape, kernel, stride, padding, dilation, patches: bool, rank: int):
    """compress_columns of the channels-last int8 map q_map (N, H, W, C) of x_shape (N, C, H, W): (q, scale)."""
    N, C, H, W = x_shape
    Ho, Wo = _conv_out_hw(H, W, kernel, stride, padding, dilation)
    q = scale = None
    if Ho > 0 and Wo > 0:
        q = c.empty((kernel[0] * kernel[1] * C, _C.padded_k(_C.hla_rows(N * Ho * Wo, rank))), "int8")
        scale = c.empty((1,), "float32")
    rq, rs = c.call(_C.compress_columns, q_map, q, scale, list(x_shape), list(kernel), list(stride), list(padding),
                    list(dilation), patches, rank, c.stream)
    return c.result(q, rq), c.result(scale, rs)


def _im2col_t(c: _Call, q_map, x_shape, kernel, stride, padding, dilation, patches: bool):
    """im2col_t of the channels-last int8 map q_map (N, H, W, C) of x_shape (N, C, H, W): the columns' codes
    transposed, (kh*kw*C, padded_k(N*Ho*Wo)) int8, zero past N*Ho*Wo."""
    N, C, H, W = x_shape
    Ho, Wo = _conv_out_hw(H, W, kernel, stride, padding, dilation)
    out = c.empty((kernel[0] * kernel[1] * C, _C.padded_k(N * Ho * Wo)), "int8") if Ho > 0 and Wo > 0 else None
    r = c.call(_C.im2col_t, q_map, out, list(x_shape), list(kernel), list(stride), list(padding), list(dilation),
               patches, c.stream)
    return c.result(out, r)


def _max_pool2d_offsets(c: _Call, x, y, off, kernel, stride, padding, dilation):
    """max_pool2d_offsets of the (N, C, H, W) array x into the caller's y and off (int8), any strides."""
    c.call(_C.max_pool2d_offsets, x, y, off, list(kernel), list(stride), list(padding), list(dilation), c.stream)


def _max_pool2d_offsets_backward(c: _Call, gy, off, gx, kernel, stride, padding, dilation):
    """max_pool2d_offsets_backward of gy and off into the caller's (N, C, H, W) gx, any strides."""
    c.call(_C.max_pool2d_offsets_backward, gy, off, gx, list(kernel), list(stride), list(padding), list(dilation),
           c.stream)


def _relu_mask(c: _Call, x, y, bits=None, amax=False):
    """relu_mask of the 1-D array x into y (x itself for the in-place ReLU; None: a new array) and bits (None: a new
    int8 array): (y, bits), and with amax (True: a new float32 (1,) array, or an array to write) y's amax as well:
    (y, bits, amax)."""
    n = fws.shape(x)[0]
    if y is None:
        y = c.empty_as((n,), x)
    if bits is None:
        bits = c.empty(((n + 7) // 8,), "int8")
    if amax is False:
        ry, rb = c.call(_C.relu_mask, x, y, bits, c.stream)
        return c.result(y, ry), c.result(bits, rb)
    m = c.empty((1,), "float32") if amax is True else amax
    ry, rb, rm = c.call(_C.relu_mask, x, y, bits, c.stream, True if m is None else m)
    return c.result(y, ry), c.result(bits, rb), c.result(m, rm)


def _batch_norm_stats(c: _Call, x, eps, running_mean=None, running_var=None, momentum=0.0):
    """batch_norm_stats of the R x C array x: new (mean, invstd); running_mean, running_var updated in place where
    given."""
    C = fws.shape(x)[1]
    m, i = c.empty((C,), "float32"), c.empty((C,), "float32")  # None: the bindings allocate
    r = c.call(_C.batch_norm_stats, x, m, i, eps, running_mean, running_var, momentum, c.stream)
    return c.result(m, r[0]), c.result(i, r[1])


def _batch_norm_transform(c: _Call, x, mean, invstd, weight, bias, out=None):
    """batch_norm_transform of the R x C array x into out (None: a new array; x itself: in place)."""
    if out is None:
        out = c.empty_as(fws.shape(x), x)
    return c.result(out, c.call(_C.batch_norm_transform, x, mean, invstd, weight, bias, out, c.stream))


def _batch_norm_backward_reduce(c: _Call, gy, x, mean, invstd, grad_weight=True, relu_bits=None, g_relu=None):
    """batch_norm_backward_reduce of the R x C arrays gy and x: new (sum_dy, sum_dy_xmu, grad_weight), grad_weight None
    where not asked; with relu_bits, of gy masked by the ReLU's bits (written into the R x C g_relu where given)."""
    C = fws.shape(gy)[1]
    sd, sx = c.empty((C,), "float32"), c.empty((C,), "float32")  # None: the bindings allocate
    gw = None
    if grad_weight:
        gw = c.empty((C,), "float32")
        gw = True if gw is None else gw  # True: the bindings allocate it
    r = c.call(_C.batch_norm_backward_reduce, gy, x, mean, invstd, sd, sx, gw, c.stream, relu_bits, g_relu)
    return c.result(sd, r[0]), c.result(sx, r[1]), None if gw is None else c.result(None if gw is True else gw, r[2])


def _batch_norm_backward_input(c: _Call, gy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, out=None):
    """batch_norm_backward_input of the R x C arrays gy and x into out (None: a new array): (g_x, gt_amax)."""
    if out is None:
        out = c.empty_as(fws.shape(gy), gy)
    amax = c.empty((1,), "float32")
    rx, ra = c.call(_C.batch_norm_backward_input, gy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, out, amax, c.stream)
    return c.result(out, rx), c.result(amax, ra)


def _relu_mask_backward(c: _Call, gy, bits, out):
    """relu_mask_backward of the 1-D array gy into out (gy itself: in place; None: a new array)."""
    if out is None:
        out = c.empty_as(fws.shape(gy), gy)
    return c.result(out, c.call(_C.relu_mask_backward, gy, bits, out, c.stream))


def _quantize_weight(c: _Call, w, ws, config) -> QuantizedWeight:
    """quantize_weight of w (shape ws, O x I, non-empty) at config.gx_bits."""
    core = c.call(_C.quantize_weight, w, config, c.stream)
    return QuantizedWeight(c.result(None, core.q_wt), c.result(None, core.s_w), ws, config.gx_bits, core)


def _wrap_saved(c: _Call, q, scale, rows: int, cols: int, rank: int, op: str, codes: bool = False):
    """The core's SavedActivation over q (I x K_pad int8) and scale ((1,) float32) of x (rows x cols) at rank; codes:
    q holds x's own codes, transposed (im2col_t), and scale their scale (SPEC §4, g_w from G~'s codes)."""
    return c.call(_C.SavedActivation.wrap, q, scale, rows, cols, rank, c.stream, op, codes)


def _backward_linear(c: _Call, gy, w, saved, gi_shape, need_gi: bool, need_gw: bool, bias: bool, config, seed,
                     weight_q=None, gw_dtype=None, gi_dtype=None, gy_amax=None):
    """backward_linear of gy (..., O) and w (O x I): (g_x shaped gi_shape, g_w, g_b), None where not requested.
    saved: the g_w operand when need_gw: the core's SavedActivation (_compress, _wrap_saved) or the raw x (L x I
    elements), which the core compresses (or, in exact mode, uses in gy's dtype). weight_q: the core's QuantizedWeight
    of w at config.gx_bits, or None (the core forms W~). The results come in gy's dtype; g_w in gw_dtype and g_x in
    gi_dtype when given (dtype names, e.g. "float32"). seed: an integer, or a one-element int64 array on gy's device
    (hot::Seed). gy_amax: G~'s amax ((1,) float32) when known (a BatchNorm's backward hands it over), else None."""
    if config.exact:
        dt = c.fw.dtype_name(gy)
        w = _exact_operand(c, "backward_linear", "weight", w, dt)
        if need_gw and saved is not None and not isinstance(saved, _C.SavedActivation):
            saved = _exact_operand(c, "backward_linear", "saved", saved, dt)
    O, I = fws.shape(w)
    gi = (c.empty(gi_shape, gi_dtype) if gi_dtype is not None else c.empty_as(gi_shape, gy)) if need_gi else None
    gw = (c.empty((O, I), gw_dtype) if gw_dtype is not None else c.empty_as((O, I), gy)) if need_gw else None
    gb = c.empty_as((O,), gy) if bias else None
    rx, rw, rb = c.call(_C.backward_linear, gy, w, saved if need_gw else None, gi, gw, gb, need_gi, need_gw, bias,
                        config, seed, c.stream, weight_q, gy_amax)
    return (
        c.result(gi, rx, gi_shape) if need_gi else None,
        c.result(gw, rw) if need_gw else None,
        c.result(gb, rb) if bias else None,
    )


def _backward_conv2d(c: _Call, gy, w, saved, x_shape, kernel, stride, padding, dilation, patches: bool,
                     need_gi: bool, need_gw: bool, bias: bool, config, seed, weight_q=None, gw_dtype=None,
                     gy_amax=None):
    """backward_conv2d of a convolution's g_y rows gy (N*Ho*Wo x O) and w (O x kh*kw*C, columns (i, j, c)), saved the
    columns' SavedActivation (_wrap_saved) when need_gw: (g_x as the channels-last map N*H*W x C, g_w, g_b), None
    where not requested, in gy's dtype (g_w in gw_dtype when given). gy_amax as in :func:`_backward_linear`."""
    N, C, H, W = x_shape
    O, CKK = fws.shape(w)
    gi = c.empty_as((N * H * W, C), gy) if need_gi else None
    gw = (c.empty((O, CKK), gw_dtype) if gw_dtype is not None else c.empty_as((O, CKK), gy)) if need_gw else None
    gb = c.empty_as((O,), gy) if bias else None
    rx, rw, rb = c.call(_C.backward_conv2d, gy, w, saved if need_gw else None, gi, gw, gb, need_gi, need_gw, bias,
                        list(x_shape), list(kernel), list(stride), list(padding), list(dilation), patches, config,
                        seed, c.stream, weight_q, gy_amax)
    return (c.result(gi, rx) if need_gi else None, c.result(gw, rw) if need_gw else None,
            c.result(gb, rb) if bias else None)


def _exact_operand(c, op, name, a, dt):
    """a in grad_output's dtype dt for exact mode: a cast of a floating array (a cast would silently turn bool, integer
    or complex arrays into floats)."""
    have = c.fw.dtype_name(a)
    if have == dt:
        return a
    if have not in _FLOATS:
        raise TypeError(f"{op}: {name} has dtype {have}, expected float32, float16 or bfloat16")
    return c.fw.cast(a, dt)


# ---- backends ---------------------------------------------------------------------------------------


def cuda_available() -> bool:
    """True when the CUDA backend is compiled in and a CUDA device is present."""
    return bool(_C.cuda_available())


def cuda_unavailable_reason() -> str:
    """Why CUDA is not available ("" when it is)."""
    return str(_C.cuda_unavailable_reason())


def build_info() -> str:
    """One line per compiled backend / kernel family."""
    return str(_C.build_info())


def set_num_threads(n: int) -> None:
    """Threads of the CPU backend (0 = hardware concurrency)."""
    if not _is_int(n) or not 0 <= n <= 1024:
        raise ValueError(f"set_num_threads: n must be an integer in 0..1024 (0 = hardware concurrency), got {n!r}")
    _C.set_num_threads(int(n))


def get_num_threads() -> int:
    return int(_C.get_num_threads())
