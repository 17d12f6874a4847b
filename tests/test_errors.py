"""Every bad input raises the right exception type, naming the function and the argument."""
import numpy as np
import pytest

import hot

rng = np.random.default_rng(0)
GY = rng.standard_normal((8, 16)).astype(np.float32)
W = rng.standard_normal((16, 12)).astype(np.float32)
X = rng.standard_normal((8, 12)).astype(np.float32)
EXACT = hot.Config(exact=True)


def f32(*s):
    return np.ones(s, np.float32)


CASES = [
    # (id, call, exception, substrings of the message)
    ("weight_3d", lambda: hot.backward_linear(GY, f32(2, 16, 12), X), ValueError,
     ["backward_linear: weight has 3 dims, expected 2 (O x I)"]),
    ("weight_O_mismatch", lambda: hot.backward_linear(GY, f32(15, 12), X), ValueError,
     ["backward_linear", "weight", "O must agree"]),
    ("grad_output_int", lambda: hot.backward_linear(GY.astype(np.int32), W, X), TypeError,
     ["backward_linear", "grad_output", "int32", "float32"]),
    ("weight_float64", lambda: hot.backward_linear(GY, W.astype(np.float64), X), TypeError,
     ["backward_linear", "weight", "float64"]),
    ("x_float64", lambda: hot.backward_linear(GY, W, X.astype(np.float64)), TypeError,
     ["backward_linear", "saved", "float64"]),
    ("x_wrong_shape", lambda: hot.backward_linear(GY, W, f32(8, 11)), ValueError,
     ["backward_linear", "saved", "(8, 11)"]),
    ("grad_output_empty", lambda: hot.backward_linear(f32(0, 16), W, f32(0, 12)), ValueError,
     ["backward_linear", "grad_output", "empty"]),
    ("weight_empty", lambda: hot.backward_linear(f32(8, 0), f32(0, 12), X), ValueError,
     ["backward_linear", "empty"]),
    ("saved_none", lambda: hot.backward_linear(GY, W, None), ValueError,
     ["backward_linear", "saved", "None"]),
    ("saved_wrong_rows", lambda: hot.backward_linear(GY, W, hot.compress_activation(f32(9, 12))), ValueError,
     ["backward_linear", "saved"]),
    ("saved_rank_mismatch",
     lambda: hot.backward_linear(GY, W, hot.compress_activation(X, hot.Config(rank=4))), ValueError,
     ["backward_linear", "rank"]),
    ("not_an_array", lambda: hot.backward_linear([[1.0]], W, X), TypeError,
     ["backward_linear", "grad_output", "list", "DLPack"]),
    ("config_type", lambda: hot.backward_linear(GY, W, X, config={"rank": 8}), TypeError,
     ["backward_linear", "config"]),
    ("seed_negative", lambda: hot.backward_linear(GY, W, X, seed=-1), ValueError, ["backward_linear", "seed"]),
    ("seed_float", lambda: hot.backward_linear(GY, W, X, seed=1.5), TypeError, ["backward_linear", "seed"]),
    ("compress_empty", lambda: hot.compress_activation(f32(0, 4)), ValueError, ["compress_activation", "x", "empty"]),
    ("compress_int8", lambda: hot.compress_activation(np.ones((4, 4), np.int8)), TypeError,
     ["compress_activation", "x", "int8"]),
    ("compress_col_strided", lambda: hot.compress_activation(f32(4, 8)[:, ::2]), ValueError,
     ["compress_activation", "x", "contiguous"]),
    ("hadamard_block_not_dividing", lambda: hot.hadamard_transform(f32(4, 24), block=16), ValueError,
     ["hadamard_transform", "block 16", "24"]),
    ("hadamard_block_not_pow2", lambda: hot.hadamard_transform(f32(4, 24), block=3), ValueError,
     ["hadamard_transform", "block", "power of two"]),
    ("hadamard_axis", lambda: hot.hadamard_transform(f32(4, 16), axis=2), ValueError, ["hadamard_transform", "axis"]),
    ("hadamard_int", lambda: hot.hadamard_transform(np.ones((4, 16), np.int32)), TypeError,
     ["hadamard_transform", "x", "int32"]),
    ("hla_rank", lambda: hot.hla(f32(16, 4), rank=0), ValueError, ["hla", "rank", "1..16"]),
    ("quantize_bits", lambda: hot.quantize(f32(4, 4), bits=5), ValueError, ["quantize", "bits", "4 or 8"]),
    ("quantize_scale", lambda: hot.quantize(f32(4, 4), scale="row"), ValueError, ["quantize", "scale", "row"]),
    ("quantize_rounding", lambda: hot.quantize(f32(4, 4), rounding="up"), ValueError, ["quantize", "rounding"]),
    ("quantize_empty", lambda: hot.quantize(f32(4, 0)), ValueError, ["quantize", "x", "empty"]),
    ("dequantize_dtype", lambda: hot.dequantize(np.ones((2, 2), np.int8), f32(1), dtype="int8"), TypeError,
     ["dequantize", "dtype"]),
    ("dequantize_q_float", lambda: hot.dequantize(f32(2, 2), f32(1)), TypeError, ["dequantize", "q", "int8"]),
    ("dequantize_scale_shape", lambda: hot.dequantize(np.ones((2, 2), np.int8), f32(3)), ValueError,
     ["dequantize", "scale"]),
    ("pack_odd", lambda: hot.pack_int4(np.ones((2, 3), np.int8)), ValueError, ["pack_int4", "q", "even"]),
    ("pack_out_of_range", lambda: hot.pack_int4(np.full((2, 2), 9, np.int8)), ValueError, ["pack_int4"]),
    ("pack_float", lambda: hot.pack_int4(f32(2, 2)), TypeError, ["pack_int4", "q", "float32"]),
    ("unpack_int8", lambda: hot.unpack_int4(np.ones((2, 2), np.int8)), TypeError,
     ["unpack_int4", "packed", "uint8"]),
    ("gemm_k_mismatch", lambda: hot.gemm_s8(np.ones((2, 3), np.int8), np.ones((2, 4), np.int8)), ValueError,
     ["gemm_s8", "K"]),
    ("gemm_3d", lambda: hot.gemm_s8(np.ones((2, 3, 3), np.int8), np.ones((2, 3), np.int8)), ValueError,
     ["gemm_s8", "a", "3 dims"]),
    ("gemm_dtype", lambda: hot.gemm_s8(np.ones((2, 3), np.int32), np.ones((2, 3), np.int8)), TypeError,
     ["gemm_s8", "a", "int32"]),
    ("gemm_s4_dtype", lambda: hot.gemm_s4(np.ones((2, 3), np.int8), np.ones((2, 3), np.uint8)), TypeError,
     ["gemm_s4", "a", "int8"]),
    ("set_num_threads", lambda: hot.set_num_threads(-2), ValueError, ["set_num_threads"]),
    ("set_num_threads_big", lambda: hot.set_num_threads(2 ** 31), ValueError, ["set_num_threads", "0..1024"]),
    # exact mode casts x and W to grad_output's dtype, floating dtypes only
    ("exact_x_complex", lambda: hot.backward_linear(GY, W, X.astype(np.complex64), config=EXACT), TypeError,
     ["backward_linear", "saved has dtype complex64", "float32"]),
    ("exact_x_bool", lambda: hot.backward_linear(GY, W, X > 0, config=EXACT), TypeError,
     ["backward_linear", "saved has dtype bool"]),
    ("exact_weight_int", lambda: hot.backward_linear(GY, W.astype(np.int32), X, config=EXACT), TypeError,
     ["backward_linear", "weight has dtype int32"]),
    # dtypes without a name in the native module's messages get their numpy name
    ("grad_output_bool", lambda: hot.backward_linear(GY > 0, W, X), TypeError,
     ["backward_linear: grad_output has dtype bool, expected"]),
    ("quantize_complex", lambda: hot.quantize(X.astype(np.complex64)), TypeError,
     ["quantize: x has dtype complex64, expected"]),
    ("dequantize_bfloat16_numpy", lambda: hot.dequantize(np.ones((2, 2), np.int8), f32(1), dtype="bfloat16"),
     TypeError, ["dequantize", "dtype bfloat16", "numpy"]),
]


