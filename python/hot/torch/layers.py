"""Drop-in HOT layers: ``hot.torch.Linear``, ``hot.torch.Conv2d`` and ``hot.torch.Conv1d`` (SPEC §2-§4, §7, §8), and
the converted forms of modules whose weights are not those layers' (``hot.torch.MultiheadAttention``,
``hot.torch.TransposedLinear``).

They subclass ``nn.Linear`` / ``nn.Conv2d`` / ``nn.Conv1d`` and keep their parameters and state_dict keys; only the
backward pass changes (integer GEMMs after Hadamard transforms) and what is kept for it (the ABC
buffer instead of the input). ``hot.torch.convert`` swaps existing layers in place (the module object,
its parameters, hooks and optimizer references are preserved).

The HOT configuration of a layer is ``layer.hot_config`` (a ``hot.Config``). After
``hot.torch.calibrate`` (SPEC §7.2) the layer carries ``layer.hot_calibration`` (the measured errors and the
choice), after ``hot.torch.lqs`` (§7.1) ``layer.hot_lqs``, and during a ``hot.torch.Warmup`` (§10)
``layer.hot_warmup``; then, and only then, its state_dict gains one entry ``<name>._extra_state`` holding the
configuration and that state, restored by ``load_state_dict``. A state_dict without it (for
example one of the original ``nn.Linear`` model) loads into a converted model with ``strict=True``. A layer whose
weight is sharded (a DTensor: FSDP2, tensor parallelism) always has the entry, as a JSON string ("null" until there
is state), because ``torch.distributed.checkpoint`` restores only the keys the destination's state_dict has.
"""
from __future__ import annotations

import functools
import json
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import hot
from hot._api import _DEFAULT_CONFIG, _is_int

from . import ops

_EXTRA_STATE_VERSION = 2


def _grad_wanted(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)


def _check_inputs(kind: str, x: Tensor, weight: Tensor, bias: Optional[Tensor], autocast: bool) -> None:
    if x.device != weight.device:
        raise ValueError(f"hot.torch.{kind}: input is on {x.device} but the weight is on {weight.device}; "
                         f"move the input or the layer to one device")
    if bias is not None and bias.device != weight.device:
        raise ValueError(f"hot.torch.{kind}: bias is on {bias.device} but the weight is on {weight.device}")
    if not x.is_floating_point():
        raise TypeError(f"hot.torch.{kind}: input has dtype {x.dtype}, expected a floating dtype "
                        f"(float32, float16 or bfloat16)")
    if autocast:
        return
    if x.dtype != weight.dtype:
        raise TypeError(f"hot.torch.{kind}: input dtype {x.dtype} differs from weight dtype {weight.dtype}; "
                        f"cast the input, or run under torch.autocast")
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"hot.torch.{kind}: bias dtype {bias.dtype} differs from weight dtype {weight.dtype}")
    if weight.dtype not in ops.ENGINE_FLOATS:
        raise TypeError(f"hot.torch.{kind}: weight dtype {weight.dtype} is not supported by the hot engine, "
                        f"expected float32, float16 or bfloat16")


def _autocast_on(dev: str) -> bool:
    try:
        return torch.is_autocast_enabled(dev)
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        return False


def _autocast_cast(kind: str, x: Tensor, weight: Tensor, bias: Optional[Tensor]):
    """(x, weight, bias, autocast on, its dtype or None) for a layer call under torch.compile: see
    :func:`_autocast_operands`."""
    dev = x.device.type
    if not _autocast_on(dev):
        return x, weight, bias, False, None
    dt = torch.get_autocast_dtype(dev)
    return (*_autocast_operands(kind, x, weight, bias, dt), True, dt)


def _autocast_operands(kind: str, x: Tensor, weight: Tensor, bias: Optional[Tensor], dt):
    """(x, weight, bias) of a layer call under autocast (dtype dt) as its autograd.Function takes them: the bias cast
    to dt; the weight, and a Linear's x, as they are where the Function casts them itself (a float dtype the engine
    writes, other than dt), so that the backward writes g_w, and a Linear's g_x, in their own dtypes with no cast by
    autograd (SPEC §3, §4; ops._weight_in); anything else cast to dt here."""
    if not _cast_inside(weight, dt):
        weight = _cast(weight, dt)
    if kind != "Linear" or not _cast_inside(x, dt):
        x = _cast(x, dt)
    return x, weight, _cast(bias, dt)


def _cast_inside(t: Tensor, dt) -> bool:
    """Whether a layer's autograd.Function casts t to autocast's dtype dt itself (see :func:`_autocast_operands`)."""
    return t.dtype != dt and t.dtype in ops.ENGINE_FLOATS


