"""Shared fixtures of the hot pytest suite: frameworks (numpy, torch CPU; CUDA ones skip without a GPU),
dtypes and memory layouts, all with readable ids."""
from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py

import hot  # noqa: E402


def _has(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


HAS_TORCH = _has("torch")
HAS_CUPY = _has("cupy")
HAS_JAX = _has("jax")
CUDA = hot.cuda_available()
NO_CUDA_REASON = "no CUDA: " + (hot.cuda_unavailable_reason() or "available")


def _jax_gpu() -> bool:
    if not (HAS_JAX and CUDA):
        return False
    import jax

    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


class FW:
    """How a test makes arrays of one framework on one device and reads them back."""

    def __init__(self, name, dtypes, device="cpu"):
        self.name, self.dtypes, self.device = name, dtypes, device

    def __repr__(self):
        return self.name

    # --- making arrays ---
    def convert(self, a: np.ndarray, dtype: str):
        raise NotImplementedError

    def make(self, a, dtype="float32", layout="contiguous"):
        """a (numpy, any shape) in `dtype` on this framework/device, with the given memory layout:
        contiguous; row_strided (a slice of a wider array: row stride > cols, unit column stride);
        col_strided (every other column: non-unit column stride)."""
        a = np.asarray(a)
        if layout == "contiguous":
            return self.convert(np.ascontiguousarray(a), dtype)
        C = a.shape[-1]
        if layout == "row_strided":
            base = np.zeros(a.shape[:-1] + (C + 3,), a.dtype)
            base[..., :C] = a
            return self.convert(base, dtype)[..., :C]
        if layout == "col_strided":
            base = np.zeros(a.shape[:-1] + (2 * C,), a.dtype)
            base[..., ::2] = a
            return self.convert(base, dtype)[..., ::2]
        raise ValueError(layout)

    def numpy(self, x) -> np.ndarray:
        raise NotImplementedError

    def check(self, x, dtype, shape):
        """x is an array of this framework, on this device, of `dtype` and `shape`."""
        raise NotImplementedError


class NumpyFW(FW):
    def convert(self, a, dtype):
        return a.astype(dtype)

    def numpy(self, x):
        return np.asarray(x)

    def check(self, x, dtype, shape):
        assert isinstance(x, np.ndarray), type(x)
        assert x.dtype == np.dtype(dtype), x.dtype
        assert tuple(x.shape) == tuple(shape), (x.shape, shape)


class TorchFW(FW):
    def _dt(self, dtype):
        import torch

        return getattr(torch, dtype)

    def convert(self, a, dtype):
        import torch

        src = a.astype(np.float32) if a.dtype.kind == "f" else a
        return torch.from_numpy(np.ascontiguousarray(src)).to(device=self.device, dtype=self._dt(dtype))

    def numpy(self, x):
        import torch

        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        return x.numpy()

    def check(self, x, dtype, shape):
        import torch

        assert isinstance(x, torch.Tensor), type(x)
        assert x.dtype == self._dt(dtype), x.dtype
        assert x.device.type == torch.device(self.device).type, x.device
        assert tuple(x.shape) == tuple(shape), (x.shape, shape)


class CupyFW(FW):
    def convert(self, a, dtype):
        import cupy

        return cupy.asarray(a.astype(dtype))

    def numpy(self, x):
        import cupy

        return cupy.asnumpy(x)

    def check(self, x, dtype, shape):
        import cupy

        assert isinstance(x, cupy.ndarray), type(x)
        assert x.dtype == np.dtype(dtype), x.dtype
        assert tuple(x.shape) == tuple(shape)


class JaxFW(FW):
    def convert(self, a, dtype):
        import jax
        import jax.numpy as jnp

        dev = jax.devices(self.device)[0]
        return jax.device_put(jnp.asarray(a.astype(np.float32) if a.dtype.kind == "f" else a).astype(dtype), dev)

    def numpy(self, x):
        import jax.numpy as jnp

        if x.dtype in (jnp.bfloat16, jnp.float16):
            x = x.astype(jnp.float32)
        return np.asarray(x)

    def check(self, x, dtype, shape):
        import jax
        import jax.numpy as jnp

        assert isinstance(x, jax.Array), type(x)
        assert x.dtype == jnp.dtype(dtype), x.dtype
        assert list(x.devices())[0].platform == ("cpu" if self.device == "cpu" else "gpu")
        assert tuple(x.shape) == tuple(shape)


def _param(fw, skip_reason):
    marks = [pytest.mark.skip(reason=skip_reason)] if skip_reason else []
    if fw.device != "cpu":
        marks.append(pytest.mark.gpu)
    return pytest.param(fw, id=fw.name, marks=marks)


FRAMEWORKS = [
    _param(NumpyFW("numpy", ("float32", "float16")), None),
    _param(TorchFW("torch", ("float32", "float16", "bfloat16")), None if HAS_TORCH else "torch not installed"),
    _param(JaxFW("jax", ("float32", "bfloat16")), None if HAS_JAX else "jax not installed"),
    _param(TorchFW("torch_cuda", ("float32", "float16", "bfloat16"), "cuda"),
           None if (HAS_TORCH and CUDA) else ("torch not installed" if not HAS_TORCH else NO_CUDA_REASON)),
    _param(CupyFW("cupy", ("float32", "float16"), "cuda"),
           None if (HAS_CUPY and CUDA) else ("cupy not installed" if not HAS_CUPY else NO_CUDA_REASON)),
    _param(JaxFW("jax_gpu", ("float32", "bfloat16"), "gpu"), None if _jax_gpu() else "no jax GPU"),
]


def _fw_dtype_params():
    out = []
    for p in FRAMEWORKS:
        fw = p.values[0]
        for dt in ("float32", "float16", "bfloat16"):
            if dt in fw.dtypes:
                out.append(pytest.param(fw, dt, id=f"{fw.name}-{dt}", marks=p.marks))
    return out


# (framework, float dtype) pairs the framework supports, ids "torch-bfloat16".
FW_DTYPES = _fw_dtype_params()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skips cleanly without one)")


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# Tolerances: unit roundoff of each dtype (the error of rounding one result to it).
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
