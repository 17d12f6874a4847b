"""Gradient fidelity of HOT and of the methods the paper compares with, per layer of a real model.

For a model, a batch and a loss, ``fidelity`` runs one exact forward/backward pass, captures every
``nn.Linear`` and ``nn.Conv2d`` (groups = 1, as im2col columns) layer's input x, weight W and output
gradient g_y, and recomputes g_x = g_y W and g_w = g_yᵀ x with each method, using the engine's own
operations (hot.backward_linear, hot.quantize, hot.gemm_s8, hot.hla, ...):

=================  ===========================================================================
method             what it is
=================  ===========================================================================
``naive-int4``     per-tensor INT4 of g_y (stochastic), W and x (nearest), no Hadamard, full rank
                   on both GEMMs (integer GEMMs through ``hot.gemm_s8``)
``lbp-wht``        low rank only (LBP-WHT style): g_y and x projected on the HLA rows (rank 8) along
                   the tokens, no quantisation, for both g_x and g_w
``hq-only``        Hadamard quantisation only: the paper's g_x path (4-bit), g_w at rank 16 (full rank, 8-bit)
``paper``          the paper's HOT: ``hot.Config.paper()`` (g_x 4-bit HQ per tensor, g_w HLA rank 8, 8-bit)
``hot+lqs``        the paper's HOT with the per-layer scale choice of LQS (SPEC §7.1)
``hot-r{2,4,8,16}``  the paper's HOT at HLA rank r
``hot``            hot's default, ``hot.Config()`` (g_x 8-bit HQ per tensor, g_w 8-bit full rank; SPEC §10); on a
                   convolution (its int8 map's columns; a pointwise one's pixel rows) g_w from G̃'s codes (SPEC
                   §4), as ``hot-gxcodes`` computes it
=================  ===========================================================================

Extra methods (not in the default set) that isolate one part of the paper's HOT, used by the accuracy-gap
study of ``hot.experiments.parity``: ``exact`` (float64 reference, cast to float32), ``hot-gx-only`` (the paper's g_x,
exact g_w), ``hot-gw-only`` (exact g_x, the paper's g_w), ``hot-gx8`` (8-bit g_x), ``hot-token`` (per-token
g_x scales on every layer), ``hot-gx8-r16`` (8-bit g_x and full-rank g_w: only 8-bit quantisation left; the
same configuration as ``hot``), ``hot-gxcodes`` (the engine's numerics on a convolution, a candidate elsewhere: g_x
as ``hot``'s, and g_w from the same stochastic 8-bit codes of G̃ = g_y blockdiag(H_b), transposed, against a
per-tensor 8-bit round-to-nearest copy of x, with H_b applied along O to the O x I product: g_yᵀ x = blockdiag(H_b)
G̃ᵀ x / b, no rotation along the tokens).

Every method gets the same seed. The report gives, per layer and method, the cosine similarity and the
relative error ‖ĝ − g‖_F / ‖g‖_F of g_x and g_w against the exact float64 gradients, as a markdown
table and as a plot (``FidelityReport.plot``, matplotlib).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

import hot

# SPEC §4: LP_L1 order of the rows of H_16 kept by HLA.
HLA_ORDER = (0, 8, 2, 12, 10, 3, 4, 14, 11, 1, 6, 15, 9, 7, 13, 5)

DEFAULT_METHODS = ("naive-int4", "lbp-wht", "hq-only", "paper", "hot+lqs", "hot-r2", "hot-r4", "hot-r8", "hot-r16",
                   "hot")
EXTRA_METHODS = ("exact", "hot-gx-only", "hot-gw-only", "hot-gx8", "hot-token", "hot-gx8-r16", "hot-gxcodes")


@dataclasses.dataclass
class LayerCapture:
    """One layer's backward operands as L x I, O x I and L x O float32 arrays."""

    name: str
    kind: str
    x: np.ndarray
    w: np.ndarray
    gy: np.ndarray


@dataclasses.dataclass
class FidelityRow:
    layer: str
    method: str
    gx_cos: float
    gx_rel: float
    gw_cos: float
    gw_rel: float