def _cast(t: Optional[Tensor], dt) -> Optional[Tensor]:
    """t in dtype dt (autocast's cast of a layer's operands): t itself, without a dispatched no-op .to(), where it
    has that dtype already (the output of a preceding autocast op), None for None."""
    return t if t is None or t.dtype == dt else t.to(dt)


def _keep_mode(weight: Tensor, config) -> int:
    if not weight.requires_grad:
        return ops.KEEP_NOTHING  # frozen weight: g_x needs only W; nothing is kept (SPEC §2)
    return ops.KEEP_RAW if config.exact else ops.KEEP_COMPRESSED


def _seed(config, device) -> Tensor:
    """The seed of a compiled layer call: drawn on the layer's device (ops.draw_seed), or 0 there without stochastic
    rounding (no CPU tensor in the graph: a CUDA graph can hold the whole step)."""
    if config.rounding == "stochastic" and not config.exact:
        return ops.draw_seed(device)
    return torch.zeros((), dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=256)
def _plan(config):
    """What an eager layer call needs from its config, computed once per config: (draws a stochastic-rounding seed,
    what is kept with a trainable weight)."""
    return (config.rounding == "stochastic" and not config.exact,
            ops.KEEP_RAW if config.exact else ops.KEEP_COMPRESSED)


_SAVED_NAMES: Dict[type, Tuple[str, ...]] = {}


def _kept_by_producer(x: Tensor) -> bool:
    """Whether the autograd node that produced x, or the tensor x is a view of, keeps x's storage for its own backward
    (a ReLU's output, an attention output, ...). A layer that then keeps x itself, instead of an int8 copy of it, holds
    no memory that exact training does not hold (SPEC §2), and compresses x in its backward pass instead: the same
    deterministic compression of the same values, so the same gradients. Eager mode only (under torch.compile the
    layers keep their compressed copy): the check reads the producer's saved tensors."""
    if x.numel() == 0:
        return False
    ptr = x.untyped_storage().data_ptr()
    for t in (x, x._base):
        fn = None if t is None else t.grad_fn
        if fn is None:
            continue
        names = _SAVED_NAMES.get(type(fn))
        if names is None:
            names = _SAVED_NAMES[type(fn)] = tuple(n for n in dir(fn) if n.startswith("_saved_"))
        for n in names:
            try:
                v = getattr(fn, n)
            except RuntimeError:  # a saved value that cannot be unpacked (already freed)
                continue
            if isinstance(v, Tensor) and v.numel() > 0 and v.untyped_storage().data_ptr() == ptr:
                return True
    return False


def _eager_operands(kind: str, x: Tensor, weight: Tensor, bias: Optional[Tensor], config, ac: bool, layer,
                    param: Optional[Tensor]):
    """What an eager layer call hands its autograd.Function, with the same checks, casts, seed draw and keep mode as the
    compiled route (the per-config values of _plan): (x, weight, bias) as :func:`_autocast_operands` gives them where ac
    (autocast is on for x's device type), the seed, the keep mode, the weight_reuse record, and autocast's dtype (or
    None) for the Function's own casts. An input its producer keeps anyway, and that the layer uses as it is, is
    kept as it is (_kept_by_producer), which the calling layer records. param: the parameter weight is a view of (a
    layer whose weight is stored I x O, a Conv1d), which weight_reuse keys its W~ on."""
    if x.device != weight.device:
        _check_inputs(kind, x, weight, bias, True)
    x_in = x
    reuse = ops.reuse_of(weight if param is None else param, config) if ops._REUSE is not None else None
    dt = None
    if ac:
        dt = torch.get_autocast_dtype(x.device.type)
        x, weight, bias = _autocast_operands(kind, x, weight, bias, dt)
    _check_inputs(kind, x, weight, bias, ac)
    plan = _plan(config)
    seed = ops.draw_seed(x.device) if plan[0] else 0
    keep = plan[1] if weight.requires_grad else ops.KEEP_NOTHING
    if keep == ops.KEEP_COMPRESSED and x is x_in and (dt is None or x.dtype == dt) and _kept_by_producer(x):
        keep = ops.KEEP_RAW  # its producer keeps it: no compressed copy now (the backward forms it)
    if layer is not None:  # what the layer keeps, for hot.torch.summary
        layer.__dict__["_hot_keeps_input"] = keep == ops.KEEP_RAW and not config.exact
        layer.__dict__["_hot_shares_buffer"] = keep == ops.KEEP_COMPRESSED and kind == "Linear" and \
            ops.shared_buffer_alive(x, dt, config)
    return x, weight, bias, seed, keep, reuse, dt


