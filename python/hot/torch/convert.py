"""``hot.torch.convert``: swap eligible layers of a model for HOT layers, in place (SPEC §8).

Eligible: modules whose type is exactly ``nn.Linear``, or ``nn.Conv2d`` / ``nn.Conv1d`` with ``groups == 1``, zero
padding and float32/float16/bfloat16 parameters on one device. The swap changes the module's class in
place (``module.__class__``), so the module object, its parameters (and any optimizer holding them),
hooks and state_dict keys stay the same. An ``nn.MultiheadAttention`` (one embedding size for query, key and
value, no ``add_bias_kv`` / ``add_zero_attn``) becomes a ``hot.torch.MultiheadAttention``: its packed in-projection
is an ``in_proj`` child (a ``hot.torch.Linear`` holding the module's own ``in_proj_weight`` / ``in_proj_bias``) and
its ``out_proj`` a ``hot.torch.Linear``, each selected by include / exclude under its own name
(``<attn>.in_proj``, ``<attn>.out_proj``); parameters and state_dict keys stay nn.MultiheadAttention's. A
transformers ``Conv1D`` (GPT-2's projections, weight stored I x O) becomes an instance of a subclass of its own class
and ``hot.torch.TransposedLinear``. Every module
that is a Linear/Conv2d (or a known container of matmul weights) and is not converted gets a line in the report
with the reason. LoRA (peft-style ``base_layer`` / ``lora_A`` / ``lora_B``): the base layer is converted
and the adapters stay exact (SPEC §8).

Converting a model in which nothing is eligible raises ``ValueError`` (with the report), because a run
that silently trains without HOT is worse than a stopped one; a model whose eligible layers are all
already HOT layers only warns.

With ``keep_less`` (the default) the model's ``nn.ReLU`` and ``nn.MaxPool2d`` modules become ``hot.torch.ReLU`` and
``hot.torch.MaxPool2d`` (same class swap), which keep a 1-bit mask (ReLU) or 1-byte window offsets (max-pool) for their
backward instead of their outputs / inputs: then the converted layer after a ReLU keeps its own int8 copy in place of
the ReLU's output, and the model keeps less than exact training (SPEC §2). Its ``nn.BatchNorm2d`` modules become
``hot.torch.BatchNorm2d``, whose backward, after a converted convolution on a channels-last CUDA map, hands that
convolution the amax its g_y pass would otherwise read g_y once more to find (SPEC §2). The gradients are unchanged bit
for bit.
"""
from __future__ import annotations

import fnmatch
import warnings
from typing import Callable, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn as nn

import hot

from .layers import (Conv1d, Conv2d, HOT_LAYERS, Linear, MultiheadAttention, TransposedLinear, attach_in_proj,
                     conv_padding, transposed_class)
from .lean import BatchNorm2d, MaxPool2d, ReLU
from .ops import ENGINE_FLOATS

Matcher = Union[None, str, Iterable[str], Callable[[str, nn.Module], bool]]

_LORA_ADAPTER_NAMES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def _matcher(spec: Matcher, what: str) -> Optional[Callable[[str, nn.Module], bool]]:
    if spec is None:
        return None
    if callable(spec):
        return spec
    pats = [spec] if isinstance(spec, str) else list(spec)
    for p in pats:
        if not isinstance(p, str):
            raise TypeError(f"hot.torch.convert: {what} must be a name pattern, a list of them or a predicate "
                            f"(name, module) -> bool; got an element of type {type(p).__name__}")

    def match(name: str, module: nn.Module) -> bool:
        for p in pats:
            if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*"):
                return True
        return False

    return match


