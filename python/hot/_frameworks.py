"""Per-framework conventions: how to allocate an output like a given array, how to turn a hot array
back into the caller's type, and which stream the caller's framework is using.

Frameworks are imported lazily: hot itself needs only numpy.
"""
from __future__ import annotations

import contextlib
import functools
import math
import sys

import numpy as np

from . import _dlpack

# DLPack device types (see cpp/bindings/dlpack_abi.h).
_CPU, _CUDA, _CUDA_HOST = 1, 2, 3


@functools.cache
def _torch_dtypes() -> dict:
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
            "uint8": torch.uint8, "int32": torch.int32}


def _torch_dtype(name):
    return _torch_dtypes()[name]


class Framework:
    """Default behaviour: a numpy-compatible CPU framework."""

    name = "numpy"
    can_allocate = True  # False: hot allocates outputs itself and hands them over with from_dlpack

    def prepare(self, x):
        return x

    def device(self, x):
        """(DLPack device type, index) of x, or None when x does not support DLPack."""
        return _dlpack.device_of(x)

    def exporter(self):
        """None, or a function that maps a call's argument tuple to a list where this framework's arrays are
        DLPack capsules for hot._C, made faster than by the generic __dlpack__ protocol (other arguments pass
        through unchanged)."""
        return None

    def dtype_name(self, x) -> str:
        return np.dtype(x.dtype).name

    def empty(self, shape, dtype, like):
        return np.empty(shape, dtype=np.dtype(dtype))

    def empty_as(self, shape, a, like):
        """empty(shape, the dtype of array a, like)."""
        return self.empty(shape, self.dtype_name(a), like)

    def from_dlpack(self, a, like):
        return np.from_dlpack(a)

    def stream(self, like) -> int:
        return 0

    def device_scope(self, like):
        """A context in which `like`'s device is the framework's current device (DLPack exports of CUDA
        arrays in torch require it)."""
        return contextlib.nullcontext()

    def cast(self, x, dtype):
        return x.astype(dtype)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def permute(self, x, axes):
        """x with its axes in the order `axes` (a view where the framework has views)."""
        return x.transpose(axes)

    def copy_(self, dst, src):
        np.copyto(dst, src)


class Numpy(Framework):
    name = "numpy"

    def prepare(self, x):
        if isinstance(x, np.generic):  # a numpy scalar: a 0-d array
            return np.asarray(x)
        return x


class Torch(Framework):
    name = "torch"

    def permute(self, x, axes):
        return x.permute(axes)

    def prepare(self, x):
        # DLPack refuses tensors that require grad; hot's ops are not differentiable themselves
        # (hot.torch wraps them in autograd Functions).
        return x.detach()

    def device(self, x):
        if x.is_cpu:
            return (_CPU, 0)
        if x.is_cuda:
            d = x.device
            return (_CUDA, d.index if d.index is not None else 0)
        raise ValueError(f"is on torch device '{x.device}', expected a CPU or CUDA tensor")

    def exporter(self):
        # Tensors (CPU or CUDA: device() refuses others) go to hot._C as capsules made by torch's C++ exporter:
        # no Python-level __dlpack__/__dlpack_device__ calls, no stream object, no device switch. hot runs on
        # the caller's current stream (passed separately), so the exporter's stream handshake is not needed.
        return _torch_export()

    def dtype_name(self, x) -> str:
        return str(x.dtype).replace("torch.", "")

    def empty(self, shape, dtype, like):
        return _torch_empty()(tuple(shape), dtype=_torch_dtypes()[dtype], device=like.device)

    def empty_as(self, shape, a, like):
        return _torch_empty()(tuple(shape), dtype=a.dtype, device=like.device)

    def from_dlpack(self, a, like):
        import torch

        return torch.from_dlpack(a)

    def stream(self, like) -> int:
        if not like.is_cuda:
            return 0
        return _torch_raw_stream()(self.device(like)[1])

    def device_scope(self, like):
        if like.device.type != "cuda":
            return contextlib.nullcontext()
        import torch

        return torch.cuda.device(like.device)

    def cast(self, x, dtype):
        return x.to(_torch_dtype(dtype))

    def copy_(self, dst, src):
        dst.copy_(src)


@functools.cache
def _torch_export():
    """The exporter of torch arrays: the call's arguments with every tensor as a DLPack capsule."""
    import torch
    import torch.utils.dlpack

    to_dlpack, tensor = torch.utils.dlpack.to_dlpack, torch.Tensor

    def export(args):
        return [to_dlpack(a) if isinstance(a, tensor) else a for a in args]

    return export


@functools.cache
def _torch_empty():
    import torch

    return torch.empty


