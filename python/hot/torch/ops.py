"""torch.library ops around the hot engine (SPEC §2-§4, §8).

Every call into the engine has a ``torch.library`` op with a fake (meta) implementation, so converted models run under
``torch.compile(fullgraph=True)`` without graph breaks, and under autocast, DDP and GradScaler like the native layers.
The ops have no autograd kernels: the layers' ``torch.autograd.Function`` s give the gradients and call the ops, and
dynamo traces those Functions, so a compiled graph calls the ops without any Python autograd code at run time.

Ops (namespace ``hot``):

``hot::linear(x, weight, bias, seed) -> y``
    ``y = F.linear(x, weight, bias)`` in the framework's precision. The seed is not read here: as an input of the
    forward op it keeps the seed's draw in the compiled forward graph, where eager code draws it (a draw that fed only
    the backward op would be moved into the backward graph by the partitioner, the layers' seeds then drawn in
    another order).
``hot::compress_activation(x, config) -> (q, scale)``
    The ABC buffer of x (int8 ``I x K_pad`` + one f32 scale) that a layer keeps for its backward (``keep`` 1; with
    0 nothing is kept, a frozen weight's g_x needing only W, and with 2 the raw x, ``Config.exact``). A function of x
    and the configuration alone, so that a compiled graph forms it once for all the layers that read x (AOTAutograd
    merges identical calls of a functional op), as eager layers share it through :func:`_shared_input`.
``hot::linear_backward(...) -> (g_x, g_w, g_b)``
    ``hot.backward_linear`` on the tensors' device; results not requested are empty tensors.
``hot::conv2d(x, weight, bias, seed, stride, padding, dilation, keep, config) -> (y, q, scale)``
    ``y = F.conv2d(...)``; with ``keep == 1`` the layer keeps the INPUT FEATURE MAP quantised to int8
    (per-tensor round-to-nearest, ``hot.quantize``; (N, C, H, W) in x's layout), not the im2col matrix (SPEC §8); a
    pointwise conv (1 x 1, no padding, :func:`pointwise`) keeps the codes of the pixel rows it reads instead, the
    same quantisation stored transposed (``hot.activation_codes``), at the default (``_api.gw_from_codes``), and below
    it their ABC buffer, as a linear layer would.
``hot::conv2d_backward(...) -> (g_x, g_w, g_b)``
    Pointwise: ``hot.backward_linear`` over the pixel rows from their codes (g_w from G~'s codes, SPEC §4) or ABC
    buffer (no columns, no feature map), g_x put back onto the pixels read. Otherwise, at the default (rank 16, 8-bit
    per-tensor g_x; ``_api.gw_from_codes``): the engine's ``im2col_t`` writes the im2col columns ((i, j, c) order) of
    the feature map's integers transposed, and
    the core's ``backward_conv2d`` takes g_w from G~'s codes against them, the map's scale applied in its epilogue
    (SPEC §4 "g_w from G~'s codes"). Below full rank: the engine's ``hot.compress_columns`` forms the ABC buffer of
    those columns straight from the map (HLA + Q8 of the columns, the compression a linear layer applies to its input,
    without writing the columns), ``backward_conv2d`` takes it as the saved buffer, and the float32 g_w is multiplied
    by the map's scale (SPEC §8). The column gradient is folded back by :func:`col2im` (the core's) where g_x is not
    the transposed convolution of G~'s codes. Choice: the stored buffer stays at one byte per input element (instead of
    ``r/16 * kh*kw`` bytes per element for an ABC buffer of the columns kept from the forward), which is what SPEC §8
    asks for, for one HLA pass in backward; the double quantisation (8-bit feature map, then 8-bit HLA) adds at most
    ``s_fmap/2`` per input element before the projection.

The configuration (a ``hot.Config``, the core's ``hot::Config``) crosses the ops' schemas as ONE integer,
``config.code`` (``hot::Config::code``, the only scalar encoding of a configuration, produced and parsed in the core);
the op bodies turn it back into the Config with :func:`config_of` (``hot.Config.from_code``, cached), and the engine
gets the Config whole.

Two routes through the same autograd.Functions (:class:`_LinearFunction`, :class:`_Conv2dFunction`): eager calls (not
under ``torch.compile``) run the op bodies directly, without the dispatcher (it costs tens of us of host time per
call, which on a GPU leaves the device idle between small kernels); under ``torch.compile`` the Functions call the ops
(:func:`linear_ops`, :func:`conv2d_ops`: the configuration as its code), so graphs capture them. Both routes run the
same bodies, which reach the engine through the one internal entry per operation of ``hot._api`` (``_compress``,
``_backward_linear``), as the public functions do; they give the same tensors for the same seed (tested).

Stochastic-rounding seeds are drawn at each forward call of each layer (one int64 draw) by torch's default generator
of the layer's device (the CPU's, or the GPU's for a CUDA layer), so ``torch.manual_seed`` makes runs reproducible and
seeds differ per step and per layer. The seed travels as a 0-d int64 tensor on that device, which the engine's kernels
read when they run (SPEC §5): compiled graphs do not specialise on it, the host never reads it, and a CUDA graph of a
step (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``) draws a new one at every replay. Under
``torch.compile`` with the inductor backend the draw is traced with the graph and inductor replaces torch's random
ops by its own generator, so a compiled model draws other seeds than the eager one after the same
``torch.manual_seed`` (each reproducible on its own); ``torch._inductor.config.fallback_random = True`` keeps torch's.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.dlpack
from torch import Tensor

import hot
from hot import _api
from hot import _frameworks as _fws
from hot._frameworks import _torch_raw_stream

KEEP_NOTHING = 0
KEEP_COMPRESSED = 1
KEEP_RAW = 2

#: The float dtypes the engine reads and writes.
ENGINE_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

_SEED_HIGH = 2**62


def padded_k(rows, rank: int):
    """K_pad of an ABC buffer of ``rows`` rows at rank ``rank`` (works with SymInts)."""
    k = (rows + 15) // 16 * rank
    return (k + 15) // 16 * 16


def draw_seed(device=None) -> Tensor:
    """One stochastic-rounding seed (0-d int64) drawn on ``device`` (default: the CPU) by torch's default generator of
    that device: a layer's seed is drawn on the layer's device, where the engine's kernels read it (SPEC §5), so that
    a CUDA graph of the step draws a new one at each replay."""
    return torch.randint(0, _SEED_HIGH, (), dtype=torch.int64, device=device)


def _seed_for(seed, like: Tensor):
    """A seed tensor on like's device (the layers draw it there; a seed given elsewhere is copied); an int as it is."""
    return seed if not isinstance(seed, Tensor) or seed.device == like.device else seed.to(like.device)


@functools.lru_cache(maxsize=None)
def config_of(code: int) -> hot.Config:
    """The hot.Config of an op's ``config`` argument (``config.code``, see the module docstring); cached."""
    return hot.Config.from_code(code)


def _empty(like: Tensor, dtype=None) -> Tensor:
    return like.new_empty((0,), dtype=dtype if dtype is not None else like.dtype)


def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return _empty(like) if t is None else t


_LIB = torch.library.Library("hot", "DEF")