def _linear_eager(x: Tensor, weight: Tensor, bias: Optional[Tensor], config, ac: bool, layer=None,
                  param: Optional[Tensor] = None) -> Tensor:
    """hot_linear outside torch.compile once gradients are wanted (see :func:`_eager_operands`)."""
    x, weight, bias, seed, keep, reuse, dt = _eager_operands("Linear", x, weight, bias, config, ac, layer, param)
    return ops.linear_eager(x, weight, bias, seed, keep, config, reuse, dt)


def hot_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, config=None) -> Tensor:
    """Functional HOT linear: ``F.linear`` forward, HOT backward; weight O x I."""
    if weight.dim() != 2:
        raise ValueError(f"hot_linear: weight has {weight.dim()} dims, expected 2 (O x I) (got shape "
                         f"{tuple(weight.shape)})")
    config = config if config is not None else _DEFAULT_CONFIG
    if not _grad_wanted(x, weight, bias):
        return F.linear(x, weight, bias)
    if not torch.compiler.is_compiling():
        return _linear_eager(x, weight, bias, config, _autocast_on(x.device.type))
    if x.device != weight.device:
        _check_inputs("Linear", x, weight, bias, True)
    x, weight, bias, ac, dt = _autocast_cast("Linear", x, weight, bias)
    _check_inputs("Linear", x, weight, bias, ac)
    return ops.linear(x, weight, bias, _seed(config, x.device), _keep_mode(weight, config), config, dt)


def _pair(name: str, v) -> List[int]:
    """An int or a pair of ints of hot_conv2d as [h, w]."""
    if type(v) is tuple and len(v) == 2 and type(v[0]) is int and type(v[1]) is int:  # a module's own: no checks
        return [v[0], v[1]]
    if _is_int(v):
        return [int(v), int(v)]
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_int(e) for e in v):
        return [int(e) for e in v]
    raise ValueError(f"hot_conv2d: {name} must be an int or a pair of ints (h, w), got {v!r}")


def _batched(x: Tensor) -> Tuple[Tensor, bool]:
    """A conv input as the 4-D (N, C, H, W) map, and whether it came unbatched (C, H, W); other ranks raise."""
    unbatched = x.dim() == 3
    if unbatched:
        x = x.unsqueeze(0)
    if x.dim() != 4:
        raise ValueError(f"hot.torch.Conv2d: input has {x.dim()} dims, expected 3 (C, H, W) or 4 (N, C, H, W)")
    return x, unbatched


def hot_conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride=1, padding=0, dilation=1,
               config=None, _layer=None, _param: Optional[Tensor] = None) -> Tensor:
    """Functional HOT conv2d (groups = 1, zero padding; stride, padding and dilation each an int or a pair of
    ints): ``F.conv2d`` forward, HOT backward."""
    stride, padding, dilation = _pair("stride", stride), _pair("padding", padding), _pair("dilation", dilation)
    config = config if config is not None else _DEFAULT_CONFIG
    if not _grad_wanted(x, weight, bias):
        return F.conv2d(x, weight, bias, stride, padding, dilation)
    if not torch.compiler.is_compiling():
        return _conv2d_eager(x, weight, bias, stride, padding, dilation, config, _autocast_on(x.device.type), _layer,
                             _param)
    x, unbatched = _batched(x)
    if x.device != weight.device:
        _check_inputs("Conv2d", x, weight, bias, True)
    x, weight, bias, ac, dt = _autocast_cast("Conv2d", x, weight, bias)
    _check_inputs("Conv2d", x, weight, bias, ac)
    y = ops.conv2d(x, weight, bias, _seed(config, x.device), stride, padding, dilation, _keep_mode(weight, config),
                   config, dt=dt)
    return y.squeeze(0) if unbatched else y


def _conv2d_eager(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride, padding, dilation, config, ac: bool,
                  layer=None, param: Optional[Tensor] = None) -> Tensor:
    """hot_conv2d outside torch.compile once gradients are wanted (stride, padding, dilation: [h, w] lists; see
    :func:`_eager_operands`)."""
    x, unbatched = _batched(x)
    x, weight, bias, seed, keep, reuse, dt = _eager_operands("Conv2d", x, weight, bias, config, ac, layer, param)
    y = ops.conv2d_eager(x, weight, bias, seed, stride, padding, dilation, keep, config, reuse, dt)
    return y.squeeze(0) if unbatched else y


def _is_dtensor(t) -> bool:
    """t is a torch.distributed DTensor (a parameter FSDP2 or tensor parallelism has sharded)."""
    return type(t).__name__ == "DTensor" and type(t).__module__.startswith("torch.distributed")