@functools.cache
def _torch_raw_stream():
    """device index -> cudaStream_t (int) of torch's current stream there."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # pragma: no cover - older or newer torch without the private binding
        def raw(index):
            return int(torch.cuda.current_stream(index).cuda_stream)
    return raw


class Cupy(Framework):
    name = "cupy"

    def empty(self, shape, dtype, like):
        import cupy

        with like.device:
            return cupy.empty(tuple(shape), dtype=np.dtype(dtype) if dtype != "bfloat16" else _bf16_numpy_dtype())

    def from_dlpack(self, a, like):
        import cupy

        return cupy.from_dlpack(a)

    def stream(self, like) -> int:
        import cupy

        with like.device:
            return int(cupy.cuda.get_current_stream().ptr)

    def device_scope(self, like):
        return like.device

    def copy_(self, dst, src):
        dst[...] = src


class Jax(Framework):
    name = "jax"
    can_allocate = False  # immutable arrays: hot allocates and jax imports with from_dlpack

    def dtype_name(self, x) -> str:
        return np.dtype(x.dtype).name

    def empty(self, shape, dtype, like):
        return None

    def from_dlpack(self, a, like):
        import jax.dlpack

        return jax.dlpack.from_dlpack(a)

    def stream(self, like) -> int:
        # jax runs its computations on its own streams and synchronises when exporting through
        # DLPack for a consumer stream; hot runs on the legacy default stream.
        return 0

    def cast(self, x, dtype):
        import jax.numpy as jnp

        return x.astype(jnp.dtype(dtype))

    def copy_(self, dst, src):
        raise ValueError("jax arrays are immutable; hot cannot copy into them")


class Generic(Framework):
    """Any other DLPack producer: results come back as numpy arrays (CPU) or hot arrays (GPU)."""

    name = "dlpack"
    can_allocate = False

    def dtype_name(self, x) -> str:
        return str(getattr(x, "dtype", "unknown"))

    def from_dlpack(self, a, like):
        if _dlpack.device_of(a)[0] == _CPU:
            return np.from_dlpack(a)
        return a

    def reshape(self, x, shape):
        if isinstance(x, np.ndarray):
            return x.reshape(shape)
        return x

    def permute(self, x, axes):
        if isinstance(x, np.ndarray):
            return x.transpose(axes)
        return x


_NUMPY, _TORCH, _CUPY, _JAX, _GENERIC = Numpy(), Torch(), Cupy(), Jax(), Generic()


def _bf16_numpy_dtype():
    try:
        import ml_dtypes

        return ml_dtypes.bfloat16
    except ImportError as e:  # pragma: no cover - only with cupy and without ml_dtypes
        raise TypeError("a bfloat16 cupy output needs the ml_dtypes package") from e


_OF_TYPE = {}


def of(x) -> Framework:
    """The framework of array x (by its type's module; cached per type)."""
    t = type(x)
    fw = _OF_TYPE.get(t)
    if fw is None:
        mod = t.__module__.split(".", 1)[0]
        if mod == "numpy":
            fw = _NUMPY
        elif mod == "torch":
            fw = _TORCH
        elif mod == "cupy":
            fw = _CUPY
        elif mod in ("jax", "jaxlib"):
            fw = _JAX
        else:
            fw = _GENERIC
        _OF_TYPE[t] = fw
    return fw


def check_arrays(op: str, **arrays) -> tuple:
    """TypeError for a non-DLPack argument, ValueError for arrays on different devices (or on a device their
    framework cannot export); returns the common device."""
    return check_arrays_first(op, arrays)[0]


def check_arrays_first(op: str, arrays: dict) -> tuple:
    """check_arrays over a dict name -> array (or None); returns (the common device, the first array)."""
    first_name, first_dev, first = None, None, None
    for name, a in arrays.items():
        if a is None:
            continue
        try:
            dev = of(a).device(a)
        except ValueError as e:  # e.g. torch's meta device
            raise ValueError(f"{op}: {name} {e}") from None
        if dev is None:
            raise TypeError(
                f"{op}: {name} is a {type(a).__module__}.{type(a).__qualname__}, expected an array that "
                "supports DLPack (numpy, torch, cupy or jax array)"
            )
        if first_dev is None:
            first_name, first_dev, first = name, dev, a
        elif dev != first_dev:
            raise ValueError(
                f"{op}: {name} is on {_dlpack.device_str(dev)} but {first_name} is on "
                f"{_dlpack.device_str(first_dev)}; all arrays must be on one device"
            )
    return first_dev, first


def ndim(x) -> int:
    return len(shape(x))


def shape(x) -> tuple:
    s = x.shape
    if type(s).__name__ == "Size":  # torch.Size: Python ints already
        return tuple(s)
    return tuple(int(v) for v in s)


def prod(s) -> int:
    return int(math.prod(s))


def loaded(name: str) -> bool:
    return name in sys.modules
