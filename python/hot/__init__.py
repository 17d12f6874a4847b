"""hot: Hadamard-based Optimized Training (HOT, CVPR 2025) - integer backward passes and compressed
activations for linear and convolution layers.

Every function accepts arrays of any DLPack framework (numpy, torch, cupy, jax) and returns arrays of
the caller's framework on the caller's device. See SPEC.md for the method.
"""
try:
    from . import _C
except ImportError as _e:  # pragma: no cover - a broken or missing build
    raise ImportError(
        "hot: the native module hot._C could not be imported (" + str(_e) + "). Install hot with "
        "`pip install .` or build it in-tree with cmake (see README)."
    ) from _e

from ._api import (
    Config,
    QuantizedWeight,
    SavedActivation,
    activation_codes,
    backward_linear,
    batch_norm_backward_input,
    batch_norm_backward_reduce,
    batch_norm_stats,
    batch_norm_transform,
    build_info,
    col2im,
    column_codes,
    compress_columns,
    compress_activation,
    cuda_available,
    cuda_unavailable_reason,
    dequantize,
    gemm_s4,
    gemm_s8,
    get_num_threads,
    hadamard_transform,
    hla,
    im2col,
    pack_int4,
    quantize,
    quantize_weight,
    relu_mask,
    relu_mask_backward,
    set_num_threads,
    unpack_int4,
)

__version__ = _C.__version__

__all__ = [
    "Config",
    "QuantizedWeight",
    "SavedActivation",
    "activation_codes",
    "backward_linear",
    "batch_norm_backward_input",
    "batch_norm_backward_reduce",
    "batch_norm_stats",
    "batch_norm_transform",
    "build_info",
    "col2im",
    "column_codes",
    "compress_columns",
    "compress_activation",
    "cuda_available",
    "cuda_unavailable_reason",
    "dequantize",
    "gemm_s4",
    "gemm_s8",
    "get_num_threads",
    "hadamard_transform",
    "hla",
    "im2col",
    "pack_int4",
    "quantize",
    "quantize_weight",
    "relu_mask",
    "relu_mask_backward",
    "set_num_threads",
    "unpack_int4",
    "__version__",
]
