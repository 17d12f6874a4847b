"""DLPack helpers of the Python layer: devices of arrays (the protocol itself lives in hot._C)."""
from __future__ import annotations

_CPU, _CUDA, _CUDA_HOST = 1, 2, 3
_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 13: "cuda_managed"}


def device_of(x) -> tuple:
    """(DLPack device type, index) of x; CUDA host memory counts as the CPU."""
    fn = getattr(x, "__dlpack_device__", None)
    if fn is None:
        return None
    t, i = fn()
    t, i = int(t), int(i)
    if t == _CUDA_HOST:
        return (_CPU, 0)
    if t == _CPU:
        return (_CPU, 0)
    return (t, i)


def device_str(dev) -> str:
    t, i = dev
    return "cpu" if t == _CPU else f"{_NAMES.get(t, f'device_type_{t}')}:{i}"