def define_op(schema: str, body, fake):
    """hot::<schema> as a low-level torch.library op, the graph-capturable form of an engine call: ``body`` for CPU
    and CUDA tensors (for others it raises the engine's named error), ``fake`` for tracing, and no autograd kernel of
    its own: the torch.autograd.Functions that call the ops give the gradients, and dynamo traces them with the ops
    inside. (A ``torch.library.custom_op`` runs a Python autograd kernel, a redispatch and an aliasing check around
    its body at every call, in a compiled graph's runtime as well: ~20-65 us a call on the development machine, more
    than a small op's body.) Returns the op's default overload."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake("hot::" + name, fake, lib=_LIB)
    return getattr(torch.ops.hot, name).default


# ------------------------------------------------------------------------------------------------
# the engine calls of the layer ops, eager and compiled
# ------------------------------------------------------------------------------------------------
# Both go through hot._api's entries (_compress, _backward_linear), as hot.compress_activation and hot.backward_linear
# do, with a torch call context built without the framework-generic argument checks of the public functions (which
# cost more host time than a small layer's kernels): the layers' own forward fixes shapes, devices and dtypes, and the
# core checks them again. Tensors on a device other than CPU or CUDA get the public functions' named error. Empty
# tensors, which the engine refuses, get nn.Linear's results from torch ops (empty or zero gradients).
_UINT64_MAX = (1 << 64) - 1
_TORCH = _fws._TORCH


def _call(op: str, t: Tensor) -> "_api._Call":
    """hot._api's call context for the CPU or CUDA tensor t (the stream: 0 on the CPU, torch's current raw stream on
    t's GPU); for a tensor elsewhere, the public functions' check raises its named error."""
    if t.is_cpu:
        return _api._Call.known(op, _TORCH, t, 0)
    if t.is_cuda:
        return _api._Call.known(op, _TORCH, t, _torch_raw_stream()(t.get_device()))
    return _api._Call(op, x=t)  # raises: "<op>: x is on torch device '...', expected a CPU or CUDA tensor"


def _compress(x: Tensor, cfg, codes: bool = False, amax: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(q, scale) of ``hot.compress_activation(x.reshape(-1, I), cfg)`` for a torch tensor x (..., I); a contiguous x
    goes to the engine as it is (the engine flattens its leading dims, as the reshape would). A layer accepts any
    input layout F.linear does: a non-contiguous x is compressed from a temporary contiguous copy. codes: x's own
    codes instead (``hot.activation_codes``, SPEC §2; only at the default, ``_api.gw_from_codes``: rank 16, the
    buffer's shape the same), with amax x's amax when known (:func:`note_amax`)."""
    I = x.shape[-1]
    if x.numel() == 0:  # an empty batch (or I = 0): an empty buffer (the engine refuses empty arrays)
        return (x.new_zeros((I, padded_k(math.prod(x.shape[:-1]), cfg.rank)), dtype=torch.int8),
                x.new_ones((1,), dtype=torch.float32))
    if not x.is_contiguous():
        x = x.contiguous()
    q, scale, _ = _api._compress(_call("compress_activation", x), x, x.shape, cfg, codes=codes,
                                 amax=amax if codes else None)
    return q, scale


def _compress_cast(x: Tensor, dt, cfg) -> Tuple[Tensor, Tensor, Tensor]:
    """(x.to(dt), and the ABC buffer (q, scale) of that cast) by one engine call (compress_activation_cast, which on
    the GPU reads x once for both where its rows allow 16-byte loads): the same bits as ``_compress(x.to(dt), cfg)``.
    An empty or non-contiguous x, or one of a dtype the engine does not read (float64), takes the two steps."""
    if x.numel() == 0 or not x.is_contiguous() or x.dtype not in ENGINE_FLOATS:
        xc = x.to(dt)
        return (xc, *_compress(xc, cfg))
    xc = torch.empty(x.shape, dtype=dt, device=x.device)
    q, scale, _ = _api._compress(_call("compress_activation", x), x, x.shape, cfg, x_cast=xc)
    return xc, q, scale


# What the eager layers that read one input tensor share: id(x) -> [weak reference to x, x's version when the entry was
# made, made while a CUDA graph was being recorded, {dtype: x's cast}, {(dtype, rank): weak references to the ABC
# buffer (q, scale)}, x's amax or None] (:func:`_shared_input`, :func:`note_amax`).
_SHARED: Dict[int, list] = {}


def _drop_shared(key: int, ref) -> None:
    e = _SHARED.get(key)
    if e is not None and e[0] is ref:
        del _SHARED[key]


