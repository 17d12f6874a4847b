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


def cmd_summary(args) -> int:
    torch = _torch()
    if torch is None:
        print("hot summary: needs torch (pip install torch)", file=sys.stderr)
        return 2
    import hot
    import hot.torch as ht
    from hot.experiments import models

    torch.manual_seed(0)
    model = models.build(args.model)
    report = ht.convert(model, hot.Config(rank=args.rank, gx_bits=args.gx_bits))
    print(report)
    print()
    x = torch.randn(args.batch, 1, 8, 8)
    print(f"{args.model}: per-layer HOT summary for a batch of {args.batch} 8x8 images")
    model.train()
    model(x)
    ht.summary(model)
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
    s = sub.add_parser("summary", help="per-layer HOT table of a built-in model")
    s.add_argument("model", choices=["vit", "cnn"])
    s.add_argument("--batch", type=int_in(1), default=128)
    s.add_argument("--rank", type=int_in(1, 16), default=16, help="HLA rank of the g_w path (1..16; default 16, "
                   "full rank, as hot.Config())")
    s.add_argument("--gx-bits", type=int, default=8, choices=[4, 8], help="bits of the g_x path (default 8, as "
                   "hot.Config())")
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
