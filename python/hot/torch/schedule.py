"""``hot.torch.Warmup``: the paper's INT8 warm-up (SPEC §10; supplement, Appendix B).

For the first ``steps`` training steps every HOT layer runs ``config`` (default ``hot.Config()``: 8-bit g_x, full
rank), then its own configuration. The state lives in the layers (``layer.hot_warmup``: steps left and the
configuration to return to) and travels with the model's state_dict, so a run restored from a checkpoint resumes
the warm-up where it stopped: ``Warmup(model)`` without ``steps`` picks it up. Under ``torch.compile`` each layer is
compiled once per configuration: once for the warm-up and once after it, not every step.
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

import hot

from .convert import hot_layers


class Warmup:
    """Run every HOT layer of ``model`` at ``config`` for ``steps`` calls of ``step()`` (one per optimizer step),
    then at its own configuration. ``steps=None`` resumes a warm-up restored with the model's state_dict."""

    def __init__(self, model: nn.Module, steps: Optional[int] = None, config=None) -> None:
        layers = hot_layers(model)
        if not layers:
            raise ValueError("hot.torch.Warmup: the model has no HOT layers; run hot.torch.convert(model) first")
        if config is None:
            config = hot.Config()
        elif not isinstance(config, hot.Config):
            raise TypeError(f"hot.torch.Warmup: config must be a hot.Config, got {type(config).__name__}")
        self.model = model
        if steps is None:
            return  # resume: the layers hold the state
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"hot.torch.Warmup: steps must be a non-negative integer, got {steps!r}")
        if steps == 0:
            return
        for _, m in layers:
            target = m.hot_target_config
            m.hot_warmup = {"left": steps, "target": target}
            m.hot_config = config

    @property
    def left(self) -> int:
        """Steps left in the warm-up (the most over the layers; 0 once it is over)."""
        return max((m.hot_warmup["left"] for _, m in hot_layers(self.model) if m.hot_warmup is not None), default=0)

    def step(self) -> None:
        """Count one training step; layers whose warm-up is over switch to their own configuration."""
        for _, m in hot_layers(self.model):
            w = m.hot_warmup
            if w is None:
                continue
            if w["left"] <= 1:
                m.hot_warmup = None
                m.hot_config = w["target"]
            else:
                m.hot_warmup = {"left": w["left"] - 1, "target": w["target"]}
