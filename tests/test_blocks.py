"""The building blocks (hadamard_transform, hla, quantize, dequantize, pack/unpack, integer GEMMs)
against the float64 / integer reference."""
from __future__ import annotations

import numpy as np
import pytest

import hot
import reference as R
from reference import bn_stats_bound
from conftest import FW_DTYPES, UNIT_ROUNDOFF

SIZES = [pytest.param(s, id=f"{s[0]}x{s[1]}") for s in [(16, 16), (64, 128), (37, 48), (5, 6), (1, 32)]]


@pytest.mark.parametrize("fw,dtype", FW_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "row_strided"])
@pytest.mark.parametrize("block", [1, 2, 16])
def test_hadamard_rows(fw, dtype, layout, block, rng):
    if layout != "contiguous" and fw.name.startswith("jax"):
        pytest.skip("jax slices are copies")
    x = fw.make(rng.standard_normal((3, 11, 32)), dtype, layout)
    y = hot.hadamard_transform(x, block=block)
    fw.check(y, "float32", (3, 11, 32))
    ref = R.right_blocks(fw.numpy(x).reshape(-1, 32).astype(np.float64), block).reshape(3, 11, 32)
    # fp32 butterflies: log2(block) roundings of values bounded by the block's sum of |x|.
    ax = np.abs(fw.numpy(x).astype(np.float64)).reshape(3, 11, 32 // block, block)
    bound = np.log2(block) * 2.0 ** -24 * np.broadcast_to(ax.sum(-1, keepdims=True), ax.shape).reshape(ref.shape)
    assert np.all(np.abs(fw.numpy(y) - ref) <= 1.01 * bound)


@pytest.mark.parametrize("axis", [0, 1, -2])
def test_hadamard_other_axes(fw, axis, rng):
    x = rng.standard_normal((16, 8, 12)).astype(np.float32)
    y = fw.numpy(hot.hadamard_transform(fw.make(x), block=8 if axis in (1, -2) else 16, axis=axis))
    b = 8 if axis in (1, -2) else 16
    h = R.hadamard(b)
    ax = axis % 3
    xm = np.moveaxis(x.astype(np.float64), ax, -1)
    ref = np.moveaxis((xm.reshape(xm.shape[:-1] + (-1, b)) @ h).reshape(xm.shape), -1, ax)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_hadamard_is_self_inverse_up_to_n(rng):
    x = rng.standard_normal((7, 64)).astype(np.float32)
    y = hot.hadamard_transform(hot.hadamard_transform(x, block=64), block=64) / 64
    np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank", [1, 4, 8, 16])
@pytest.mark.parametrize("size", SIZES)
def test_hla(fw, rank, size, rng):
    x = fw.make(rng.standard_normal(size))
    y = hot.hla(x, rank=rank)
    L, C = size
    fw.check(y, "float32", (R.hla_rows(L, rank), C))
    np.testing.assert_allclose(fw.numpy(y), R.hla(fw.numpy(x).astype(np.float64), rank), rtol=1e-5, atol=1e-5)


def test_hla_rank16_is_lossless(rng):
    """r = 16 keeps all of H_16: H_16^T H_16 / 16 = I recovers x."""
    x = rng.standard_normal((32, 8)).astype(np.float32)
    y = hot.hla(x, rank=16).astype(np.float64)
    h = R.hadamard(16)[R.HLA_ORDER]
    back = np.concatenate([h.T @ y[16 * g:16 * g + 16] / 16 for g in range(2)])
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale", ["tensor", "token"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fw,dtype", FW_DTYPES)
def test_quantize_bit_exact(fw, bits, scale, rounding, dtype, rng):
    """Same integers and scales as SPEC §5 computed independently (including the Philox draws)."""
    x = fw.make(rng.standard_normal((2, 19, 40)) * 3, dtype)
    q, s = hot.quantize(x, bits=bits, scale=scale, rounding=rounding, seed=77, rng_stream=1)
    fw.check(q, "int8", (2, 19, 40))
    fw.check(s, "float32", (1,) if scale == "tensor" else (38,))
    rq, rs = R.quantize(fw.numpy(x).reshape(38, 40), bits, scale == "token", rounding, 77, 1)
    np.testing.assert_array_equal(fw.numpy(q).reshape(38, 40), rq)
    np.testing.assert_array_equal(fw.numpy(s), rs)
    qmax = 2 ** (bits - 1) - 1
    assert np.abs(fw.numpy(q)).max() <= qmax


