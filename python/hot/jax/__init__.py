"""JAX front of hot: HOT layers as functions that work under ``jax.jit``, ``jax.grad``, ``jax.value_and_grad`` and
``jax.vmap``.

    import jax, jax.numpy as jnp, hot, hot.jax
    def loss(params, x, key):
        y = hot.jax.dense(x, params["w"], params["b"], key=key)     # y = x @ w.T + b; w is (out, in)
        return jnp.mean(y ** 2)
    grads = jax.jit(jax.grad(loss))(params, x, jax.random.key(0))

``dense`` is a ``jax.custom_vjp``: its forward computes ``y`` with JAX's own matmul and keeps, instead of ``x``, the
ABC buffer of ``x`` (SPEC §2: int8 ``I x K_pad`` plus one float32 scale, from ``hot::compress_activation``); its
backward runs ``hot::backward_linear`` (SPEC §3, §4). Both run as XLA FFI custom calls into hot's C++ core (the
library ``hot/_hot_jax_ffi.so``, cpp/jax/hot_jax_ffi.cpp), on the CPU and, when hot is built with CUDA, on the GPU
on the stream XLA gives them. The stochastic rounding's seed comes from ``key`` (``seed_from_key``): no host state,
so a jitted step is reproducible, and the key is an operand of the custom call, so a new key does not recompile.

Import explicitly (``import hot.jax``); ``import hot`` stays free of JAX.
"""
from __future__ import annotations

try:
    import jax
    import jax.numpy as jnp
except ImportError as _e:  # pragma: no cover - exercised where jax is absent
    raise ImportError(
        f"hot.jax needs JAX, which is not importable ({_e}): pip install jax (or pip install 'hot[jax]')") from _e
if not hasattr(jax, "ffi") or not hasattr(jax.ffi, "ffi_call"):  # pragma: no cover
    raise ImportError(f"hot.jax needs jax >= 0.5.0 (jax.ffi.ffi_call), found jax {jax.__version__}: "
                      "pip install -U jax (or pip install 'hot[jax]')")

import functools

import numpy as np

import hot
from hot import _C

from . import _ffi

_ffi.load()

__all__ = ["dense", "conv2d", "compress_activation", "seed_from_key", "seed_words", "set_num_threads", "get_num_threads",
           "build_info"]

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_DEFAULT_CONFIG = hot.Config()


# ---- arguments ---------------------------------------------------------------------------------------------------


def _config(op, config):
    if config is None:
        return _DEFAULT_CONFIG
    if not isinstance(config, hot.Config):
        raise TypeError(f"{op}: config is a {type(config).__name__}, expected hot.Config or None")
    return config


def _array(op, name, a):
    if a is None:
        raise TypeError(f"{op}: {name} is None, expected an array")
    try:
        return jnp.asarray(a)
    except TypeError as e:
        raise TypeError(f"{op}: {name} is a {type(a).__name__}, expected an array ({e})") from None


def _float(op, name, a):
    if a.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name} has dtype {a.dtype}, expected float32, float16 or bfloat16")


def _is_key(key) -> bool:
    dt = getattr(key, "dtype", None)
    return dt is not None and jnp.issubdtype(dt, jax.dtypes.prng_key)


def seed_words(key, op: str = "hot.jax.seed_words"):
    """The seed operand that hot.jax passes to the backward custom call for ``key``: ``jax.random.bits(key, (2,),
    jnp.uint32)``, a uint32 array of two words. Traceable (use it under jit). ``key`` is one ``jax.random`` key: a
    typed key (``jax.random.key(n)``, shape ()) or a legacy raw key (``jax.random.PRNGKey(n)``, uint32 (2,))."""
    if key is None:
        raise TypeError(f"{op}: key is None, expected a jax.random key (e.g. jax.random.key(0)); the stochastic "
                        "rounding of the backward draws its seed from it")
    if _is_key(key):
        if key.shape != ():
            raise ValueError(f"{op}: key has shape {key.shape}, expected one key (shape ()); under jax.vmap pass the "
                             "batch of keys as a mapped argument")
    else:
        want = "expected a jax.random key: jax.random.key(n), or a raw uint32 key from jax.random.PRNGKey(n)"
        dt = getattr(key, "dtype", None)
        if dt is None:
            raise TypeError(f"{op}: key is {type(key).__name__} {key!r:.60}, {want}")
        if jnp.dtype(dt) != jnp.uint32 or len(key.shape) != 1:
            raise TypeError(f"{op}: key has dtype {dt} and shape {tuple(key.shape)}, {want}")
    return jax.random.bits(key, (2,), jnp.uint32)


