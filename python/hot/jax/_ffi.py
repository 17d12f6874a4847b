"""Loads hot's XLA FFI library (hot/_hot_jax_ffi.so, built from cpp/jax/hot_jax_ffi.cpp) and registers its handlers
with JAX: the CPU handlers always, the CUDA handlers when hot was built with CUDA."""
from __future__ import annotations

import ctypes
import os

import jax

import hot

LIBRARY = "_hot_jax_ffi.so"
# target name -> exported symbol stem (the library exports <stem>Cpu and, with CUDA, <stem>Cuda)
TARGETS = {
    "hot_compress_activation": "HotJaxCompress",
    "hot_backward_linear": "HotJaxBackward",
    "hot_backward_linear_bias": "HotJaxBackwardBias",
    "hot_quantize_nearest": "HotJaxQuantize",
    "hot_compress_columns": "HotJaxCompressColumns",
    "hot_im2col_t": "HotJaxIm2colT",
    "hot_backward_conv2d": "HotJaxBackwardConv",
    "hot_backward_conv2d_bias": "HotJaxBackwardConvBias",
}

_lib = None
platforms: tuple = ()


def library_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(hot.__file__)), LIBRARY)


def _missing_message(path: str) -> str:
    return (
        f"hot.jax: hot was built without its JAX library ({path} is missing): jaxlib's XLA FFI headers were not found "
        "when hot was built. With jax installed (pip install jax, or pip install 'hot[jax]'), rebuild hot so that "
        "CMake finds them: pip install --no-build-isolation . (a build with build isolation does not see the installed "
        "jax), or pip install . -C cmake.define.HOT_JAX_FFI_INCLUDE_DIR=\"$(python -c 'import jax.ffi; "
        "print(jax.ffi.include_dir())')\"; in-tree: cmake -S . -B build -DHOT_BUILD_JAX=ON")


def load():
    """The library as a ctypes handle, its targets registered (once per process)."""
    global _lib, platforms
    if _lib is not None:
        return _lib
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(_missing_message(path))
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(f"hot.jax: could not load {path}: {e}") from e
    lib.HotJaxHasCuda.restype = ctypes.c_int
    lib.HotJaxSetNumThreads.argtypes = [ctypes.c_int]
    lib.HotJaxSetNumThreads.restype = ctypes.c_int
    lib.HotJaxGetNumThreads.restype = ctypes.c_int
    lib.HotJaxBuildInfo.restype = ctypes.c_char_p
    regs = [("cpu", "Cpu")]
    if lib.HotJaxHasCuda():
        regs.append(("CUDA", "Cuda"))
    for name, stem in TARGETS.items():
        for platform, suffix in regs:
            fn = getattr(lib, stem + suffix)
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform=platform)
    _lib = lib
    platforms = tuple(p for p, _ in regs)
    return lib
