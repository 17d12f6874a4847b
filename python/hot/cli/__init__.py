"""The ``hot`` command: ``hot demo`` (exact vs HOT training of a small ViT on scikit-learn's digits),
``hot info`` (version, backends, GPU, kernels compiled in) and ``hot summary MODEL`` (per-layer table of a
built-in model converted to HOT)."""
from __future__ import annotations

import argparse
import platform
import sys
from typing import List, Optional


def _torch():
    try:
        import torch  # noqa: F401

        return torch
    except ImportError:
        return None


def int_in(lo: int, hi: Optional[int] = None):
    """argparse type: an integer in lo..hi (no upper bound when hi is None)."""
    want = f"an integer in {lo}..{hi}" if hi is not None else f"an integer >= {lo}"

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {want}, got {v}")
        return v

    return parse


def torch_device(s: str) -> str:
    """argparse type: a torch device string (cpu, cuda, cuda:1, ...)."""
    torch = _torch()
    if torch is not None:
        try:
            torch.device(s)
        except (RuntimeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a torch device (cpu, cuda, cuda:1, ...), got {s!r}") from None
    return s


def cmd_info(args) -> int:
    import hot

    print(f"hot {hot.__version__}  (python {platform.python_version()}, {platform.machine()})")
    print("backends / kernels compiled in:")
    for line in hot.build_info().splitlines():
        print(f"  {line}")
    print(f"threads (cpu backend): {hot.get_num_threads()}")
    if hot.cuda_available():
        print("cuda: available")
    else:
        print(f"cuda: unavailable ({hot.cuda_unavailable_reason()})")
    torch = _torch()
    if torch is None:
        print("torch: not installed (hot.torch needs it)")
        return 0
    print(f"torch: {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda else ", CPU build"))
    int4_note = {True: "4-bit g_x is cheaper here (INT4 tensor cores): hot.torch.calibrate may pick it per layer",
                 False: "4-bit g_x costs as much as 8-bit here (it runs through the 8-bit GEMM): 8-bit everywhere"}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"gpu {i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB; "
                  f"{int4_note[p.major == 8]}")
    else:
        print("gpu: none visible to torch")
    print(f"cpu: {int4_note[False]}")
    print(f"default configuration (hot.Config()): {hot.Config().describe()}; the accurate default (SPEC §10). "
          f"Cheaper settings: hot.torch.calibrate (per layer, within a measured error budget) or hot.Config.paper() "
          f"({hot.Config.paper().describe()})")
    return 0


#: names ``hot summary`` takes for timm models under the benchmarks' names
SUMMARY_ALIASES = {"vit_b16": "vit_base_patch16_224", "vit_s16": "vit_small_patch16_224"}
#: input of the built-in models: an image shape (C, H, W) or ("tokens", T)
_BUILTIN_INPUT = {"vit": (1, 8, 8), "cnn": (1, 8, 8), "vit_synth": (3, 32, 32), "cnn_synth": (3, 32, 32),
                  "cnn_bneck": (1, 8, 8), "cnn_bneck_synth": (3, 32, 32), "char_lm": ("tokens", 128)}


def shape_arg(s: str):
    """argparse type: an input shape without the batch, e.g. 3,224,224."""
    try:
        dims = tuple(int(v) for v in s.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape such as 3,224,224, got {s!r}") from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"expected a shape of positive sizes such as 3,224,224, got {s!r}")
    return dims


def summary_model(spec: str):
    """(model, input shape without the batch or ("tokens", T), where it came from) for ``hot summary MODEL``: a
    built-in model (hot.experiments.models), ``pkg.module:factory`` (called without arguments), a torchvision model
    name or a timm model name (random weights; ``vit_b16`` is timm's vit_base_patch16_224)."""
    from hot.experiments import models

    if spec in models.MODELS:
        return models.build(spec), _BUILTIN_INPUT.get(spec, (3, 224, 224)), "built-in"
    if ":" in spec:
        import importlib

        mod, _, attr = spec.partition(":")
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
        import torch.nn as nn

        model = obj if isinstance(obj, nn.Module) else obj()
        return model, (3, 224, 224), spec
    tried = []
    try:
        import torchvision

        if spec in torchvision.models.list_models():
            return torchvision.models.get_model(spec, weights=None), (3, 224, 224), "torchvision"
        tried.append("torchvision")
    except ImportError:
        tried.append("torchvision (not installed)")
    try:
        import timm

        name = SUMMARY_ALIASES.get(spec, spec)
        if name in timm.list_models():
            model = timm.create_model(name, pretrained=False)
            cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
            return model, tuple(cfg.get("input_size", (3, 224, 224))), f"timm {name}"
        tried.append("timm")
    except ImportError:
        tried.append("timm (not installed)")
    raise ValueError(f"unknown model {spec!r}: not built-in ({', '.join(sorted(models.MODELS))}), not "
                     f"pkg.module:factory, not found in {', '.join(tried)}")


def cmd_summary(args) -> int:
    torch = _torch()
    if torch is None:
        print("hot summary: needs torch (pip install torch)", file=sys.stderr)
        return 2
    import hot
    import hot.torch as ht

    torch.manual_seed(0)
    try:
        model, shape, origin = summary_model(args.model)
    except ValueError as e:
        print(f"hot summary: error: {e}", file=sys.stderr)
        return 2
    if args.input_shape is not None:
        shape = args.input_shape
    builtin = origin == "built-in"
    batch = args.batch if args.batch is not None else (128 if builtin else 8)
    config = hot.Config.paper() if args.paper else hot.Config(rank=args.rank, gx_bits=args.gx_bits)
    report = ht.convert(model, config)
    print(report)
    print()
    if args.state_dict is not None:  # a calibrated state_dict: its layers' configurations (and weights)
        sd = torch.load(args.state_dict, map_location="cpu", weights_only=False)
        if isinstance(sd, dict) and "model" in sd and isinstance(sd["model"], dict):
            sd = sd["model"]
        missing, unexpected = model.load_state_dict(sd, strict=False)
        print(f"loaded {args.state_dict} ({len(missing)} missing, {len(unexpected)} unexpected keys)")
    model.to(args.device)
    if shape and shape[0] == "tokens":
        x = torch.randint(0, 64, (batch, shape[1]), device=args.device)
        what = f"{batch} sequences of {shape[1]} tokens"
    else:
        x = torch.randn(batch, *shape, device=args.device)
        what = f"a batch of {batch} inputs of shape {'x'.join(str(d) for d in shape)}"
    model.train()
    if args.no_cost:
        print(f"{args.model}: per-layer HOT summary for {what}")
        model(x)
        ht.summary(model)
        return 0
    amp = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    if amp is not None:
        what += f", under {args.amp} autocast (each layer's GEMMs, kept bytes and timed backward in {args.amp})"
    print(f"{args.model} ({origin}): HOT cost report for {what}, one forward (no backward)")
    print()
    with torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
        ht.summary(model, x, cost=True, config=args.config, format=args.format, plot=args.plot,
                   time=None if not args.no_time else False)
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hot", description="HOT: Hadamard-based Optimized Training (integer backward "
                                "passes and compressed activations for linear and conv layers)")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    d = sub.add_parser("demo", help="train a small ViT on scikit-learn's digits, exact vs HOT, side by side")
    d.add_argument("--model", choices=["vit", "cnn"], default="vit")
    d.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    d.add_argument("--batch", type=int_in(1), default=128)
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", type=torch_device, default=None,
                   help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    d.add_argument("--rank", type=int_in(1, 16), default=None,
                   help="HLA rank of the g_w path (1..16; default: hot.Config()'s, 16 = full rank)")
    d.add_argument("--gx-bits", type=int, default=None, choices=[4, 8],
                   help="bits of the g_x path (default: hot.Config()'s, 8)")
    d.add_argument("--paper", action="store_true", help="the paper's configuration (hot.Config.paper(): 4-bit g_x, "
                   "rank 8) with its LQS, instead of the default")
    d.add_argument("--calibrate", action="store_true",
                   help="run hot.torch.calibrate on the first batch (per-layer settings within the error budget)")
    d.add_argument("--hot-input-layer", action="store_true",
                   help="also convert the input layer (patch embedding / stem); kept exact by default")
    d.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off", help="autocast dtype")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(fn=cmd_demo)
    i = sub.add_parser("info", help="version, backends, GPU and arch, kernels compiled in")
    i.set_defaults(fn=cmd_info)
    s = sub.add_parser("summary", help="per-layer HOT cost report of a model: bytes kept, backward operations and "
                       "GBOPs, GPU forward and backward time, exact vs HOT")
    s.add_argument("model", help="a built-in model (vit, cnn, cnn_bneck, vit_synth, cnn_synth, cnn_bneck_synth, "
                   "char_lm), a torchvision or timm model name (vit_b16 = timm vit_base_patch16_224), or "
                   "pkg.module:factory")
    s.add_argument("--batch", type=int_in(1), default=None, help="batch of the traced forward (default 128 for "
                   "built-in models, 8 for others)")
    s.add_argument("--input-shape", type=shape_arg, default=None, help="input shape without the batch, e.g. "
                   "3,224,224 (default: the model's; 3,224,224 for pkg.module:factory)")
    s.add_argument("--rank", type=int_in(1, 16), default=16, help="HLA rank of the g_w path (1..16; default 16, "
                   "full rank, as hot.Config())")
    s.add_argument("--gx-bits", type=int, default=8, choices=[4, 8], help="bits of the g_x path (default 8, as "
                   "hot.Config())")
    s.add_argument("--paper", action="store_true", help="convert with the paper's configuration "
                   "(hot.Config.paper(): 4-bit g_x, rank 8)")
    s.add_argument("--state-dict", default=None, help="a state_dict (torch.save) of the converted model, e.g. after "
                   "hot.torch.calibrate: its layers' configurations are the ones reported")
    s.add_argument("--config", choices=["default", "paper"], default=None, help="report every layer at this "
                   "configuration instead of its own")
    s.add_argument("--format", choices=["text", "markdown", "csv"], default="text")
    s.add_argument("--plot", default=None, metavar="PATH", help="write a figure (time or GBOPs, and bytes kept, per "
                   "layer; needs matplotlib)")
    s.add_argument("--device", type=torch_device, default="cpu", help="cpu (default) or cuda[:N]: on CUDA the "
                   "report times each distinct layer shape's backward, HOT against exact")
    s.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off", help="trace the forward under "
                   "torch.autocast with this dtype (default off: the model's own dtype); the layers' bytes, operation "
                   "counts and timed backward are then in that dtype, as in mixed-precision training")
    s.add_argument("--no-time", action="store_true", help="no GPU timing")
    s.add_argument("--no-cost", action="store_true", help="only the memory table (the summary before issue 20)")
    s.set_defaults(fn=cmd_summary)
    from . import fidelity, gradnoise, parity  # noqa: E402  (hot fidelity, hot parity, hot gradnoise)

    fidelity.add_parser(sub)
    parity.add_parser(sub)
    gradnoise.add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "fn", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.fn(args) or 0)
    except ImportError as e:
        print(f"hot {args.cmd}: error: {e}", file=sys.stderr)
        return 1
