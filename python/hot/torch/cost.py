"""``hot.torch.cost``: what converting a model to HOT costs and saves, per layer (docs/cost.md).

For every HOT layer of a model, and for one traced forward pass of a real input, against the exact
(``nn.Linear`` / ``nn.Conv2d``) backward:

(a) bytes kept for the backward pass (analytic, and as the forward's saved-tensor hooks measured them);
(b) backward operations by precision: float FLOPs of the exact GEMMs, int8 and int4 OPs of the integer GEMMs,
    and the transform / quantisation / dequantisation overhead, each term named (docs/cost.md says what each
    counts), and BOPs as the paper's GBOPs count them (operations x bits x bits);
(c) on a CUDA device, the measured backward time of each distinct layer shape, HOT against torch's exact
    backward (cuBLAS / cuDNN), and a verdict per layer.

    import hot.torch.cost as cost
    rep = cost.report(model, x)                # or config="paper", or a hot.Config
    print(rep.render("markdown")); rep.plot("cost.png")

``hot.torch.summary(model, x, cost=True)`` and ``hot summary MODEL`` print the same report.
"""
from __future__ import annotations

import contextlib
import csv
import io
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

import hot
from hot import _api

from . import ops
from .convert import hot_layers
from .layers import Linear, TransposedLinear, as_2d, conv_geom
from .lean import ReLU

#: Hadamard block of the HLA projection (SPEC §4): 16 rows.
HLA_BLOCK = 16


# ------------------------------------------------------------------------------------------------
# operation counts (docs/cost.md)
# ------------------------------------------------------------------------------------------------
gx_block = hot._api._hq_block  # the g_x path's Hadamard block b of O output features (SPEC §3)


def padded_rows(L: int) -> int:
    """L rounded up to a multiple of 16 (the HLA blocks, SPEC §4)."""
    return (L + 15) // 16 * 16


