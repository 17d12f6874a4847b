"""hot.jax: dense as a jax.custom_vjp over XLA FFI custom calls into hot's core, under jit, grad, value_and_grad and
vmap; its gradients against hot.backward_linear (the same core through the Python bindings), bit for bit on the CPU;
its errors; and the Equinox digits example, exact vs HOT. Skipped when jax is not installed."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import hot  # noqa: E402
import hot.jax  # noqa: E402  (jax present: the FFI library must be there too, else this fails, as it should)

CPU = jax.devices("cpu")[0]


def _data(rng, lead=(37,), I=48, O=32, scale=1.0):
    x = rng.standard_normal(lead + (I,)).astype(np.float32)
    w = (rng.standard_normal((O, I)) * 0.1).astype(np.float32)
    b = rng.standard_normal((O,)).astype(np.float32)
    gy = (rng.standard_normal(lead + (O,)) * scale).astype(np.float32)
    return x, w, b, gy


def _grads(x, w, b, gy, key, config=None, jit=True):
    """jax.grad of sum(dense(x, w, b) * gy) w.r.t. (x, w[, b]): the cotangent of y is exactly gy."""
    def loss(x, w, b):
        return jnp.sum(hot.jax.dense(x, w, b, key=key, config=config) * gy)

    argnums = (0, 1) if b is None else (0, 1, 2)
    g = jax.grad(loss, argnums=argnums)
    if jit:
        g = jax.jit(g)
    return [np.asarray(a) for a in g(x, w, b)]


CONFIGS = [
    pytest.param(None, id="default"),
    pytest.param(hot.Config.paper(), id="paper"),
    pytest.param(hot.Config(gx_scale="token", rank=12), id="token-r12"),
    pytest.param(hot.Config(rounding="nearest", gx_bits=4), id="nearest-4bit"),
]


# ---- the gradients are hot.backward_linear's, bit for bit ------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead", [(37,), (3, 21)], ids=["2d", "3d"])
def test_jit_grad_bit_identical_to_backward_linear(rng, config, bias, lead):
    x, w, b, gy = _data(rng, lead)
    key = jax.random.key(11)
    got = _grads(x, w, b if bias else None, gy, key, config)
    seed = hot.jax.seed_from_key(key)
    saved = hot.compress_activation(x, config)
    ref = hot.backward_linear(gy, w, saved, bias=bias, config=config, seed=seed)
    assert len(got) == (3 if bias else 2)
    for name, a, r in zip(("g_x", "g_w", "g_b"), got, ref):
        assert a.shape == r.shape, name
        np.testing.assert_array_equal(a, r, err_msg=name)
    # and the raw-x path of hot.backward_linear compresses the same way
    ref_raw = hot.backward_linear(gy, w, x, bias=bias, config=config, seed=seed)
    for a, r in zip(got, ref_raw):
        np.testing.assert_array_equal(a, r)


def test_compress_activation_same_bytes_as_hot(rng):
    x = rng.standard_normal((5, 19, 40)).astype(np.float32)
    for rank in (16, 8, 3):
        cfg = hot.Config(rank=rank)
        q, s = jax.jit(lambda x: hot.jax.compress_activation(x, config=cfg))(x)
        ref = hot.compress_activation(x, cfg)
        assert q.dtype == jnp.int8 and s.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(q), ref.q)
        np.testing.assert_array_equal(np.asarray(s), ref.scale)


def test_hot_gradients_close_to_exact_but_quantised(rng):
    x, w, b, gy = _data(rng, (256,), I=64, O=64)
    key = jax.random.key(0)
    h = _grads(x, w, b, gy, key)
    e = _grads(x, w, b, gy, key, hot.Config(exact=True))
    for name, a, r in zip(("g_x", "g_w"), h, e):
        rel = np.linalg.norm(a - r) / np.linalg.norm(r)
        assert 0 < rel < 0.05, (name, rel)
    np.testing.assert_allclose(h[2], e[2], rtol=1e-5, atol=1e-5)  # g_b is exact (fp32 accumulation)


def test_exact_config_is_jax_autodiff(rng):
    x, w, b, gy = _data(rng)
    key = jax.random.key(0)
    got = _grads(x, w, b, gy, key, hot.Config(exact=True))
    ref = jax.grad(lambda x, w, b: jnp.sum((x @ w.T + b) * gy), argnums=(0, 1, 2))(x, w, b)
    for a, r in zip(got, ref):
        np.testing.assert_allclose(a, np.asarray(r), rtol=1e-6, atol=1e-6)


def test_forward_is_the_plain_dense(rng):
    x, w, b, _ = _data(rng, (2, 9))
    y = jax.jit(lambda x, w, b: hot.jax.dense(x, w, b, key=jax.random.key(0)))(x, w, b)
    ref = jax.jit(lambda x, w, b: jax.lax.dot_general(x, w, (((2,), (1,)), ((), ()))) + b)(x, w, b)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    assert y.shape == (2, 9, 32) and y.dtype == jnp.float32


def test_residual_is_the_abc_buffer_not_x(rng, capsys):
    from jax.ad_checkpoint import print_saved_residuals

    x, w, _, _ = _data(rng, (100,), I=48, O=32)
    print_saved_residuals(lambda x, w: hot.jax.dense(x, w, key=jax.random.key(0)), x, w)
    out = capsys.readouterr().out
    K_pad = hot._C.padded_k(hot._C.hla_rows(100, 16))
    assert f"i8[48,{K_pad}]" in out, out
    assert "f32[1]" in out, out
    assert "f32[100,48]" not in out, out  # x is not kept


# ---- jit, grad, value_and_grad, seeds -----------------------------------------------------------------------------


def test_jit_and_eager_identical(rng):
    x, w, b, gy = _data(rng, (3, 17))
    key = jax.random.key(5)
    for bb in (b, None):
        jitted = _grads(x, w, bb, gy, key, jit=True)
        eager = _grads(x, w, bb, gy, key, jit=False)
        for a, e in zip(jitted, eager):
            np.testing.assert_array_equal(a, e)


def test_value_and_grad(rng):
    x, w, b, gy = _data(rng)
    key = jax.random.key(3)

    def loss(w, b, x):
        return jnp.sum(hot.jax.dense(x, w, b, key=key) * gy)

    val, (gw, gb) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, b, x)
    np.testing.assert_allclose(float(val), float(np.sum((x @ w.T + b) * gy)), rtol=1e-5)
    ref = _grads(x, w, b, gy, key)
    np.testing.assert_array_equal(np.asarray(gw), ref[1])
    np.testing.assert_array_equal(np.asarray(gb), ref[2])


def test_seed_from_key_is_documented_rule():
    key = jax.random.key(42)
    words = np.asarray(jax.random.bits(key, (2,), jnp.uint32)).astype(np.uint64)
    assert hot.jax.seed_from_key(key) == int(words[0]) | (int(words[1]) << 32)
    np.testing.assert_array_equal(np.asarray(hot.jax.seed_words(key)), words.astype(np.uint32))
    # legacy raw keys work the same way
    raw = jax.random.PRNGKey(42)
    assert hot.jax.seed_from_key(raw) == int(np.asarray(jax.random.bits(raw, (2,), jnp.uint32)).astype(np.uint64)
                                             @ np.array([1, 1 << 32], dtype=np.uint64))


def test_key_drives_the_rounding_and_jit_compiles_once(rng):
    x, w, b, gy = _data(rng)

    @jax.jit
    def grads(w, key):
        return jax.grad(lambda w: jnp.sum(hot.jax.dense(x, w, b, key=key) * gy))(w)

    g0 = np.asarray(grads(w, jax.random.key(0)))
    g0b = np.asarray(grads(w, jax.random.key(0)))
    g1 = np.asarray(grads(w, jax.random.key(1)))
    np.testing.assert_array_equal(g0, g0b)  # reproducible: no host state
    assert not np.array_equal(g0, g1)      # stochastic rounding follows the key
    assert grads._cache_size() == 1        # the seed is an operand: a new key does not recompile
    ref = hot.backward_linear(gy, w, x, bias=True, seed=hot.jax.seed_from_key(jax.random.key(1)))[1]
    np.testing.assert_array_equal(g1, ref)


def test_dtypes_follow_the_inputs(rng):
    x, w, b, gy = _data(rng)
    key = jax.random.key(2)
    xb = jnp.asarray(x, jnp.bfloat16)
    bh = jnp.asarray(b, jnp.float16)
    gx, gw, gb = jax.jit(jax.grad(lambda x, w, b: jnp.sum(hot.jax.dense(x, w, b, key=key) * gy),
                                  argnums=(0, 1, 2)))(xb, w, bh)
    assert (gx.dtype, gw.dtype, gb.dtype) == (jnp.bfloat16, jnp.float32, jnp.float16)
    # the core writes each output in its dtype: the same values as its float32 result rounded (to nearest even)
    ref = hot.backward_linear(gy, w, np.asarray(xb.astype(jnp.float32)), bias=True, seed=hot.jax.seed_from_key(key))
    np.testing.assert_array_equal(np.asarray(gx.astype(jnp.float32)),
                                  np.asarray(jnp.asarray(ref[0]).astype(jnp.bfloat16).astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(gw), ref[1])


def test_threads_do_not_change_the_bits(rng):
    x, w, b, gy = _data(rng, (300,), I=64, O=48)
    key = jax.random.key(9)
    before = hot.jax.get_num_threads()
    try:
        hot.jax.set_num_threads(1)
        assert hot.jax.get_num_threads() == 1
        one = _grads(x, w, b, gy, key)
        hot.jax.set_num_threads(2)
        two = _grads(x, w, b, gy, key)
    finally:
        hot.jax.set_num_threads(before)
    for a, c in zip(one, two):
        np.testing.assert_array_equal(a, c)


# ---- vmap -------------------------------------------------------------------------------------------------------


def test_vmap_forward_and_per_example_grads(rng):
    x, w, b, _ = _data(rng, (4, 20))
    key = jax.random.key(1)

    def per(xi, w, b):
        return jnp.sum(jnp.sin(hot.jax.dense(xi, w, b, key=key)))

    y = jax.jit(jax.vmap(lambda xi: hot.jax.dense(xi, w, b, key=key)))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(hot.jax.dense(x, w, b, key=key)))
    g = jax.jit(jax.vmap(jax.grad(per, argnums=(0, 1, 2)), in_axes=(0, None, None)))(x, w, b)
    for i in range(4):
        one = jax.grad(per, argnums=(0, 1, 2))(x[i], w, b)
        for a, r in zip(g, one):
            np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(r))  # each example is its own layer call


def test_grad_of_vmap_and_vmapped_keys(rng):
    x, w, b, _ = _data(rng, (3, 16))
    keys = jax.random.split(jax.random.key(4), 3)

    def total(x, w):
        ys = jax.vmap(lambda xi, k: hot.jax.dense(xi, w, b, key=k))(x, keys)
        return jnp.sum(jnp.tanh(ys))

    gx, gw = jax.jit(jax.grad(total, argnums=(0, 1)))(x, w)
    gxs, gws = [], []
    for i in range(3):
        a, c = jax.grad(lambda xi, w: jnp.sum(jnp.tanh(hot.jax.dense(xi, w, b, key=keys[i]))), argnums=(0, 1))(x[i], w)
        gxs.append(np.asarray(a))
        gws.append(np.asarray(c))
    np.testing.assert_array_equal(np.asarray(gx), np.stack(gxs))
    np.testing.assert_allclose(np.asarray(gw), sum(gws), rtol=1e-6, atol=1e-6)  # the sum over examples, by XLA


# ---- errors -----------------------------------------------------------------------------------------------------


def _raises(exc, match, fn, *args, **kw):
    with pytest.raises(exc, match=match):
        fn(*args, **kw)
    with pytest.raises(exc, match=match):  # the same message at trace time under jit
        jax.jit(lambda *a: fn(*a, **kw))(*args)


def test_errors_name_the_argument(rng):
    x, w, b, _ = _data(rng)
    k = jax.random.key(0)
    d = hot.jax.dense
    _raises(ValueError, r"w has shape \(48,\), expected 2 dims \(O, I\)", lambda x, w: d(x, w, key=k), x, w[0])
    _raises(ValueError, r"x has shape \(37, 47\) \(47 features\) but w has shape \(32, 48\)",
            lambda x, w: d(x, w, key=k), x[:, :47], w)
    _raises(ValueError, r"b has shape \(31,\), expected \(32,\)", lambda x, w, b: d(x, w, b, key=k), x, w, b[:31])
    _raises(ValueError, r"x has shape \(\), expected at least 1 dim", lambda x, w: d(x, w, key=k), x[0, 0], w)
    _raises(ValueError, r"x is empty", lambda x, w: d(x, w, key=k), x[:0], w)
    _raises(TypeError, r"x has dtype int32, expected float32, float16 or bfloat16", lambda x, w: d(x, w, key=k),
            x.astype(np.int32), w)
    _raises(TypeError, r"w has dtype int32", lambda x, w: d(x, w, key=k), x, w.astype(np.int32))
    with pytest.raises(TypeError, match=r"hot.jax.dense: key is None, expected a jax.random key"):
        d(x, w, key=None)
    with pytest.raises(TypeError, match=r"hot.jax.dense: key is int 3, expected a jax.random key"):
        d(x, w, key=3)
    with pytest.raises(ValueError, match=r"key has shape \(2,\), expected one key"):
        d(x, w, key=jax.random.split(k, 2))
    with pytest.raises(TypeError, match=r"hot.jax.dense: key has dtype float32 and shape \(2,\), expected a jax"):
        d(x, w, key=jnp.zeros(2))
    with pytest.raises(TypeError, match=r"config is a dict, expected hot.Config or None"):
        d(x, w, key=k, config={"rank": 8})
    with pytest.raises(TypeError, match=r"w is None, expected an array"):
        d(x, None, key=k)


def test_handler_checks_its_operands(rng):
    """The C++ handler validates what reaches it (here a seed operand of the wrong size, which hot.jax never makes)."""
    x, w, _, gy = _data(rng)
    q, s = hot.jax.compress_activation(x)
    call = jax.ffi.ffi_call("hot_backward_linear", (jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                                    jax.ShapeDtypeStruct(w.shape, jnp.float32)))
    attrs = dict(codes=np.int32(0), config=np.int64(hot.Config().code))  # the configuration crosses whole, as its code
    with pytest.raises(Exception, match=r"seed has 3 elements, expected 2"):
        jax.block_until_ready(call(gy, w, q, s, jnp.zeros(3, jnp.uint32), **attrs))
    with pytest.raises(Exception, match=r"code 3 is no configuration's code"):  # gx_bits 3, rank 0
        jax.block_until_ready(call(gy, w, q, s, jnp.zeros(2, jnp.uint32), codes=np.int32(0), config=np.int64(3)))
    with pytest.raises(Exception, match=r"saved.q has shape"):
        jax.block_until_ready(call(gy, w, q[:, :16], s, jnp.zeros(2, jnp.uint32), **attrs))


def test_missing_library_message(monkeypatch, tmp_path):
    from hot.jax import _ffi

    monkeypatch.setattr(_ffi, "_lib", None)
    monkeypatch.setattr(_ffi, "library_path", lambda: str(tmp_path / "_hot_jax_ffi.so"))
    with pytest.raises(ImportError, match=r"built without its JAX library .*pip install jax.*HOT_JAX_FFI_INCLUDE_DIR"):
        _ffi.load()


def test_import_without_jax_says_what_to_install():
    code = ("import sys; sys.modules['jax'] = None\n"
            "try:\n    import hot.jax\nexcept ImportError as e:\n    print(e)\nelse:\n    print('imported')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "hot.jax needs JAX" in out.stdout and "pip install jax" in out.stdout and "hot[jax]" in out.stdout, \
        out.stdout + out.stderr


# ---- GPU (skips without a JAX GPU and hot's CUDA backend) ---------------------------------------------------------


def _jax_gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.mark.gpu
@pytest.mark.skipif(not (_jax_gpus() and hot.cuda_available()), reason="no JAX GPU or hot without CUDA")
def test_gpu_matches_cpu(rng):
    x, w, b, gy = _data(rng, (4, 300), I=128, O=96)
    key = jax.random.key(8)
    cpu = _grads(x, w, b, gy, key)
    gpu = jax.devices("gpu")[0]
    xg, wg, bg, gyg = (jax.device_put(a, gpu) for a in (x, w, b, gy))
    got = jax.jit(jax.grad(lambda x, w, b: jnp.sum(hot.jax.dense(x, w, b, key=key) * gyg), argnums=(0, 1, 2)))(
        xg, wg, bg)
    assert all(list(a.devices())[0].platform == "gpu" for a in got)
    q, _ = jax.jit(hot.jax.compress_activation)(xg)
    np.testing.assert_array_equal(np.asarray(q), hot.compress_activation(x).q)
    for a, c in zip(got, cpu):
        np.testing.assert_allclose(np.asarray(a), c, rtol=2 ** -22, atol=1e-30)


# ---- the Equinox digits example: exact vs HOT ----------------------------------------------------------------------

# Bound on |HOT - exact| test accuracy per seed, in points, after 15 epochs with the same init and batches. Measured
# (python -m hot.experiments.jax_digits --seeds 0 1 2 3 4 5 6 7 8 9 --epochs 15 [--model cnn], CPU, jax 0.10.2): at hot.Config()
# the difference was 0 on 8 of 10 seeds and +-0.28 (one of the 359 test images) on the other two, for the MLP and for
# the CNN alike; at hot.Config.paper() it was -0.92 on average and as low as -2.23 (MLP, seed 2), and -0.84 to -1.67
# on the CNN's seeds 0-5, so this bound separates the two.
DIGITS_BOUND_POINTS = 1.0


@pytest.mark.parametrize("model,seeds", [("mlp", (0, 1, 2)), ("cnn", (0, 1))])
def test_digits_hot_trains_like_exact(model, seeds):
    pytest.importorskip("equinox")
    pytest.importorskip("sklearn")
    from hot.experiments import jax_digits as digits

    data = digits.load_digits()
    for seed in seeds:
        exact = digits.train(hot.Config(exact=True), seed, epochs=15, data=data, model=model)
        h = digits.train(hot.Config(), seed, epochs=15, data=data, model=model)
        diff = 100 * (h["accuracy"] - exact["accuracy"])
        assert exact["accuracy"] > 0.95, exact
        assert abs(diff) <= DIGITS_BOUND_POINTS, (seed, exact, h)


def test_digits_rejects_an_unknown_model():
    pytest.importorskip("equinox")
    pytest.importorskip("sklearn")
    from hot.experiments import jax_digits as digits

    with pytest.raises(ValueError, match=r"model must be one of \('mlp', 'cnn'\), got 'resnet'"):
        digits.train(hot.Config(), 0, epochs=1, model="resnet")