def _parse_extra_state(extra) -> Optional[Dict[str, Any]]:
    """A layer's ``_extra_state`` entry as {"config": hot.Config, "lqs", "calibration": dict or None, "warmup": None
    or {"left": int >= 1, "target": hot.Config}}, or None for the entry of a sharded layer without state (the JSON
    string "null"; a sharded layer's entry is that dict as JSON); TypeError / ValueError if malformed. Version 1
    entries (config and LQS only) load as well."""
    what = ("a dict {'config': dict, 'lqs': dict or None, 'calibration': dict or None, 'warmup': None or "
            "{'left': int, 'target': dict}} (hot.torch extra state)")
    if isinstance(extra, str):  # a sharded layer's entry: JSON, "null" without state
        try:
            extra = json.loads(extra)
        except ValueError as e:
            raise TypeError(f"expected {what} or its JSON, got a string that is not JSON ({e})") from None
        if extra is None:
            return None
    if not isinstance(extra, dict) or not isinstance(extra.get("config"), dict):
        raise TypeError(f"expected {what}, got {extra!r:.200}")
    out: Dict[str, Any] = {"config": hot.Config.from_dict(extra["config"])}
    for key in ("lqs", "calibration"):
        v = extra.get(key)
        if v is not None and not isinstance(v, dict):
            raise TypeError(f"expected {what}, got {key!r}: {v!r:.200}")
        out[key] = dict(v) if v is not None else None
    w = extra.get("warmup")
    if w is not None:
        if not isinstance(w, dict) or not isinstance(w.get("target"), dict) or not _is_int(w.get("left")) \
                or w["left"] < 1:
            raise ValueError(f"expected {what}, got 'warmup': {w!r:.200}")
        w = {"left": int(w["left"]), "target": hot.Config.from_dict(w["target"])}
    out["warmup"] = w
    return out


class _HotMixin:
    """State shared by the HOT layers: configuration, how it was chosen (LQS, calibration, warm-up), last seen input,
    extra state."""

    hot_config: Any
    hot_lqs: Optional[Dict[str, Any]]
    hot_calibration: Optional[Dict[str, Any]]
    hot_warmup: Optional[Dict[str, Any]]

    def _hot_init(self, config) -> None:
        if config is None:
            config = hot.Config()
        elif not isinstance(config, hot.Config):
            raise TypeError(f"hot.torch: config must be a hot.Config, got {type(config).__name__}")
        self.hot_config = config
        self.hot_lqs = None
        self.hot_calibration = None  # set by hot.torch.calibrate: the measured errors and the choice
        self.hot_warmup = None  # set by hot.torch.Warmup: {"left": steps, "target": the config after the warm-up}
        self._hot_seen = None  # (rows L, input shape, input dtype) of the last forward with gradients
        self._hot_keeps_input = False  # its last forward kept the input itself, which its producer keeps anyway
        self._hot_shares_buffer = False  # its last forward reused the ABC buffer of another layer reading its input
        self._hot_capture = None  # list, set by calibrate() to collect (input, output) pairs

    def _hot_record(self, x: Tensor, rows: int) -> None:
        if not torch.compiler.is_compiling():
            dt = torch.get_autocast_dtype(x.device.type) if _autocast_on(x.device.type) else x.dtype
            self.__dict__["_hot_seen"] = (int(rows), tuple(x.shape), dt)  # not through nn.Module.__setattr__

    @property
    def hot_target_config(self):
        """The configuration this layer runs once any warm-up is over (its own configuration)."""
        return self.hot_warmup["target"] if self.hot_warmup is not None else self.hot_config

    def set_hot_config(self, config) -> None:
        """Set this layer's own configuration; during a warm-up it takes effect when the warm-up ends."""
        if not isinstance(config, hot.Config):
            raise TypeError(f"hot.torch: config must be a hot.Config, got {type(config).__name__}")
        if self.hot_warmup is not None:
            self.hot_warmup = {"left": self.hot_warmup["left"], "target": config}
        else:
            self.hot_config = config

    def hot_config_source(self) -> str:
        """Why the layer runs its current configuration (for summaries)."""
        if self.hot_warmup is not None:
            return f"warm-up ({self.hot_warmup['left']} steps left, then: {self.hot_warmup['target'].describe()})"
        if self.hot_calibration is not None:
            return f"calibrated (budget {self.hot_calibration.get('budget', float('nan')):g})"
        if self.hot_lqs is not None:
            return "LQS"
        if self.hot_config == hot.Config():
            return "default"
        if self.hot_config == hot.Config.paper():
            return "paper"
        return "given"

    # state_dict: one `_extra_state` entry, only once LQS, calibration or a warm-up has run --------------------------
    # A layer whose weight is a DTensor (FSDP2, tensor parallel) always has it, as one JSON string ("null" until there
    # is state): the checkpoints of sharded models are torch.distributed.checkpoint's, which restores only the keys
    # the destination state_dict has, and flattens a dict into its leaves (so a fresh layer's entry must have the
    # same structure as a calibrated one's) and drops None leaves.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)
        entry = None
        if self.hot_lqs is not None or self.hot_calibration is not None or self.hot_warmup is not None:
            w = self.hot_warmup
            entry = {
                "version": _EXTRA_STATE_VERSION, "config": self.hot_config.to_dict(),
                "lqs": dict(self.hot_lqs) if self.hot_lqs is not None else None,
                "calibration": dict(self.hot_calibration) if self.hot_calibration is not None else None,
                "warmup": None if w is None else {"left": int(w["left"]), "target": w["target"].to_dict()}}
        if _is_dtensor(self.weight):
            destination[prefix + "_extra_state"] = json.dumps(entry)
        elif entry is not None:
            destination[prefix + "_extra_state"] = entry

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "_extra_state"
        extra = state_dict.get(key)
        if extra is not None:  # checked before anything of this layer is loaded
            try:
                parsed = _parse_extra_state(extra)
            except (TypeError, ValueError) as e:
                error_msgs.append(f"{key}: {e}")
                return
        nn.Module._load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                        unexpected_keys, error_msgs)
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if extra is not None and parsed is not None:
            self.hot_config, self.hot_lqs = parsed["config"], parsed["lqs"]
            self.hot_calibration, self.hot_warmup = parsed["calibration"], parsed["warmup"]

    def set_lqs(self, choice: str, e_tensor: float = float("nan"), e_token: float = float("nan")) -> None:
        """Fix this layer's g_x scale choice ('tensor' or 'token')."""
        self.set_hot_config(self.hot_target_config.replace(gx_scale=choice))
        self.hot_lqs = {"choice": choice, "e_tensor": float(e_tensor), "e_token": float(e_token)}