@dataclass
class OpCount:
    """Backward operations of one layer call. GEMM operations count 2 per multiply-accumulate (a multiply and an
    add), as FLOPs do; ``macs_*`` are the multiply-accumulates themselves, which the paper's BOPs count.
    ``overhead``: named element-wise terms (transforms, quantisation, dequantisation, col2im), run in fp32."""

    fp: int = 0  # FLOPs of the float GEMMs (exact paths), in the layer's dtype
    int8: int = 0  # OPs of the s8 x s8 GEMMs
    int4: int = 0  # OPs of the s4 x s4 GEMMs (on Hopper and the CPU they run through the s8 GEMM, same values)
    overhead: Dict[str, int] = field(default_factory=dict)
    fp_bits: int = 32  # bits of the float GEMM operands (32 fp32, 16 bf16 / fp16)

    @property
    def overhead_total(self) -> int:
        return sum(self.overhead.values())

    @property
    def total(self) -> int:
        return self.fp + self.int8 + self.int4 + self.overhead_total

    fp_bits_sum: Optional[int] = None  # float GEMM BOPs of a sum of calls of different dtypes

    @property
    def fp_bops(self) -> int:
        return self.fp_bits_sum if self.fp_bits_sum is not None else (self.fp // 2) * self.fp_bits ** 2

    @property
    def bops(self) -> int:
        """Bit operations as the paper's GBOPs count them: multiply-accumulates of each GEMM x bits_a x bits_b (float
        GEMMs at the layer's width, int8 at 8 x 8, int4 at 4 x 4), plus each overhead operation at 32 x 32 bits."""
        return self.fp_bops + (self.int8 // 2) * 64 + (self.int4 // 2) * 16 + self.overhead_total * 32 * 32

    def __add__(self, other: "OpCount") -> "OpCount":
        ov = dict(self.overhead)
        for k, v in other.overhead.items():
            ov[k] = ov.get(k, 0) + v
        return OpCount(self.fp + other.fp, self.int8 + other.int8, self.int4 + other.int4, ov,
                       max(self.fp_bits, other.fp_bits), self.fp_bops + other.fp_bops)


def exact_ops(L: int, I: int, O: int, need_gx: bool = True, need_gw: bool = True, fp_bits: int = 32) -> OpCount:
    """The exact backward of y = x W^T (x: L x I, W: O x I): g_x = g_y W and g_w = g_y^T x, 2·L·O·I FLOPs each, so
    4·L·I·O for both (the supplement's vanilla count). g_b (L·O adds) is the same for exact and HOT and not counted."""
    return OpCount(fp=2 * L * O * I * (int(need_gx) + int(need_gw)), fp_bits=fp_bits)


def hot_ops(L: int, I: int, O: int, config, need_gx: bool = True, need_gw: bool = True, fp_bits: int = 32,
            fmap: Optional[int] = None, col2im: bool = False) -> OpCount:
    """HOT's backward of y = x W^T at ``config`` (SPEC §3, §4), as this project runs it.

    g_x path (HQ, block b = :func:`gx_block` (O)): FWHT of g_y's rows (L·O·log2 b add/subtract), of W's row groups
    (O·I·log2 b), quantisation of G~ (L·O) and W~ (O·I), the s{gx_bits} GEMM L x O x I (2·L·O·I OPs), the
    dequantising epilogue (L·I).
    g_w path (HLA, rank r; L padded to L_pad, a multiple of 16; K = ``ops.padded_k(L, r)`` rows kept): the 16-point
    FWHT of every 16-row block of g_y and of x, keeping r rows (L_pad·O·4 and L_pad·I·4), quantisation of G^ (K·O)
    and X^ (K·I; in the forward pass, the ABC buffer), the s8 GEMM O x K x I (2·K·O·I OPs), dequantisation (O·I).
    A convolution other than a pointwise one keeps an int8 feature map of ``fmap`` elements: quantised in the forward
    (fmap); its columns hold the map's integers, so g_w is multiplied by the map's scale (O·I); ``col2im``: its g_x
    columns are summed back onto the map (L·I adds). At the default (rank 16, 8-bit per-tensor g_x: SPEC §4 "g_w from
    G~'s codes") such a convolution's g_w is instead the s8 GEMM O x K x I (K = L_pad) of G~'s codes (formed for g_w
    alone where no g_x is wanted) and the map's columns as they are, dequantised with the map's scale (O·I) and
    transformed along O (O·I·log2 b): no HLA and no second quantisation. A pointwise conv at the default does the same
    with the codes of its pixel rows (``fmap`` = L·I, quantised in the forward: ``hot.activation_codes``).
    ``config.exact``: :func:`exact_ops`."""
    if config.exact:
        return exact_ops(L, I, O, need_gx, need_gw, fp_bits)
    c = OpCount(fp_bits=fp_bits)
    ov = c.overhead
    if need_gx:
        lg = int(math.log2(gx_block(O)))
        ov["gx: H(g_y)"] = L * O * lg
        ov["gx: H(W)"] = O * I * lg
        ov["gx: Q(g_y)"] = L * O
        ov["gx: Q(W)"] = O * I
        ov["gx: dequant"] = L * I
        if col2im:
            ov["gx: col2im"] = L * I
        if config.gx_bits == 4:
            c.int4 += 2 * L * O * I
        else:
            c.int8 += 2 * L * O * I
    if need_gw and fmap is not None and _api.gw_from_codes(config):
        lg = int(math.log2(gx_block(O)))
        if not need_gx:  # G~ formed for g_w alone
            ov["gw: H(g_y)"] = L * O * lg
            ov["gw: Q(g_y)"] = L * O
        ov["gw: Q(fmap)"] = fmap
        ov["gw: dequant"] = O * I  # the map's scale included
        ov["gw: H(g_w)"] = O * I * lg
        c.int8 += 2 * ops.padded_k(L, 16) * O * I
    elif need_gw:
        Lp, K = padded_rows(L), ops.padded_k(L, config.rank)
        lg = int(math.log2(HLA_BLOCK))
        ov["gw: HLA(g_y)"] = Lp * O * lg
        ov["gw: HLA(x)"] = Lp * I * lg
        ov["gw: Q(g_y)"] = K * O
        ov["gw: Q(x)"] = K * I
        ov["gw: dequant"] = O * I
        if fmap is not None:
            ov["gw: Q(fmap)"] = fmap
            ov["gw: scale g_w"] = O * I  # the columns hold the map's integers: g_w times its scale (SPEC §8)
        c.int8 += 2 * K * O * I
    return c


def paper_bops(L: int, O: int, I: int, r: int = 8, n: int = 16, frozen: bool = False, scheme: str = "HLQ") -> float:
    """The BOPs the paper's released analysis (``utils/analysis_calculator.py``, ``BOPsCounter``) gives for one layer,
    for comparison: ``scheme="FP"``: 2·L·O·I MACs at 32 x 32 bits; ``"HLQ"`` (HOT): L·O·log2 n + O·I·log2 n + L·O + O·I
    (g_x transforms and quantisers) + L·I·log2 n + L·O·log2 n + O·(r/n)·L + I·(r/n)·O (g_w projections and
    quantisers; its last term has O where the quantised X^ has L) + I·O + L·I (dequantisation), all at 32 x 32 bits,
    plus the GEMMs O·(r/n)·L·I at 8 x 8 and L·O·I at 4 x 4. L is unpadded (and, in that code, per sample); a frozen
    layer (LoRA base) has the g_x terms only."""
    if scheme == "FP":
        return L * O * I * 1024 * 2
    lg = math.log2(n)
    if frozen:
        return (L * O * lg + O * I * lg + L * O + O * I + L * I) * 1024 + L * O * I * 16
    return ((L * O * lg + O * I * lg + L * O + O * I
             + L * I * lg + L * O * lg + O * (r / n) * L + I * (r / n) * O
             + I * O + L * I) * 1024 + O * (r / n) * L * I * 64 + L * O * I * 16)


# ------------------------------------------------------------------------------------------------
# tracing one forward pass
# ------------------------------------------------------------------------------------------------
@dataclass
class Call:
    """One call of a HOT layer in the traced forward."""

    kind: str  # "Linear" or "Conv2d"
    L: int
    I: int
    O: int
    need_gx: bool
    need_gw: bool
    dtype: torch.dtype
    x_shape: Tuple[int, ...]
    shared: bool = False  # kept its input itself, which its producer keeps anyway (SPEC §2)
    pointwise: bool = False
    fmap: Optional[int] = None  # elements of a non-pointwise conv's input feature map
    geom: Optional[Tuple] = None  # conv: (kernel, stride, padding, dilation)
    bias: bool = False
    measured: int = 0  # bytes its saved tensors add (saved-tensor hooks; parameters, producers' tensors excluded)
    w_cast: int = 0  # bytes of the weight's autocast copy (a new tensor, kept for backward), 0 without a cast

    @property
    def fp_bits(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size() * 8

    def key(self, config) -> Tuple:
        return (self.kind, self.L, self.I, self.O, self.x_shape, self.geom, self.dtype, self.need_gx, self.need_gw,
                self.bias, config)


def _pointwise(m: nn.Module) -> bool:
    f = getattr(ops, "pointwise", None)  # a pointwise conv keeps the codes or ABC buffer of its pixel rows (SPEC §8)
    k, _, p, _ = conv_geom(m)
    return bool(f is not None and f(k, p))


def _call_of(m: nn.Module, x: torch.Tensor) -> Optional[Call]:
    dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    need_gx = bool(x.requires_grad and torch.is_grad_enabled())
    need_gw = bool(m.weight.requires_grad and torch.is_grad_enabled())
    bias = m.bias is not None
    w_cast = m.weight.numel() * torch.empty((), dtype=dt).element_size() if dt != m.weight.dtype else 0
    if isinstance(m, (Linear, TransposedLinear)):
        I = m.in_features
        return Call("Linear", int(x.numel() // max(I, 1)), I, m.out_features, need_gx, need_gw, dt, tuple(x.shape),
                    bias=bias, w_cast=w_cast)
    xs = as_2d(m, x)  # a Conv1d as the 2-D convolution it runs as
    xs = xs if xs.dim() == 4 else xs.unsqueeze(0)
    N, C, H, W = xs.shape
    k, st, pad, dil = conv_geom(m)
    ho = ops._conv_out(H, k[0], st[0], pad[0], dil[0])
    wo = ops._conv_out(W, k[1], st[1], pad[1], dil[1])
    pw = _pointwise(m)
    return Call("Conv2d", N * ho * wo, C * k[0] * k[1], m.out_channels, need_gx, need_gw, dt,
                tuple(xs.shape), pointwise=pw, fmap=None if pw else N * C * H * W,
                geom=(k, st, pad, dil), bias=bias, w_cast=w_cast)


def trace(model: nn.Module, input: Any) -> Tuple[List[Tuple[str, nn.Module, List[Call]]], int]:
    """Run ``model`` once on ``input`` with gradients enabled (a training step's forward; no backward) and record every
    call of its HOT layers: [(name, layer, [Call, ...])], and the bytes all saved tensors of the forward hold
    (distinct tensors, parameters excluded). Each Call's ``measured``: the bytes of the tensors the layer's own
    forward saved for backward that are not parameters and that no op outside the layer saved as well."""
    layers = [(name or "<root>", m) for name, m in hot_layers(model)]
    calls: Dict[int, List[Call]] = {id(m): [] for _, m in layers}
    params = {p.data_ptr() for p in model.parameters()}
    current: List[Optional[int]] = [None]
    saved: List[Tuple[Optional[int], int, Tuple, int]] = []  # (layer id, call index, key, bytes)

    def pack(t):
        if t.data_ptr() not in params:
            mid = current[0]
            idx = len(calls[mid]) - 1 if mid is not None else -1
            saved.append((mid, idx, (t.data_ptr(), t.numel(), t.dtype), t.numel() * t.element_size()))
        return t

    def pre(m, args):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor):
            calls[id(m)].append(_call_of(m, x))
        current[0] = id(m)

    def post(m, args, out):
        if calls[id(m)]:
            calls[id(m)][-1].shared = bool(getattr(m, "_hot_keeps_input", False))
        current[0] = None

    handles = []
    for _, m in layers:
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _run(model, input)
    finally:
        for h in handles:
            h.remove()
    outside = {k for mid, _, k, _ in saved if mid is None}
    seen_keys = set()
    total = 0
    for mid, idx, k, nb in saved:
        if k not in seen_keys:
            seen_keys.add(k)
            total += nb
    counted = set()
    for mid, idx, k, nb in saved:
        if mid is None or k in outside or (mid, idx, k) in counted or idx < 0:
            continue
        counted.add((mid, idx, k))
        calls[mid][idx].measured += nb
    return [(name, m, calls[id(m)]) for name, m in layers], total


def _run(model: nn.Module, input: Any):
    if isinstance(input, (tuple, list)):
        return model(*input)
    if isinstance(input, dict):
        return model(**input)
    return model(input)


def _x_elems(call: Call) -> int:
    n = 1
    for s in call.x_shape:
        n *= s
    return n


def _x_bytes(call: Call) -> int:
    """Bytes of the layer's input in the dtype it computes in."""
    return _x_elems(call) * torch.empty((), dtype=call.dtype).element_size()


def kept_bytes(call: Call, config) -> Tuple[int, int]:
    """(HOT, exact) bytes kept for backward by one call at ``config`` (SPEC §2, §8): nothing for a frozen weight; the
    input for exact; the ABC buffer (int8, ``I x padded_k(L, r)``, plus a 4-byte scale) for a linear layer or a
    pointwise conv (its pixel rows, I = C_in; at the default their codes, the same bytes); the int8 input feature map
    plus its scale for any other conv; nothing beyond its producer's tensor when its input is kept by its producer
    anyway. Under autocast both also keep the weight's cast copy: an exact Linear when its input needs a gradient, an
    exact conv and a HOT layer always."""
    if not call.need_gw:  # a frozen weight: only the weight's cast copy under autocast, for g_x
        return (call.w_cast, call.w_cast) if call.need_gx else (0, 0)
    exact = _x_bytes(call)
    wc_hot = call.w_cast
    wc_exact = call.w_cast if (call.kind != "Linear" or call.need_gx) else 0
    if config.exact:
        return exact + wc_exact, exact + wc_exact
    if call.shared:
        return wc_hot, exact + wc_exact
    if call.kind == "Linear" or call.pointwise:
        return call.I * ops.padded_k(call.L, config.rank) + 4 + wc_hot, exact + wc_exact
    return _x_elems(call) + 4 + wc_hot, exact + wc_exact


def ops_of(call: Call, config) -> Tuple[OpCount, OpCount]:
    """(HOT, exact) backward operations of one call at ``config``."""
    ex = exact_ops(call.L, call.I, call.O, call.need_gx, call.need_gw, call.fp_bits)
    fmap = call.fmap
    if call.pointwise and _api.gw_from_codes(config):  # the codes of its pixel rows (SPEC §2 "codes", §4)
        fmap = call.L * call.I
    ho = hot_ops(call.L, call.I, call.O, config, call.need_gx, call.need_gw, call.fp_bits,
                 fmap=fmap, col2im=call.kind == "Conv2d" and not call.pointwise and not _gx_direct(call, config))
    return ho, ex


def _gx_direct(call: Call, config) -> bool:
    """Whether a k x k conv's g_x is the transposed convolution of G~'s codes (SPEC §8: stride 1, raster rows,
    per-tensor g_x scale, padding <= dilation * (k - 1)), which sums no columns back (no col2im)."""
    if call.geom is None:
        return False
    kernel, stride, padding, dilation = call.geom
    H, W = call.x_shape[-2], call.x_shape[-1]
    Ho = ops._conv_out(H, kernel[0], stride[0], padding[0], dilation[0])
    Wo = ops._conv_out(W, kernel[1], stride[1], padding[1], dilation[1])
    return (tuple(stride) == (1, 1) and not ops.conv_patch_rows(Ho, Wo, config) and config.gx_scale == "tensor"
            and all(p <= d * (k - 1) for p, d, k in zip(padding, dilation, kernel)))


# ------------------------------------------------------------------------------------------------
# GPU timing
# ------------------------------------------------------------------------------------------------
_SLEEP_CYCLES = 4_000_000  # ~2-3 ms at a GPU's clock: longer than the host needs to enqueue one layer's backward


def _bench_pair(call: Call, config, device, iters: int = 10,
                warmup: int = 3) -> Tuple[Tuple[float, float], Tuple[float, float]]:
    """((HOT forward, HOT backward), (exact forward, exact backward)): median times in ms of one layer of ``call``'s
    shape on ``device``, each between CUDA events of its own (a forward and its backward per iteration). The forward
    counts: HOT's keeps the layer's int8 buffer of its input (ABC, SPEC §2), work exact training does not do."""
    from .layers import Conv2d as HotConv2d, Linear as HotLinear

    dt = call.dtype
    if call.kind == "Linear":
        ex = nn.Linear(call.I, call.O, bias=call.bias)
        ho = HotLinear(call.I, call.O, bias=call.bias, config=config)
        x = torch.randn(call.L, call.I, device=device, dtype=dt)
    else:
        k, s, p, d = call.geom
        C = call.x_shape[1]
        ex = nn.Conv2d(C, call.O, k, s, p, d, bias=call.bias)
        ho = HotConv2d(C, call.O, k, s, p, d, bias=call.bias, config=config)
        x = torch.randn(call.x_shape, device=device, dtype=dt)
    ex = ex.to(device=device, dtype=dt)
    ho = ho.to(device=device, dtype=dt)
    ho.load_state_dict(ex.state_dict(), strict=False)
    for m in (ex, ho):
        for p_ in m.parameters():
            p_.requires_grad_(call.need_gw)
    x.requires_grad_(call.need_gx)
    # GPU time, not host time: a sleep kernel queued ahead of each timed range keeps the GPU busy while the host
    # enqueues it (autograd, the layer's Python), so the events bracket the kernels alone, as bench_hot's do; the
    # host's share of a layer is a separate cost (benchmarks/profile_step.py)
    sleep = getattr(torch.cuda, "_sleep", None)

    @contextlib.contextmanager
    def timed(into: list):  # events around the block, the GPU kept busy while the host enqueues it
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        if sleep is not None:
            sleep(_SLEEP_CYCLES)
        a.record()
        yield
        b.record()
        into.append((a, b))

    def median(ev) -> float:
        ms = sorted(a.elapsed_time(b) for a, b in ev[warmup:])
        return ms[len(ms) // 2]

    out = []
    for m in (ho, ex):  # in the layer's dtype itself, whatever autocast state the caller traced under
        g = None
        fwd, bwd = [], []
        for _ in range(warmup + iters):
            with timed(fwd), torch.autocast(device.type, enabled=False):
                y = m(x)
            if g is None:
                g = torch.randn_like(y)
            with timed(bwd):
                y.backward(g)
            m.zero_grad(set_to_none=True)
            x.grad = None
        torch.cuda.synchronize(device)
        out.append((median(fwd), median(bwd)))
    return out[0], out[1]


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------
def _resolve(config, m: nn.Module):
    if config is None:
        return m.hot_target_config, m.hot_config_source()
    if isinstance(config, str):
        if config == "paper":
            return hot.Config.paper(), "paper (asked)"
        if config == "default":
            return hot.Config(), "default (asked)"
        raise ValueError(f"hot.torch.cost: config must be None, 'default', 'paper' or a hot.Config, got {config!r}")
    if not isinstance(config, hot.Config):
        raise TypeError(f"hot.torch.cost: config must be None, 'default', 'paper' or a hot.Config, got "
                        f"{type(config).__name__}")
    return config, "given"


def _paths(cfg, call: Call) -> Tuple[str, str]:
    if cfg.exact:
        return "exact", "exact"
    gx = f"int{cfg.gx_bits} {cfg.gx_scale}" if call.need_gx else "none (input needs no grad)"
    if not call.need_gw:
        gw = "none (frozen)"
    else:
        gw = "int8 full rank" if cfg.rank == 16 else f"int8 HLA r={cfg.rank}"
    return gx, gw


def _verdict(row: dict) -> str:
    he, hh = row["kept_exact"], row["kept_hot"]
    own = he - row.get("shared_bytes", 0)  # what the exact layer keeps beyond an input its producer keeps anyway
    if he == 0:
        mem = "nothing kept either way"
    elif row.get("shared") and hh <= own:  # e.g. both keep only the weight's autocast copy
        mem = "no memory change (its producer keeps the input either way)"
    elif hh == 0:
        mem = "keeps nothing of its own (its producer keeps the input)"
    elif hh < he:
        mem = f"{he / hh:.1f}x less kept"
    else:
        mem = "no memory saving"
    te, th = row.get("ms_exact"), row.get("ms_hot")
    fe, fh = row.get("fwd_ms_exact"), row.get("fwd_ms_hot")
    if te is not None and th is not None and fe is not None and fh is not None:  # the layer's whole training time
        te, th, what = te + fe, th + fh, "forward + backward"
    else:
        what = "backward"
    if te is None or th is None:
        be, bh = row["gbops_exact"], row["gbops_hot"]
        if bh <= be:
            ops_s = f"{be / bh:.1f}x fewer BOPs" if bh else "no backward BOPs"
        else:
            ops_s = f"{bh / be:.1f}x more BOPs (overhead of a small layer)" if be else "more BOPs"
        return f"{mem}; {ops_s}; time not measured"
    speed = te / th if th > 0 else float("inf")
    if speed >= 1.05:
        return f"convert: {speed:.2f}x faster {what}, {mem}"
    if hh < he and not row.get("shared"):  # a real saving (not an input its producer keeps either way)
        return f"convert for memory: {speed:.2f}x {what} speed, {mem}"
    return f"keep exact: {speed:.2f}x {what} speed, {mem}"


_TIME_KEYS = ("ms_", "fwd_ms_")  # the timing columns (CUDA only)


@dataclass
class Report:
    rows: List[dict]
    total: dict
    notes: List[str]
    timed: bool

    # ---- rendering ----
    COLUMNS = [("name", "layer"), ("type", "type"), ("LIO", "L x I x O"), ("gx", "g_x path"), ("gw", "g_w path"),
               ("why", "why"), ("kept_exact", "kept (exact)"), ("kept_hot", "kept (HOT)"), ("kept_measured", "kept (hooks)"),
               ("fp_exact", "exact FLOPs"), ("fp_hot", "HOT float FLOPs"), ("int8", "HOT int8 OPs"),
               ("int4", "HOT int4 OPs"), ("overhead", "HOT overhead ops"), ("gbops_exact", "GBOPs exact"),
               ("gbops_hot", "GBOPs HOT"),
               ("fwd_ms_exact", "fwd ms exact"), ("fwd_ms_hot", "fwd ms HOT"),
               ("ms_exact", "bwd ms exact"), ("ms_hot", "bwd ms HOT"), ("verdict", "verdict")]

    def _cells(self, r: dict, human: bool) -> List[str]:
        out = []
        for k, _ in self.COLUMNS:
            v = r.get(k)
            if v is None:
                out.append("-")
            elif not human:
                out.append(f"{v:.6g}" if isinstance(v, float) else str(v))
            elif k.startswith("kept"):
                out.append(_fmt_bytes(v))
            elif k in ("fp_exact", "fp_hot", "int8", "int4", "overhead"):
                out.append(_fmt_count(v))
            elif k.startswith("gbops"):
                out.append(f"{v / 1e9:.3f}")
            elif k.startswith(_TIME_KEYS):
                out.append(f"{v:.3f}")
            else:
                out.append(str(v))
        return out

    def render(self, format: str = "text") -> str:
        if format not in ("text", "markdown", "csv"):
            raise ValueError(f"hot.torch.cost: format must be 'text', 'markdown' or 'csv', got {format!r}")
        cols = [c for c in self.COLUMNS if self.timed or not c[0].startswith(_TIME_KEYS)]
        keys = [k for k, _ in cols]
        idx = [i for i, (k, _) in enumerate(self.COLUMNS) if k in keys]
        body = [self.rows[i] for i in range(len(self.rows))] + [self.total]
        if format == "csv":
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            w.writerow(keys)
            for r in body:
                cells = self._cells(r, human=False)
                w.writerow([cells[i] for i in idx])
            return buf.getvalue().rstrip("\n")
        head = [h for _, h in cols]
        table = [[self._cells(r, True)[i] for i in idx] for r in body]
        if format == "markdown":
            lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in t) + " |" for t in table]
            lines += [""] + [f"- {n}" for n in self.notes]
            return "\n".join(lines)
        widths = [max(len(x[j]) for x in [head] + table) for j in range(len(head))]
        lines = ["  ".join(f"{h:<{w}}" for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
        lines += ["  ".join(f"{c:<{w}}" for c, w in zip(t, widths)) for t in table]
        lines += [""] + self.notes
        return "\n".join(lines)

    def plot(self, path: str) -> Optional[str]:
        """Write a figure (forward + backward time per layer, exact vs HOT, where measured, else GBOPs; bytes kept per
        layer) to ``path``. Returns None, or why no plot was written (matplotlib missing)."""
        try:
            import matplotlib
            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            return "no plot: matplotlib is not installed (pip install matplotlib)"
        names = [r["name"] for r in self.rows]
        n = len(names)
        fig, axes = plt.subplots(1, 2, figsize=(13, max(3.0, 0.22 * n + 1.5)), sharey=True)
        ys = list(range(n))
        h = 0.4
        if self.timed:
            a = [(r["ms_exact"] or 0.0) + (r["fwd_ms_exact"] or 0.0) for r in self.rows]
            b = [(r["ms_hot"] or 0.0) + (r["fwd_ms_hot"] or 0.0) for r in self.rows]
            axes[0].set_xlabel("forward + backward time (ms)")
            axes[0].set_title("forward + backward time per layer")
        else:
            a = [r["gbops_exact"] / 1e9 for r in self.rows]
            b = [r["gbops_hot"] / 1e9 for r in self.rows]
            axes[0].set_xlabel("GBOPs (paper's count)")
            axes[0].set_title("backward GBOPs per layer (time not measured: no GPU)")
        axes[0].barh([y - h / 2 for y in ys], a, h, label="exact")
        axes[0].barh([y + h / 2 for y in ys], b, h, label="HOT")
        axes[1].barh([y - h / 2 for y in ys], [r["kept_exact"] / 2**20 for r in self.rows], h, label="exact")
        axes[1].barh([y + h / 2 for y in ys], [r["kept_hot"] / 2**20 for r in self.rows], h, label="HOT")
        axes[1].set_xlabel("kept for backward (MiB)")
        axes[1].set_title("bytes kept per layer")
        axes[0].set_yticks(ys)
        axes[0].set_yticklabels(names, fontsize=7)
        axes[0].invert_yaxis()
        for ax in axes:
            ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return None


def _fmt_bytes(b: float) -> str:
    if b == 0:
        return "0"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:g} B"


def _fmt_count(v: float) -> str:
    if v == 0:
        return "0"
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= div:
            return f"{v / div:.2f}{unit}"
    return f"{v:g}"


def report(model: nn.Module, input: Any, config=None, time: Optional[bool] = None, iters: int = 10) -> Report:
    """The cost report of ``model``'s HOT layers for one forward of ``input`` (gradients enabled, no backward; as a
    training step's forward, so BatchNorm running statistics move as in one). ``config``: None, each layer's own
    configuration (default, calibrated, LQS, warm-up target, given); "default"; "paper"; or a hot.Config for every
    layer. ``time``: measure each distinct layer shape's backward, HOT against exact (default: when the model's
    parameters are on a CUDA device); on other devices the report says it was not measured."""
    relus = [m for m in model.modules() if isinstance(m, ReLU)]
    masks = [0, 0]  # (bytes of the 1-bit masks the ReLUs keep, bytes of the outputs exact training keeps there)

    def relu_post(m, args, out):
        if isinstance(out, torch.Tensor) and out.grad_fn is not None and out.is_floating_point():
            masks[0] += (out.numel() + 7) // 8
            masks[1] += out.numel() * out.element_size()

    handles = [m.register_forward_hook(relu_post) for m in relus]
    try:
        traced, _ = trace(model, input)
    finally:
        for h in handles:
            h.remove()
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    if time is None:
        time = dev.type == "cuda"
    timed = bool(time and dev.type == "cuda" and torch.cuda.is_available())
    notes = []
    cache: Dict[Tuple, Tuple[Tuple[float, float], Tuple[float, float]]] = {}
    rows = []
    tot = dict(kept_exact=0, kept_hot=0, kept_measured=0, fp_exact=0, fp_hot=0, int8=0, int4=0, overhead=0,
               gbops_exact=0, gbops_hot=0, ms_exact=0.0 if timed else None, ms_hot=0.0 if timed else None,
               fwd_ms_exact=0.0 if timed else None, fwd_ms_hot=0.0 if timed else None)
    measured_ok = True
    shared_exact = 0
    for name, m, calls in traced:
        if not calls:
            continue
        cfg, why = _resolve(config, m)
        ho_all, ex_all = OpCount(), OpCount()
        kh = ke = km = 0
        te = th = fe = fh = 0.0
        for c in calls:
            ho, ex = ops_of(c, cfg)
            ho_all, ex_all = ho_all + ho, ex_all + ex
            h, e = kept_bytes(c, cfg)
            kh, ke, km = kh + h, ke + e, km + c.measured
            if timed and (c.need_gx or c.need_gw):
                k = c.key(cfg)
                if k not in cache:
                    cache[k] = _bench_pair(c, cfg, dev, iters=iters)
                (f_h, b_h), (f_e, b_e) = cache[k]
                th, te, fh, fe = th + b_h, te + b_e, fh + f_h, fe + f_e
        own = cfg == m.hot_config
        measured_ok &= own
        c0 = calls[0]
        gx, gw = _paths(cfg, c0)
        lio = f"{c0.L}x{c0.I}x{c0.O}" + (f" (x{len(calls)} calls)" if len(calls) > 1 else "")
        shared = all(c.shared for c in calls if c.need_gw) and any(c.need_gw for c in calls)
        row = dict(name=name, shared=shared, type=type(m).__name__ + ("/1x1" if c0.pointwise else ""), LIO=lio, gx=gx, gw=gw,
                   why=why, kept_exact=ke, kept_hot=kh, kept_measured=km if own else None,
                   fp_exact=ex_all.fp, fp_hot=ho_all.fp, int8=ho_all.int8, int4=ho_all.int4,
                   overhead=ho_all.overhead_total, gbops_exact=ex_all.bops, gbops_hot=ho_all.bops,
                   ms_exact=te if timed else None, ms_hot=th if timed else None,
                   fwd_ms_exact=fe if timed else None, fwd_ms_hot=fh if timed else None,
                   ops_hot=ho_all, ops_exact=ex_all)
        row["shared_bytes"] = sum(_x_bytes(c) for c in calls if c.shared and c.need_gw and not cfg.exact)
        row["verdict"] = _verdict(row)
        rows.append(row)
        for k in ("kept_exact", "kept_hot", "fp_exact", "fp_hot", "int8", "int4", "overhead", "gbops_exact",
                  "gbops_hot"):
            tot[k] += row[k]
        tot["kept_measured"] += km
        shared_exact += row["shared_bytes"]
        if timed:
            tot["ms_exact"] += te
            tot["ms_hot"] += th
            tot["fwd_ms_exact"] += fe
            tot["fwd_ms_hot"] += fh
    if not measured_ok:
        tot["kept_measured"] = None
        notes.append("kept (hooks): measured only for layers whose own configuration is the one reported")
    tot.update(name="total", type="", LIO="", gx="", gw="", why="")
    tot["verdict"] = _verdict(dict(tot, kept_exact=tot["kept_exact"] - shared_exact)) if rows else ""
    if shared_exact:
        own = tot["kept_exact"] - shared_exact
        notes.append(f"{_fmt_bytes(shared_exact)} of the exact total are inputs their producer keeps anyway (a ReLU's "
                     f"output, an attention output): neither the exact nor the HOT layer adds memory for them (SPEC "
                     f"§2). What the layers add: exact {_fmt_bytes(own)}, HOT {_fmt_bytes(tot['kept_hot'])}")
    if masks[0]:
        notes.append(f"{len(relus)} hot.torch.ReLU module(s) keep 1-bit masks, {_fmt_bytes(masks[0])}, in place of "
                     f"their outputs, {_fmt_bytes(masks[1])} in exact training (SPEC §2): the layers after them keep "
                     f"their own buffers (HOT column) where exact training keeps the ReLU's output (exact column); "
                     f"the masks are not in the totals")
    dtypes = {c.dtype for _, _, cs in traced for c in cs}
    notes.append("FLOPs/OPs count 2 per multiply-accumulate; exact backward = 4*L*I*O (g_x and g_w GEMMs); HOT "
                 "overhead = Hadamard transforms, quantisation, dequantisation (fp32); GBOPs = MACs x bits x bits "
                 "(float GEMMs at " + "/".join(sorted(str(d).replace("torch.", "") for d in dtypes)) +
                 ", int8 64, int4 16) + overhead x 32 x 32, as the paper counts; g_b is the same for both and not "
                 "counted (docs/cost.md)")
    if any(r["int4"] for r in rows):
        notes.append("int4 OPs run as s4 GEMMs on Ampere/Ada only; on Hopper and the CPU the same values go through "
                     "the s8 GEMM (SPEC §6)")
    if timed:
        notes.append(f"forward and backward time: medians of {iters} runs per distinct layer shape on "
                     f"{torch.cuda.get_device_name(dev)}, HOT vs torch's exact layer (cuBLAS/cuDNN), CUDA events "
                     f"around the forward and around the backward, GPU time (the host enqueues behind a sleep kernel; "
                     f"its own time per layer is not included); the verdicts weigh their sum, since HOT's forward "
                     f"also forms the int8 copy of the input")
    else:
        notes.append(f"time: not measured (the model is on {dev.type}; the timing runs on a CUDA device only): "
                     f"verdicts are from bytes and operation counts")
    return Report(rows=rows, total=tot, notes=notes, timed=timed)
