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


_OF = None


def _framework_of():
    global _OF
    if _OF is None:
        from ._frameworks import of

        _OF = of
    return _OF


def check_arrays(op: str, **arrays) -> tuple:
    """TypeError for a non-DLPack argument, ValueError for arrays on different devices; returns the
    common device."""
    of = _framework_of()
    first_name, first_dev = None, None
    for name, a in arrays.items():
        if a is None:
            continue
        try:
            dev = of(a).device(a)
        except ValueError as e:  # a device the framework cannot export (e.g. torch's meta)
            raise ValueError(f"{op}: {name} {e}") from None
        if dev is None:
            raise TypeError(
                f"{op}: {name} is a {type(a).__module__}.{type(a).__qualname__}, expected an array that "
                "supports DLPack (numpy, torch, cupy or jax array)"
            )
        if first_dev is None:
            first_name, first_dev = name, dev
        elif dev != first_dev:
            raise ValueError(
                f"{op}: {name} is on {device_str(dev)} but {first_name} is on {device_str(first_dev)}; "
                "all arrays must be on one device"
            )
    return first_dev