def _live_entry(x: Tensor) -> Optional[list]:
    """x's entry of _SHARED if it was made for this tensor, at its current version, and in the same recording state
    (see :func:`_shared_input`), else None."""
    e = _SHARED.get(id(x))
    if e is None or e[0]() is not x or e[1] != x._version or \
            e[2] != (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return e


def _entry(x: Tensor) -> list:
    """x's live entry of _SHARED, made now if there is none."""
    e = _live_entry(x)
    if e is None:
        key = id(x)
        e = _SHARED[key] = [weakref.ref(x, functools.partial(_drop_shared, key)), x._version,
                            x.is_cuda and torch.cuda.is_current_stream_capturing(), {}, {}, None]
    return e


def note_amax(x: Tensor, amax: Tensor) -> None:
    """Records x's amax (float32 (1,), max |x| as the engine's relu_mask gives it for its output) for the layers that
    quantise x as it is next (SPEC §2, §8: a convolution's int8 map, a stride-1 pointwise convolution's codes): they
    take it instead of a pass over x, while x is alive and unchanged (its version counter), in the same recording
    state."""
    _entry(x)[5] = amax


def _known_amax(x: Tensor) -> Optional[Tensor]:
    """x's amax recorded by :func:`note_amax`, if x is unchanged since, else None."""
    e = _live_entry(x)
    return None if e is None else e[5]


def _live_buffer(e: list, dtype, rank: int):
    """The ABC buffer (q, scale) of an entry's x in dtype at rank while some layer keeps it, else None."""
    refs = e[4].get((dtype, rank))
    q, scale = (refs[0](), refs[1]()) if refs is not None else (None, None)
    return None if q is None or scale is None else (q, scale)


def _shared_input(x: Tensor, dt, cfg, compress: bool):
    """(x cast to dt (x itself for None or x's dtype), its ABC buffer at cfg.rank or (None, None) unless compress),
    shared by the eager linear layers that read the same tensor x (SPEC §2: the query, key and value projections of one
    attention input, a gated MLP's gate and up projections): the first forms them, the others reuse them while x is
    alive and unchanged (its version counter). Deterministic casts and compression of the same values, so the same bits
    as forming them per layer, each formed once, and the buffer kept once (the layers save the same tensors). Where x
    must be cast and compressed, one engine call forms both (:func:`_compress_cast`). The cast is held while x lives;
    the buffer only while some layer keeps it (a weak reference). What was formed while a CUDA graph was being recorded
    serves only calls recorded with it, and the rest only calls outside of recording: a recorded graph forms what it
    reads, as its caller may refill a static input before each replay."""
    e = _entry(x)
    cast = dt is not None and x.dtype != dt
    xc = e[3].get(dt) if cast else x
    if not compress:
        if xc is None:
            xc = e[3][dt] = x.to(dt)
        return xc, None, None
    buf = _live_buffer(e, dt if cast else x.dtype, cfg.rank)
    if buf is None:
        if xc is None:  # the cast and its buffer by one engine call
            xc, *buf = _compress_cast(x, dt, cfg)
            e[3][dt] = xc
        else:
            buf = _compress(xc, cfg)
        e[4][(xc.dtype, cfg.rank)] = (weakref.ref(buf[0]), weakref.ref(buf[1]))
    elif xc is None:
        xc = e[3][dt] = x.to(dt)
    return (xc, *buf)


def shared_buffer_alive(x: Tensor, dt, cfg) -> bool:
    """Whether a linear layer reading x now (autocast's dtype dt or None, cfg) would reuse another layer's ABC buffer
    (:func:`_shared_input`), for what the layers record for hot.torch.summary."""
    e = _live_entry(x)
    return e is not None and _live_buffer(e, dt if dt is not None else x.dtype, cfg.rank) is not None


def _backward_linear(g: Tensor, w: Tensor, x: Optional[Tensor], q: Optional[Tensor], scale: Optional[Tensor],
                     seed, cfg, need_gx: bool, need_gw: bool, need_gb: bool, gx_shape, reuse=None,
                     gw_dtype: Optional[str] = None, gx_dtype: Optional[str] = None, codes: bool = False,
                     gy_amax: Optional[Tensor] = None):
    """``hot.backward_linear(g.reshape(-1, O), w, saved, bias=need_gb, config=cfg, seed=seed, ...)`` for a
    contiguous g (..., O) and w (O x I), where saved is the raw x (contiguous, L x I elements, given only when g_w
    is needed) or else the ABC buffer (q, scale) of L x I; g_x comes back shaped gx_shape (g's leading dims, I).
    reuse: (WeightReuse, parameter, its version at the forward) of a layer called inside weight_reuse, else None.
    gw_dtype, gx_dtype: g_w's and g_x's dtype names when not g's. seed: an int, or the 0-d int64 seed tensor on g's
    device. codes: (q, scale) are x's own codes (``hot.activation_codes``; g_w from G~'s codes, in float32).
    gy_amax: G~'s amax of g when known (:func:`handed_amax`), else None."""
    O = g.shape[-1]
    I = w.shape[1]
    L = math.prod(g.shape[:-1])
    if L == 0 or I == 0 or O == 0:  # empty operands (the engine refuses them): g_x and g_w are zeros
        gw_dt = g.dtype if gw_dtype is None else getattr(torch, gw_dtype)
        gx_dt = g.dtype if gx_dtype is None else getattr(torch, gx_dtype)
        return (g.new_zeros(gx_shape, dtype=gx_dt) if need_gx else None,
                g.new_zeros((O, I), dtype=gw_dt) if need_gw else None, g.reshape(L, O).sum(0) if need_gb else None)
    if not isinstance(seed, Tensor) and not 0 <= seed <= _UINT64_MAX:
        _api._seed("backward_linear", seed)  # raises, naming the seed
    c = _call("backward_linear", g)
    saved = None
    if need_gw:
        saved = x if x is not None else _api._wrap_saved(c, q, scale, L, I, cfg.rank, "backward_linear", codes)
    wq = reuse[0]._get(c, w, cfg, reuse[1], reuse[2]) if reuse is not None and need_gx and not cfg.exact else None
    if cfg.exact and (gw_dtype is not None or gx_dtype is not None):  # the exact GEMMs write their operands' dtype:
        gx, gw, gb = _api._backward_linear(c, g, w, saved, gx_shape, need_gx, need_gw, need_gb, cfg, seed, wq)
        return (gx if gx is None or gx_dtype is None else gx.to(getattr(torch, gx_dtype)),  # cast after
                gw if gw is None or gw_dtype is None else gw.to(getattr(torch, gw_dtype)), gb)
    return _api._backward_linear(c, g, w, saved, gx_shape, need_gx, need_gw, need_gb, cfg, seed, wq, gw_dtype,
                                 gx_dtype, gy_amax)


def _backward_conv2d(g: Tensor, w: Tensor, q: Optional[Tensor], scale: Optional[Tensor], seed, cfg, x_shape,
                     kernel, stride, padding, dilation, patches: bool, need_gx: bool, need_gw: bool, need_gb: bool,
                     reuse=None, gw_dtype: Optional[str] = None, codes: bool = False, gy_amax=None):
    """``hot::backward_conv2d`` of a non-empty convolution (not exact) from its contiguous g_y rows g (N*Ho*Wo x O),
    its weight columns w (O x kh*kw*C) and the g_w operand (q, scale) (given when g_w is needed): the ABC buffer of
    its im2col columns, or with ``codes`` the columns' codes transposed (im2col_t) and the map's scale: (g_x as the
    channels-last map N*H*W x C, g_w, g_b). reuse, gw_dtype and gy_amax as in :func:`_backward_linear`."""
    if not isinstance(seed, Tensor) and not 0 <= seed <= _UINT64_MAX:
        _api._seed("backward_conv2d", seed)  # raises, naming the seed
    c = _call("backward_conv2d", g)
    L, CKK = g.shape[0], w.shape[1]
    saved = _api._wrap_saved(c, q, scale, L, CKK, cfg.rank, "backward_conv2d", codes) if need_gw else None
    wq = reuse[0]._get(c, w, cfg, reuse[1], reuse[2]) if reuse is not None and need_gx else None
    return _api._backward_conv2d(c, g, w, saved, x_shape, kernel, stride, padding, dilation, patches, need_gx,
                                 need_gw, need_gb, cfg, seed, wq, gw_dtype, gy_amax)


class WeightReuse:
    """The W~ (SPEC §3, hot.quantize_weight) of each layer called inside one :func:`weight_reuse` block, formed by the
    layer's first backward in the block and used by the next ones while the weight is unchanged."""

    def __init__(self):
        self._kept = {}  # id(parameter) -> (parameter, version, dtype, shape, gx_bits, the core's QuantizedWeight)
        self.formed = 0  # W~ formed in this block
        self.reused = 0  # backward calls that took a kept W~

    @property
    def nbytes(self) -> int:
        """Bytes of the W~ kept now (one byte per weight element, plus padding of O to the Hadamard block)."""
        return sum(int(e[5].nbytes) for e in self._kept.values())

    def _get(self, c, w: Tensor, cfg, param: Tensor, version: int):
        """The core's QuantizedWeight of w (O x I, the weight the backward uses: param or its autocast copy, as it was
        at the forward, whose param had the given version) at cfg.gx_bits: kept, or formed now and kept."""
        key = (version, w.dtype, tuple(w.shape), cfg.gx_bits)
        e = self._kept.get(id(param))
        if e is not None and e[0] is param and e[1:5] == key:
            self.reused += 1
            return e[5]
        wq = c.call(hot._C.quantize_weight, w, cfg, c.stream)
        self._kept[id(param)] = (param,) + key + (wq,)
        self.formed += 1
        return wq


_REUSE: Optional[WeightReuse] = None  # the innermost active weight_reuse block, if any


class weight_reuse:
    """``with hot.torch.weight_reuse() as r:`` the converted layers' backward passes inside the block form each
    layer's quantised weight W~ (g_x path, SPEC §3) once and reuse it while the weight is unchanged: gradient
    accumulation over micro-batches, activation recomputation. Results are bit-identical to forming W~ every call.

    The block's promise: weights change only through in-place torch ops (an optimizer step), which bump the
    parameter's version and so form a new W~; a weight whose storage is refilled behind torch's back (by hand through
    .data, or sharded parameters regathered between micro-batches) must not be trained inside the block. Eager
    layers only (under torch.compile the layers form W~ every call). Memory: one byte per element of each weight
    used (``r.nbytes``), freed when the block ends. ``r.formed`` / ``r.reused`` count the W~ formed and reused."""

    def __init__(self):
        self._state = WeightReuse()
        self._outer = None

    def __enter__(self) -> WeightReuse:
        global _REUSE
        self._outer, _REUSE = _REUSE, self._state
        return self._state

    def __exit__(self, *exc):
        global _REUSE
        _REUSE = self._outer
        self._state._kept.clear()
        return False


def reuse_of(param: Tensor, config):
    """What a layer's forward records for its backward: (the active WeightReuse, param, param's version) inside a
    weight_reuse block for a HOT (not exact) configuration, else None."""
    if _REUSE is None or config.exact:
        return None
    return (_REUSE, param, param._version)


# ------------------------------------------------------------------------------------------------
# linear
# ------------------------------------------------------------------------------------------------
def _linear_backward_body(grad_y, weight, x, q, scale, seed, x_shape, cfg, need_gx, need_gw, need_gb,
                          reuse=None, gw_dtype=None, gx_dtype=None):
    """hot.backward_linear for the layer; (g_x, g_w, g_b) with None for what was not requested; g_w in gw_dtype and
    g_x in gx_dtype (torch dtypes: the parameter's and the input's, which the layer cast for autocast) when given,
    else in grad_y's."""
    return _backward_linear(grad_y.contiguous(), weight.contiguous(),
                            x.contiguous() if need_gw and x is not None else None, q, scale, seed, cfg, need_gx,
                            need_gw, need_gb, x_shape, reuse, _dtype_name(gw_dtype), _dtype_name(gx_dtype))


def _linear_fake(x, weight, bias, seed):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


linear_op = define_op("linear(Tensor x, Tensor weight, Tensor? bias, Tensor seed) -> Tensor",
                      lambda x, weight, bias, seed: F.linear(x, weight, bias), _linear_fake)


def _compress_fake(x, config):
    rows = math.prod(x.shape[:-1])
    return (x.new_empty((x.shape[-1], padded_k(rows, config_of(config).rank)), dtype=torch.int8),
            x.new_empty((1,), dtype=torch.float32))


compress_op = define_op("compress_activation(Tensor x, int config) -> (Tensor, Tensor)",
                        lambda x, config: _compress(x, config_of(config)), _compress_fake)


def _linear_backward_op(grad_y, weight, x, q, scale, seed, x_shape, config, need_gx, need_gw, need_gb,
                        gw_dtype=None, gx_dtype=None):
    gx, gw, gb = _linear_backward_body(grad_y, weight, x, q, scale, _seed_for(seed, grad_y), x_shape,
                                       config_of(config), need_gx, need_gw, need_gb, None, gw_dtype, gx_dtype)
    return _or_empty(gx, grad_y), _or_empty(gw, grad_y), _or_empty(gb, grad_y)


def _linear_backward_fake(grad_y, weight, x, q, scale, seed, x_shape, config, need_gx, need_gw, need_gb,
                          gw_dtype=None, gx_dtype=None):
    gx = grad_y.new_empty(x_shape, dtype=gx_dtype or grad_y.dtype) if need_gx else grad_y.new_empty((0,))
    gw = grad_y.new_empty(weight.shape, dtype=gw_dtype or grad_y.dtype) if need_gw else grad_y.new_empty((0,))
    gb = grad_y.new_empty((weight.shape[0],)) if need_gb else grad_y.new_empty((0,))
    return gx, gw, gb


linear_backward_op = define_op(
    "linear_backward(Tensor grad_y, Tensor weight, Tensor? x, Tensor q, Tensor scale, Tensor seed, SymInt[] x_shape, "
    "int config, bool need_gx, bool need_gw, bool need_gb, ScalarType? gw_dtype=None, ScalarType? gx_dtype=None) -> "
    "(Tensor, Tensor, Tensor)",
    _linear_backward_op, _linear_backward_fake)


def _weight_in(ctx, weight: Tensor, dt) -> Tensor:
    """The weight a layer's forward computes with: weight itself, or its cast to dt (autocast's dtype) when the layer
    casts it (SPEC §4, "g_w's dtype": under autocast the layer takes the parameter as it is and casts it inside, so
    that its backward writes g_w in the parameter's dtype, rounded once from the engine's float32 result, and autograd
    has no cast of g_w to run). Sets ctx.gw_dtype (the parameter's dtype, or None: g_w in g_y's dtype)."""
    if dt is None or weight.dtype == dt:
        ctx.gw_dtype = None
        return weight
    ctx.gw_dtype = weight.dtype
    return weight.to(dt)


def _dtype_name(dt) -> Optional[str]:
    """A torch float dtype's name for the engine ("float32"), None for None."""
    return None if dt is None else _api._dtype_name("hot.torch", dt)


def _needs(ctx):
    """(need g_x, need g_w, need g_b) of a backward: g_w only when something was kept for it."""
    return (ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.keep != KEEP_NOTHING,
            ctx.has_bias and ctx.needs_input_grad[2])


def _save(ctx, x, weight, bias, q, scale, seed, keep, cfg):
    """What the layers' autograd.Functions keep: the tensors the backward reads (the raw x only when kept raw; q and
    scale when compressed), the seed, the configuration (eager: the hot.Config; the op route: its code) and the
    backward's flags. The seed is a context attribute on the eager route (its tensor, or 0 without stochastic
    rounding: not a saved tensor, so saved-tensor hooks see what the layer keeps of its input) and a saved tensor on
    the op route (which dynamo traces)."""
    if isinstance(cfg, int):
        ctx.save_for_backward(x if keep == KEEP_RAW else None, weight, q, scale, seed)
    else:
        ctx.save_for_backward(x if keep == KEEP_RAW else None, weight, q, scale)
        ctx.seed = seed
    ctx.x_shape, ctx.keep, ctx.has_bias, ctx.cfg = list(x.shape), keep, bias is not None, cfg


def _saved(ctx):
    """(x, weight, q, scale, seed) as :func:`_save` kept them."""
    t = ctx.saved_tensors
    return t if len(t) == 5 else (*t, ctx.seed)


def _double_backward_error(kind: str) -> RuntimeError:
    return RuntimeError(
        f"hot.torch.{kind}: double backward is not supported: HOT's backward pass runs in the hot engine, outside "
        f"autograd, so the gradient of its gradients (create_graph=True: gradient penalties, Hessian-vector products) "
        f"would miss its terms; keep this layer as nn.{kind} (hot.torch.convert(..., exclude=...))")


class _NotDifferentiable(torch.autograd.Function):
    """Passes the results of a HOT backward run with create_graph=True through a node whose backward raises. The
    tensors they depend on (g_y, W, the raw x) come after them, so that they require grad where exact ones would."""

    @staticmethod
    def forward(ctx, kind: str, n: int, *tensors):
        ctx.kind = kind
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise _double_backward_error(ctx.kind)


def _layer_backward(ctx, grad_y, n_other: int, kind: str, body):
    """Backward of a layer's autograd.Function: body(x, weight, q, scale, seed, need_gx, need_gw, need_gb) when
    anything is needed; (g_x, g_w, g_b) then None for the n_other other inputs. Under create_graph=True the results
    come out of a _NotDifferentiable node: differentiating them again raises instead of silently giving zero."""
    x, weight, q, scale, seed = _saved(ctx)
    needs = _needs(ctx)
    if not any(needs):
        return (None,) * (3 + n_other)
    if not torch.is_grad_enabled():  # the usual backward, without create_graph
        grads = body(x, weight, q, scale, seed, *needs)
        return tuple(g if n else None for g, n in zip(grads, needs)) + (None,) * n_other
    with torch.no_grad():
        grads = [g if n else None for g, n in zip(body(x, weight, q, scale, seed, *needs), needs)]
    got = [g for g in grads if g is not None]
    deps = [t for t in (grad_y, weight, x) if t is not None]
    marked = iter(_NotDifferentiable.apply(kind, len(got), *got, *deps))
    return tuple(None if g is None else next(marked) for g in grads) + (None,) * n_other


class _LinearFunction(torch.autograd.Function):
    """:func:`linear` for autograd, by two routes with the same bodies and results. Eager (``args`` = (seed, keep,
    cfg, reuse), cfg a hot.Config): the bodies directly, without the dispatcher. Under torch.compile (cfg the
    configuration's code, reuse None): hot::linear and hot::linear_backward, which dynamo traces into the graphs
    (:func:`linear_ops`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, args):
        seed, keep, cfg, reuse, dt = args
        w = _weight_in(ctx, weight, dt)
        # x of another dtype than autocast's is cast here as well: g_x comes in x's dtype (SPEC §4, "g_w's dtype")
        ctx.gx_dtype = x.dtype if dt is not None and x.dtype != dt else None
        if isinstance(cfg, int):
            # The ABC buffer by its own op, which has no other input than x and the configuration, so that the
            # compiled graph forms it once for all the layers that read x (AOTAutograd's common-subexpression
            # elimination merges identical calls of a functional op, as it merges their casts of x).
            x = x if ctx.gx_dtype is None else x.to(dt)
            y = linear_op(x, w, bias, seed)
            q, scale = compress_op(x, cfg) if keep == KEEP_COMPRESSED else (_empty(x, torch.int8),
                                                                             _empty(x, torch.float32))
        else:  # the cast and the ABC buffer shared with the other layers that read x
            x, q, scale = _shared_input(x, dt, cfg, keep == KEEP_COMPRESSED)
            y = F.linear(x, w, bias)
        _save(ctx, x, w, bias, q, scale, seed, keep, cfg)
        ctx.reuse = reuse
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if isinstance(ctx.cfg, int):
            return _layer_backward(ctx, grad_y, 1, "Linear", lambda x, w, q, s, seed, *needs: linear_backward_op(
                grad_y, w, x, q, s, seed, ctx.x_shape, ctx.cfg, *needs, ctx.gw_dtype, ctx.gx_dtype))
        return _layer_backward(ctx, grad_y, 1, "Linear", lambda x, w, q, s, seed, *needs: _linear_backward_body(
            grad_y, w, x, q, s, seed, ctx.x_shape, ctx.cfg, *needs, reuse=ctx.reuse, gw_dtype=ctx.gw_dtype,
            gx_dtype=ctx.gx_dtype))


def linear_eager(x: Tensor, weight: Tensor, bias: Optional[Tensor], seed, keep: int, cfg, reuse=None,
                 dt=None) -> Tensor:
    """The eager route of :func:`linear` with the seed as a 0-d int64 tensor on x's device, or 0 without stochastic
    rounding (the layers' entry point; not for torch.compile);
    reuse: :func:`reuse_of` the layer's parameter; dt: see :func:`linear`."""
    return _LinearFunction.apply(x, weight, bias, (seed, keep, cfg, reuse, dt))


def linear_ops(x: Tensor, weight: Tensor, bias: Optional[Tensor], seed: Tensor, keep: int, code: int,
               dt=None) -> Tensor:
    """The route of :func:`linear` under torch.compile (the torch.library ops hot::linear and hot::linear_backward,
    the configuration as its code); eager calls run it too."""
    return _LinearFunction.apply(x, weight, bias, (_seed_for(seed, x), keep, code, None, dt))


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], seed: Tensor, keep: int, config, dt=None) -> Tensor:
    """y = F.linear(x, weight, bias) with HOT's backward at ``config`` (a hot.Config): the torch.library ops under
    torch.compile, else the bodies directly (same results). keep is what the forward keeps (KEEP_COMPRESSED: the ABC
    buffer; KEEP_RAW: the raw x, for an exact g_w or one its producer keeps anyway; KEEP_NOTHING when no g_w is
    wanted). dt: autocast's dtype, to which the layer casts a weight (and an x) of another dtype itself, and then
    writes g_w (and g_x) in their own dtypes (:func:`_weight_in`), else None."""
    if torch.compiler.is_compiling():
        return linear_ops(x, weight, bias, seed, keep, config.code, dt)
    return _LinearFunction.apply(x, weight, bias, (_seed_for(seed, x), keep, config, None, dt))