@pytest.mark.parametrize("fw,dtype", FW_DTYPES)
def test_relu_amax_feeds_quantize_and_codes(fw, dtype, rng):
    """hot.relu_mask(x, amax=True)'s amax is max(relu(x)) (a float32 (1,) array of x's framework and device);
    hot.quantize and hot.activation_codes of the ReLU's output given it return what they return without it."""
    x = fw.make(rng.standard_normal((37, 24)) * 3, dtype)
    y, bits, amax = hot.relu_mask(x, amax=True)
    fw.check(amax, "float32", (1,))
    assert fw.numpy(amax)[0] == np.maximum(fw.numpy(x).astype(np.float32), 0).max()
    q0, s0 = hot.quantize(y)
    q1, s1 = hot.quantize(y, amax=amax)
    np.testing.assert_array_equal(fw.numpy(q1), fw.numpy(q0))
    np.testing.assert_array_equal(fw.numpy(s1), fw.numpy(s0))
    c0, c1 = hot.activation_codes(y), hot.activation_codes(y, amax=amax)
    np.testing.assert_array_equal(fw.numpy(c1.q), fw.numpy(c0.q))
    np.testing.assert_array_equal(fw.numpy(c1.scale), fw.numpy(c0.scale))


@pytest.mark.parametrize("fw,dtype", FW_DTYPES)
def test_batch_norm_backward_input_and_its_amax(fw, dtype, rng):
    """hot.batch_norm_backward_input: g_x within the float32 steps' and the final rounding's error of a float64
    evaluation of BatchNorm's input gradient, in grad_output's dtype, framework and shape; gt_amax (float32 (1,)) is the
    max |.| of g_x's block Hadamard transform along C (hot.hadamard_transform in float32), and hot.backward_linear of
    that g_x with a layer's codes returns the same bits given it as without it."""
    R, C = 200, 48
    gy = fw.make(rng.standard_normal((4, R // 4, C)), dtype)
    x = fw.make(rng.standard_normal((4, R // 4, C)) * 2 + 0.5, dtype)
    mean, invstd = rng.standard_normal(C) * 0.1, 0.5 + np.abs(rng.standard_normal(C))
    w, sd, sdx = rng.standard_normal(C), rng.standard_normal(C) * R * 0.05, rng.standard_normal(C) * R * 0.05
    f32 = [fw.make(v, "float32") for v in (mean, invstd, sd, sdx, w)]
    gx, amax = hot.batch_norm_backward_input(gy, x, *f32[:4], weight=f32[4])
    fw.check(gx, dtype, (4, R // 4, C))
    fw.check(amax, "float32", (1,))
    m32, is32, sd32, sdx32, w32 = (v.astype(np.float32).astype(np.float64) for v in (mean, invstd, sd, sdx, w))
    g64 = fw.numpy(gy).astype(np.float64).reshape(R, C)
    x64 = fw.numpy(x).astype(np.float64).reshape(R, C)
    terms = np.abs(g64) + np.abs(sd32 / R) + np.abs((x64 - m32) * sdx32 / R * is32 ** 2)
    want = (g64 - sd32 / R - (x64 - m32) * sdx32 / R * is32 ** 2) * is32 * w32
    got = fw.numpy(gx).astype(np.float64).reshape(R, C)
    bound = 8 * 2.0 ** -24 * terms * np.abs(is32 * w32) + UNIT_ROUNDOFF[dtype] * np.abs(want) + 1e-30
    assert np.all(np.abs(got - want) <= bound)
    gt = fw.numpy(hot.hadamard_transform(fw.make(got.reshape(R, C), "float32"), block=16))
    assert fw.numpy(amax)[0] == np.abs(gt).max()
    codes = hot.activation_codes(fw.make(rng.standard_normal((R, 32)), dtype))
    wl = fw.make(rng.standard_normal((C, 32)) * 0.1, dtype)
    g2 = fw.make(got.reshape(R, C), dtype)
    plain = hot.backward_linear(g2, wl, codes)
    handed = hot.backward_linear(g2, wl, codes, grad_output_amax=amax)
    for a, b in zip(plain[:2], handed[:2]):
        np.testing.assert_array_equal(fw.numpy(a), fw.numpy(b))
    with pytest.raises(ValueError, match="grad_output_amax has shape"):
        hot.backward_linear(g2, wl, codes, grad_output_amax=f32[0])
    with pytest.raises(ValueError, match="batch_norm_backward_input: x has shape"):
        hot.batch_norm_backward_input(gy, fw.make(rng.standard_normal((R, C)), dtype), *f32[:4])


@pytest.mark.parametrize("fw,dtype", FW_DTYPES)
def test_batch_norm_backward_reduce(fw, dtype, rng):
    """hot.batch_norm_backward_reduce: sum_dy and sum_dy_xmu within the error bound of their fp32 order (SPEC §2:
    chains of at most 1024 / 32 adds in a lane, 5 between lanes, one a 1024-row group; two more roundings a term of
    sum_dy_xmu) of float64 sums, grad_weight = sum_dy_xmu * invstd rounded once; float32 (C,) in the input's framework;
    grad_weight=False asks for none; x of another shape is refused."""
    R, C = 2500, 40  # three row groups, the last partial
    gy = fw.make(rng.standard_normal((5, R // 5, C)), dtype)
    x = fw.make(rng.standard_normal((5, R // 5, C)) * 2 + 0.5, dtype)
    mean, invstd = rng.standard_normal(C) * 0.1, 0.5 + np.abs(rng.standard_normal(C))
    sd, sdx, gw = hot.batch_norm_backward_reduce(gy, x, fw.make(mean, "float32"), fw.make(invstd, "float32"))
    for t in (sd, sdx, gw):
        fw.check(t, "float32", (C,))
    g64 = fw.numpy(gy).astype(np.float64).reshape(R, C)
    p64 = g64 * (fw.numpy(x).astype(np.float64).reshape(R, C) - mean.astype(np.float32))
    chain = 1024 // 32 + 5 + 3
    u = 2.0 ** -24
    assert np.all(np.abs(fw.numpy(sd) - g64.sum(0)) <= 1.001 * chain * u * np.abs(g64).sum(0))
    assert np.all(np.abs(fw.numpy(sdx) - p64.sum(0)) <= 1.001 * (chain + 2) * u * np.abs(p64).sum(0))
    np.testing.assert_array_equal(fw.numpy(gw), fw.numpy(sdx) * invstd.astype(np.float32))
    sd2, sdx2, none = hot.batch_norm_backward_reduce(gy, x, fw.make(mean, "float32"), fw.make(invstd, "float32"),
                                                     grad_weight=False)
    assert none is None
    np.testing.assert_array_equal(fw.numpy(sd2), fw.numpy(sd))
    np.testing.assert_array_equal(fw.numpy(sdx2), fw.numpy(sdx))
    with pytest.raises(ValueError, match="batch_norm_backward_reduce: x has shape"):
        hot.batch_norm_backward_reduce(gy, fw.make(rng.standard_normal((R, C)), dtype), fw.make(mean, "float32"),
                                       fw.make(invstd, "float32"))


@pytest.mark.parametrize("fw,dtype", FW_DTYPES)
def test_batch_norm_stats(fw, dtype, rng):
    """hot.batch_norm_stats: mean and invstd (float32 (C,), in x's framework) within the error bound of SPEC §2's fp32
    order of the float64 batch statistics of x's stored values, on a map far from zero in half its channels (where
    unshifted sums would cancel) and near it in the rest; the same bits from a strided x; eps in invstd; x of no
    rows is refused."""
    R, C = 2500, 40  # three row groups, the last partial
    x = rng.standard_normal((5, R // 5, C)) * 2 + np.where(np.arange(C) < C // 2, 300.0, 0.5)
    xa = fw.make(x, dtype)
    eps = 1e-3
    mean, invstd = hot.batch_norm_stats(xa, eps=eps)
    for t in (mean, invstd):
        fw.check(t, "float32", (C,))
    want_m, want_i, bm, bi = bn_stats_bound(fw.numpy(xa).astype(np.float64).reshape(R, C), np.float32(eps))
    assert np.all(np.abs(fw.numpy(mean) - want_m) <= bm)
    assert np.all(np.abs(fw.numpy(invstd) - want_i) <= bi)
    if not fw.name.startswith("jax"):  # jax slices are copies
        wide = fw.make(np.concatenate([x, x[..., :8]], -1), dtype)[..., :C]
        m2, i2 = hot.batch_norm_stats(wide, eps=eps)
        np.testing.assert_array_equal(fw.numpy(m2), fw.numpy(mean))
        np.testing.assert_array_equal(fw.numpy(i2), fw.numpy(invstd))
    with pytest.raises(ValueError, match="batch_norm_stats: x is empty"):
        hot.batch_norm_stats(fw.make(np.zeros((0, C)), dtype))


@pytest.mark.parametrize("fw,dtype", FW_DTYPES)
def test_batch_norm_transform(fw, dtype, rng):
    """hot.batch_norm_transform: y = fma(x - mean, weight * invstd, bias) within one rounding of x - mean and of the
    scale, the fma's and the final rounding to x's dtype of a float64 evaluation, in x's dtype, shape and framework;
    without weight and bias, x - mean times invstd."""
    R, C = 300, 24
    x = fw.make(rng.standard_normal((3, R // 3, C)) * 2 + 0.5, dtype)
    mean, invstd = rng.standard_normal(C) * 0.3, 0.5 + np.abs(rng.standard_normal(C))
    w, b = rng.standard_normal(C), rng.standard_normal(C)
    x64 = fw.numpy(x).astype(np.float64).reshape(R, C)
    m32, i32, w32, b32 = (v.astype(np.float32).astype(np.float64) for v in (mean, invstd, w, b))
    u = 2.0 ** -24
    for weight, bias in ((w, b), (None, None)):
        y = hot.batch_norm_transform(x, fw.make(mean, "float32"), fw.make(invstd, "float32"),
                                     None if weight is None else fw.make(weight, "float32"),
                                     None if bias is None else fw.make(bias, "float32"))
        fw.check(y, dtype, (3, R // 3, C))
        s = i32 * (w32 if weight is not None else 1.0)
        bb = b32 if bias is not None else 0.0
        want = (x64 - m32) * s + bb
        prod = np.abs((x64 - m32) * s)
        bound = 2.01 * u * prod + u * (prod + np.abs(bb)) + UNIT_ROUNDOFF[dtype] * np.abs(want) * 1.01 + 1e-30
        got = fw.numpy(y).astype(np.float64).reshape(R, C)
        assert np.all(np.abs(got - want) <= bound)
    with pytest.raises(ValueError, match="batch_norm_transform: mean has shape"):
        hot.batch_norm_transform(x, fw.make(mean[:-1], "float32"), fw.make(invstd, "float32"))


def test_quantize_zero_and_non_finite():
    q, s = hot.quantize(np.zeros((3, 4), np.float32))
    assert (q == 0).all() and (s == 0).all()
    x = np.ones((3, 4), np.float32)
    x[1, 2] = np.nan
    q, s = hot.quantize(x, scale="token")
    assert np.isnan(s[1]) and np.isfinite(s[[0, 2]]).all() and (q[1] == 0).all()
    d = hot.dequantize(q, s)
    assert np.isnan(d[1]).all() and np.isfinite(d[[0, 2]]).all()


def test_stochastic_rounding_unbiased():
    """E[q s] = v: the mean over n seeds is within 6 standard errors (Var <= s^2/4) of v."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    n = 400
    acc = np.zeros(x.shape)
    for seed in range(n):
        q, s = hot.quantize(x, bits=4, rounding="stochastic", seed=seed)
        acc += q.astype(np.float64) * s[0]
    mean = acc / n
    se = s[0] / 2 / np.sqrt(n)
    assert np.all(np.abs(mean - x) <= 6 * se)
    # nearest rounding is biased for most values; the stochastic mean is far closer
    qn, sn = hot.quantize(x, bits=4)
    assert np.abs(mean - x).mean() < 0.25 * np.abs(qn * sn[0] - x).mean()


def test_stochastic_rounding_reproducible():
    x = np.random.default_rng(3).standard_normal((8, 32)).astype(np.float32)
    a = hot.quantize(x, rounding="stochastic", seed=5)[0]
    b = hot.quantize(x, rounding="stochastic", seed=5)[0]
    c = hot.quantize(x, rounding="stochastic", seed=6)[0]
    d = hot.quantize(x, rounding="stochastic", seed=5, rng_stream=1)[0]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a, d)


@pytest.mark.parametrize("fw,dtype", FW_DTYPES)
def test_dequantize(fw, dtype, rng):
    x = fw.make(rng.standard_normal((9, 10)))
    q, s = hot.quantize(x, scale="token")
    d = hot.dequantize(q, s, dtype=dtype)
    fw.check(d, dtype, (9, 10))
    ref = R.dequantize(fw.numpy(q), fw.numpy(s))
    np.testing.assert_allclose(fw.numpy(d), ref, rtol=UNIT_ROUNDOFF[dtype], atol=0)


@pytest.mark.parametrize("size", [pytest.param(s, id=f"{s[0]}x{s[1]}") for s in [(1, 2), (5, 32), (16, 18)]])
def test_pack_unpack_int4(fw, size, rng):
    q = rng.integers(-8, 8, size=size).astype(np.int8)
    tq = fw.make(q, "int8")
    p = hot.pack_int4(tq)
    fw.check(p, "uint8", (size[0], size[1] // 2))
    np.testing.assert_array_equal(fw.numpy(p), R.pack_int4(q))
    u = hot.unpack_int4(p)
    fw.check(u, "int8", size)
    np.testing.assert_array_equal(fw.numpy(u), q)


@pytest.mark.parametrize("mnk", [pytest.param(s, id="M{}_N{}_K{}".format(*s)) for s in
                                 [(16, 16, 16), (64, 32, 128), (7, 5, 3), (33, 17, 50)]])
def test_gemm_s8_exact(fw, mnk, rng):
    M, N, K = mnk
    a = rng.integers(-127, 128, size=(M, K)).astype(np.int8)
    b = rng.integers(-127, 128, size=(N, K)).astype(np.int8)
    c = hot.gemm_s8(fw.make(a, "int8"), fw.make(b, "int8"))
    fw.check(c, "int32", (M, N))
    np.testing.assert_array_equal(fw.numpy(c), a.astype(np.int64) @ b.astype(np.int64).T)


def test_gemm_s8_row_strided(fw, rng):
    if fw.name.startswith("jax"):
        pytest.skip("jax slices are copies")
    a = rng.integers(-127, 128, size=(9, 20)).astype(np.int8)
    b = rng.integers(-127, 128, size=(6, 20)).astype(np.int8)
    c = hot.gemm_s8(fw.make(a, "int8", "row_strided"), fw.make(b, "int8", "row_strided"))
    np.testing.assert_array_equal(fw.numpy(c), a.astype(np.int64) @ b.astype(np.int64).T)


@pytest.mark.parametrize("mnk", [pytest.param(s, id="M{}_N{}_K{}".format(*s)) for s in
                                 [(16, 16, 32), (7, 5, 6), (33, 17, 64)]])
def test_gemm_s4_exact(fw, mnk, rng):
    M, N, K = mnk
    a = rng.integers(-8, 8, size=(M, K)).astype(np.int8)
    b = rng.integers(-8, 8, size=(N, K)).astype(np.int8)
    pa, pb = fw.make(R.pack_int4(a), "uint8"), fw.make(R.pack_int4(b), "uint8")
    c = hot.gemm_s4(pa, pb)
    fw.check(c, "int32", (M, N))
    np.testing.assert_array_equal(fw.numpy(c), a.astype(np.int64) @ b.astype(np.int64).T)


def test_num_threads():
    n = hot.get_num_threads()
    try:
        hot.set_num_threads(1)
        assert hot.get_num_threads() == 1
    finally:
        hot.set_num_threads(n)
    assert hot.get_num_threads() == n


def test_backend_info():
    assert isinstance(hot.__version__, str) and hot.__version__
    assert "cpu" in hot.build_info()
    if not hot.cuda_available():
        assert hot.cuda_unavailable_reason()
    else:
        assert hot.cuda_unavailable_reason() == ""