def seed_from_key(key) -> int:
    """The 64-bit seed of the stochastic rounding (SPEC §5) that ``dense``'s backward uses for ``key``: with
    ``w = jax.random.bits(key, (2,), jnp.uint32)`` (``seed_words``), ``seed = int(w[0]) | int(w[1]) << 32``. So
    ``hot.backward_linear(..., seed=hot.jax.seed_from_key(key))`` computes the same gradients bit for bit. Runs
    eagerly (a concrete key; it returns a Python int)."""
    w = np.asarray(jax.device_get(seed_words(key, "hot.jax.seed_from_key")), dtype=np.uint64)
    return int(w[0]) | (int(w[1]) << 32)


# ---- the custom calls --------------------------------------------------------------------------------------------


def _abc_shape(lead, cols, rank):
    L = int(np.prod(lead, dtype=np.int64)) if len(lead) else 1
    return (cols, int(_C.padded_k(_C.hla_rows(L, rank))))


def _compress_call(x, rank, codes: bool = False):
    """(q int8 (I, K_pad), scale float32 (1,)) of x (..., I), through the FFI target hot_compress_activation; codes:
    x's own codes instead (``hot.activation_codes``: no rotation, SPEC §2; only at rank 16, the default)."""
    q_shape = _abc_shape(x.shape[:-1], x.shape[-1], rank)
    call = jax.ffi.ffi_call("hot_compress_activation",
                            (jax.ShapeDtypeStruct(q_shape, jnp.int8), jax.ShapeDtypeStruct((1,), jnp.float32)),
                            vmap_method="sequential")
    return call(x, rank=np.int32(rank), codes=np.int32(codes))


def compress_activation(x, *, config=None):
    """ABC (SPEC §2) of x (..., I), flattened to L x I: ``(q, scale)``, q int8 ``I x K_pad`` (K_pad =
    ``ceil(ceil(L/16) * rank / 16) * 16``), scale float32 ``(1,)``; the same bytes as ``hot.compress_activation``.
    This is what ``dense`` keeps for its backward. Traceable."""
    op = "hot.jax.compress_activation"
    cfg = _config(op, config)
    x = _array(op, "x", x)
    _float(op, "x", x)
    if x.ndim < 1 or x.size == 0:
        raise ValueError(f"{op}: x has shape {x.shape}, expected a non-empty array (..., I)")
    return _compress_call(x, cfg.rank)


