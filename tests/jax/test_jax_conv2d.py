"""hot.jax.conv2d: a jax.custom_vjp whose forward keeps the int8 feature map and whose backward is hot's
(hot::backward_conv2d through an XLA custom call); its gradients against the same computation composed from hot's
Python API and the torch front (hot.quantize, hot.compress_columns, the torch front's call of the engine's conv
backward), bit for bit on the CPU; under jit, vmap and value_and_grad; errors. Skipped when jax is not installed."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
import jax.numpy as jnp  # noqa: E402

import hot  # noqa: E402
import hot.jax  # noqa: E402
from hot.torch import ops as tops  # noqa: E402  (the torch front's calls of the engine)


def _reference(x, w, b, gy, seed, config, stride, padding, dilation):
    """The torch front's conv backward, composed by hand from hot's Python API and hot.torch.ops."""
    N, C, H, W = x.shape
    O, _, kh, kw = w.shape
    Ho, Wo = gy.shape[2:]
    patches = tops.conv_patch_rows(Ho, Wo, config)
    g = torch.from_numpy(gy).permute(0, 2, 3, 1)
    if patches:
        g = tops._patch_split(g, 1)
    g = g.reshape(N * Ho * Wo, O).contiguous().numpy()
    if tops.pointwise((kh, kw), padding):  # a linear layer over the pixels it reads, from their codes or ABC buffer
        rows = torch.from_numpy(x)[:, :, ::stride[0], ::stride[1]].permute(0, 2, 3, 1)
        if patches:
            rows = tops._patch_split(rows, 1)
        rows = rows.reshape(N * Ho * Wo, C).contiguous().numpy()
        codes = hot._api.gw_from_codes(config)  # g_w from the codes of G~ and of the rows (float32, then w's dtype)
        saved = hot.activation_codes(rows) if codes else hot.compress_activation(rows, config)
        grows, gw, gb = hot.backward_linear(g, w.reshape(O, C), saved, bias=b is not None, config=config, seed=seed)
        gx = tops._pixel_unrows(torch.from_numpy(grows), (N, C, H, W), stride, Ho, Wo, patches).numpy()
        return [gx, gw.astype(w.dtype).reshape(w.shape)] + ([gb] if b is not None else [])
    q, s = hot.quantize(x.reshape(N * C, H * W), bits=8, scale="tensor", rounding="nearest")
    qh = np.ascontiguousarray(q.reshape(N, C, H, W).transpose(0, 2, 3, 1))  # the map's integers, channels-last
    codes = hot._api.gw_from_codes(config)  # g_w from the codes of G~ and of the columns, the map's scale applied
    if codes:
        cols = hot.column_codes(qh, s, (kh, kw), stride, padding, dilation, patches=patches)
    else:
        cols = hot.compress_columns(qh, (kh, kw), stride, padding, dilation, patches=patches, config=config)
    wc = tops.conv_weight_cols(torch.from_numpy(w))  # (O, kh*kw*C): im2col's (i, j, c) column order
    gxr, gw, gb = tops._backward_conv2d(torch.from_numpy(g), wc, torch.from_numpy(cols.q), torch.from_numpy(cols.scale),
                                        seed, config, (N, C, H, W), (kh, kw), stride, padding, dilation, patches,
                                        True, True, b is not None, gw_dtype="float32", codes=codes)
    gx = gxr.reshape(N, H, W, C).permute(0, 3, 1, 2).numpy()
    gw = tops.conv_weight_from_cols(gw if codes else gw * torch.from_numpy(s), w.shape).numpy()  # times the scale
    return [gx, gw] + ([gb.numpy()] if b is not None else [])


def _grads(x, w, b, gy, key, config, stride, padding, dilation, jit=True):
    def loss(x, w, b):
        y = hot.jax.conv2d(x, w, b, key=key, stride=stride, padding=padding, dilation=dilation, config=config)
        return jnp.sum(y * gy)

    g = jax.grad(loss, argnums=(0, 1) if b is None else (0, 1, 2))
    return [np.asarray(a) for a in (jax.jit(g) if jit else g)(x, w, b)]


GEOMETRIES = [
    pytest.param(((2, 3, 8, 8), (5, 3, 3, 3), (1, 1), (1, 1), (1, 1)), id="3x3-pad1"),       # overlapping windows
    pytest.param(((2, 4, 16, 16), (6, 4, 4, 4), (4, 4), (0, 0), (1, 1)), id="patchify"),     # disjoint windows
    pytest.param(((1, 2, 11, 9), (3, 2, 3, 2), (2, 1), (1, 0), (2, 1)), id="stride-dilation"),
    pytest.param(((3, 8, 8, 8), (16, 8, 1, 1), (1, 1), (0, 0), (1, 1)), id="1x1"),                # pointwise
    pytest.param(((2, 6, 15, 16), (12, 6, 1, 1), (2, 2), (0, 0), (1, 1)), id="1x1-stride2"),    # pointwise, strided
]
CONFIGS = [pytest.param(hot.Config(), id="default"), pytest.param(hot.Config.paper(), id="paper"),
           pytest.param(hot.Config(rank=12, gx_scale="token"), id="r12-token")]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("geom", GEOMETRIES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_grads_bit_identical_to_hot_composition(rng, config, geom, bias):
    xs, ws, stride, padding, dilation = geom
    x = rng.standard_normal(xs).astype(np.float32)
    w = (rng.standard_normal(ws) * 0.2).astype(np.float32)
    b = rng.standard_normal(ws[0]).astype(np.float32) if bias else None
    y = jax.lax.conv_general_dilated(x, w, stride, [(p, p) for p in padding], rhs_dilation=dilation,
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
    gy = rng.standard_normal(y.shape).astype(np.float32)
    key = jax.random.key(5)
    got = _grads(x, w, b, gy, key, config, stride, padding, dilation)
    ref = _reference(x, w, b, gy, hot.jax.seed_from_key(key), config, stride, padding, dilation)
    assert len(got) == len(ref)
    for name, a, r in zip(("g_x", "g_w", "g_b"), got, ref):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        np.testing.assert_array_equal(a, r, err_msg=name)


def test_patch_order_is_used_below_rank_16(rng):
    """At rank 8 on an 8x8 output map the rows go in 4x4 patch order: the result differs from raster order's."""
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    w = (rng.standard_normal((4, 3, 3, 3)) * 0.2).astype(np.float32)
    gy = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    cfg = hot.Config(rank=8)
    key = jax.random.key(1)
    got = _grads(x, w, None, gy, key, cfg, (1, 1), (1, 1), (1, 1))
    ref = _reference(x, w, None, gy, hot.jax.seed_from_key(key), cfg, (1, 1), (1, 1), (1, 1))
    np.testing.assert_array_equal(got[1], ref[1])
    raster = hot.backward_linear(
        gy.transpose(0, 2, 3, 1).reshape(-1, 4), w.reshape(4, -1),
        tops.im2col(torch.from_numpy(np.asarray(hot.dequantize(*hot.quantize(x.reshape(6, 64), bits=8, scale="tensor",
                                                                             rounding="nearest"),
                                                          dtype="float32")).reshape(x.shape)),
                    (3, 3), (1, 1), (1, 1), (1, 1)).numpy(),
        config=cfg, seed=hot.jax.seed_from_key(key))[1]
    assert not np.array_equal(got[1], raster.reshape(w.shape))