@pytest.mark.parametrize("call,exc,parts", [pytest.param(c, e, p, id=i) for i, c, e, p in CASES])
def test_bad_input(call, exc, parts):
    with pytest.raises(exc) as e:
        call()
    msg = str(e.value)
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"


def test_mixed_devices_is_a_value_error():
    """A second device type in one call (here a DLPack producer claiming CUDA) is refused up front."""

    class FakeCuda:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kw):  # pragma: no cover - never reached
            raise AssertionError("must not be consumed")

    with pytest.raises(ValueError, match=r"backward_linear: weight is on cuda:0 but grad_output is on cpu"):
        hot.backward_linear(GY, FakeCuda(), X)


@pytest.mark.parametrize("value", ["abc", "-3", "4x", "100000"])
def test_bad_hot_num_threads_is_a_clear_error(value):
    """HOT_NUM_THREADS is read at the first CPU operation: anything but an integer in 0..1024 is an error naming it."""
    import os
    import subprocess
    import sys

    code = ("import numpy as np, hot\n"
            "try:\n"
            "    hot.gemm_s8(np.ones((64, 16), np.int8), np.ones((2, 16), np.int8))\n"
            "except ValueError as e:\n"
            "    print('ValueError:', e)\n")
    env = dict(os.environ, HOT_NUM_THREADS=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ValueError: environment variable HOT_NUM_THREADS: expected an integer in 0..1024" in out.stdout
    assert f"got '{value}'" in out.stdout


def test_torch_dtypes_are_named():
    torch = pytest.importorskip("torch")
    for dt, name in ((torch.bool, "bool"), (torch.complex64, "complex64"), (torch.float8_e4m3fn, "float8_e4m3fn")):
        with pytest.raises(TypeError, match=f"quantize: x has dtype {name}, expected"):
            hot.quantize(torch.ones(4, 4).to(dt))


@pytest.mark.skipif(not hot.cuda_available(), reason="needs a GPU")
def test_mixed_devices_torch():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="one device"):
        hot.backward_linear(torch.tensor(GY).cuda(), torch.tensor(W), torch.tensor(X))


@pytest.mark.skipif(hot.cuda_available(), reason="CPU-only build")
def test_cuda_unavailable_is_explained():
    assert hot.cuda_available() is False
    assert "CUDA" in hot.cuda_unavailable_reason() or "cuda" in hot.cuda_unavailable_reason().lower()