class ConvertReport:
    """What ``convert`` did: ``converted`` and ``skipped`` lists of (name, type, detail) tuples."""

    def __init__(self, config) -> None:
        self.config = config
        self.converted: List[Tuple[str, str, str]] = []
        self.skipped: List[Tuple[str, str, str]] = []
        self.lean: List[Tuple[str, str]] = []  # (name, type) of the nn.ReLU / nn.MaxPool2d modules swapped (keep_less)

    def __len__(self) -> int:
        return len(self.converted)

    def __str__(self) -> str:
        c = self.config
        lines = [f"hot.torch.convert: {len(self.converted)} layer(s) converted, {len(self.skipped)} left alone "
                 f"(config: {c.describe()})"]
        rows = [("", "layer", "type", "detail")]
        rows += [("+", n or "<root>", t, d) for n, t, d in self.converted]
        rows += [("-", n or "<root>", t, d) for n, t, d in self.skipped]
        w1 = max(len(r[1]) for r in rows)
        w2 = max(len(r[2]) for r in rows)
        for mark, n, t, d in rows:
            lines.append(f"  {mark:1} {n:<{w1}}  {t:<{w2}}  {d}")
        if self.lean:
            n_relu = sum(t == "ReLU" for _, t in self.lean)
            n_pool = sum(t == "MaxPool2d" for _, t in self.lean)
            n_bn = len(self.lean) - n_relu - n_pool
            lines.append(f"  keep_less: {n_relu} nn.ReLU module(s) keep a 1-bit mask for their backward instead of their "
                         f"output, {n_pool} nn.MaxPool2d module(s) 1-byte window offsets instead of their input and "
                         f"indices, {n_bn} nn.BatchNorm2d module(s) hand G~'s amax to the convolution before them "
                         f"(exact gradients; keep_less=False keeps them as they are)")
        return "\n".join(lines)

    __repr__ = __str__


def _describe(m: nn.Module) -> str:
    if isinstance(m, (nn.Linear, TransposedLinear)):
        return (f"{m.out_features} x {m.in_features}" + (" (stored I x O)" if isinstance(m, TransposedLinear) else "")
                + ("" if m.bias is not None else ", no bias"))
    if isinstance(m, (nn.Conv2d, nn.Conv1d)):
        k = "x".join(str(v) for v in m.kernel_size)
        return f"{m.out_channels} x {m.in_channels} x {k}, stride {m.stride}" + ("" if m.bias is not None else ", no bias")
    return ""


def _param_problem(m: nn.Module) -> Optional[str]:
    return _params_problem([p for p in (m.weight, getattr(m, "bias", None)) if p is not None])


def _params_problem(params) -> Optional[str]:
    """Why the engine cannot take a layer with these parameters (lazy, mixed dtypes or devices, unsupported dtype,
    meta device), or None."""
    for p in params:
        if isinstance(p, nn.parameter.UninitializedParameter):
            return "uninitialized (lazy) parameters: run one forward pass before converting"
    dts = {p.dtype for p in params}
    devs = {p.device for p in params}
    if len(dts) > 1:
        return f"mixed parameter dtypes {sorted(str(d) for d in dts)}"
    if len(devs) > 1:
        return f"parameters on several devices {sorted(str(d) for d in devs)}"
    dt = params[0].dtype
    if dt not in ENGINE_FLOATS:
        return f"dtype {dt} is not supported by the hot engine (float32, float16, bfloat16)"
    if params[0].device.type == "meta":
        return "parameters on the meta device"
    return None


