"""PyTorch front end of hot: drop-in HOT layers, model conversion, per-layer calibration, the paper's LQS and
warm-up, and summaries.

    import hot, hot.torch
    report = hot.torch.convert(model)  # swaps nn.Linear / nn.Conv2d (groups=1), nn.ReLU / MaxPool2d / BatchNorm2d
    print(report)                                        # default: hot.Config(), the accurate configuration
    hot.torch.calibrate(model, (x, y), F.cross_entropy)  # optional: cheaper settings where measured safe (SPEC §7.2)
    hot.torch.summary(model, x)

Import explicitly (``import hot.torch``); ``import hot`` stays free of torch.
"""
from __future__ import annotations

import hot  # noqa: F401  (engine)

from . import ops  # registers the torch.library ops (namespace "hot")
from .ops import WeightReuse, weight_reuse
from .convert import ConvertReport, convert, hot_layers
from .layers import Conv1d, Conv2d, Linear, MultiheadAttention, TransposedLinear, hot_conv2d, hot_linear
from .lean import BatchNorm2d, MaxPool2d, ReLU
from .calibrate import DEFAULT_BIAS_BUDGET, DEFAULT_BUDGET, Recalibrator, calibrate, int4_tensor_cores, lqs, lqs_errors
from .schedule import Warmup
from .summary import summary

__all__ = ["Linear", "Conv2d", "Conv1d", "MultiheadAttention", "TransposedLinear", "ReLU", "MaxPool2d", "BatchNorm2d", "convert", "ConvertReport", "calibrate", "Recalibrator", "DEFAULT_BUDGET", "DEFAULT_BIAS_BUDGET", "lqs",
           "Warmup", "int4_tensor_cores", "summary", "hot_layers", "hot_linear", "hot_conv2d", "lqs_errors", "weight_reuse", "WeightReuse",
           "ops"]