def test_close_to_exact_and_exact_config_is_autodiff(rng):
    x = rng.standard_normal((4, 8, 16, 16)).astype(np.float32)
    w = (rng.standard_normal((16, 8, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    gy = rng.standard_normal((4, 16, 16, 16)).astype(np.float32)
    key = jax.random.key(0)
    geo = ((1, 1), (1, 1), (1, 1))
    exact = _grads(x, w, b, gy, key, hot.Config(exact=True), *geo)
    auto = jax.grad(lambda x, w, b: jnp.sum((jax.lax.conv_general_dilated(
        x, w, (1, 1), [(1, 1), (1, 1)], dimension_numbers=("NCHW", "OIHW", "NCHW")) + b[None, :, None, None]) * gy),
        argnums=(0, 1, 2))(x, w, b)
    for a, r in zip(exact, auto):
        np.testing.assert_allclose(a, np.asarray(r), rtol=1e-5, atol=1e-5)
    h = _grads(x, w, b, gy, key, hot.Config(), *geo)
    for name, a, r in zip(("g_x", "g_w"), h, exact):
        rel = np.linalg.norm(a - r) / np.linalg.norm(r)
        assert 0 < rel < 0.05, (name, rel)
    np.testing.assert_allclose(h[2], exact[2], rtol=1e-4, atol=1e-4)


def test_forward_is_the_plain_conv_and_eager_equals_jit(rng):
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    w = (rng.standard_normal((4, 3, 3, 3)) * 0.2).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    key = jax.random.key(3)
    y = hot.jax.conv2d(x, w, b, key=key, stride=2, padding=1)
    ref = jax.lax.conv_general_dilated(x, w, (2, 2), [(1, 1), (1, 1)],
                                       dimension_numbers=("NCHW", "OIHW", "NCHW")) + b[None, :, None, None]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    gy = rng.standard_normal(y.shape).astype(np.float32)
    geo = ((2, 2), (1, 1), (1, 1))
    for a, r in zip(_grads(x, w, b, gy, key, None, *geo), _grads(x, w, b, gy, key, None, *geo, jit=False)):
        np.testing.assert_array_equal(a, r)


def test_vmap_is_per_example_calls(rng):
    x = rng.standard_normal((3, 2, 2, 8, 8)).astype(np.float32)
    w = (rng.standard_normal((4, 2, 3, 3)) * 0.2).astype(np.float32)
    gy = rng.standard_normal((3, 2, 4, 8, 8)).astype(np.float32)
    key = jax.random.key(2)

    def gw_one(x, gy):
        return jax.grad(lambda w: jnp.sum(hot.jax.conv2d(x, w, key=key, padding=1) * gy))(w)

    got = np.asarray(jax.jit(jax.vmap(gw_one))(x, gy))
    for i in range(3):
        np.testing.assert_array_equal(got[i], np.asarray(gw_one(x[i], gy[i])))


def test_value_and_grad_and_bf16(rng):
    x = jnp.asarray(rng.standard_normal((2, 3, 8, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 3, 3, 3)) * 0.2, jnp.bfloat16)
    b = jnp.zeros(4, jnp.float32)
    f = jax.jit(jax.value_and_grad(lambda x, w, b: jnp.sum(hot.jax.conv2d(x, w, b, key=jax.random.key(0), padding=1)
                                                           .astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    v, (gx, gw, gb) = f(x, w, b)
    assert np.isfinite(float(v))
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16 and gb.dtype == jnp.float32
    assert gx.shape == x.shape and gw.shape == w.shape and gb.shape == (4,)


def test_errors_name_the_argument(rng):
    x = jnp.zeros((2, 3, 8, 8))
    w = jnp.zeros((4, 3, 3, 3))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"hot.jax.conv2d: x has shape \(3, 8, 8\), expected 4 dims"):
        hot.jax.conv2d(x[0], w, key=key)
    with pytest.raises(ValueError, match=r"x has shape .* \(3 channels\) but w has shape .*groups"):
        hot.jax.conv2d(x, jnp.zeros((4, 6, 3, 3)), key=key)
    with pytest.raises(ValueError, match=r"stride must be an int or a pair of ints \(h, w\), got \(1, 2, 3\)"):
        hot.jax.conv2d(x, w, key=key, stride=(1, 2, 3))
    with pytest.raises(ValueError, match=r"expected stride >= 1"):
        hot.jax.conv2d(x, w, key=key, stride=0)
    with pytest.raises(ValueError, match=r"too small for the kernel"):
        hot.jax.conv2d(jnp.zeros((1, 3, 2, 2)), w, key=key)
    with pytest.raises(ValueError, match=r"b has shape \(3,\), expected \(4,\)"):
        hot.jax.conv2d(x, w, jnp.zeros(3), key=key)
    with pytest.raises(TypeError, match=r"x has dtype int32"):
        hot.jax.conv2d(jnp.zeros((2, 3, 8, 8), jnp.int32), w, key=key)
    with pytest.raises(TypeError, match=r"key is None"):
        hot.jax.conv2d(x, w, key=None)


def _jax_gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.mark.gpu
@pytest.mark.skipif(not (_jax_gpus() and hot.cuda_available()), reason="no JAX GPU or hot without CUDA")
def test_gpu_matches_cpu(rng):
    """On the GPU (custom calls on XLA's stream): the kept map is the CPU's byte for byte, the gradients agree to
    float32 rounding (the GEMMs' float epilogues may round differently)."""
    x = rng.standard_normal((4, 16, 16, 16)).astype(np.float32)
    w = (rng.standard_normal((32, 16, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    gy = rng.standard_normal((4, 32, 8, 8)).astype(np.float32)
    key = jax.random.key(4)
    geo = ((2, 2), (1, 1), (1, 1))
    for cfg in (hot.Config(), hot.Config.paper()):
        cpu = _grads(x, w, b, gy, key, cfg, *geo)
        gpu = jax.devices("gpu")[0]
        xg, wg, bg, gyg = (jax.device_put(a, gpu) for a in (x, w, b, gy))
        got = jax.jit(jax.grad(lambda x, w, b: jnp.sum(hot.jax.conv2d(x, w, b, key=key, stride=2, padding=1,
                                                                      config=cfg) * gyg), argnums=(0, 1, 2)))(xg, wg, bg)
        assert all(list(a.devices())[0].platform == "gpu" for a in got)
        for name, a, c in zip(("g_x", "g_w", "g_b"), got, cpu):
            np.testing.assert_allclose(np.asarray(a), c, rtol=1e-5, atol=1e-6 * np.abs(c).max(), err_msg=name)