class Linear(_HotMixin, nn.Linear):
    """``nn.Linear`` whose backward pass is HOT's (SPEC §3, §4) and which keeps the ABC buffer (§2)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 config=None) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._hot_init(config)

    def forward(self, x: Tensor) -> Tensor:
        if self._hot_capture is not None:  # calibration: exact forward, output collected for its gradient
            y = F.linear(x, self.weight, self.bias)
            self._hot_capture.append((x, y))
            return y
        if torch.compiler.is_compiling():
            return hot_linear(x, self.weight, self.bias, self.hot_config)
        # eager: _hot_record and hot_linear inlined (one autocast query, the config's plan cached)
        ac = _autocast_on(x.device.type)
        self.__dict__["_hot_seen"] = (int(x.numel() // max(x.shape[-1], 1)), tuple(x.shape),
                                      torch.get_autocast_dtype(x.device.type) if ac else x.dtype)
        weight, bias = self.weight, self.bias
        if not _grad_wanted(x, weight, bias):
            return F.linear(x, weight, bias)
        return _linear_eager(x, weight, bias, self.hot_config, ac, self)

    def extra_repr(self) -> str:
        c = self.hot_config
        s = nn.Linear.extra_repr(self)
        if c.exact:
            return s + ", hot=exact"
        return s + f", hot=({c.describe()})"


def conv_padding(m: nn.Conv2d) -> Optional[Tuple[int, int]]:
    """Explicit symmetric (ph, pw) of a conv, or None when it cannot be expressed so (asymmetric 'same')."""
    p = m.padding
    if isinstance(p, str):
        if p == "valid":
            return (0, 0)
        out = []
        for k, d in zip(m.kernel_size, m.dilation):
            total = d * (k - 1)
            if total % 2:
                return None
            out.append(total // 2)
        return tuple(out)
    return tuple(p)


def _conv_init(layer, base, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
               padding_mode, device, dtype, config) -> None:
    """The shared constructor of hot.torch.Conv2d / Conv1d: base's (nn.Conv2d or nn.Conv1d), after and around the
    checks of what the engine takes (groups 1, zero padding, symmetric 'same'), then the HOT state."""
    kind = base.__name__
    if groups != 1:
        raise ValueError(f"hot.torch.{kind}: groups={groups} is not supported, expected 1 "
                         f"(grouped and depthwise convolutions stay nn.{kind})")
    if padding_mode != "zeros":
        raise ValueError(f"hot.torch.{kind}: padding_mode={padding_mode!r} is not supported, expected 'zeros'")
    base.__init__(layer, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                  padding_mode, device=device, dtype=dtype)
    if conv_padding(layer) is None:
        raise ValueError(f"hot.torch.{kind}: padding='same' with kernel {layer.kernel_size} and dilation "
                         f"{layer.dilation} needs asymmetric padding, which is not supported")
    layer._hot_init(config)


class Conv2d(_HotMixin, nn.Conv2d):
    """``nn.Conv2d`` (groups = 1, zero padding) with HOT's backward; keeps an int8 copy of its input."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None,
                 config=None) -> None:
        _conv_init(self, nn.Conv2d, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                   padding_mode, device, dtype, config)

    def forward(self, x: Tensor) -> Tensor:
        if self._hot_capture is not None:
            y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)
            self._hot_capture.append((x, y))
            return y
        k, s, p, d = conv_geom(self)
        if torch.compiler.is_compiling():
            return hot_conv2d(x, self.weight, self.bias, s, p, d, self.hot_config, self)
        # eager: _hot_record and hot_conv2d inlined (one autocast query, the config's plan cached), as Linear's
        ac = _autocast_on(x.device.type)
        rows = 0
        if x.dim() in (3, 4):
            n = x.shape[0] if x.dim() == 4 else 1
            rows = n * ops._conv_out(x.shape[-2], k[0], s[0], p[0], d[0]) * ops._conv_out(x.shape[-1], k[1], s[1],
                                                                                       p[1], d[1])
        self.__dict__["_hot_seen"] = (rows, tuple(x.shape), torch.get_autocast_dtype(x.device.type) if ac else x.dtype)
        weight, bias = self.weight, self.bias
        if not _grad_wanted(x, weight, bias):
            return F.conv2d(x, weight, bias, s, p, d)
        return _conv2d_eager(x, weight, bias, list(s), list(p), list(d), self.hot_config, ac, self)

    def extra_repr(self) -> str:
        c = self.hot_config
        s = nn.Conv2d.extra_repr(self)
        if c.exact:
            return s + ", hot=exact"
        return s + f", hot=({c.describe()}, int8 fmap)"


