#!/usr/bin/env python3
"""Whole-model training steps, exact against HOT: peak memory, bytes kept for backward (per op kind and per
layer) and step time with a breakdown, for ViT-B/16, ResNet-50 and one LLaMA-style block.

Models: vit_b16 (timm ``vit_base_patch16_224`` when timm imports, else the same network built here: 12 blocks,
dim 768, 12 heads, MLP 3072, 196 + 1 tokens, timm's module names), vit_b16_tv (torchvision's VisionTransformer at
ViT-B/16's sizes, whose attention is nn.MultiheadAttention: converted as hot.torch.MultiheadAttention), resnet50 (torchvision,
when torchvision is absent: the same network built here), llama_block (one LLaMA-3-8B-style block: hidden 4096, 32 query heads, 8 key/value
heads, SwiGLU MLP 14336, RMSNorm, RoPE, causal SDPA, sequence 2048; its input requires a gradient as inside a
network). All randomly initialised, parameters fp32, AdamW.
Modes: exact; hot (``hot.torch.convert`` with the default ``hot.Config()``); hot-plain (the same with
``keep_less=False``: the model's nn.ReLU / nn.MaxPool2d modules keep what torch's keep); hot-paper (with ``hot.Config.paper()``,
the paper's 4-bit g_x and rank-8 HLA); lora (LoRA r=16 on every Linear
and groups=1 Conv2d, base frozen, exact; the baseline of the next); hot+lora (the same, then ``convert``: HOT
runs on the frozen base layers, the adapters stay exact, SPEC §8). LoRA through peft when it imports, else a
small peft-style wrapper (``base_layer`` / ``lora_A`` / ``lora_B``). Precisions: fp32, and bf16 autocast.

What is measured for one configuration (model, mode, precision, batch), in this order:
1. warm-up steps (they allocate the gradients and the optimizer state);
2. memory step (CUDA): ``memory_allocated`` before the step, ``reset_peak_memory_stats``, forward, backward:
   ``max_memory_allocated`` - allocated before = "activation peak" (saved tensors, gradients in flight,
   workspaces); allocated at the end of forward - before = what the forward pass left for backward as the
   allocator sees it; then the optimizer step (its own peak above that level is folded into the absolute peak).
   Gradients stay allocated across steps (``zero_grad(set_to_none=False)``). The models of all modes of one
   network stay resident (each batch size is run in every mode before the next), so "static" is this model's
   parameters, buffers, gradients, optimizer state and batch as summed tensor sizes, and the absolute peak is
   static + the measured rise;
3. attribution pass (forward only, not timed, not in the peak): ``torch.autograd.graph.saved_tensors_hooks``
   sees every tensor autograd keeps; each storage is counted once (parameters and buffers excluded), and
   attributed to the innermost module running when it was saved (module pre/post forward hooks). The inputs of
   the converted (or, in the exact modes, convertible) layers are recorded, so an input that another op also
   keeps (e.g. the attention output feeding ``proj``, kept by SDPA) is reported as such;
4. timed steps: CUDA events after forward, backward and optimizer step; median of N;
5. hooked steps: the same, with CUDA events at each converted (convertible) layer's backward: a full backward
   pre-hook (gradient of the output ready) and the later of the full backward hook (gradients of the inputs
   ready) and the weight's post-accumulate-grad hook. "layers bwd" = sum of those intervals (GPU time between
   the two events on the stream; autograd runs one node at a time on one stream here, so the intervals do not
   overlap); "other bwd" = backward total of the same steps - layers bwd. Median over M steps.
OOM at any point -> "OOM" for that configuration (larger batches of the same mode and precision are not tried).

Usage (GPU):   python benchmarks/bench_models.py [--out DIR] [--quick] [--models vit_b16,resnet50,llama_block]
Usage (CPU):   python benchmarks/bench_models.py --cpu-smoke --out DIR   (tiny sizes; every code path)
Writes DIR/bench_models.md and DIR/bench_models.json (DIR = --out, else $OUT, else ./bench_models_out).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import hot
import hot.torch as ht
from hot.experiments.models import Attention  # qkv / proj nn.Linear, as timm names them
from hot.torch.summary import kept_bytes as _analytic_kept_bytes

GB = 1e9
MODES = ("exact", "hot", "hot-plain", "hot-paper", "lora", "hot+lora")
# The paper's analytic activation-memory figure for ViT-B at batch 256 (FP32 training vs HOT), from the issue.
PAPER = {("vit_b16", 256): {"exact": 33.2e9, "hot": 5.8e9}}

DEFAULT_BATCHES = {"vit_b16": [64, 128, 256], "vit_b16_tv": [64, 128], "resnet50": [64, 128, 256],
                   "llama_block": [1, 2, 4]}
QUICK_BATCHES = {"vit_b16": [64, 256], "vit_b16_tv": [128], "resnet50": [256], "llama_block": [2]}
SMOKE_BATCHES = {"vit_b16": [2], "vit_b16_tv": [2], "resnet50": [2], "llama_block": [2]}


# ------------------------------------------------------------------------------------------------------------------
# formatting
# ------------------------------------------------------------------------------------------------------------------
def fmt_bytes(b) -> str:
    if b is None:
        return "-"
    if isinstance(b, str):
        return b
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= div:
            return f"{b / div:.2f} {unit}"
    return f"{int(b)} B"


def fmt_ms(t) -> str:
    if t is None:
        return "-"
    return f"{t:.1f}" if t >= 10 else f"{t:.2f}"


def md_table(header: List[str], rows: List[List[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------------------------
class _PatchEmbed(nn.Module):
    def __init__(self, img: int, patch: int, chans: int, dim: int) -> None:
        super().__init__()
        self.num_patches = (img // patch) ** 2
        self.proj = nn.Conv2d(chans, dim, patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = _Mlp(dim, mlp)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """ViT with timm's layout and module names (used when timm is not importable)."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, embed_dim=768, depth=12,
                 num_heads=12, mlp_ratio=4.0, class_token=True, global_pool="token") -> None:
        super().__init__()
        self.patch_embed = _PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        n = self.patch_embed.num_patches + (1 if class_token else 0)
        self.pos_embed = nn.Parameter(torch.randn(1, n, embed_dim) * 0.02)
        self.blocks = nn.Sequential(*[_Block(embed_dim, num_heads, int(embed_dim * mlp_ratio)) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        self.global_pool = global_pool

    def forward(self, x):
        x = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        x = self.blocks(x + self.pos_embed)
        x = self.norm(x)
        x = x[:, 0] if self.global_pool == "token" else x.mean(1)
        return self.head(x)


class _Bottleneck(nn.Module):
    """torchvision's ResNet-50 block (v1.5: the stride on the 3x3 conv; one in-place ReLU module called three times)."""

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        cout = planes * 4
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """ResNet-50 with torchvision's layout and module names (used when torchvision is not importable); ``width`` and
    ``blocks`` make the smoke stand-in (8, (1, 1, 1, 1))."""

    def __init__(self, num_classes: int = 1000, width: int = 64, blocks=(3, 4, 6, 3)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        for i, (n, stride) in enumerate(zip(blocks, (1, 2, 2, 2))):
            planes = width * 2 ** i
            layer = []
            for j in range(n):
                layer.append(_Bottleneck(cin, planes, stride if j == 0 else 1))
                cin = planes * 4
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class LlamaRMSNorm(nn.Module):
    """RMSNorm as Hugging Face's LLaMA computes it (fp32 statistics, weight applied in the input dtype)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dt)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, max_seq: int, theta: float = 500000.0) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(heads * self.hd, dim, bias=False)
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        f = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
        emb = torch.cat((f, f), -1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.hd).transpose(1, 2)
        cos, sin = self.cos[:S].to(q.dtype), self.sin[:S].to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        if rep > 1:  # Hugging Face's repeat_kv: expand + reshape (a copy)
            k = k[:, :, None].expand(B, self.kv_heads, rep, S, self.hd).reshape(B, self.heads, S, self.hd)
            v = v[:, :, None].expand(B, self.kv_heads, rep, S, self.hd).reshape(B, self.heads, S, self.hd)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.heads * self.hd))


class LlamaMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """One LLaMA decoder layer (pre-norm RMSNorm, RoPE + causal SDPA with grouped KV heads, SwiGLU MLP)."""

    def __init__(self, dim=4096, heads=32, kv_heads=8, mlp=14336, max_seq=2048) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(dim)
        self.self_attn = LlamaAttention(dim, heads, kv_heads, max_seq)
        self.post_attention_layernorm = LlamaRMSNorm(dim)
        self.mlp = LlamaMLP(dim, mlp)

    def forward(self, x):
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class Task:
    """A model factory plus how to make a batch and a loss."""

    def __init__(self, name, build, make_batch, loss_fn, desc, unit) -> None:
        self.name, self.build, self.make_batch, self.loss_fn, self.desc, self.unit = \
            name, build, make_batch, loss_fn, desc, unit


def _ce(out, y):
    return F.cross_entropy(out, y)


def _sq(out, y):
    return out.float().pow(2).mean()


def gpu_task(script: str, args) -> Optional[Task]:
    """The full-size task args.model of a GPU benchmark script (LLaMA block: 8 KV heads, sequence 2048), or None after
    printing why not (no GPU, or the task's reason to skip)."""
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU")
        return None
    args.llama_kv_heads, args.llama_seq = 8, 2048
    task, note = make_task(args.model, False, args)
    if task is None:
        print(note)
    return task


def layout(t, channels_last: bool):
    """t (a model or a batch) in torch.channels_last when asked and 4-D (a model: its 4-D parameters), else as is."""
    if not channels_last:
        return t
    if isinstance(t, torch.nn.Module):
        return t.to(memory_format=torch.channels_last)
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def make_task(name: str, smoke: bool, args) -> (Optional[Task], str):
    """(Task, note) or (None, reason to skip)."""
    if name == "vit_b16":
        if smoke:  # 16 tokens per image (no class token) so L = batch * 16 is a multiple of 16
            kw = dict(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=10,
                      class_token=False, global_pool="avg")
            img, classes = 16, 10
        else:
            kw, img, classes = {}, 224, 1000
        try:
            import timm

            def build():
                return timm.create_model("vit_base_patch16_224", pretrained=False, **kw)
            desc = f"timm {timm.__version__} vit_base_patch16_224" + (" (tiny smoke sizes)" if smoke else "")
        except ImportError:
            def build():
                return VisionTransformer(**kw)
            desc = "ViT-B/16 built in this script (timm not importable; timm's layout and names)" + \
                (" (tiny smoke sizes)" if smoke else "")

        def batch(b, dev):
            return torch.randn(b, 3, img, img, device=dev), torch.randint(0, classes, (b,), device=dev)
        return Task(name, build, batch, _ce, desc, "images"), ""
    if name == "vit_b16_tv":  # torchvision's ViT-B/16: its attention is nn.MultiheadAttention
        try:
            import torchvision
        except ImportError:
            return None, "torchvision is not importable"
        if smoke:
            kw = dict(image_size=16, patch_size=4, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                      num_classes=10)
            img, classes = 16, 10
        else:
            kw, img, classes = dict(image_size=224, patch_size=16, num_layers=12, num_heads=12, hidden_dim=768,
                                    mlp_dim=3072), 224, 1000

        def build():
            return torchvision.models.VisionTransformer(**kw)
        desc = (f"torchvision {torchvision.__version__} VisionTransformer (vit_b_16's sizes; nn.MultiheadAttention "
                f"blocks)" + (" (tiny smoke sizes)" if smoke else ""))

        def batch(b, dev):
            return torch.randn(b, 3, img, img, device=dev), torch.randint(0, classes, (b,), device=dev)
        return Task(name, build, batch, _ce, desc, "images"), ""
    if name == "resnet50":
        if smoke:
            def build():
                return ResNet50(num_classes=10, width=8, blocks=(1, 1, 1, 1))
            desc = "ResNet-50's layout with one block per stage at width 8 (smoke stand-in for ResNet-50)"
            img, classes = 32, 10
        else:
            try:
                import torchvision

                def build():
                    return torchvision.models.resnet50(weights=None)
                desc = f"torchvision {torchvision.__version__} resnet50"
            except ImportError:
                def build():
                    return ResNet50()
                desc = "ResNet-50 built in this script (torchvision not importable; torchvision's layout and names)"
            img, classes = 224, 1000

        def batch(b, dev):
            return torch.randn(b, 3, img, img, device=dev), torch.randint(0, classes, (b,), device=dev)
        return Task(name, build, batch, _ce, desc, "images"), ""
    if name == "llama_block":
        if smoke:
            dim, heads, kv, mlp, seq = 64, 4, 2, 128, 16
        else:
            dim, heads, kv, mlp, seq = 4096, 32, args.llama_kv_heads, 14336, args.llama_seq

        def build():
            return LlamaBlock(dim, heads, kv, mlp, seq)

        def batch(b, dev):
            return torch.randn(b, seq, dim, device=dev, requires_grad=True), None
        desc = (f"one LLaMA-style block (built here): hidden {dim}, {heads} heads, {kv} KV heads, SwiGLU {mlp}, "
                f"RMSNorm, RoPE, causal SDPA, sequence {seq}; input requires grad; loss mean(y^2)")
        return Task(name, build, batch, _sq, desc, f"sequences of {seq}"), ""
    raise ValueError(f"unknown model {name!r}")


# ------------------------------------------------------------------------------------------------------------------
# LoRA
# ------------------------------------------------------------------------------------------------------------------
class LoraLinear(nn.Module):
    """peft-style LoRA around an nn.Linear (fallback when peft is absent)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=base.weight.device)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


class LoraConv2d(nn.Module):
    def __init__(self, base: nn.Conv2d, r: int, alpha: float) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Conv2d(base.in_channels, r, base.kernel_size, base.stride, base.padding, base.dilation,
                                bias=False)
        self.lora_B = nn.Conv2d(r, base.out_channels, 1, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def lora_targets(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules()
            if type(m) is nn.Linear or (type(m) is nn.Conv2d and m.groups == 1)]


def apply_lora(model: nn.Module, r: int, force_fallback: bool = False):
    targets = lora_targets(model)
    if not force_fallback:
        try:
            import peft

            cfg = peft.LoraConfig(r=r, lora_alpha=r, lora_dropout=0.0, target_modules=targets, bias="none")
            return peft.get_peft_model(model, cfg), f"peft {peft.__version__} (r={r}, alpha={r}, no dropout)"
        except ImportError:
            pass
    for p in model.parameters():
        p.requires_grad_(False)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        wrap = LoraLinear(base, r, r) if isinstance(base, nn.Linear) else LoraConv2d(base, r, r)
        setattr(parent, child, wrap)
    return model, f"built-in peft-style LoRA wrapper (r={r}, alpha={r}; peft not importable)"


def candidate_names(model: nn.Module) -> List[str]:
    """Names of the layers hot.torch.convert would convert (found on a deep copy)."""
    rep = ht.convert(copy.deepcopy(model).cpu())
    return [n for n, _, _ in rep.converted]


def short_name(n: str) -> str:
    n = re.sub(r"^base_model\.model\.", "", n)
    return re.sub(r"\.base_layer$", "", n)


def group_name(n: str) -> str:
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", short_name(n))


# ------------------------------------------------------------------------------------------------------------------
# clocks
# ------------------------------------------------------------------------------------------------------------------
class Clock:
    """CUDA events on a GPU, perf_counter on the CPU; elapsed in ms."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else 1e3 * (b - a)


# ------------------------------------------------------------------------------------------------------------------
# saved-tensor attribution
# ------------------------------------------------------------------------------------------------------------------
_NORMS = ("LayerNorm", "RMSNorm", "LlamaRMSNorm", "BatchNorm2d", "GroupNorm", "BatchNorm1d")
_ACTS = ("GELU", "ReLU", "SiLU", "Tanh", "Sigmoid", "Hardswish", "QuickGELU", "GELUTanh")


def op_kind(mname: str, mtype: str) -> str:
    if mname == "<outside>":
        return "loss (outside the model)"
    if any(p.startswith("lora_") for p in mname.split(".")):
        return "LoRA adapters (their own inputs)"
    if mtype in _NORMS:
        return "normalisation (LayerNorm/RMSNorm/BatchNorm inputs, statistics)"
    if mtype in _ACTS:
        return "activation functions (GELU/ReLU/SiLU inputs or outputs)"
    if "attn" in mname.lower().split(".")[-1] or "Attention" in mtype:
        return "attention (SDPA q/k/v, output, log-sum-exp; RoPE)"
    if mtype in ("LlamaMLP", "Mlp", "_Mlp"):
        return "MLP glue (SwiGLU product inputs)"
    return f"other ({mtype})"


class SavedAttribution:
    """saved_tensors_hooks + module hooks: each saved storage once, with the modules that saved it."""

    def __init__(self, model: nn.Module, candidates: set, device: torch.device) -> None:
        self.model = model
        self.candidates = candidates
        self.device = device
        self.excluded = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
        self.stack: List[str] = []
        self.types: Dict[str, str] = {}
        self.weights: Dict[str, tuple] = {}
        self.is_hot: Dict[str, bool] = {}
        self.cur_input: Dict[str, tuple] = {}
        self.records: Dict[int, dict] = {}
        self.layer_inputs: Dict[int, List[str]] = {}
        self._held = []  # references to the candidates' inputs: their addresses must not be reused in this pass
        self._handles = []

    def __enter__(self):
        for name, m in self.model.named_modules():
            self.types[name] = type(m).__name__
            if name in self.candidates:
                self.weights[name] = tuple(m.weight.shape)
                self.is_hot[name] = isinstance(m, ht.layers.HOT_LAYERS) and not m.hot_config.exact
            self._handles.append(m.register_forward_pre_hook(self._pre(name)))
            self._handles.append(m.register_forward_hook(self._post))
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._held.clear()
        return False

    def _pre(self, name):
        def hook(mod, args):
            self.stack.append(name)
            if name in self.candidates and args and isinstance(args[0], torch.Tensor):
                x = args[0]
                self._held.append(x)
                ptr = x.untyped_storage().data_ptr()
                self.layer_inputs.setdefault(ptr, []).append(name)
                self.cur_input[name] = (ptr, tuple(x.shape))
        return hook

    def _post(self, mod, args, out):
        self.stack.pop()

    def _pack(self, t):
        if isinstance(t, torch.Tensor) and t.device == self.device:  # CPU-side seeds of a GPU run: not counted
            try:
                st = t.untyped_storage()
                ptr, nbytes = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):
                return t
            if ptr in self.excluded or nbytes == 0:
                return t
            mname = self.stack[-1] if self.stack else "<outside>"
            rec = self.records.setdefault(ptr, {"bytes": nbytes, "savers": [], "dtype": str(t.dtype),
                                                "shape": list(t.shape)})
            mtype = self.types.get(mname, "")
            role = self._role(mname, t, ptr) if mname in self.candidates else "op"
            rec["savers"].append((mname, mtype, role))
        return t

    def _role(self, name: str, t: torch.Tensor, ptr: int) -> str:
        """What a tensor saved by a converted (convertible) layer is: its input, a HOT buffer, a weight copy."""
        if t.dtype == torch.int64 and t.numel() == 1:
            return "seed"
        if t.dtype == torch.int8 or (t.numel() == 1 and t.dtype == torch.float32):
            return "hot"
        if self.is_hot.get(name):
            return "weight"  # a HOT layer keeps no float tensor but the weight (an autocast cast of it)
        xptr, xshape = self.cur_input.get(name, (None, None))
        if ptr == xptr:
            return "input"
        w = self.weights[name]
        if len(w) == 4:  # conv: the weight (cast) has the weight's shape, the input the input's
            return "weight" if tuple(t.shape) == w and tuple(t.shape) != xshape else "input"
        # linear: autograd keeps W^T (a transposed view, O x I -> I x O) and x folded to L x I
        if t.dim() == 2 and tuple(t.shape) == (w[1], w[0]) and not t.is_contiguous():
            return "weight"
        return "input"

    def summarize(self) -> dict:
        cats: Dict[str, int] = {}
        shared_by: Dict[str, int] = {}
        per_layer: Dict[str, dict] = {n: {"input": 0, "hot": 0, "weight": 0} for n in self.candidates}
        total = uniq_input = uniq_hot = 0
        for ptr, rec in self.records.items():
            b = rec["bytes"]
            total += b
            uniq_input += b if any(r == "input" for _, _, r in rec["savers"]) else 0
            uniq_hot += b if any(r == "hot" for _, _, r in rec["savers"]) else 0
            savers = rec["savers"]
            roles = {r for _, _, r in savers}
            cand = [s for s in savers if s[2] != "op"]
            others = [s for s in savers if s[2] == "op"]
            for name in {s[0] for s in cand}:
                role = next(s[2] for s in cand if s[0] == name)
                # a HOT buffer counts for the layer that formed it (the first to save it), not for the layers that
                # read the same input and keep the same buffer (SPEC §2); an input counts for every layer keeping it
                if role in per_layer[name] and (role != "hot" or name == cand[0][0]):
                    per_layer[name][role] += b
            is_input = ptr in self.layer_inputs or "input" in roles
            if is_input and others:
                cat = "inputs of converted layers, also kept by another op"
                for k in {op_kind(n, t) for n, t, _ in others}:
                    shared_by[k] = shared_by.get(k, 0) + b
            elif is_input:
                cat = "inputs of converted layers (kept only for their g_w)"
            elif "hot" in roles:
                cat = "HOT int8 buffers (ABC; conv int8 feature maps) + scales"
            elif "weight" in roles:
                cat = "weight copies (autocast casts kept for backward)"
            elif "seed" in roles:
                cat = "RNG seeds"
            else:
                n, t, _ = savers[0]
                cat = op_kind(n, t)
            cats[cat] = cats.get(cat, 0) + b
        return {"total": total, "categories": cats, "shared_by": shared_by,
                "per_layer": {short_name(n): v for n, v in per_layer.items()},
                "layers_input": uniq_input, "layers_hot": uniq_hot,
                "layers_weight": sum(v["weight"] for v in per_layer.values())}


# ------------------------------------------------------------------------------------------------------------------
# backward timing of the converted (convertible) layers
# ------------------------------------------------------------------------------------------------------------------
class LayerBackwardTimer:
    def __init__(self, model: nn.Module, candidates: set, clock: Clock) -> None:
        self.clock = clock
        self.mods = [(n, m) for n, m in model.named_modules() if n in candidates]
        self.marks: Dict[str, list] = {}
        self._handles = []

    def __enter__(self):
        # A layer whose input needs no gradient (the first one) fires its full backward hook early, with a
        # warning; its end is then the weight's post-accumulate-grad hook.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        for name, m in self.mods:
            self._handles.append(m.register_full_backward_pre_hook(self._pre(name)))
            self._handles.append(m.register_full_backward_hook(self._post(name)))
            for p in (m.weight, m.bias):
                if p is not None and p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._post_param(name)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return False

    def reset(self):
        self.marks = {}

    def _pre(self, name):
        def hook(mod, grad_out):
            self.marks[name] = [self.clock.mark()]
        return hook

    def _post(self, name):
        def hook(mod, grad_in, grad_out):
            if name in self.marks:
                self.marks[name].append(self.clock.mark())
        return hook

    def _post_param(self, name):
        def hook(p):
            if name in self.marks:
                self.marks[name].append(self.clock.mark())
        return hook

    def per_layer_ms(self) -> Dict[str, float]:
        out = {}
        for name, ms in self.marks.items():
            if len(ms) > 1:
                out[name] = max(self.clock.ms(ms[0], e) for e in ms[1:])
        return out


# ------------------------------------------------------------------------------------------------------------------
# one configuration
# ------------------------------------------------------------------------------------------------------------------
def own_static_bytes(model: nn.Module, opt, batch) -> int:
    """Bytes of the model's parameters, buffers, gradients, optimizer state and the input batch (each storage
    once)."""
    seen = {}

    def add(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.device == next(model.parameters()).device:
                add(v)
    for t in batch:
        add(t)
    return sum(seen.values())


def is_oom(e: BaseException) -> bool:
    return (hasattr(torch, "OutOfMemoryError") and isinstance(e, torch.OutOfMemoryError)) or \
        "out of memory" in str(e).lower()


def run_config(task: Task, model, opt, cands: set, device, dtype: str, batch: int, a, clock: Clock,
               res: dict) -> dict:
    """Measure one configuration; fills ``res`` in place (``res['stage']`` says how far it got)."""
    cuda = device.type == "cuda"
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    torch.manual_seed(1234 + batch)
    x, y = task.make_batch(batch, device)
    x = layout(x, a.channels_last)
    res.update(status="ok", stage=None)

    def fwd():
        with amp:
            return task.loss_fn(model(x), y)

    def after():
        opt.zero_grad(set_to_none=False)
        if x.requires_grad:
            x.grad = None

    def step():
        loss = fwd()
        loss.backward()
        opt.step()
        after()

    res["stage"] = "warm-up"
    for _ in range(a.warmup):
        step()
    clock.sync()

    # 2. memory step
    res["stage"] = "memory step"
    static = own_static_bytes(model, opt, (x, y))
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fwd()
        torch.cuda.synchronize()
        after_fwd = torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        peak_fb = torch.cuda.max_memory_allocated()
        del loss
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        after()
        torch.cuda.synchronize()
        peak_opt = torch.cuda.max_memory_allocated()
        # The models of the other modes stay resident: absolute figures are this model's static bytes (summed
        # tensor sizes) + what the allocator measured above its own level before the step.
        res.update(static=static, allocated_before=before, peak_abs=static + max(peak_fb, peak_opt) - before,
                   act_peak=peak_fb - before, opt_peak=peak_opt - before, fwd_kept=after_fwd - before)
    else:
        step()
        res.update(static=static, allocated_before=None, peak_abs=None, act_peak=None, opt_peak=None,
                   fwd_kept=None)

    # 3. attribution (forward only)
    res["stage"] = "saved-tensor attribution"
    with SavedAttribution(model, cands, device) as attr:
        loss = fwd()
    del loss
    res["saved"] = attr.summarize()
    del attr
    hot_layers = ht.hot_layers(model)
    res["layer_info"] = {short_name(n): {"type": type(m).__name__, "rows": m._hot_seen[0] if m._hot_seen else None,
                                         "in": m.in_features if isinstance(m, nn.Linear) else m.in_channels,
                                         "trainable": m.weight.requires_grad, "rank": m.hot_config.rank,
                                         "keeps_input": bool(m._hot_keeps_input),
                                         "shares_buffer": bool(m._hot_shares_buffer),
                                         "pointwise": isinstance(m, nn.Conv2d)
                                         and ht.ops.pointwise(m.kernel_size, ht.layers.conv_padding(m))}
                         for n, m in hot_layers}
    res["abc_analytic"] = int(sum(_analytic_kept_bytes(m)[0] for _, m in hot_layers if m._hot_seen is not None)) \
        if hot_layers else 0

    # 4. timed steps
    res["stage"] = "timed steps"
    f, b, o, t = [], [], [], []
    for _ in range(a.steps):
        e0 = clock.mark()
        loss = fwd()
        e1 = clock.mark()
        loss.backward()
        e2 = clock.mark()
        opt.step()
        after()
        e3 = clock.mark()
        del loss
        clock.sync()
        f.append(clock.ms(e0, e1))
        b.append(clock.ms(e1, e2))
        o.append(clock.ms(e2, e3))
        t.append(clock.ms(e0, e3))
    med = statistics.median
    res.update(fwd_ms=med(f), bwd_ms=med(b), opt_ms=med(o), step_ms=med(t), step_ms_all=t)

    # 5. hooked steps: backward time inside the converted (convertible) layers
    res["stage"] = "hooked steps"
    lay, bh, per = [], [], {}
    try:
        with LayerBackwardTimer(model, cands, clock) as lt:
            for _ in range(a.hooked_steps):
                lt.reset()
                loss = fwd()
                e1 = clock.mark()
                loss.backward()
                e2 = clock.mark()
                opt.step()
                after()
                del loss
                clock.sync()
                pl = lt.per_layer_ms()
                lay.append(sum(pl.values()))
                bh.append(clock.ms(e1, e2))
                for n, v in pl.items():
                    per.setdefault(n, []).append(v)
    except RuntimeError as e:  # e.g. module backward hooks refused by an in-place op: keep the rest
        if is_oom(e) or a.cpu_smoke:
            raise
        res["hooked_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        lay, bh, per = [], [], {}
        opt.zero_grad(set_to_none=False)
    res.update(layers_bwd_ms=med(lay) if lay else None, hooked_bwd_ms=med(bh) if bh else None,
               layers_timed=len(per), per_layer_bwd_ms={short_name(n): med(v) for n, v in per.items()})
    res["other_bwd_ms"] = res["hooked_bwd_ms"] - res["layers_bwd_ms"] if lay else None
    res["stage"] = None
    return res


# ------------------------------------------------------------------------------------------------------------------
# environment
# ------------------------------------------------------------------------------------------------------------------
def _version(dist: str) -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return "?"
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def environment(device: torch.device) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "timm": _version("timm"), "torchvision": _version("torchvision"), "peft": _version("peft"),
           "hot": getattr(hot, "__version__", "?"), "hot_build": hot.build_info(),
           "matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
           "cudnn_benchmark": torch.backends.cudnn.benchmark, "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env["gpu"] = f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, " \
                     f"{p.total_memory / 2**30:.1f} GiB)"
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            env["driver"] = "?"
    else:
        env["gpu"] = "none (CPU: " + (platform.processor() or platform.machine()) + \
                     f", {torch.get_num_threads()} threads)"
        env["driver"] = "-"
    return env


# ------------------------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------------------------
def _ok(r):
    return r is not None and r.get("status") == "ok"


def find(results, model, mode, dtype, batch):
    for r in results:
        if r["model"] == model and r["mode"] == mode and r["dtype"] == dtype and r["batch"] == batch:
            return r
    return None


def reference_config(results, model):
    """(dtype, batch) for the explanation: fp32 at the largest batch where exact and hot both ran, else bf16."""
    for dtype in ("fp32", "bf16"):
        bs = sorted({r["batch"] for r in results if r["model"] == model and r["dtype"] == dtype}, reverse=True)
        for b in bs:
            if _ok(find(results, model, "exact", dtype, b)) and _ok(find(results, model, "hot", dtype, b)):
                return dtype, b
    return None


def paper_cell(model, mode, dtype, batch) -> str:
    p = PAPER.get((model, batch))
    if p is None or dtype != "fp32" or mode not in p:
        return ""
    return f"{p[mode] / GB:.1f} GB"


def explain(results, model, titles) -> List[str]:
    ref = reference_config(results, model)
    if ref is None:
        return [f"{titles.get(model, model)}: no configuration where both exact and HOT ran; nothing to explain."]
    dtype, b = ref
    ex, ho = find(results, model, "exact", dtype, b), find(results, model, "hot", dtype, b)
    se, sh = ex["saved"], ho["saved"]
    lines = []
    head = f"**{titles.get(model, model)}, batch {b}, {dtype}.** "
    s = head + (f"Saved-tensor hooks count {fmt_bytes(se['total'])} kept for backward by exact training and "
                f"{fmt_bytes(sh['total'])} with HOT ({sh['total'] / se['total']:.2f}x). ")
    if ex.get("act_peak") is not None:
        s += (f"Activation peak (forward + backward, above the memory allocated before the step): "
              f"{fmt_bytes(ex['act_peak'])} exact, "
              f"{fmt_bytes(ho['act_peak'])} HOT ({ho['act_peak'] / ex['act_peak']:.2f}x); absolute peaks "
              f"{fmt_bytes(ex['peak_abs'])} and {fmt_bytes(ho['peak_abs'])}. ")
    li_e = se["layers_input"]
    abc = sh["layers_hot"]
    s += (f"The converted layers themselves keep {fmt_bytes(li_e)} of inputs in exact training and "
          f"{fmt_bytes(abc)} of int8 buffers with HOT"
          + (f" ({abc / li_e:.3f}x; 1/8 for a linear layer's fp32 input at rank 8, 1/4 for bf16, 1/4 resp. 1/2 "
             f"for a conv's int8 feature map)" if li_e else "") + ". ")
    per_layer_x = sum(v["input"] for v in se["per_layer"].values())
    if per_layer_x > li_e * 1.01:
        s += (f"Some converted layers share one input (e.g. separate q/k/v or gate/up projections): exact training "
              f"keeps it once ({fmt_bytes(li_e)} unique against {fmt_bytes(per_layer_x)} counted per layer), HOT "
              f"keeps one ABC buffer per layer. ")
    lines.append(s)
    cats = sh["categories"]
    untouched = {k: v for k, v in cats.items() if not k.startswith("HOT int8") and k != "RNG seeds"}
    tot_untouched = sum(untouched.values())
    parts = [f"{k}: {fmt_bytes(v)}" for k, v in sorted(untouched.items(), key=lambda kv: -kv[1]) if v]
    s = (f"What HOT leaves in place ({fmt_bytes(tot_untouched)}, {tot_untouched / max(sh['total'], 1):.0%} of what "
         f"HOT keeps): " + "; ".join(parts) + ". ")
    shared = sh.get("shared_by") or {}
    if shared:
        why = []
        for k in shared:
            if k.startswith("attention"):
                why.append("the attention output feeding the output projection is saved by SDPA")
            elif k.startswith("activation"):
                why.append("an activation that saves its output (ReLU) keeps the next layer's input")
            elif k.startswith("LoRA"):
                why.append("a LoRA adapter's A matrix saves the same input as the frozen base layer")
            elif k.startswith("normalisation"):
                why.append("a normalisation saves its input, the previous layer's output")
            elif k.startswith("other ("):
                why.append(f"functional ops inside {k[7:-1]} save a layer's input (e.g. F.relu keeps its output)")
        s += ("Inputs of converted layers that another op keeps anyway cannot shrink, whatever the layer stores: "
              + ", ".join(f"{fmt_bytes(v)} kept by {k}" for k, v in sorted(shared.items(), key=lambda kv: -kv[1]))
              + " (" + "; ".join(why) + "). ")
    lines.append(s)
    p = PAPER.get((model, b))
    if p is not None:
        s = (f"The paper's analytic figure for ViT-B at batch 256 is {p['exact'] / GB:.1f} GB (FP) and "
             f"{p['hot'] / GB:.1f} GB (HOT), a ratio of {p['hot'] / p['exact']:.2f}; measured here (fp32 rows, "
             f"same batch) exact training keeps {fmt_bytes(se['total'])} and HOT {fmt_bytes(sh['total'])} "
             f"({sh['total'] / se['total']:.2f}x). ")
        if dtype != "fp32":
            s = s.replace("fp32 rows", f"{dtype} rows (no fp32 pair ran)")
        s += (f"The tensors HOT does not compress add up to {fmt_bytes(tot_untouched)} on their own"
              + (", more than the paper's whole HOT figure: the analytic figure treats them as compressed too "
                 "(or leaves them out)." if tot_untouched > p["hot"] else
                 f"; the paper's HOT figure leaves {fmt_bytes(p['hot'] - tot_untouched)} for everything else."))
        lines.append(s)
    le, lh = find(results, model, "lora", dtype, b), find(results, model, "hot+lora", dtype, b)
    if _ok(le) and _ok(lh):
        sl = lh["saved"]
        lora_x = sum(v for k, v in (sl.get("shared_by") or {}).items() if k.startswith("LoRA"))
        lines.append(f"Under LoRA (base frozen): exact LoRA keeps {fmt_bytes(le['saved']['total'])}, HOT + LoRA "
                     f"{fmt_bytes(sl['total'])}. A frozen base layer keeps no input for g_w in either (HOT keeps "
                     f"nothing at all, SPEC §8; HOT buffers here {fmt_bytes(sl['layers_hot'])}), while the adapters "
                     f"keep {fmt_bytes(lora_x)} of the base layers' inputs (A's input) plus "
                     f"{fmt_bytes(sl['categories'].get('LoRA adapters (their own inputs)', 0))} of their own; "
                     f"HOT + LoRA changes the base layers' backward arithmetic, not the memory.")
    return lines


def write_report(path_md, path_json, env, results, notes, titles, args):
    with open(path_json, "w") as fjs:
        json.dump({"environment": env, "notes": notes, "models": titles, "results": results,
                   "paper_analytic": {f"{k[0]}@{k[1]}": v for k, v in PAPER.items()},
                   "args": vars(args)}, fjs, indent=1, default=str)
    L = ["# Whole-model memory and step time: exact vs HOT", ""]
    L.append(f"GPU: {env['gpu']}, driver {env['driver']}, CUDA (torch) {env['torch_cuda']}, torch {env['torch']}, "
             f"timm {env['timm']}, torchvision {env['torchvision']}, peft {env['peft']}, hot {env['hot']}, "
             f"Python {env['python']}; {env['date']}. TF32: matmul {env['matmul_tf32']}, cuDNN {env['cudnn_tf32']}; "
             f"cudnn.benchmark {env['cudnn_benchmark']}." +
             (" Images and 4-D parameters channels-last." if getattr(args, "channels_last", False) else ""))
    L += ["", "hot build: " + " / ".join(l.strip() for l in str(env["hot_build"]).splitlines()), ""]
    L += ["Models: " + "; ".join(f"`{k}` = {v}" for k, v in titles.items()) + "."]
    L += [f"Steps: {args.warmup} warm-up, memory step, attribution pass (forward only), median of {args.steps} timed "
          f"steps, median of {args.hooked_steps} hooked steps. AdamW; parameters fp32; bf16 = torch.autocast. "
          f"HOT = `hot.torch.convert(model)` with `hot.Config()` ({hot.Config().describe()}); hot-paper = with "
          f"`hot.Config.paper()` ({hot.Config.paper().describe()}); hot-plain = HOT with `keep_less=False` (nn.ReLU / "
          f"nn.MaxPool2d keep what torch's keep); every Linear and groups=1 Conv2d is converted "
          "(patch embedding / stem included). "
          "LoRA r=16 on every Linear and groups=1 Conv2d, everything else frozen. GB = 1e9 bytes.", ""]
    for n in notes:
        L.append(f"- {n}")
    if notes:
        L.append("")
    L += ["Columns: *static* = this model's parameters, buffers, gradients (kept allocated between steps), "
          "optimizer state and input batch (summed tensor sizes; the models of the other modes stay resident on "
          "the device, so `memory_allocated` itself is not used for it); *act. peak* = `max_memory_allocated` over "
          "forward + backward - `memory_allocated` just before the step (after `reset_peak_memory_stats`); *peak* = "
          "static + the larger of act. peak and the optimizer step's own peak above that level; *fwd left* = "
          "allocated at the end of forward - allocated before it; *saved* = storages "
          "autograd keeps (saved-tensor hooks, each storage once, parameters/buffers excluded); *layers x* = inputs "
          "saved by the converted (convertible) layers; *HOT buf* = their int8 ABC buffers / feature maps + scales "
          "(measured; = the analytic size `hot.torch.summary` gives); *layers bwd* = GPU time in those layers' "
          "backward (hooked steps); *other bwd* = rest of the backward of the same steps; times in ms.", ""]
    hdr = ["model", "mode", "dtype", "batch", "peak", "static", "act. peak", "fwd left", "saved", "layers x",
           "HOT buf", "step", "fwd", "bwd", "opt", "layers bwd", "other bwd", "paper (analytic)"]
    rows = []
    for r in results:
        if not _ok(r):
            rows.append([r["model"], r["mode"], r["dtype"], r["batch"], r["status"]] + [""] * 12 +
                        [paper_cell(r["model"], r["mode"], r["dtype"], r["batch"])])
            continue
        s = r["saved"]
        rows.append([r["model"], r["mode"], r["dtype"], r["batch"], fmt_bytes(r["peak_abs"]), fmt_bytes(r["static"]),
                     fmt_bytes(r["act_peak"]), fmt_bytes(r["fwd_kept"]), fmt_bytes(s["total"]),
                     fmt_bytes(s["layers_input"]), fmt_bytes(s["layers_hot"]), fmt_ms(r["step_ms"]),
                     fmt_ms(r["fwd_ms"]), fmt_ms(r["bwd_ms"]), fmt_ms(r["opt_ms"]), fmt_ms(r["layers_bwd_ms"]),
                     fmt_ms(r["other_bwd_ms"]), paper_cell(r["model"], r["mode"], r["dtype"], r["batch"])])
    L += ["## All configurations", "", md_table(hdr, rows), ""]

    L += ["## Speed: HOT against exact in the same run", ""]
    srows = []
    for r in results:
        if r["mode"] not in ("hot", "hot-plain", "hot-paper", "hot+lora") or not _ok(r):
            continue
        base = find(results, r["model"], "lora" if r["mode"] == "hot+lora" else "exact", r["dtype"], r["batch"])
        if not _ok(base):
            continue
        srows.append([r["model"], f"{r['mode']} / {base['mode']}", r["dtype"], r["batch"],
                      f"{base['step_ms'] / r['step_ms']:.2f}x", f"{base['fwd_ms'] / r['fwd_ms']:.2f}x",
                      f"{base['bwd_ms'] / r['bwd_ms']:.2f}x",
                      f"{base['layers_bwd_ms'] / r['layers_bwd_ms']:.2f}x"
                      if r["layers_bwd_ms"] and base["layers_bwd_ms"] else "-",
                      f"{base['other_bwd_ms'] / r['other_bwd_ms']:.2f}x"
                      if r["other_bwd_ms"] and base["other_bwd_ms"] else "-"])
    L += [md_table(["model", "modes", "dtype", "batch", "step speed-up", "fwd", "bwd", "layers bwd", "other bwd"],
                   srows) if srows else "(no pair ran)", ""]

    L += ["## What is kept for backward, by op kind", ""]
    for model in titles:
        ref = reference_config(results, model)
        if ref is None:
            continue
        dtype, b = ref
        runs = [(m, find(results, model, m, dtype, b)) for m in MODES]
        runs = [(m, r) for m, r in runs if _ok(r)]
        cats = []
        for _, r in runs:
            for k in r["saved"]["categories"]:
                if k not in cats:
                    cats.append(k)
        crow = [[k] + [fmt_bytes(r["saved"]["categories"].get(k, 0)) for _, r in runs] for k in cats]
        crow.append(["**total**"] + [fmt_bytes(r["saved"]["total"]) for _, r in runs])
        L += [f"### {model}, batch {b}, {dtype}", "", md_table(["kept for backward"] + [m for m, _ in runs], crow), ""]
        shared = {m: r["saved"].get("shared_by") or {} for m, r in runs}
        if any(shared.values()):
            L.append("Inputs of converted layers also kept by another op, by that op: " + "; ".join(
                f"{m}: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d.items())
                for m, d in shared.items() if d) + ".")
            L.append("")
        # per layer group
        ex, ho = find(results, model, "exact", dtype, b), find(results, model, "hot", dtype, b)
        groups: Dict[str, dict] = {}
        for name, v in ex["saved"]["per_layer"].items():
            g = groups.setdefault(group_name(name), {"n": 0, "ex": 0, "ho": 0, "tex": [], "tho": []})
            g["n"] += 1
            g["ex"] += v["input"]
            if name in ex["per_layer_bwd_ms"]:
                g["tex"].append(ex["per_layer_bwd_ms"][name])
        for name, v in ho["saved"]["per_layer"].items():
            g = groups.setdefault(group_name(name), {"n": 0, "ex": 0, "ho": 0, "tex": [], "tho": []})
            g["ho"] += v["hot"] + v["input"]
            if name in ho["per_layer_bwd_ms"]:
                g["tho"].append(ho["per_layer_bwd_ms"][name])
        grow = []
        for gname, g in groups.items():
            n = max(g["n"], 1)
            te = statistics.mean(g["tex"]) if g["tex"] else None
            th = statistics.mean(g["tho"]) if g["tho"] else None
            grow.append([gname, g["n"], fmt_bytes(g["ex"] / n), fmt_bytes(g["ho"] / n),
                         f"{g['ho'] / g['ex']:.3f}" if g["ex"] else "-",
                         f"{1e3 * te:.0f}" if te is not None else "-", f"{1e3 * th:.0f}" if th is not None else "-"])
        L += [f"Per layer (mean over the layers of a group), {dtype}, batch {b}: bytes the layer itself keeps "
              f"(exact: its input; HOT: ABC + scale), and its backward time in us (hooked steps).", "",
              md_table(["layers", "n", "exact kept", "HOT kept", "HOT/exact", "exact bwd us", "HOT bwd us"], grow), ""]

    L += ["## Why HOT's saving is smaller than the converted layers' 8x", ""]
    for model in titles:
        L += explain(results, model, titles) + [""]
    with open(path_md, "w") as fmd:
        fmd.write("\n".join(L) + "\n")


def compact_table(results) -> str:
    hdr = ["model", "mode", "dtype", "B", "peak", "act.peak", "saved", "layersX", "HOTbuf", "step ms", "fwd", "bwd",
           "lay.bwd"]
    rows = []
    for r in results:
        if not _ok(r):
            rows.append([r["model"], r["mode"], r["dtype"], str(r["batch"]), r["status"]] + [""] * 8)
            continue
        s = r["saved"]
        rows.append([r["model"], r["mode"], r["dtype"], str(r["batch"]), fmt_bytes(r["peak_abs"]),
                     fmt_bytes(r["act_peak"]), fmt_bytes(s["total"]), fmt_bytes(s["layers_input"]),
                     fmt_bytes(s["layers_hot"]), fmt_ms(r["step_ms"]), fmt_ms(r["fwd_ms"]), fmt_ms(r["bwd_ms"]),
                     fmt_ms(r["layers_bwd_ms"])])
    w = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    return "\n".join("  ".join(str(c).rjust(w[i]) if i >= 3 else str(c).ljust(w[i]) for i, c in enumerate(row))
                     for row in [hdr] + rows)


# ------------------------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else ./bench_models_out)")
    ap.add_argument("--models", default="vit_b16,resnet50,llama_block")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--batches", action="append", default=[], metavar="MODEL=B1,B2",
                    help="batch sizes of one model, e.g. vit_b16=64,256 (repeatable)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (median)")
    ap.add_argument("--hooked-steps", type=int, default=None, help="steps with per-layer backward events")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new configurations after this many seconds (default 225; smoke: none)")
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes and steps")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU; every code path")
    ap.add_argument("--device", default=None)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-fallback", action="store_true", help="use the built-in LoRA wrapper even if peft imports")
    ap.add_argument("--llama-seq", type=int, default=2048)
    ap.add_argument("--llama-kv-heads", type=int, default=8)
    ap.add_argument("--channels-last", action="store_true",
                    help="images and the models' 4-D parameters channels-last (torch.channels_last)")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 matmuls (default: torch's default, off)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                    help="merge the bench_models.json of earlier runs (e.g. one process per configuration, see "
                         "benchmarks/run_bench_models.sh) into one report in --out")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        a.device = a.device or "cpu"
        d = dict(warmup=1, steps=2, hooked_steps=1)
        batches = SMOKE_BATCHES
    elif a.quick:
        d = dict(warmup=1, steps=3, hooked_steps=1)
        batches = QUICK_BATCHES
    else:
        d = dict(warmup=2, steps=5, hooked_steps=2)
        batches = DEFAULT_BATCHES
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.batch_map = {k: list(v) for k, v in batches.items()}
    for spec in a.batches:
        k, _, v = spec.partition("=")
        a.batch_map[k.strip()] = [int(s) for s in v.split(",") if s.strip()]
    if a.budget_s is None:
        a.budget_s = float("inf") if a.cpu_smoke else 225.0
    return a


def main(argv=None) -> int:
    threads = torch.get_num_threads()
    try:
        a = parse_args(argv)
        return merge_reports(a) if a.merge else _main(a)
    finally:
        torch.set_num_threads(threads)


def merge_reports(a) -> int:
    """One report from the JSON outputs of several runs (same environment)."""
    docs = []
    for d in a.merge:
        path = os.path.join(d, "bench_models.json")
        if os.path.exists(path):
            with open(path) as f:
                docs.append(json.load(f))
    if not docs:
        print("bench_models --merge: no bench_models.json found", file=sys.stderr)
        return 1
    results, notes, titles = [], [], {}
    for doc in docs:
        results += doc["results"]
        notes += [n for n in doc["notes"] if n not in notes]
        titles.update(doc["models"])
    names = list(titles)
    order = {m: i for i, m in enumerate(MODES)}
    results.sort(key=lambda r: (names.index(r["model"]) if r["model"] in names else 99, order.get(r["mode"], 9),
                                r["dtype"] != "fp32", r["batch"]))
    first = argparse.Namespace(**docs[0]["args"])
    out_dir = a.out or os.environ.get("OUT") or "bench_models_out"
    os.makedirs(out_dir, exist_ok=True)
    md, js = os.path.join(out_dir, "bench_models.md"), os.path.join(out_dir, "bench_models.json")
    write_report(md, js, docs[0]["environment"], results, notes, titles, first)
    print(compact_table(results))
    print(f"\nmerged {len(docs)} runs into {md} and {js}")
    return 0


def _main(a) -> int:
    t_start = time.perf_counter()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:  # tensors report cuda:N; compare like with like
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and not hot.cuda_available():
        print(f"bench_models: torch sees a GPU but hot's CUDA backend is unavailable ({hot.cuda_unavailable_reason()})",
              file=sys.stderr)
        return 2
    if a.cpu_smoke:
        torch.set_num_threads(1)  # tiny ops: one thread avoids spinning OpenMP workers on a busy machine
    if a.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    out_dir = a.out or os.environ.get("OUT") or "bench_models_out"
    os.makedirs(out_dir, exist_ok=True)
    clock = Clock(device.type == "cuda")
    env = environment(device)
    print(f"bench_models: device {device} ({env['gpu']}), torch {env['torch']}, timm {env['timm']}, "
          f"torchvision {env['torchvision']}, peft {env['peft']}", flush=True)
    notes, titles, results = [], {}, []
    modes = [m for m in a.modes.split(",") if m]
    dtypes = [d for d in a.dtypes.split(",") if d]
    model_names = [m for m in a.models.split(",") if m]
    runs = model = opt = None
    for mi, mname in enumerate(model_names):
        # rolling deadline: each model gets an equal share of the budget plus what earlier models left
        deadline = t_start + a.budget_s * (mi + 1) / len(model_names)
        task, why = make_task(mname, a.cpu_smoke, a)
        if task is None:
            notes.append(f"{mname}: {why}")
            print(f"  {mname}: {why}", flush=True)
            continue
        titles[mname] = task.desc
        torch.manual_seed(0)
        base = task.build()
        # one model per mode, all resident, so each batch size is measured in every mode before the next
        runs = {}
        for mode in modes:
            model = copy.deepcopy(base)
            if "lora" in mode:
                model, lnote = apply_lora(model, a.lora_r, a.lora_fallback)
                if f"LoRA: {lnote}" not in notes:
                    notes.append(f"LoRA: {lnote}")
            cands = set(candidate_names(model))
            if mode.startswith("hot"):
                rep = ht.convert(model, hot.Config.paper() if mode == "hot-paper" else None,
                                 keep_less=mode != "hot-plain")
                assert {n for n, _, _ in rep.converted} == cands
            model = layout(model.to(device), a.channels_last)
            model.train()
            params = [p for p in model.parameters() if p.requires_grad]
            runs[mode] = (model, torch.optim.AdamW(params, lr=1e-4), cands, sum(p.numel() for p in params))
        del base
        oom_seen = set()
        for dtype in dtypes:
            for bsz in a.batch_map[mname]:
                for mode in modes:
                    model, opt, cands, n_train = runs[mode]
                    rec = dict(model=mname, mode=mode, dtype=dtype, batch=bsz, trainable_params=n_train,
                               layers=len(cands))
                    if (mode, dtype) in oom_seen:
                        rec["status"] = "OOM (a smaller batch ran out of memory)"
                        results.append(rec)
                        continue
                    if time.perf_counter() > deadline:
                        rec["status"] = "skipped (time budget)"
                        results.append(rec)
                        continue
                    t0 = time.perf_counter()
                    err = None
                    try:
                        run_config(task, model, opt, cands, device, dtype, bsz, a, clock, rec)
                    except Exception as e:  # noqa: BLE001  (one failed configuration must not stop the run)
                        if a.cpu_smoke and not is_oom(e):
                            raise
                        oom = is_oom(e)
                        err = ("OOM" if oom else "error", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                        if not oom:
                            traceback.print_exc()
                    if err is not None:
                        rec["status"] = err[0] if err[0] == "OOM" else f"error ({err[1][:60]})"
                        rec["error"] = err[1] + f" (stage: {rec.get('stage')})"
                        if err[0] == "OOM":
                            oom_seen.add((mode, dtype))
                        opt.zero_grad(set_to_none=False)
                    rec["wall_s"] = time.perf_counter() - t0
                    results.append(rec)
                    msg = rec["status"] if rec["status"] != "ok" else (
                        f"peak {fmt_bytes(rec['peak_abs'])}, saved {fmt_bytes(rec['saved']['total'])}, "
                        f"step {fmt_ms(rec['step_ms'])} ms (layers bwd {fmt_ms(rec['layers_bwd_ms'])})")
                    print(f"  {mname:12} {mode:9} {dtype:5} batch {bsz:4}: {msg}  [{rec['wall_s']:.1f} s]", flush=True)
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        del runs, model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    order = {m: i for i, m in enumerate(MODES)}
    results.sort(key=lambda r: (model_names.index(r["model"]), order.get(r["mode"], 9), r["dtype"] != "fp32",
                                r["batch"]))
    md = os.path.join(out_dir, "bench_models.md")
    js = os.path.join(out_dir, "bench_models.json")
    write_report(md, js, env, results, notes, titles, a)
    print()
    print(compact_table(results))
    print(f"\nwrote {md} and {js} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
