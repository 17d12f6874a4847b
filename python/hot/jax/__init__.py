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

__all__ = ["dense", "compress_activation", "seed_from_key", "seed_words", "set_num_threads", "get_num_threads",
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


def _compress_call(x, rank):
    """(q int8 (I, K_pad), scale float32 (1,)) of x (..., I), through the FFI target hot_compress_activation."""
    q_shape = _abc_shape(x.shape[:-1], x.shape[-1], rank)
    call = jax.ffi.ffi_call("hot_compress_activation",
                            (jax.ShapeDtypeStruct(q_shape, jnp.int8), jax.ShapeDtypeStruct((1,), jnp.float32)),
                            vmap_method="sequential")
    return call(x, rank=np.int32(rank))


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


@functools.lru_cache(maxsize=None)
def _dense_fn(gx_bits: int, rank: int, rounding: str, gx_scale: str, x_dtype, w_dtype, b_dtype):
    """The custom_vjp of one configuration and one set of dtypes (the cotangents' dtypes are the inputs')."""
    attrs = dict(gx_bits=np.int32(gx_bits), rank=np.int32(rank), rounding=str(rounding), gx_scale=str(gx_scale))
    bias = b_dtype is not None

    def backward(q, scale, w, seed, gy):
        O, I = w.shape
        outs = [jax.ShapeDtypeStruct(gy.shape[:-1] + (I,), x_dtype), jax.ShapeDtypeStruct((O, I), w_dtype)]
        if bias:
            outs.append(jax.ShapeDtypeStruct((O,), b_dtype))
        call = jax.ffi.ffi_call("hot_backward_linear_bias" if bias else "hot_backward_linear", tuple(outs),
                                vmap_method="sequential")
        return call(gy, w, q, scale, seed, **attrs)

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
    f = _dense_fn(cfg.gx_bits, cfg.rank, cfg.rounding, cfg.gx_scale, x.dtype, w.dtype,
                  None if b is None else b.dtype)
    return f(x, w, seed) if b is None else f(x, w, b, seed)


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