def _metrics(est: np.ndarray, ref: np.ndarray) -> Tuple[float, float]:
    est = np.asarray(est, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    nr = np.linalg.norm(ref)
    ne = np.linalg.norm(est)
    if not np.all(np.isfinite(est)):
        return float("nan"), float("nan")
    cos = float(np.sum(est * ref) / (ne * nr)) if ne > 0 and nr > 0 else float("nan")
    rel = float(np.linalg.norm(est - ref) / nr) if nr > 0 else float("nan")
    return cos, rel


# ---- methods, each a function (x, w, gy, seed) -> (g_x, g_w) on float32 numpy arrays ---------------------


# hot.gemm_s8 accumulates in int32 and refuses contractions past (2^31 - 1) / 128² = 131,071 terms; longer
# ones (naive INT4's g_w over L rows, e.g. a 32x32 conv at batch 128: L = 131,072) run in chunks summed in int64.
GEMM_K_CHUNK = (2 ** 31 - 1) // (128 * 128) // 16 * 16


def _int_gemm(qa, qb):
    """qa (M x K) int8 times qb (N x K)ᵀ with the engine's exact integer GEMM, as float64 in qa's framework
    (numpy arrays or torch tensors, any device); exact: K is split into chunks of GEMM_K_CHUNK (column slices,
    which the engine takes as they are) summed in int64 when longer."""
    parts = [hot.gemm_s8(qa[:, k:k + GEMM_K_CHUNK], qb[:, k:k + GEMM_K_CHUNK])
             for k in range(0, max(qa.shape[1], 1), GEMM_K_CHUNK)]
    if isinstance(parts[0], np.ndarray):
        return sum(p.astype(np.int64) for p in parts).astype(np.float64)
    return sum(p.long() for p in parts).double()


def _naive_int4(x, w, gy, seed):
    qg, sg = hot.quantize(gy, bits=4, rounding="stochastic", seed=seed, rng_stream=0)
    qw, sw = hot.quantize(np.ascontiguousarray(w.T), bits=4)  # I x O (K-major for g_x)
    gx = _int_gemm(qg, qw) * (float(sg[0]) * float(sw[0]))
    qgt, sgt = hot.quantize(np.ascontiguousarray(gy.T), bits=4, rounding="stochastic", seed=seed, rng_stream=1)
    qxt, sxt = hot.quantize(np.ascontiguousarray(x.T), bits=4)  # I x L
    gw = _int_gemm(qgt, qxt) * (float(sgt[0]) * float(sxt[0]))
    return gx, gw


def _hla_basis(rank: int) -> np.ndarray:
    """Ĥ: the kept rows of H_16 (rank x 16), built with the engine's transform."""
    h16 = np.asarray(hot.hadamard_transform(np.eye(16, dtype=np.float32), block=16, axis=0), dtype=np.float64)
    return h16[list(HLA_ORDER[:rank])]


def _lbp_wht(x, w, gy, seed, rank=8):
    L = gy.shape[0]
    hx = np.asarray(hot.hla(x, rank=rank), dtype=np.float64)  # K x I
    hg = np.asarray(hot.hla(gy, rank=rank), dtype=np.float64)  # K x O
    gw = hg.T @ hx / 16.0
    # g_x from the projected g_y: P g_y = blockdiag(Ĥᵀ) Ĝ / 16, back on the token rows.
    hb = _hla_basis(rank)
    blocks = hg.reshape(-1, rank, gy.shape[1])
    pg = np.einsum("rt,brc->btc", hb, blocks).reshape(-1, gy.shape[1])[:L] / 16.0
    gx = pg @ w.astype(np.float64)
    return gx, gw


def _hot(config: "hot.Config"):
    def run(x, w, gy, seed):
        gx, gw, _ = hot.backward_linear(gy, w, x, config=config, seed=seed)
        return gx, gw

    run.engine_only = True  # engine calls alone: runs on numpy arrays or on any framework's tensors
    return run


def _exact(x, w, gy, seed):
    g = gy.astype(np.float64)
    return (g @ w.astype(np.float64)).astype(np.float32), (g.T @ x.astype(np.float64)).astype(np.float32)


def _hot_gx_only(x, w, gy, seed):
    gx, _, _ = hot.backward_linear(gy, w, None, config=hot.Config.paper(), seed=seed, need_grad_weight=False)
    return gx, _exact(x, w, gy, seed)[1]


def _hot_gw_only(x, w, gy, seed):
    _, gw, _ = hot.backward_linear(gy, w, x, config=hot.Config.paper(), seed=seed, need_grad_input=False)
    return _exact(x, w, gy, seed)[0], gw


def _transposed(a):
    """a's transpose, contiguous, in a's framework (numpy array or torch tensor)."""
    return np.ascontiguousarray(a.T) if isinstance(a, np.ndarray) else a.t().contiguous()


def _hot_gxcodes(x, w, gy, seed):
    """``hot-gxcodes`` (see the module docstring): one set of G̃ codes for both GEMMs; engine calls only, so it runs on
    numpy arrays or on any framework's tensors."""
    b = hot._api._hq_block(gy.shape[1])
    qg, sg = hot.quantize(hot.hadamard_transform(gy, block=b, axis=-1), bits=8, rounding="stochastic", seed=seed,
                          rng_stream=0)  # L x O codes of G~
    qw, sw = hot.quantize(_transposed(hot.hadamard_transform(w, block=b, axis=0)), bits=8)  # I x O codes of W~
    gx = _int_gemm(qg, qw) * (float(sg[0]) * float(sw[0]) / b)
    qx, sx = hot.quantize(_transposed(x), bits=8)  # I x L, round to nearest
    p = _int_gemm(_transposed(qg), qx) * (float(sg[0]) * float(sx[0]))  # G~^T x, O x I
    p32 = p.astype(np.float32) if isinstance(p, np.ndarray) else p.float()
    return gx, hot.hadamard_transform(p32, block=b, axis=0) / b


_hot_gxcodes.engine_only = True


def lqs_choice(gy: np.ndarray) -> str:
    """SPEC §7.1 on one layer: per-token iff e_token < 0.5 e_tensor for the 4-bit G̃ = g_y blockdiag(H_b)."""
    b = hot._api._hq_block(gy.shape[1])
    g = np.asarray(hot.hadamard_transform(gy, block=b, axis=-1), dtype=np.float32)
    err = {}
    for mode in ("tensor", "token"):
        q, s = hot.quantize(g, bits=4, scale=mode, rounding="nearest")
        deq = np.asarray(hot.dequantize(q, s), dtype=np.float64)
        err[mode] = float(np.linalg.norm(g.astype(np.float64) - deq))
    return "token" if err["token"] < 0.5 * err["tensor"] else "tensor"


def method_fn(name: str) -> Callable:
    """The function of a method name (see the module docstring)."""
    if name == "naive-int4":
        return _naive_int4
    if name == "lbp-wht":
        return _lbp_wht
    if name == "hq-only":
        return _hot(hot.Config.paper(rank=16))
    if name == "hot":
        return _hot(hot.Config())
    if name == "paper":
        return _hot(hot.Config.paper())
    if name == "hot+lqs":
        def run(x, w, gy, seed):
            return _hot(hot.Config.paper(gx_scale=lqs_choice(gy)))(x, w, gy, seed)

        return run
    if name == "exact":
        return _exact
    if name == "hot-gx-only":
        return _hot_gx_only
    if name == "hot-gw-only":
        return _hot_gw_only
    if name == "hot-gx8":
        return _hot(hot.Config.paper(gx_bits=8))
    if name == "hot-token":
        return _hot(hot.Config.paper(gx_scale="token"))
    if name == "hot-gx8-r16":
        return _hot(hot.Config.paper(gx_bits=8, rank=16))
    if name == "hot-gxcodes":
        return _hot_gxcodes
    if name.startswith("hot-r"):
        try:
            r = int(name[5:])
        except ValueError:
            r = 0
        if 1 <= r <= 16:
            return _hot(hot.Config.paper(rank=r))
    raise ValueError(f"fidelity: unknown method {name!r}, expected one of {list(DEFAULT_METHODS + EXTRA_METHODS)} "
                     f"(or hot-r<rank> with rank 1..16)")


# ---- capture ---------------------------------------------------------------------------------------


def capture(model, batch, loss_fn, include_conv: bool = True) -> List[LayerCapture]:
    """One exact forward/backward of ``loss_fn(model(inputs), targets)`` with ``batch = (inputs,
    targets)``; returns every Linear (and groups = 1 Conv2d, as im2col columns) layer's x, W, g_y. Layers of a model
    converted by ``hot.torch.convert`` run exactly here (as ``hot.torch.calibrate`` runs them), so every g_y is the
    exact one."""
    import torch.nn as nn
    import torch.nn.functional as F

    layers = [(n, m) for n, m in model.named_modules()
              if isinstance(m, nn.Linear) or (include_conv and isinstance(m, nn.Conv2d) and m.groups == 1)]
    if not layers:
        raise ValueError("fidelity: the model has no nn.Linear or nn.Conv2d (groups=1) layer to analyse")
    store: Dict[str, dict] = {}
    handles = []

    def fwd_hook(name):
        def hook(mod, inputs, output):
            if name in store:
                raise ValueError(f"fidelity: layer {name!r} ({type(mod).__name__}) is called more than once per "
                                 f"forward pass; capture needs one (x, g_y) pair per layer")
            store[name] = {"x": inputs[0].detach()}
            if output.requires_grad:  # else no gradient reaches it (a frozen layer on an input without grad)
                output.register_hook(lambda g: store[name].__setitem__("gy", g.detach()))

        return hook

    for n, m in layers:
        handles.append(m.register_forward_hook(fwd_hook(n)))
    converted = [m for m in model.modules() if hasattr(m, "_hot_capture")]  # hot.torch layers
    try:
        for m in converted:
            m._hot_capture = []  # exact forward (F.linear / F.conv2d), hence exact autograd backward
        inputs, targets = batch
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        for m in converted:
            m._hot_capture = None

    out = []
    for n, m in layers:
        if n not in store or "gy" not in store[n]:
            continue
        x, gy = store[n]["x"].float(), store[n]["gy"].float()
        if isinstance(m, nn.Linear):
            X = x.reshape(-1, x.shape[-1])
            G = gy.reshape(-1, gy.shape[-1])
            W = m.weight.detach().float()
            kind = "linear"
        else:
            if x.dim() == 3:  # an unbatched call (C, H, W)
                x, gy = x.unsqueeze(0), gy.unsqueeze(0)
            # padded as nn.Conv2d pads (any padding_mode, 'same' / 'valid' included), then unfolded without padding
            x = F.pad(x, m._reversed_padding_repeated_twice,
                      mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
            cols = F.unfold(x, m.kernel_size, dilation=m.dilation, stride=m.stride)
            X = cols.transpose(1, 2).reshape(-1, cols.shape[1])  # L x (C k k)
            G = gy.permute(0, 2, 3, 1).reshape(-1, gy.shape[1])  # L x O
            W = m.weight.detach().float().reshape(m.out_channels, -1)
            kind = "conv2d"
        out.append(LayerCapture(n, kind, X.cpu().contiguous().numpy(), W.cpu().contiguous().numpy(),
                                G.cpu().contiguous().numpy()))
    return out


# ---- report ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class FidelityReport:
    rows: List[FidelityRow]
    methods: Tuple[str, ...]
    layers: Tuple[str, ...]

    def get(self, layer: str, method: str) -> FidelityRow:
        for r in self.rows:
            if r.layer == layer and r.method == method:
                return r
        raise KeyError((layer, method))

    def to_markdown(self) -> str:
        head = "| layer | " + " | ".join(self.methods) + " |"
        sep = "|---|" + "---|" * len(self.methods)
        parts = []
        for metric, title in (("gx_cos", "g_x cosine similarity"), ("gx_rel", "g_x relative error"),
                              ("gw_cos", "g_w cosine similarity"), ("gw_rel", "g_w relative error")):
            parts.append(f"**{title}** (against exact, float64)\n\n{head}\n{sep}")
            for layer in self.layers:
                vals = " | ".join(f"{getattr(self.get(layer, m), metric):.4f}" for m in self.methods)
                parts.append(f"| {layer} | {vals} |")
            parts.append("")
        return "\n".join(parts)

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(self.layers) + 4), 4.5), sharey=False)
        x = np.arange(len(self.layers))
        width = 0.8 / len(self.methods)
        for ax, metric, title in ((axes[0], "gx_cos", "g_x: cosine similarity to exact"),
                                  (axes[1], "gw_cos", "g_w: cosine similarity to exact")):
            for i, m in enumerate(self.methods):
                ax.bar(x + i * width - 0.4 + width / 2, [getattr(self.get(l, m), metric) for l in self.layers],
                       width, label=m)
            ax.set_xticks(x)
            ax.set_xticklabels(self.layers, rotation=45, ha="right", fontsize=8)
            ax.set_title(title)
            ax.set_ylim(0, 1.02)
            ax.grid(axis="y", alpha=0.3)
        axes[1].legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def fidelity_of_captures(captures: Sequence[LayerCapture], methods: Sequence[str] = DEFAULT_METHODS,
                         seed: int = 0) -> FidelityReport:
    fns = {m: method_fn(m) for m in methods}
    rows = []
    for c in captures:
        gx_ref = c.gy.astype(np.float64) @ c.w.astype(np.float64)
        gw_ref = c.gy.astype(np.float64).T @ c.x.astype(np.float64)
        for m in methods:
            # hot's default on a convolution (its int8 map's columns, or a pointwise one's pixel rows' codes) takes
            # g_w from G~'s codes (SPEC §4)
            fn = _hot_gxcodes if m == "hot" and c.kind == "conv2d" else fns[m]
            gx, gw = fn(c.x, c.w, c.gy, seed)
            rows.append(FidelityRow(c.name, m, *_metrics(gx, gx_ref), *_metrics(gw, gw_ref)))
    return FidelityReport(rows, tuple(methods), tuple(c.name for c in captures))


def fidelity(model, batch, loss_fn, methods: Sequence[str] = DEFAULT_METHODS, seed: int = 0,
             include_conv: bool = True) -> FidelityReport:
    """Per-layer fidelity of g_x and g_w for each method (see the module docstring)."""
    return fidelity_of_captures(capture(model, batch, loss_fn, include_conv), methods, seed)