def _ineligible(m: nn.Module) -> Optional[str]:
    """Reason a Linear/Conv2d-like module cannot be converted, or None."""
    if type(m) is nn.Linear:
        return _param_problem(m)
    if _transposed_linear(m):
        w, b = getattr(m, "weight", None), getattr(m, "bias", False)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return "Conv1D without a 2-D weight"
        if b is not None and not (isinstance(b, torch.Tensor) and b.shape == (w.shape[1],)):
            return "Conv1D without a bias of its output size (or None)"
        return _param_problem(m)
    if type(m) in (nn.Conv2d, nn.Conv1d):
        if m.groups != 1:
            kind = "depthwise" if m.groups == m.in_channels == m.out_channels else "grouped"
            return f"{kind} conv (groups={m.groups}); only groups=1 is supported"
        if m.padding_mode != "zeros":
            return f"padding_mode={m.padding_mode!r} unsupported (only 'zeros')"
        if conv_padding(m) is None:
            return f"padding='same' needs asymmetric padding for kernel {m.kernel_size}, dilation {m.dilation}"
        return _param_problem(m)
    if isinstance(m, nn.Linear):
        return f"subclass {type(m).__qualname__} of nn.Linear (may override forward); not converted"
    if isinstance(m, nn.Conv2d):
        return f"subclass {type(m).__qualname__} of nn.Conv2d (may override forward); not converted"
    if isinstance(m, nn.Conv1d):
        return f"subclass {type(m).__qualname__} of nn.Conv1d (may override forward); not converted"
    if isinstance(m, (nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return f"{type(m).__name__} is not supported (Linear, Conv1d and Conv2d only)"
    if isinstance(m, nn.MultiheadAttention):
        return f"subclass {type(m).__qualname__} of nn.MultiheadAttention (may override forward); not converted"
    if isinstance(m, nn.Bilinear):
        return "nn.Bilinear is not supported"
    return "not a Linear/Conv2d"


def _mha_problem(m: nn.MultiheadAttention) -> Optional[str]:
    """Why an nn.MultiheadAttention cannot become a hot.torch.MultiheadAttention, or None."""
    if not m._qkv_same_embed_dim:
        return (f"kdim / vdim ({m.kdim}, {m.vdim}) differ from embed_dim {m.embed_dim}: separate projection weights "
                f"are not supported")
    if m.bias_k is not None or m.add_zero_attn:
        return "add_bias_kv / add_zero_attn are not supported"
    if m.embed_dim % m.num_heads:
        return f"embed_dim {m.embed_dim} is not a multiple of num_heads {m.num_heads}"
    return _params_problem([p for p in (m.in_proj_weight, m.in_proj_bias, m.out_proj.weight, m.out_proj.bias)
                            if p is not None])


def _transposed_linear(m: nn.Module) -> bool:
    """A Hugging Face ``Conv1D`` (GPT-2's projections): a linear layer ``y = x @ W + b`` whose weight is stored
    I x O."""
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers.") and \
        not isinstance(m, TransposedLinear)


def _reportable(m: nn.Module) -> bool:
    return isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                          nn.ConvTranspose3d, nn.MultiheadAttention, nn.Bilinear)) or _transposed_linear(m)


def _lora_adapter(name: str) -> bool:
    parts = name.split(".")
    return any(p in _LORA_ADAPTER_NAMES for p in parts)