def _matmul(x, w):
    """x (..., I) @ w.T (w: O x I), in JAX's own precision."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def _backward_saved(code: int, x_dtype, w_dtype, b_dtype, gy, w, q, scale, seed, codes: bool = False):
    """hot::backward_linear of gy (..., O) and w (O, I) from the ABC buffer (q, scale), or with ``codes`` from x's
    codes (g_w from G~'s codes, SPEC §4; then w_dtype must be float32), through the FFI target
    hot_backward_linear[_bias]: (g_x, g_w[, g_b]) in the dtypes x_dtype, w_dtype[, b_dtype]."""
    O, I = w.shape
    bias = b_dtype is not None
    outs = [jax.ShapeDtypeStruct(gy.shape[:-1] + (I,), x_dtype), jax.ShapeDtypeStruct((O, I), w_dtype)]
    if bias:
        outs.append(jax.ShapeDtypeStruct((O,), b_dtype))
    call = jax.ffi.ffi_call("hot_backward_linear_bias" if bias else "hot_backward_linear", tuple(outs),
                            vmap_method="sequential")
    return call(gy, w, q, scale, seed, codes=np.int32(codes), config=np.int64(code))


def _backward_conv_call(code: int, x_dtype, b_dtype, g, w_cols, q, scale, seed, x_shape, kernel, stride, padding,
                        dilation, patches: bool, codes: bool = False):
    """hot::backward_conv2d of a convolution's g_y rows g (N*Ho*Wo, O) and weight columns w_cols (O, kh*kw*C) from the
    ABC buffer (q, scale) of its columns, or with ``codes`` from the columns' codes (_im2col_t) and the map's scale,
    through the FFI target hot_backward_conv2d[_bias]: (g_x as the channels-last map (N*H*W, C) in x_dtype, g_w in
    float32[, g_b in b_dtype])."""
    N, C, H, W = x_shape
    O, CKK = w_cols.shape
    bias = b_dtype is not None
    outs = [jax.ShapeDtypeStruct((N * H * W, C), x_dtype), jax.ShapeDtypeStruct((O, CKK), jnp.float32)]
    if bias:
        outs.append(jax.ShapeDtypeStruct((O,), b_dtype))
    call = jax.ffi.ffi_call("hot_backward_conv2d_bias" if bias else "hot_backward_conv2d", tuple(outs),
                            vmap_method="sequential")
    i32 = np.int32
    return call(g, w_cols, q, scale, seed, n=i32(N), c=i32(C), h=i32(H), w=i32(W), kh=i32(kernel[0]),
                kw=i32(kernel[1]), sh=i32(stride[0]), sw=i32(stride[1]), ph=i32(padding[0]), pw=i32(padding[1]),
                dh=i32(dilation[0]), dw=i32(dilation[1]), patches=i32(patches), codes=i32(codes), config=np.int64(code))


@functools.lru_cache(maxsize=None)
def _dense_fn(code: int, x_dtype, w_dtype, b_dtype):
    """The custom_vjp of one configuration (its ``hot.Config.code``) and one set of dtypes (the cotangents' dtypes
    are the inputs')."""
    rank = hot.Config.from_code(code).rank
    bias = b_dtype is not None

    def backward(q, scale, w, seed, gy):
        return _backward_saved(code, x_dtype, w_dtype, b_dtype, gy, w, q, scale, seed)

    if bias:
        @jax.custom_vjp
        def f(x, w, b, seed):
            return _matmul(x, w) + b

        def f_fwd(x, w, b, seed):
            q, scale = _compress_call(x, rank)
            return _matmul(x, w) + b, (q, scale, w, seed)

        def f_bwd(res, gy):
            q, scale, w, seed = res
            gx, gw, gb = backward(q, scale, w, seed, gy)
            return gx, gw, gb, None
    else:
        @jax.custom_vjp
        def f(x, w, seed):
            return _matmul(x, w)

        def f_fwd(x, w, seed):
            q, scale = _compress_call(x, rank)
            return _matmul(x, w), (q, scale, w, seed)

        def f_bwd(res, gy):
            q, scale, w, seed = res
            gx, gw = backward(q, scale, w, seed, gy)
            return gx, gw, None

    f.defvjp(f_fwd, f_bwd)
    return f


def dense(x, w, b=None, *, key, config=None):
    """HOT linear layer: ``y = x @ w.T (+ b)`` with x ``(..., I)``, w ``(O, I)`` (as in ``hot.backward_linear``),
    b ``(O,)`` or None; float32, float16 or bfloat16 each.

    The forward computes y with JAX's matmul and keeps the ABC buffer of x (``compress_activation``) instead of x;
    the backward runs hot's integer backward (SPEC §3, §4) through an XLA custom call and returns g_x, g_w (and g_b)
    in the dtypes of x, w (and b). x's leading dims are flattened into the L rows of hot's layer. ``key``: a
    ``jax.random`` key, the source of the stochastic rounding's seed (``seed_from_key``); split it per step and per
    layer as for dropout. ``config``: a ``hot.Config`` (default ``hot.Config()``); ``config.exact`` gives the plain
    JAX dense layer (JAX's own backward, x kept). Under ``jax.vmap`` each mapped example is its own layer call (its
    own scales), as when the calls are made one by one.
    """
    op = "hot.jax.dense"
    cfg = _config(op, config)
    x = _array(op, "x", x)
    w = _array(op, "w", w)
    _float(op, "x", x)
    _float(op, "w", w)
    if x.ndim < 1:
        raise ValueError(f"{op}: x has shape {x.shape}, expected at least 1 dim (..., I)")
    if x.size == 0:
        raise ValueError(f"{op}: x is empty (shape {x.shape})")
    if w.ndim != 2:
        raise ValueError(f"{op}: w has shape {w.shape}, expected 2 dims (O, I): w is (out_features, in_features)")
    if w.size == 0:
        raise ValueError(f"{op}: w is empty (shape {w.shape})")
    O, I = w.shape
    if x.shape[-1] != I:
        raise ValueError(f"{op}: x has shape {x.shape} ({x.shape[-1]} features) but w has shape {w.shape} (O, I) "
                         f"with I = {I}; the last dim of x must equal w.shape[1]")
    if b is not None:
        b = _array(op, "b", b)
        _float(op, "b", b)
        if b.shape != (O,):
            raise ValueError(f"{op}: b has shape {b.shape}, expected ({O},) (one bias per output feature of w "
                             f"{w.shape})")
    seed = seed_words(key, op)
    if cfg.exact:
        y = _matmul(x, w)
        return y if b is None else y + b
    f = _dense_fn(cfg.code, x.dtype, w.dtype, None if b is None else b.dtype)
    return f(x, w, seed) if b is None else f(x, w, b, seed)


# ---- conv2d ------------------------------------------------------------------------------------------------------


def _pair(op, name, v):
    """An int or a pair of ints as (h, w)."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return (int(v), int(v))
    if (isinstance(v, (tuple, list)) and len(v) == 2
            and all(isinstance(e, (int, np.integer)) and not isinstance(e, (bool, np.bool_)) for e in v)):
        return (int(v[0]), int(v[1]))
    raise ValueError(f"{op}: {name} must be an int or a pair of ints (h, w), got {v!r}")


def _conv_out(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _patch_rows(t, Ho, Wo):
    """t (N, Ho, Wo, ...) with its rows in 4 x 4 patch order (N, Ho/4, Wo/4, 4, 4, ...) (SPEC §8)."""
    N, rest = t.shape[0], t.shape[3:]
    t = t.reshape((N, Ho // 4, 4, Wo // 4, 4) + rest)
    return jnp.swapaxes(t, 2, 3)


def _raster_rows(t, Ho, Wo):
    """The inverse of _patch_rows: (N, Ho/4, Wo/4, 4, 4, ...) back to (N, Ho, Wo, ...)."""
    N, rest = t.shape[0], t.shape[5:]
    return jnp.swapaxes(t, 2, 3).reshape((N, Ho, Wo) + rest)


def pointwise(kernel, padding) -> bool:
    """Whether a conv is a GEMM over channels without im2col (SPEC §8; ``hot.torch.ops.pointwise``): a 1 x 1 kernel
    without padding (any stride)."""
    return tuple(kernel) == (1, 1) and tuple(padding) == (0, 0)


def _patches(cfg, Ho, Wo) -> bool:
    """Rows in 4 x 4 patch order (``hot.torch.ops.conv_patch_rows``)."""
    return cfg.rank < 16 and Ho % 4 == 0 and Wo % 4 == 0


def _conv(x, w, stride, padding, dilation):
    return jax.lax.conv_general_dilated(x, w, stride, [(padding[0], padding[0]), (padding[1], padding[1])],
                                        rhs_dilation=dilation, dimension_numbers=("NCHW", "OIHW", "NCHW"))


def _quantize_fmap(x):
    """The int8 copy of a conv input x (N, C, H, W) (SPEC §8): per-tensor round-to-nearest of its channels-last map,
    through the FFI target hot_quantize_nearest (q int8 (N, H, W, C), scale float32 (1,))."""
    xh = jnp.transpose(x, (0, 2, 3, 1))
    call = jax.ffi.ffi_call("hot_quantize_nearest",
                            (jax.ShapeDtypeStruct(xh.shape, jnp.int8), jax.ShapeDtypeStruct((1,), jnp.float32)),
                            vmap_method="sequential")
    return call(xh)


def _compress_columns(q, kernel, stride, padding, dilation, patches: bool, rank: int):
    """The ABC buffer of the im2col columns of the int8 map q (N, H, W, C) (SPEC §8; ``hot.compress_columns``),
    through the FFI target hot_compress_columns: (q_t int8 (kh*kw*C, K_pad), scale float32 (1,))."""
    N, H, W, C = q.shape
    Ho = _conv_out(H, kernel[0], stride[0], padding[0], dilation[0])
    Wo = _conv_out(W, kernel[1], stride[1], padding[1], dilation[1])
    K_pad = hot._C.padded_k(hot._C.hla_rows(N * Ho * Wo, rank))
    call = jax.ffi.ffi_call("hot_compress_columns",
                            (jax.ShapeDtypeStruct((kernel[0] * kernel[1] * C, K_pad), jnp.int8),
                             jax.ShapeDtypeStruct((1,), jnp.float32)), vmap_method="sequential")
    i32 = np.int32
    return call(q, kh=i32(kernel[0]), kw=i32(kernel[1]), sh=i32(stride[0]), sw=i32(stride[1]), ph=i32(padding[0]),
                pw=i32(padding[1]), dh=i32(dilation[0]), dw=i32(dilation[1]), patches=i32(patches), rank=i32(rank))


def _im2col_t(q, kernel, stride, padding, dilation, patches: bool):
    """The codes of the im2col columns of the int8 map q (N, H, W, C), transposed (SPEC §4, §8; ``hot.column_codes``),
    through the FFI target hot_im2col_t: int8 (kh*kw*C, padded_k(N*Ho*Wo))."""
    N, H, W, C = q.shape
    Ho = _conv_out(H, kernel[0], stride[0], padding[0], dilation[0])
    Wo = _conv_out(W, kernel[1], stride[1], padding[1], dilation[1])
    call = jax.ffi.ffi_call("hot_im2col_t",
                            jax.ShapeDtypeStruct((kernel[0] * kernel[1] * C, hot._C.padded_k(N * Ho * Wo)), jnp.int8),
                            vmap_method="sequential")
    i32 = np.int32
    return call(q, kh=i32(kernel[0]), kw=i32(kernel[1]), sh=i32(stride[0]), sw=i32(stride[1]), ph=i32(padding[0]),
                pw=i32(padding[1]), dh=i32(dilation[0]), dw=i32(dilation[1]), patches=i32(patches))


def _pixel_rows(t, stride, Ho, Wo, patches):
    """The (N*Ho*Wo) x C rows of a pointwise conv's operand t (N, C, H, W): the pixels the kernel reads, in (n, ho, wo)
    or 4 x 4 patch order (``hot.torch.ops._pixel_rows``)."""
    if tuple(stride) != (1, 1):
        t = t[:, :, ::stride[0], ::stride[1]]
    r = jnp.transpose(t, (0, 2, 3, 1))
    if patches:
        r = _patch_rows(r, Ho, Wo)
    return r.reshape(-1, t.shape[1])


def _pixel_unrows(rows, x_shape, stride, Ho, Wo, patches):
    """The adjoint of :func:`_pixel_rows`: rows back onto (N, C, H, W), zero at the pixels a stride skips."""
    N, C, H, W = x_shape
    r = _raster_rows(rows.reshape(N, Ho // 4, Wo // 4, 4, 4, C), Ho, Wo) if patches else rows.reshape(N, Ho, Wo, C)
    r = jnp.transpose(r, (0, 3, 1, 2))
    if tuple(stride) == (1, 1):
        return r
    return jnp.zeros(x_shape, rows.dtype).at[:, :, ::stride[0], ::stride[1]].set(r)


@functools.lru_cache(maxsize=None)
def _conv2d_fn(code: int, stride, padding, dilation, x_hw, x_dtype, w_dtype, b_dtype):
    """The custom_vjp of hot.jax.conv2d for one configuration, geometry, input size (H, W) and set of dtypes."""
    cfg = hot.Config.from_code(code)
    bias = b_dtype is not None
    codes = hot._api.gw_from_codes(cfg)  # g_w from the codes of G~ and of x's (map's columns, pixel rows; SPEC §4)

    def fwd(x, w, b, seed):
        y = _conv(x, w, stride, padding, dilation)
        if bias:
            y = y + b[None, :, None, None].astype(y.dtype)
        if pointwise(w.shape[2:], padding):  # a linear layer over the pixels it reads: their codes or ABC buffer
            Ho, Wo = y.shape[2], y.shape[3]
            q, scale = _compress_call(_pixel_rows(x, stride, Ho, Wo, _patches(cfg, Ho, Wo)), cfg.rank, codes)
        else:
            q, scale = _quantize_fmap(x)
        return y, (q, scale, w, seed)

    def bwd(res, gy):
        q, scale, w, seed = res
        O, C, kh, kw = w.shape
        N, H, W = gy.shape[0], x_hw[0], x_hw[1]
        Ho, Wo = gy.shape[2], gy.shape[3]
        patches = _patches(cfg, Ho, Wo)
        g = _pixel_rows(gy, (1, 1), Ho, Wo, patches)  # (N*Ho*Wo, O)
        if pointwise((kh, kw), padding):  # g_w from G~'s codes in float32 (SPEC §4), rounded once to w's dtype
            res = _backward_saved(code, x_dtype, jnp.float32 if codes else w_dtype, b_dtype, g, w.reshape(O, C), q,
                                  scale, seed, codes)
            gx = _pixel_unrows(res[0], (N, C, H, W), stride, Ho, Wo, patches)
            return (gx, res[1].astype(w_dtype).reshape(w.shape), res[2] if bias else None, None)
        w_cols = jnp.transpose(w, (0, 2, 3, 1)).reshape(O, kh * kw * C)
        if codes:  # g_w from G~'s codes and the columns' codes, the map's scale applied by the engine (SPEC §4)
            cq = _im2col_t(q, (kh, kw), stride, padding, dilation, patches)
            res = _backward_conv_call(code, x_dtype, b_dtype, g, w_cols, cq, scale, seed, (N, C, H, W), (kh, kw),
                                      stride, padding, dilation, patches, True)
            gw32 = res[1]
        else:  # the ABC buffer of the columns of the int8 map's integers, formed from the map by the engine; g_w =
            # scale * (g_y^T Q), scaled after the GEMM in float32 (SPEC §8; as hot.torch.Conv2d)
            cq, cs = _compress_columns(q, (kh, kw), stride, padding, dilation, patches, cfg.rank)
            res = _backward_conv_call(code, x_dtype, b_dtype, g, w_cols, cq, cs, seed, (N, C, H, W), (kh, kw), stride,
                                      padding, dilation, patches)
            gw32 = res[1] * scale[0]
        gx = jnp.transpose(res[0].reshape(N, H, W, C), (0, 3, 1, 2))  # the engine's channels-last map
        gw = jnp.transpose(gw32.astype(w_dtype).reshape(O, kh, kw, C), (0, 3, 1, 2))
        return (gx, gw, res[2] if bias else None, None)

    @jax.custom_vjp
    def f(x, w, b, seed):
        y = _conv(x, w, stride, padding, dilation)
        return y + b[None, :, None, None].astype(y.dtype) if bias else y

    f.defvjp(fwd, bwd)
    return f


def conv2d(x, w, b=None, *, key, stride=1, padding=0, dilation=1, config=None):
    """HOT 2-D convolution (groups 1, zero padding): ``y = conv(x, w) (+ b)`` with x ``(N, C, H, W)``, w
    ``(O, C, kh, kw)``, b ``(O,)`` or None (PyTorch's layouts); stride, padding, dilation an int or a pair (h, w).

    The forward runs JAX's convolution and keeps x's int8 feature map (per-tensor, round-to-nearest; SPEC §8) instead
    of x (a pointwise conv, 1 x 1 without padding: the codes of the pixel rows it reads at the default, their ABC
    buffer below it, and its backward is :func:`dense`'s over those rows). The backward runs hot's convolution
    backward through XLA custom calls (``hot::backward_conv2d``: g_x at stride 1 as the transposed convolution of G~'s
    int8 codes, else the columns' GEMM and col2im): at the default g_w comes from G~'s codes against the codes of the
    map's im2col columns (``hot.column_codes``, SPEC §4), below full rank from the ABC buffer of those columns formed
    straight from the map (``hot.compress_columns``; rows in 4 x 4 patch order), then times the map's scale: the same
    computation as ``hot.torch.Conv2d``'s backward. ``key`` and ``config`` as in :func:`dense`."""
    op = "hot.jax.conv2d"
    cfg = _config(op, config)
    x = _array(op, "x", x)
    w = _array(op, "w", w)
    _float(op, "x", x)
    _float(op, "w", w)
    stride, padding, dilation = (_pair(op, "stride", stride), _pair(op, "padding", padding),
                                 _pair(op, "dilation", dilation))
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        raise ValueError(f"{op}: expected stride >= 1, dilation >= 1 and padding >= 0, got stride {stride}, "
                         f"padding {padding}, dilation {dilation}")
    if x.ndim != 4:
        raise ValueError(f"{op}: x has shape {x.shape}, expected 4 dims (N, C, H, W)")
    if w.ndim != 4:
        raise ValueError(f"{op}: w has shape {w.shape}, expected 4 dims (O, C, kh, kw)")
    if x.size == 0 or w.size == 0:
        raise ValueError(f"{op}: x (shape {x.shape}) and w (shape {w.shape}) must be non-empty")
    O, C, kh, kw = w.shape
    if x.shape[1] != C:
        raise ValueError(f"{op}: x has shape {x.shape} ({x.shape[1]} channels) but w has shape {w.shape} "
                         f"(O, C, kh, kw) with C = {C}; groups other than 1 are not supported")
    Ho = _conv_out(x.shape[2], kh, stride[0], padding[0], dilation[0])
    Wo = _conv_out(x.shape[3], kw, stride[1], padding[1], dilation[1])
    if Ho < 1 or Wo < 1:
        raise ValueError(f"{op}: x has shape {x.shape}, too small for the kernel {(kh, kw)} with padding {padding} "
                         f"and dilation {dilation} (output {Ho} x {Wo})")
    if b is not None:
        b = _array(op, "b", b)
        _float(op, "b", b)
        if b.shape != (O,):
            raise ValueError(f"{op}: b has shape {b.shape}, expected ({O},) (one bias per output channel of w "
                             f"{w.shape})")
    seed = seed_words(key, op)
    if cfg.exact:
        y = _conv(x, w, stride, padding, dilation)
        return y if b is None else y + b[None, :, None, None]
    f = _conv2d_fn(cfg.code, stride, padding, dilation, tuple(x.shape[2:]), x.dtype, w.dtype,
                   None if b is None else b.dtype)
    return f(x, w, b, seed)


# ---- the library's core ------------------------------------------------------------------------------------------


def set_num_threads(n: int) -> None:
    """CPU threads of hot's core, for hot's own calls (``hot.set_num_threads``) and for the JAX custom calls, whose
    library links its own copy of the core (0 = all cores; default: HOT_NUM_THREADS, else all cores)."""
    hot.set_num_threads(n)
    if _ffi.load().HotJaxSetNumThreads(int(n)) != 0:  # pragma: no cover - hot.set_num_threads checked n
        raise ValueError(f"hot.jax.set_num_threads: n must be in 0..1024, got {n!r}")


def get_num_threads() -> int:
    """CPU threads of the JAX custom calls' core."""
    return int(_ffi.load().HotJaxGetNumThreads())


def build_info() -> str:
    """``hot::build_info()`` of the JAX library's core, and the platforms its handlers are registered for."""
    return _ffi.load().HotJaxBuildInfo().decode() + f"\nhot.jax: XLA FFI handlers for {', '.join(_ffi.platforms)}"