# ------------------------------------------------------------------------------------------------
# conv2d
# ------------------------------------------------------------------------------------------------
def _conv_out(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _quantize_fmap(x: Tensor, amax: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """A conv input's int8 copy (SPEC §8): per-tensor round-to-nearest of the feature map in x's own layout (a
    channels-last x quantised as its (N*H*W) x C view, any other as the (N*C) x (H*W) matrix of x.contiguous(): no
    copy of x either way unless x is neither), returned as an (N, C, H, W) int8 tensor with those strides, and its
    scale. The backward needs the channels-last map; an NCHW one is transposed there, in int8. amax: x's, when known
    (:func:`note_amax`)."""
    N, C, H, W = x.shape
    if x.numel() == 0:  # an empty batch: an empty copy (hot.quantize refuses empty arrays)
        return x.new_zeros(x.shape, dtype=torch.int8), x.new_ones((1,), dtype=torch.float32)
    last = _channels_last(x)
    xc = x.permute(0, 2, 3, 1).reshape(N * H * W, C) if last else x.contiguous().reshape(N * C, H * W)
    q, scale = _api._quantize(_call("quantize", xc), xc, tuple(xc.shape), 8, "tensor", "nearest", amax=amax)
    return (q.view(N, H, W, C).permute(0, 3, 1, 2) if last else q.view(N, C, H, W)), scale


def pointwise(kernel, padding) -> bool:
    """Whether a conv is a GEMM over channels without im2col (SPEC §8): a 1 x 1 kernel without padding (any stride)."""
    return tuple(kernel) == (1, 1) and tuple(padding) == (0, 0)


def _transposable(t: Tensor) -> bool:
    """Whether the engine's transpose takes t: contiguous, not empty, of a float dtype or int8."""
    return t.numel() > 0 and t.is_contiguous() and t.dtype in (torch.float32, torch.float16, torch.bfloat16,
                                                                 torch.int8)


def _nchw_rows(t: Tensor) -> Tensor:
    """The channels-last rows (N*H*W) x C of an (N, C, H, W) t: a view where t's memory is in that order already, the
    engine's transpose of the (N, C, H*W) view of a contiguous t (one pass; torch's copy of the permuted view runs at a
    fraction of the bandwidth), else torch's copy."""
    N, C, H, W = t.shape
    r = t.permute(0, 2, 3, 1)
    if r.is_contiguous() or not _transposable(t):
        return r.reshape(N * H * W, C)
    t3 = t.reshape(N, C, H * W)
    return _api._transpose(_call("transpose", t3), t3).reshape(N * H * W, C)


def _rows_nchw(rows: Tensor, shape) -> Tensor:
    """The contiguous (N, C, H, W) map of its channels-last rows (N*H*W) x C, or of the same as an (N, H, W, C) tensor
    (the inverse of :func:`_nchw_rows`): a view where their memory is in that order already, else one transpose."""
    N, C, H, W = shape
    r = rows.reshape(N, H, W, C).permute(0, 3, 1, 2)
    if r.is_contiguous() or not _transposable(rows):
        return r.contiguous()
    r3 = rows.reshape(N, H * W, C)
    return _api._transpose(_call("transpose", r3), r3).view(N, C, H, W)


def _pixel_rows(t: Tensor, stride, patches: bool) -> Tensor:
    """The (N*Ho*Wo) x C row matrix of a pointwise conv's operand t (N, C, H, W): the pixels the kernel reads
    (every stride-th), rows in (n, ho, wo) order or in 4 x 4 patch order; a view for a channels-last t at stride 1
    without patches, the engine's transpose for a contiguous one, the engine's gather (a 1 x 1 im2col) for a strided
    channels-last one, else one copy."""
    N, C = t.shape[:2]
    if tuple(stride) == (1, 1) and not patches:
        return _nchw_rows(t)
    if tuple(stride) != (1, 1):
        if _channels_last(t) and t.dtype in ENGINE_FLOATS:
            return im2col(t, (1, 1), stride, (0, 0), (1, 1), patches)
        t = t[:, :, ::stride[0], ::stride[1]]
    r = t.permute(0, 2, 3, 1)
    if patches:
        r = _patch_split(r, 1)
    return r.reshape(-1, C)


def _pixel_unrows(rows: Tensor, x_shape, stride, Ho: int, Wo: int, patches: bool, last: bool = False) -> Tensor:
    """The adjoint of :func:`_pixel_rows`: rows (N*Ho*Wo) x C back onto (N, C, H, W), zero at the pixels a stride
    skips (at stride > 1 the engine's scatter, a 1 x 1 col2im: every pixel written once, its value or zero);
    channels-last (a view of the rows at stride 1) where ``last`` (the network's g_y is channels-last: its other ops'
    backward then sees the layout it runs in), else contiguous."""
    N, C, H, W = x_shape
    if tuple(stride) != (1, 1):
        out = col2im(rows, x_shape, (1, 1), stride, (0, 0), (1, 1), patches)
        return out if last else _rows_nchw(out.permute(0, 2, 3, 1), x_shape)
    if patches:
        r = rows.reshape(N, Ho // 4, Wo // 4, 4, 4, C).permute(0, 1, 3, 2, 4, 5).reshape(N, Ho, Wo, C)
    else:
        r = rows.reshape(N, Ho, Wo, C)
    r = r.permute(0, 3, 1, 2)
    if last:
        return r if r.is_contiguous(memory_format=torch.channels_last) else r.contiguous(
            memory_format=torch.channels_last)
    return _rows_nchw(r.permute(0, 2, 3, 1), x_shape)


def _conv_keep(x: Tensor, weight: Tensor, stride, padding, dilation, cfg) -> Tuple[Tensor, Tensor]:
    """What a converted conv keeps of x (SPEC §8): a pointwise conv keeps the codes of its pixel rows, transposed, at
    the default (``_api.gw_from_codes``; below it, their ABC buffer, as a linear layer over channels), any other the
    int8 feature map. Where x's amax is known (a ReLU's output, :func:`note_amax`), the map and the codes of a stride-1
    pointwise conv's rows (all of x's elements) take it instead of a pass over x."""
    amax = _known_amax(x)
    if pointwise(weight.shape[2:], padding):
        Ho = _conv_out(x.shape[2], 1, stride[0], 0, 1)
        Wo = _conv_out(x.shape[3], 1, stride[1], 0, 1)
        return _compress(_pixel_rows(x, stride, conv_patch_rows(Ho, Wo, cfg)), cfg, _api.gw_from_codes(cfg),
                         amax if tuple(stride) == (1, 1) else None)
    return _quantize_fmap(x, amax)


def _conv2d_forward(x, weight, bias, stride, padding, dilation, keep, cfg):
    y = F.conv2d(x, weight, bias, stride, padding, dilation)
    if keep == KEEP_COMPRESSED:
        q, s = _conv_keep(x, weight, stride, padding, dilation, cfg)
        return y, q, s
    return y, _empty(x, torch.int8), _empty(x, torch.float32)


def _conv2d_fake(x, weight, bias, seed, stride, padding, dilation, keep, config):
    N, _, H, W = x.shape
    O, _, kh, kw = weight.shape
    Ho = _conv_out(H, kh, stride[0], padding[0], dilation[0])
    Wo = _conv_out(W, kw, stride[1], padding[1], dilation[1])
    y = F.conv2d(x, weight, bias, stride, padding, dilation)  # torch's own output layout (channels-last for such x)
    if keep == KEEP_COMPRESSED:
        if pointwise((kh, kw), padding):  # the codes or ABC buffer of the N*Ho*Wo pixel rows (the same shape)
            q_shape = (x.shape[1], padded_k(N * Ho * Wo, config_of(config).rank))
            q = x.new_empty(q_shape, dtype=torch.int8)
        else:  # the int8 feature map, (N, C, H, W) in x's layout (channels-last or contiguous)
            q = torch.empty_like(x, dtype=torch.int8, memory_format=torch.channels_last if _channels_last(x) else
                                 torch.contiguous_format)
        return y, q, x.new_empty((1,), dtype=torch.float32)
    return y, x.new_empty((0,), dtype=torch.int8), x.new_empty((0,), dtype=torch.float32)


conv2d_op = define_op(
    "conv2d(Tensor x, Tensor weight, Tensor? bias, Tensor seed, SymInt[] stride, SymInt[] padding, SymInt[] dilation, "
    "int keep, int config) -> (Tensor, Tensor, Tensor)",
    lambda x, weight, bias, seed, stride, padding, dilation, keep, config: _conv2d_forward(
        x, weight, bias, stride, padding, dilation, keep, config_of(config)), _conv2d_fake)


def _patch_split(t: Tensor, dim: int) -> Tensor:
    """t with dims dim (Ho) and dim + 1 (Wo) split into (Ho / 4, 4) and (Wo / 4, 4) and ordered (Ho / 4, Wo / 4, 4, 4):
    the rows of each 4 x 4 spatial patch become consecutive (a view)."""
    t = t.unflatten(dim + 1, (t.shape[dim + 1] // 4, 4)).unflatten(dim, (t.shape[dim] // 4, 4))
    order = list(range(t.dim()))
    order[dim + 1], order[dim + 2] = order[dim + 2], order[dim + 1]
    return t.permute(order)


def conv_patch_rows(Ho: int, Wo: int, config) -> bool:
    """Whether a converted conv's backward takes the rows of g_y and of the im2col matrix in 4 x 4 spatial patch
    order (SPEC §8): when the HLA projection drops rows (rank < 16) and the output map tiles into 4 x 4 patches."""
    return not config.exact and config.rank < 16 and Ho % 4 == 0 and Wo % 4 == 0


def im2col(x: Tensor, kernel, stride, padding, dilation, patches: bool = False) -> Tensor:
    """The im2col matrix of a conv2d input x (N, C, H, W): (N*Ho*Wo) x (kh*kw*C), row-major, rows in (n, ho, wo)
    order and columns in (i, j, c) order (SPEC §8: each kernel offset's channels contiguous; the weight as
    (O, kh, kw, C)), by the engine (``hot.im2col``: one copy pass, the padding's zeros written by it) from x's
    channels-last map: a view for a channels-last x, else one copy first. patches: rows in 4 x 4 patch order instead,
    (n, ho // 4, wo // 4, ho % 4, wo % 4) (Ho and Wo multiples of 4)."""
    N, C, H, W = x.shape
    (kh, kw), (ph, pw) = kernel, padding
    Ho = _conv_out(H, kh, stride[0], ph, dilation[0])
    Wo = _conv_out(W, kw, stride[1], pw, dilation[1])
    if patches and (Ho % 4 or Wo % 4):
        raise ValueError(f"im2col: patch order needs an output map whose sides are multiples of 4, got {Ho} x {Wo}")
    if x.numel() == 0 or Ho <= 0 or Wo <= 0:  # the engine refuses empty arrays: no columns or no values in them
        return x.new_zeros((max(N * Ho * Wo, 0), kh * kw * C))
    xh = x.detach().permute(0, 2, 3, 1)  # (N, H, W, C)
    if not xh.is_contiguous():
        xh = xh.contiguous()
    return _api._im2col(_call("im2col", xh), xh, (N, C, H, W), tuple(kernel), tuple(stride), tuple(padding),
                        tuple(dilation), patches)


def conv_weight_cols(weight: Tensor) -> Tensor:
    """A conv weight (O, C, kh, kw) as the (O, kh*kw*C) matrix of :func:`im2col`'s column order."""
    return weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1).contiguous()


def conv_weight_from_cols(gw: Tensor, shape) -> Tensor:
    """The inverse of :func:`conv_weight_cols`: an (O, kh*kw*C) matrix as an (O, C, kh, kw) tensor."""
    O, C, kh, kw = shape
    return gw.reshape(O, kh, kw, C).permute(0, 3, 1, 2).contiguous()


def col2im(cols: Tensor, x_shape, kernel, stride, padding, dilation, patches: bool = False) -> Tensor:
    """The adjoint of :func:`im2col`: the (N*Ho*Wo) x (kh*kw*C) matrix summed back onto an (N, C, H, W)
    tensor, channels-last in memory, by the engine (``hot.col2im``: each pixel's contributions in float32,
    kernel-offset order, rounded once; one gather pass on the GPU). patches: cols' rows are in :func:`im2col`'s patch
    order."""
    N, C, H, W = x_shape
    if cols.numel() == 0 or N * C * H * W == 0:  # the engine refuses empty arrays: nothing to sum
        return cols.new_zeros((N, C, H, W))
    if not cols.is_contiguous():
        cols = cols.contiguous()
    return _api._col2im(_call("col2im", cols), cols, (N, C, H, W), tuple(kernel), tuple(stride), tuple(padding),
                        tuple(dilation), patches)


def _channels_last(t: Tensor) -> bool:
    """Whether t (N, C, H, W) is laid out channels-last and not also contiguous (C == 1 or H == W == 1 are both)."""
    return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _conv2d_backward_body(grad_y, weight, x, q, scale, seed, x_shape, stride, padding, dilation, cfg, need_gx,
                          need_gw, need_gb, reuse=None, gw_dtype=None, gy_amax=None):
    """hot's conv backward for the layer; (g_x, g_w, g_b) with None for what was not requested; g_w in gw_dtype (a
    torch dtype) when given, else in grad_y's (as :func:`_linear_backward_body`); gy_amax: G~'s amax of grad_y when
    handed over (:func:`handed_amax`)."""
    N, C, H, W = x_shape
    O, _, kh, kw = weight.shape
    Ho, Wo = grad_y.shape[2], grad_y.shape[3]
    P = Ho * Wo
    CKK = C * kh * kw
    # rows (n, ho, wo), or in 4 x 4 patch order for the projection (a common row order leaves g_y^T X unchanged)
    patches = conv_patch_rows(Ho, Wo, cfg)
    g = _pixel_rows(grad_y, (1, 1), patches).contiguous()
    if pointwise((kh, kw), padding):  # a linear layer over the pixels the kernel reads: no columns, no feature map
        rows = None
        codes = need_gw and _api.gw_from_codes(cfg)  # g_w from the codes of G~ and of the pixel rows (SPEC §4)
        if need_gw and x is not None:  # the raw x (exact mode, or kept by its producer: compressed by the core now)
            rows = _pixel_rows(x, stride, patches).contiguous()
            if codes:  # the codes the forward would have kept, formed now (deterministic)
                (q, scale), rows = _compress(rows, cfg, True), None
        grows, gw, gb = _backward_linear(g, weight.reshape(O, C).contiguous(), rows, q, scale, seed, cfg, need_gx,
                                         need_gw, need_gb, (N * P, C), reuse,
                                         "float32" if codes else _dtype_name(gw_dtype), codes=codes, gy_amax=gy_amax)
        gx = _pixel_unrows(grows, x_shape, stride, Ho, Wo, patches, _channels_last(grad_y)) if need_gx else None
        if gw is not None:  # float32 from the codes (transformed along O in place), rounded once to its dtype
            gw = gw.reshape(weight.shape)
            if codes:
                gw = gw.to(gw_dtype or grad_y.dtype)
        return gx, gw, gb
    cols = cq = cs = None
    map_scale = None  # the int8 map's scale, when g_w comes from the ABC buffer of the columns of its integers
    codes = False  # g_w from the codes of G~ and of the map's columns (SPEC §4), the map's scale applied by the engine
    if need_gw and min(N * P, O, CKK) > 0:  # else _backward_linear gives the zero g_w of empty operands
        if x is not None and not cfg.exact:  # kept as it is because its producer keeps it: the same int8 feature
            q, scale = _quantize_fmap(x)     # map the forward would have kept, formed now (deterministic)
            x = None
        if x is not None:  # exact: the raw columns
            cols = im2col(x, (kh, kw), stride, padding, dilation, patches)  # N*P x CKK, columns (i, j, c)
        else:
            qh = _nchw_rows(q.detach()).view(N, H, W, C)  # the channels-last map: a view, or NCHW transposed in int8
            if _api.gw_from_codes(cfg):  # the columns' codes transposed, the g_w GEMM's K-major operand (SPEC §8)
                cq = _api._im2col_t(_call("im2col_t", qh), qh, (N, C, H, W), (kh, kw), tuple(stride), tuple(padding),
                                    tuple(dilation), patches)
                cs, codes = scale.detach(), True
            else:  # the ABC buffer of the columns X = im2col(Q) of the map's integers, formed without X by the
                # engine; g_w = scale * (g_y^T X) is scaled after the GEMM, in float32 (SPEC §8)
                cq, cs = _api._compress_columns(_call("compress_columns", qh), qh, (N, C, H, W), (kh, kw),
                                                tuple(stride), tuple(padding), tuple(dilation), patches, cfg.rank)
                map_scale = scale.detach()
    engine_gw = "float32" if map_scale is not None or codes else _dtype_name(gw_dtype)
    gx = None
    if cfg.exact or min(N * P, O, CKK) == 0:  # the exact backward (or empty operands): the columns' GEMMs, col2im
        gcols, gw, gb = _backward_linear(g, conv_weight_cols(weight), cols, cq, cs, seed, cfg, need_gx, need_gw,
                                         need_gb, (N * P, CKK), reuse, engine_gw)
        if need_gx:
            gx = col2im(gcols, (N, C, H, W), (kh, kw), stride, padding, dilation, patches)
    else:  # the engine's conv backward: g_x as the transposed convolution of G~'s codes where it can (SPEC §8)
        gxr, gw, gb = _backward_conv2d(g, conv_weight_cols(weight), cq, cs, seed, cfg, (N, C, H, W), (kh, kw), stride,
                                       padding, dilation, patches, need_gx, need_gw, need_gb, reuse, engine_gw, codes,
                                       gy_amax)
        if need_gx:
            gx = gxr.view(N, H, W, C).permute(0, 3, 1, 2)
    if need_gx and not _channels_last(grad_y):  # the engine's map is channels-last: kept so for a channels-last
        gx = _rows_nchw(gx.permute(0, 2, 3, 1), (N, C, H, W))  # network (its g_y is), else NCHW
    if gw is not None:
        if map_scale is not None or codes:  # float32 g_w (times the map's scale s unless the engine applied it),
            # rounded once to its dtype, in the weight's layout
            out = torch.empty(weight.shape, dtype=gw_dtype or grad_y.dtype, device=gw.device)
            if codes:
                out.copy_(gw.view(O, kh, kw, C).permute(0, 3, 1, 2))
            else:
                torch.mul(gw.view(O, kh, kw, C).permute(0, 3, 1, 2), map_scale, out=out)
            gw = out
        else:
            gw = conv_weight_from_cols(gw, weight.shape)
    return gx, gw, gb


def _conv2d_backward_op(grad_y, weight, x, q, scale, seed, x_shape, stride, padding, dilation, config, need_gx,
                        need_gw, need_gb, gw_dtype=None):
    gx, gw, gb = _conv2d_backward_body(grad_y, weight, x, q, scale, _seed_for(seed, grad_y), x_shape, stride, padding,
                                       dilation, config_of(config), need_gx, need_gw, need_gb, None, gw_dtype)
    return _or_empty(gx, grad_y), _or_empty(gw, grad_y), _or_empty(gb, grad_y)


def _conv2d_backward_fake(grad_y, weight, x, q, scale, seed, x_shape, stride, padding, dilation, config, need_gx,
                          need_gw, need_gb, gw_dtype=None):
    # g_x is channels-last where g_y is (the body keeps the engine's channels-last map then), else contiguous
    fmt = torch.channels_last if _channels_last(grad_y) else torch.contiguous_format
    gx = torch.empty(x_shape, dtype=grad_y.dtype, device=grad_y.device, memory_format=fmt) if need_gx else \
        grad_y.new_empty((0,))
    gw = grad_y.new_empty(weight.shape, dtype=gw_dtype or grad_y.dtype) if need_gw else grad_y.new_empty((0,))
    gb = grad_y.new_empty((weight.shape[0],)) if need_gb else grad_y.new_empty((0,))
    return gx, gw, gb


conv2d_backward_op = define_op(
    "conv2d_backward(Tensor grad_y, Tensor weight, Tensor? x, Tensor q, Tensor scale, Tensor seed, SymInt[] x_shape, "
    "SymInt[] stride, SymInt[] padding, SymInt[] dilation, int config, bool need_gx, bool need_gw, bool need_gb, "
    "ScalarType? gw_dtype=None) -> (Tensor, Tensor, Tensor)",
    _conv2d_backward_op, _conv2d_backward_fake)


class _Conv2dFunction(torch.autograd.Function):
    """:func:`conv2d` for autograd, by the two routes of :class:`_LinearFunction`: ``args`` = (seed, stride, padding,
    dilation, keep, cfg, reuse), cfg a hot.Config (eager: the bodies directly) or the configuration's code (under
    torch.compile: hot::conv2d and hot::conv2d_backward, :func:`conv2d_ops`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, args):
        seed, stride, padding, dilation, keep, cfg, reuse, dt = args
        w = _weight_in(ctx, weight, dt)
        if isinstance(cfg, int):
            y, q, scale = conv2d_op(x, w, bias, seed, stride, padding, dilation, keep, cfg)
        else:
            y = F.conv2d(x, w, bias, stride, padding, dilation)
            q, scale = _conv_keep(x, w, stride, padding, dilation, cfg) if keep == KEEP_COMPRESSED else (None, None)
        _save(ctx, x, w, bias, q, scale, seed, keep, cfg)
        ctx.geom = (stride, padding, dilation)
        ctx.reuse = reuse
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if isinstance(ctx.cfg, int):
            return _layer_backward(ctx, grad_y, 1, "Conv2d", lambda x, w, q, s, seed, *needs: conv2d_backward_op(
                grad_y, w, x, q, s, seed, ctx.x_shape, *ctx.geom, ctx.cfg, *needs, ctx.gw_dtype))
        amax = handed_amax(ctx, grad_y)
        return _layer_backward(ctx, grad_y, 1, "Conv2d", lambda x, w, q, s, seed, *needs: _conv2d_backward_body(
            grad_y, w, x, q, s, seed, ctx.x_shape, *ctx.geom, ctx.cfg, *needs, reuse=ctx.reuse,
            gw_dtype=ctx.gw_dtype, gy_amax=amax))


def conv_node(y: Tensor):
    """The backward node of the converted convolution (eager route) whose output y is, else None: a converted
    BatchNorm2d after it hands it G~'s amax of the gradient it gives it (:func:`hand_amax`)."""
    node = y.grad_fn
    return node if isinstance(node, _Conv2dFunction._backward_cls) and not isinstance(node.cfg, int) else None


def hand_amax(node, g: Tensor, amax: Tensor) -> None:
    """Records, on a converted convolution's backward node (:func:`conv_node`), G~'s amax (float32 (1,), as the
    engine's batch_norm_backward_input gives it) of g, the gradient of its output about to be passed to it."""
    node.grad_amax = (g, g._version, amax)


def handed_amax(ctx, grad_y: Tensor) -> Optional[Tensor]:
    """The amax handed to this backward node for grad_y (:func:`hand_amax`), taken once: only if grad_y is that very
    tensor, unchanged (autograd passes it on as it is unless it sums it with another gradient of the output), else
    None."""
    handed = getattr(ctx, "grad_amax", None)
    if handed is None:
        return None
    ctx.grad_amax = None
    g, version, amax = handed
    return amax if g is grad_y and grad_y._version == version else None


def conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor], seed, stride: List[int], padding: List[int],
           dilation: List[int], keep: int, config, reuse=None, dt=None) -> Tensor:
    """y = F.conv2d(...) with HOT's backward at ``config`` (a hot.Config): the torch.library ops under torch.compile,
    else the bodies directly (reuse: :func:`reuse_of` the layer's parameter; dt as in :func:`linear`). seed: a 0-d
    int64 tensor (an int in eager mode, 0 without stochastic rounding)."""
    if torch.compiler.is_compiling():
        return conv2d_ops(x, weight, bias, seed, stride, padding, dilation, keep, config.code, dt)
    return conv2d_eager(x, weight, bias, _seed_for(seed, x), list(stride), list(padding), list(dilation), keep,
                        config, reuse, dt)


def conv2d_ops(x: Tensor, weight: Tensor, bias: Optional[Tensor], seed: Tensor, stride: List[int], padding: List[int],
               dilation: List[int], keep: int, code: int, dt=None) -> Tensor:
    """The route of :func:`conv2d` under torch.compile (the torch.library ops hot::conv2d and hot::conv2d_backward, the
    configuration as its code); eager calls run it too."""
    return _Conv2dFunction.apply(x, weight, bias, (_seed_for(seed, x), list(stride), list(padding), list(dilation),
                                                   keep, code, None, dt))


def conv2d_eager(x: Tensor, weight: Tensor, bias: Optional[Tensor], seed, stride: List[int], padding: List[int],
                 dilation: List[int], keep: int, cfg, reuse=None, dt=None) -> Tensor:
    """The eager route of :func:`conv2d` with the seed as a 0-d int64 tensor on x's device, or 0 without stochastic
    rounding, and stride, padding, dilation as [h, w] lists (the layers' entry point; not for torch.compile)."""
    return _Conv2dFunction.apply(x, weight, bias, (seed, stride, padding, dilation, keep, cfg, reuse, dt))