def convert(model: nn.Module, config=None, include: Matcher = None, exclude: Matcher = None,
            keep_less: Union[bool, Matcher] = True) -> ConvertReport:
    """Swap eligible layers of ``model`` for HOT layers in place; returns a printable ConvertReport.

    config: a ``hot.Config`` given to every converted layer; default ``hot.Config()``, the accurate configuration
    (8-bit g_x, full-rank g_w; SPEC §10). ``hot.Config.paper()`` is the paper's; ``hot.torch.calibrate`` picks cheaper
    settings per layer where measured safe.
    include / exclude: a glob pattern on the qualified module name (``"blocks.*.mlp.*"``; a pattern
    also matches everything below the named module), a list of patterns, or a predicate
    ``f(name, module) -> bool``. With ``include`` only matching layers are candidates; ``exclude``
    removes layers. Layers left alone are listed in the report with the reason.
    keep_less: swap the model's ``nn.ReLU``, ``nn.MaxPool2d`` (not those with ``return_indices=True``) and
    ``nn.BatchNorm2d`` modules for ``hot.torch.ReLU`` (keeps one bit per element for its backward instead of its
    output), ``hot.torch.MaxPool2d`` (one byte per output element instead of its input and int64 indices) and
    ``hot.torch.BatchNorm2d`` (hands G~'s amax to a converted convolution before it), with the exact gradients (SPEC
    §2): True (all of them), False (none), or a pattern, list of patterns or predicate selecting them by name, as for
    ``include`` (include / exclude select layers only). The report counts them.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"hot.torch.convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = hot.Config()
    elif not isinstance(config, hot.Config):
        raise TypeError(f"hot.torch.convert: config must be a hot.Config, got {type(config).__name__}")
    if isinstance(keep_less, bool):
        lean_match = (lambda name, module: True) if keep_less else None
    elif keep_less is None or isinstance(keep_less, (str, list, tuple)) or callable(keep_less):
        lean_match = _matcher(keep_less, "keep_less")
    else:
        raise TypeError(f"hot.torch.convert: keep_less must be a bool, a name pattern, a list of them or a predicate "
                        f"(name, module) -> bool; got {type(keep_less).__name__}")
    inc = _matcher(include, "include")
    exc = _matcher(exclude, "exclude")
    report = ConvertReport(config)
    already = 0
    modules = list(model.named_modules())  # before any swap: an attention module gains an in_proj child below
    mha_children = set()
    for name, m in modules:
        if isinstance(m, nn.MultiheadAttention):
            mha_children.update(id(c) for c in m.modules() if c is not m)

    def selected(name: str, tname: str, m: nn.Module) -> bool:
        why = None
        if _lora_adapter(name):
            why = "LoRA adapter: stays exact (SPEC §8)"
        elif inc is not None and not inc(name, m):
            why = "not matched by include"
        elif exc is not None and exc(name, m):
            why = "excluded by name/predicate"
        if why is not None:
            report.skipped.append((name, tname, why))
        return why is None

    for name, m in modules:
        if isinstance(m, MultiheadAttention):
            report.skipped.append((name, type(m).__name__, "already a HOT layer"))
            already += 1
            continue
        if type(m) is nn.MultiheadAttention:  # its two projections, each selected by its own name
            why = _mha_problem(m)
            pre = f"{name}." if name else ""
            if why is not None:
                report.skipped.append((name, "MultiheadAttention", why))
                continue
            sel_in = selected(pre + "in_proj", "MultiheadAttention.in_proj", m)
            sel_out = selected(pre + "out_proj", type(m.out_proj).__name__, m.out_proj)
            if not (sel_in or sel_out):
                continue
            attach_in_proj(m, config if sel_in else None)
            if sel_in:
                report.converted.append((pre + "in_proj", "MultiheadAttention.in_proj", _describe(m.in_proj)))
            if sel_out:
                tname = type(m.out_proj).__name__
                m.out_proj.__class__ = Linear
                m.out_proj._hot_init(config)
                report.converted.append((pre + "out_proj", tname, _describe(m.out_proj)))
            continue
        if id(m) in mha_children:  # handled with its attention module
            continue
        if isinstance(m, HOT_LAYERS):
            report.skipped.append((name, type(m).__name__, "already a HOT layer"))
            already += 1
            continue
        if not _reportable(m):
            continue
        tname = type(m).__name__
        if not selected(name, tname, m):
            continue
        why = _ineligible(m)
        if why is not None:
            report.skipped.append((name, tname, why))
            continue
        if _transposed_linear(m):
            new_cls = transposed_class(type(m))
        else:
            new_cls = {nn.Linear: Linear, nn.Conv2d: Conv2d, nn.Conv1d: Conv1d}[type(m)]
        m.__class__ = new_cls
        m._hot_init(config)
        report.converted.append((name, tname, _describe(m)))
    if not report.converted:
        if already:
            warnings.warn("hot.torch.convert: nothing new to convert; every eligible layer is already a HOT layer\n"
                          + str(report), stacklevel=2)
        else:
            raise ValueError("hot.torch.convert: no eligible layer (Linear, or Conv1d / Conv2d with groups=1 and zero "
                             "padding) in the model\n" + str(report))
    if lean_match is not None:
        for name, m in model.named_modules():
            if type(m) is nn.ReLU and lean_match(name, m):
                m.__class__ = ReLU
                report.lean.append((name, "ReLU"))
            elif type(m) is nn.MaxPool2d and not m.return_indices and lean_match(name, m):
                m.__class__ = MaxPool2d
                report.lean.append((name, "MaxPool2d"))
            elif type(m) is nn.BatchNorm2d and lean_match(name, m):
                m.__class__ = BatchNorm2d
                report.lean.append((name, "BatchNorm2d"))
    return report


def hot_layers(model: nn.Module):
    """(name, layer) for every HOT layer in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, HOT_LAYERS)]