class Conv1d(_HotMixin, nn.Conv1d):
    """``nn.Conv1d`` (groups = 1, zero padding) with HOT's backward: the convolution of an (N, C, 1, L) map by an
    (O, C, 1, k) kernel (SPEC §8), i.e. :class:`Conv2d`'s engine calls on the inputs with a unit height; keeps an int8
    copy of its input (a pointwise conv: the codes, or ABC buffer, of the positions it reads)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None,
                 config=None) -> None:
        _conv_init(self, nn.Conv1d, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                   padding_mode, device, dtype, config)

    def forward(self, x: Tensor) -> Tensor:
        if self._hot_capture is not None:
            y = F.conv1d(x, self.weight, self.bias, self.stride, conv_padding(self), self.dilation)
            self._hot_capture.append((x, y))
            return y
        if x.dim() not in (2, 3):
            raise ValueError(f"hot.torch.Conv1d: input has {x.dim()} dims, expected 2 (C, L) or 3 (N, C, L)")
        k, s, p, d = conv_geom(self)
        if not torch.compiler.is_compiling():
            n = x.shape[0] if x.dim() == 3 else 1
            self._hot_record(x, n * ops._conv_out(x.shape[-1], k[1], s[1], p[1], d[1]))
        y = hot_conv2d(x.unsqueeze(-2), self.weight.unsqueeze(-2), self.bias, s, p, d, self.hot_config, self,
                       _param=self.weight)  # weight_reuse keys W~ on the parameter, not on the view
        return y.squeeze(-2)

    def extra_repr(self) -> str:
        c = self.hot_config
        s = nn.Conv1d.extra_repr(self)
        return s + (", hot=exact" if c.exact else f", hot=({c.describe()}, int8 fmap)")


def conv_geom(m: nn.Module) -> Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int], Tuple[int, int]]:
    """(kernel, stride, padding, dilation) of a converted or convertible Conv2d / Conv1d as (h, w) pairs: a Conv1d's
    with a unit height (the 2-D convolution it runs as). Padding as :func:`conv_padding` makes it explicit."""
    pad = conv_padding(m)
    if isinstance(m, nn.Conv1d):
        return (1, m.kernel_size[0]), (1, m.stride[0]), (0, pad[0]), (1, m.dilation[0])
    return tuple(m.kernel_size), tuple(m.stride), tuple(pad), tuple(m.dilation)


def as_2d(m: nn.Module, t: Tensor) -> Tensor:
    """A Conv1d's input, output or gradient (N, C, L) / (C, L) as the 2-D map (N, C, 1, L) / (C, 1, L) it runs as;
    a Conv2d's as it is."""
    return t.unsqueeze(-2) if isinstance(m, nn.Conv1d) else t


