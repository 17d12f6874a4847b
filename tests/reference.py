"""A float64 numpy implementation of SPEC §3-§5, written independently of the C++ core.

Transforms and GEMMs run in float64 (exact for these sizes); the quantisers follow SPEC §5 in fp32 as
specified (inv = qmax / amax in fp32, v * inv rounded to fp32, then rint or floor(. + u) with u from
Philox4x32-7 as rng.h documents), so that the quantised integers agree with the core except where
an fp32 transform result sits within an ulp of a rounding boundary (rare, and far inside the bounds
the tests use).
"""
from __future__ import annotations

import numpy as np

HLA_ORDER = [0, 8, 2, 12, 10, 3, 4, 14, 11, 1, 6, 15, 9, 7, 13, 5]
GX_STREAM, GW_STREAM = 0, 1


def hadamard(n: int) -> np.ndarray:
    """Natural-order Sylvester Hadamard matrix H_n (float64)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    assert h.shape[0] == n
    return h


def hq_block(O: int) -> int:
    b = 16
    while b > 1 and O % b:
        b //= 2
    return b


def hla_rows(L: int, rank: int) -> int:
    return -(-L // 16) * rank


def padded(k: int) -> int:
    return -(-k // 16) * 16


def right_blocks(m: np.ndarray, b: int) -> np.ndarray:
    """m · blockdiag(H_b) (each row, in blocks of b columns, times H_b)."""
    R, C = m.shape
    return (m.reshape(R, C // b, b) @ hadamard(b)).reshape(R, C)


def left_blocks(m: np.ndarray, b: int) -> np.ndarray:
    """blockdiag(H_b) · m (groups of b rows mixed by H_b)."""
    R, C = m.shape
    return np.einsum("ij,gjc->gic", hadamard(b), m.reshape(R // b, b, C)).reshape(R, C)


def hla(m: np.ndarray, rank: int) -> np.ndarray:
    """blockdiag(Ĥ) · m: ceil(L/16)*rank rows (SPEC §4 step 1), float64."""
    L, C = m.shape
    Lp = padded(L)
    mp = np.zeros((Lp, C))
    mp[:L] = m
    hh = hadamard(16)[HLA_ORDER[:rank]]
    return np.einsum("kj,gjc->gkc", hh, mp.reshape(Lp // 16, 16, C)).reshape(Lp // 16 * rank, C)


# ---- Philox4x32-7 (rng.h) ----------------------------------------------------------------------------

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = np.uint64(0xFFFFFFFF)


def _philox(seed: int, stream: int, kind: int, call: np.ndarray) -> np.ndarray:
    """The 4 words (4, n) of Philox4x32-7 at counter (call, stream, kind) under key seed (rng.h)."""
    c0 = call & _MASK
    c1 = call >> np.uint64(32)
    c2 = np.full_like(c0, stream)
    c3 = np.full_like(c0, kind)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(7):  # hot::kPhiloxRounds
        p0 = _M0 * c0
        p1 = _M1 * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK
        n0 = hi1 ^ c1 ^ np.uint64(k0)
        n2 = hi0 ^ c3 ^ np.uint64(k1)
        c0, c1, c2, c3 = n0, lo1, n2, lo0
        k0 = (k0 + _W0) & 0xFFFFFFFF
        k1 = (k1 + _W1) & 0xFFFFFFFF
    return np.stack([c0, c1, c2, c3])


def philox_uniform(seed: int, stream: int, R: int, C: int) -> np.ndarray:
    """u in [0, 1) (float32, R x C) of the elements of an R x C operand of RNG stream `stream` under `seed`: the low
    (even column) or high (odd column) half of its row word plus its column word (rng.h)."""
    r = np.arange(R, dtype=np.uint64)[:, None]
    c = np.arange(C, dtype=np.uint64)[None, :]
    row_call = (c >> np.uint64(8)) * np.uint64((R + 3) // 4) + (r >> np.uint64(2))
    col_call = (r >> np.uint64(6)) * np.uint64((C + 7) // 8) + (c >> np.uint64(3))
    row_call, col_call = np.broadcast_arrays(row_call, col_call)
    a = _philox(seed, stream, 1, row_call.ravel())
    b = _philox(seed, stream, 2, col_call.ravel())
    rr, cc = np.broadcast_arrays(r, c)
    a = np.take_along_axis(a, (rr.ravel() & np.uint64(3)).astype(np.int64)[None], axis=0)[0]
    b = np.take_along_axis(b, ((cc.ravel() >> np.uint64(1)) & np.uint64(3)).astype(np.int64)[None], axis=0)[0]
    w = (a + b) & _MASK
    half = (w >> (np.uint64(16) * (cc.ravel() & np.uint64(1)))) & np.uint64(0xFFFF)
    return (half.astype(np.float32) * np.float32(1.0 / 65536.0)).reshape(R, C)


# ---- quantiser (SPEC §5) --------------------------------------------------------------------------


def quantize(v, bits=8, per_row=False, rounding="nearest", seed=0, stream=0):
    """(q int8, scale float32 of shape (1,) or (R,)) of the R x C matrix v, fp32 rules of SPEC §5."""
    v = np.asarray(v, dtype=np.float32)
    R, C = v.shape
    qmax = np.float32(2 ** (bits - 1) - 1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        a = np.abs(v)
        amax = (np.max(a, axis=1) if per_row else np.max(a, keepdims=True).reshape(1)).astype(np.float32)
        # NaN anywhere makes amax NaN (np.max propagates NaN).
        finite = np.isfinite(amax)
        nz = finite & (amax != 0)
        inv = np.where(nz, qmax / np.where(nz, amax, np.float32(1)), np.float32(0)).astype(np.float32)
        scale = np.where(finite, np.where(nz, amax / qmax, np.float32(0)), np.float32(np.nan)).astype(np.float32)
        inv_b = inv[:, None] if per_row else inv[0]
        prod = (v * inv_b).astype(np.float32)
        if rounding == "nearest":
            r = np.rint(prod)
        else:
            u = philox_uniform(seed, stream, R, C)
            r = np.floor((prod + u).astype(np.float32))
        r = np.clip(r, -qmax, qmax)
        zero = (inv_b == 0) if per_row else (inv[0] == 0)
        r = np.where(zero, 0, r)
        r = np.where(np.isfinite(r), r, 0)
    return r.astype(np.int8), scale


def dequantize(q, scale):
    s = np.asarray(scale, np.float64)
    return q.astype(np.float64) * (s[:, None] if s.shape[0] > 1 else s[0])


def pack_int4(q):
    q = np.asarray(q, np.int8)
    lo = q[..., 0::2].astype(np.uint8) & 0xF
    hi = q[..., 1::2].astype(np.uint8) & 0xF
    return (lo | (hi << 4)).astype(np.uint8)


# ---- layer operations (SPEC §2-§4) ---------------------------------------------------------------


def compress_activation(x2d, rank=16):
    """(q_t I x K_pad int8, scale (1,) float32)."""
    xh = hla(np.asarray(x2d, np.float64), rank).astype(np.float32)
    q, s = quantize(xh, 8, False, "nearest")
    K, I = q.shape
    q_t = np.zeros((I, padded(K)), np.int8)
    q_t[:, :K] = q.T
    return q_t, s


def backward_linear(gy, w, x, gx_bits=8, rank=16, rounding="stochastic", gx_scale="tensor", seed=0):
    """HOT backward in float64: (g_x L x I, g_w O x I, g_b O) from 2-D gy, w, x."""
    gy = np.asarray(gy, np.float64)
    w = np.asarray(w, np.float64)
    L, O = gy.shape
    b = hq_block(O)
    gt = right_blocks(gy, b).astype(np.float32)
    wt = left_blocks(w, b).astype(np.float32)
    qg, sg = quantize(gt, gx_bits, gx_scale == "token", rounding, seed, GX_STREAM)
    qw, sw = quantize(wt, gx_bits, False, "nearest")
    acc = qg.astype(np.float64) @ qw.astype(np.float64)
    sgb = sg.astype(np.float64)[:, None] if gx_scale == "token" else np.float64(sg[0])
    g_x = acc * sgb * np.float64(sw[0]) / b
    g_w = None
    if x is not None:
        qx_t, sx = compress_activation(x, rank)
        K = hla_rows(L, rank)
        gh = hla(gy, rank).astype(np.float32)
        qgh, sgh = quantize(gh, 8, False, rounding, seed, GW_STREAM)
        acc_w = qgh.astype(np.float64).T @ qx_t[:, :K].astype(np.float64).T
        g_w = acc_w * np.float64(sgh[0]) * np.float64(sx[0]) / 16
    g_b = gy.sum(axis=0)
    return g_x, g_w, g_b


def backward_linear_exact(gy, w, x):
    gy = np.asarray(gy, np.float64)
    g_x = gy @ np.asarray(w, np.float64)
    g_w = gy.T @ np.asarray(x, np.float64) if x is not None else None
    return g_x, g_w, gy.sum(axis=0)


def rel_err(a, ref) -> float:
    a = np.asarray(a, np.float64)
    ref = np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(a - ref) / (den if den > 0 else 1.0))


def assert_q_close(q, ref):
    """Quantised integers equal up to rare off-by-one flips at rounding boundaries (see module doc)."""
    q = np.asarray(q, np.int64)
    ref = np.asarray(ref, np.int64)
    assert q.shape == ref.shape, (q.shape, ref.shape)
    d = np.abs(q - ref)
    assert d.max(initial=0) <= 1, f"quantised values differ by {d.max()}"
    assert np.count_nonzero(d) <= max(1, q.size // 1000), f"{np.count_nonzero(d)} of {q.size} values differ"


def bn_stats_bound(x64, eps, momentum=None, running=None):
    """BatchNorm's batch statistics of the R x C float64 x64 (the stored values) with the error bounds of SPEC §2's
    fp32 order: (mean, invstd, bound of mean, bound of invstd), and with momentum and running = (r_mean, r_var) also
    the updated running statistics and their bounds. Sums of d = x - K (K the first row; d rounded) in chains of
    1024 / 32 adds in a lane, 5 between lanes and one a 1024-row group: a within (chain + 1) u sum |x - K|, b (d * d,
    the square and d's error: 3 u a term) within (chain + 3) u sum (x - K)^2; then q = a / R, mean = K + q,
    M2 = b - a q, var = M2 / R, invstd = 1 / sqrt(var + eps), each step's rounding counted (first order, 1 % slack)."""
    R = x64.shape[0]
    u, chain = 2.0 ** -24, 1024 // 32 + 5 + -(-R // 1024)
    d = x64 - x64[0]
    a, s1, s2 = d.sum(0), np.abs(d).sum(0), (d * d).sum(0)
    ea, eb = (chain + 1) * u * s1, (chain + 3) * u * s2
    mean = x64[0] + a / R
    m2 = np.maximum(s2 - a * a / R, 0.0)
    var = m2 / R
    em = (ea + u * np.abs(a)) / R + u * np.abs(mean)
    em2 = eb + (2 * np.abs(a) * ea + ea * ea) / R + 2 * u * (np.abs(a) + ea) ** 2 / R + u * (m2 + eb)
    ev = em2 / R + u * var
    invstd = 1 / np.sqrt(var + eps)
    ei = invstd * (0.5 * (ev + u * (var + eps)) / (var + eps) + 2 * u)
    out = [mean, invstd, 1.01 * em + 1e-30, 1.01 * ei + 1e-30]
    if running is not None:
        m = float(np.float32(momentum))
        unbiased, eu = m2 / (R - 1), em2 / (R - 1) + u * m2 / (R - 1)
        for r, s, e in zip(running, (mean, unbiased), (em, eu)):
            want = m * s + (1 - m) * r
            out += [want, 1.01 * (m * e + 3 * u * (m * np.abs(s) + (1 - m) * np.abs(r) + np.abs(want))) + 1e-30]
    return out
