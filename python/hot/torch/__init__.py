"""PyTorch front end of hot: drop-in HOT layers, model conversion, LQS calibration and summaries.

    import hot, hot.torch
    report = hot.torch.convert(model, hot.Config())   # swaps nn.Linear / nn.Conv2d (groups=1) in place
    print(report)
    hot.torch.calibrate(model, (x, y), F.cross_entropy)  # LQS (SPEC §7), optional
    hot.torch.summary(model, x)

Import explicitly (``import hot.torch``); ``import hot`` stays free of torch.
"""
from __future__ import annotations

import hot  # noqa: F401  (engine)

from . import ops  # registers the torch.library custom ops (namespace "hot")
from .convert import ConvertReport, convert, hot_layers
from .layers import Conv2d, Linear, hot_conv2d, hot_linear
from .lqs import calibrate, lqs_errors
from .summary import summary
from . import models

__all__ = ["Linear", "Conv2d", "convert", "ConvertReport", "calibrate", "summary", "hot_layers", "hot_linear",
           "hot_conv2d", "lqs_errors", "models", "ops"]