class TransposedLinear(_HotMixin):
    """The HOT version of a linear layer whose weight is stored I x O, ``y = x @ W + b`` (transformers' ``Conv1D``,
    GPT-2's projections): ``hot.torch.convert`` makes such a module an instance of a subclass of its own class and of
    this mixin (:func:`transposed_class`), so its class checks, parameters and state_dict keys stay the original's.
    Its backward is a hot.torch.Linear's on the O x I view ``W.t()`` (SPEC §3, §4); ``in_features`` /
    ``out_features`` are read from the weight."""

    @property
    def in_features(self) -> int:
        return self.weight.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.t()
        if self._hot_capture is not None:  # calibration: exact forward, output collected for its gradient
            y = F.linear(x, w, self.bias)
            self._hot_capture.append((x, y))
            return y
        if torch.compiler.is_compiling():
            return hot_linear(x, w, self.bias, self.hot_config)
        ac = _autocast_on(x.device.type)
        self.__dict__["_hot_seen"] = (int(x.numel() // max(x.shape[-1], 1)), tuple(x.shape),
                                      torch.get_autocast_dtype(x.device.type) if ac else x.dtype)
        if not _grad_wanted(x, self.weight, self.bias):
            return F.linear(x, w, self.bias)
        return _linear_eager(x, w, self.bias, self.hot_config, ac, self, param=self.weight)

    def extra_repr(self) -> str:
        c = self.hot_config
        s = f"in_features={self.in_features}, out_features={self.out_features} (weight stored I x O)"
        return s + (", hot=exact" if c.exact else f", hot=({c.describe()})")


_TRANSPOSED_CLASSES: Dict[type, type] = {}


def transposed_class(cls: type) -> type:
    """The subclass of ``cls`` (a module class whose weight is stored I x O) and :class:`TransposedLinear` that
    ``convert`` gives such a module, one per class."""
    new = _TRANSPOSED_CLASSES.get(cls)
    if new is None:
        new = _TRANSPOSED_CLASSES[cls] = type(cls.__name__, (TransposedLinear, cls),
                                              {"__module__": __name__, "__qualname__": f"Hot{cls.__name__}"})
    return new


HOT_LAYERS = (Linear, Conv2d, Conv1d, TransposedLinear)


def _float_mask(m: Tensor, dtype) -> Tensor:
    """An attention mask as nn.MultiheadAttention reads it (bool: True where attention is not allowed; float: added
    to the scores) in the additive float form, in the scores' dtype."""
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(m, float("-inf"))
    if not m.is_floating_point():
        raise TypeError(f"hot.torch.MultiheadAttention: masks must be bool or floating, got {m.dtype}")
    return m.to(dtype)


class MultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose two projections are HOT linear layers: ``in_proj``, a ``hot.torch.Linear``
    (3E x E) holding the module's own ``in_proj_weight`` / ``in_proj_bias`` parameters (the same objects, so the
    parameters, the optimizer's references and the state_dict keys stay nn.MultiheadAttention's), and ``out_proj``;
    the attention between them is torch's (``F.scaled_dot_product_attention``; the explicit softmax when the weights
    are returned). Made by ``hot.torch.convert`` from an ``nn.MultiheadAttention`` with one embedding size for query,
    key and value and without ``add_bias_kv`` / ``add_zero_attn``.

    Self-attention (``query is key is value``) calls ``in_proj`` as a module (calibration, summaries and the kept-input
    check see it as any layer); other calls project with its configuration through :func:`hot_linear` on the rows of
    the packed weight that each of query, key and value needs. Without gradients (``torch.no_grad``, inference) the
    forward is ``nn.MultiheadAttention.forward`` itself, with its fast paths."""

    in_proj: nn.Linear

    def state_dict(self, *args, **kwargs):
        # the in-projection's parameters are this module's in_proj_weight / in_proj_bias: saved once, under
        # nn.MultiheadAttention's keys (the in_proj child keeps only its _extra_state, when it has one)
        sd = nn.Module.state_dict(self, *args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for k in ("weight", "bias"):
            sd.pop(prefix + "in_proj." + k, None)
        return sd

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for k in ("weight", "bias"):  # the in_proj child loads the same values into the same parameters
            src = state_dict.get(prefix + "in_proj_" + k)
            if src is not None:
                state_dict[prefix + "in_proj." + k] = src
        nn.Module._load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                        unexpected_keys, error_msgs)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        if not torch.is_grad_enabled():  # inference: nn's forward (its fast paths); the projections' inputs recorded
            rows = query.numel() // max(query.shape[-1], 1)  # for hot.torch.summary, as their own calls would
            for lin in ((self.in_proj,) if query is key and key is value else ()) + (self.out_proj,):
                if isinstance(lin, Linear):
                    lin._hot_record(query, rows)
            return nn.MultiheadAttention.forward(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                                                 average_attn_weights, is_causal)
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"hot.torch.MultiheadAttention: query, key and value must all be 3-D (batched) or all "
                             f"2-D (unbatched), got {query.dim()}, {key.dim()} and {value.dim()} dims")
        if is_causal and attn_mask is None:
            raise RuntimeError("hot.torch.MultiheadAttention: is_causal is a hint that attn_mask is the causal mask "
                               "(as for nn.MultiheadAttention): pass attn_mask as well")
        same, kv_same = query is key and key is value, key is value
        batched = query.dim() == 3
        if not batched:  # (L, E): a batch of one
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        E, H = self.embed_dim, self.num_heads
        N, L, S = query.shape[0], query.shape[1], key.shape[1]
        if query.shape[2] != E or key.shape[2] != E or value.shape[2] != E:
            raise ValueError(f"hot.torch.MultiheadAttention: query, key and value must have embed_dim={E} features, "
                             f"got {query.shape[2]}, {key.shape[2]} and {value.shape[2]}")
        if key.shape[:2] != value.shape[:2] or key.shape[0] != N:
            raise ValueError(f"hot.torch.MultiheadAttention: key and value must have the same batch and sequence "
                             f"sizes as each other and the batch of query, got query {tuple(query.shape)}, key "
                             f"{tuple(key.shape)}, value {tuple(value.shape)} (batch first)")
        if same:
            q, k, v = self.in_proj(query).chunk(3, dim=-1)
        else:
            w, b = self.in_proj_weight, self.in_proj_bias
            ip = self.in_proj
            lin = functools.partial(hot_linear, config=ip.hot_config) if isinstance(ip, Linear) else F.linear

            def rows(i, j):
                return w[i * E:j * E], (b[i * E:j * E] if b is not None else None)

            q = lin(query, *rows(0, 1))
            if kv_same:
                k, v = lin(key, *rows(1, 3)).chunk(2, dim=-1)
            else:
                k, v = lin(key, *rows(1, 2)), lin(value, *rows(2, 3))
        D = E // H
        q, k, v = (t.reshape(N, -1, H, D).transpose(1, 2) for t in (q, k, v))
        mask = None
        if attn_mask is not None:
            want = (L, S) if attn_mask.dim() == 2 else (N * H, L, S)
            if attn_mask.dim() not in (2, 3) or tuple(attn_mask.shape) != want:
                raise ValueError(f"hot.torch.MultiheadAttention: attn_mask must have shape {(L, S)} or "
                                 f"{(N * H, L, S)}, got {tuple(attn_mask.shape)}")
            mask = _float_mask(attn_mask.reshape(1, 1, L, S) if attn_mask.dim() == 2 else
                               attn_mask.reshape(N, H, L, S), q.dtype)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (N, S):
                raise ValueError(f"hot.torch.MultiheadAttention: key_padding_mask must have shape {(N, S)} (batch, "
                                 f"source length), got {tuple(key_padding_mask.shape)}")
            kp = _float_mask(key_padding_mask.reshape(N, 1, 1, S), q.dtype)
            mask = kp if mask is None else mask + kp
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = torch.matmul(q * (1.0 / math.sqrt(D)), k.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            attn = torch.softmax(scores, dim=-1)
            if p > 0.0:
                attn = F.dropout(attn, p=p)
            a = torch.matmul(attn, v)
            weights = attn.mean(dim=1) if average_attn_weights else attn
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        out = self.out_proj(a.transpose(1, 2).reshape(N, L, E))
        if not batched:
            return out.squeeze(0), (weights.squeeze(0) if weights is not None else None)
        return (out if self.batch_first else out.transpose(0, 1)), weights


def attach_in_proj(m: nn.MultiheadAttention, config) -> None:
    """Make m (an nn.MultiheadAttention) a :class:`MultiheadAttention`: its ``in_proj`` child holds m's own
    in_proj_weight / in_proj_bias, as a hot.torch.Linear at ``config`` or, with config None, a plain nn.Linear (an
    exact in-projection)."""
    E = m.embed_dim
    lin = nn.Linear(E, 3 * E, bias=m.in_proj_bias is not None, device="meta")
    lin.weight = m.in_proj_weight
    lin.bias = m.in_proj_bias
    if config is not None:
        lin.__class__ = Linear
        lin._hot_init(config)
    m.__class__ = MultiheadAttention
    m.in_proj = lin
    m._modules = {"in_proj": m._modules.pop("in_proj"), **m._modules}  # listed (summaries) before out_proj
