"""A synthetic image-classification task generated locally (no download), deterministic in its seed.

Images (``synth_images``): N x 3 x S x S float32 (S = 32 by default), each the alpha-composite of a
colour-gradient background, an oriented sinusoidal grating (random frequency, orientation, phase and
colour; present in 80 % of the images), one to four soft-edged shapes (disks, rotated squares, rings and
bars of random position, size and colour) and a little pixel noise.

Labels (``SynthTeacher``): the argmax over 10 classes of a fixed, randomly initialised small CNN (three
tanh conv layers, 2x2 average pools, global and 2x2-quadrant pooled features, linear read-out; its weights
come from its own seed). Each class logit is standardised with statistics the teacher measured once on
its own calibration images, then shifted so the classes are about equally frequent on them, so the labels
are balanced (each class roughly 10 %) without depending on the set being labelled. The labels are a
deterministic but intricate function of colour, texture orientation / frequency and where the shapes sit:
learnable, and not to 100 % from a few tens of thousands of images.

Everything is generated on the CPU with ``torch.Generator`` (the same tensors for the same seed, whatever
the device the caller moves them to afterwards).
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F

CLASSES = 10


def _u(g: torch.Generator, *shape, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(*shape, generator=g)


def synth_images(n: int, seed: int, size: int = 32, chunk: int = 4096) -> torch.Tensor:
    """``n`` images (n x 3 x size x size, float32, roughly zero mean, values within about ±2) from ``seed``.

    The result for a given (n, seed, size) is fixed; the first k images of a larger n are *not* the same as
    those of n = k (the random draws are per chunk of ``chunk`` images, in order), so ask for the whole set
    at once."""
    if n < 0 or size < 4:
        raise ValueError(f"synth_images: need n >= 0 and size >= 4, got n={n}, size={size}")
    g = torch.Generator().manual_seed(int(seed))
    out = []
    for start in range(0, n, chunk):
        out.append(_synth_chunk(min(chunk, n - start), g, size))
    return torch.cat(out) if out else torch.empty(0, 3, size, size)


def _synth_chunk(n: int, g: torch.Generator, size: int) -> torch.Tensor:
    c = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 2 - 1
    yy, xx = torch.meshgrid(c, c, indexing="ij")  # S x S, in (-1, 1)
    xx, yy = xx[None], yy[None]  # 1 x S x S
    soft = 1.5 / size  # edge width of the shapes: about one pixel

    def col(k=None):
        shape = (n, 3) if k is None else (n, k, 3)
        return _u(g, *shape, lo=-1.0, hi=1.0)

    # Background: a colour plus a linear colour ramp in a random direction.
    th = _u(g, n, 1, 1, hi=2 * math.pi)
    ramp = torch.cos(th) * xx + torch.sin(th) * yy  # n x S x S
    img = col()[:, :, None, None] * 0.6 + col()[:, :, None, None] * 0.5 * ramp[:, None]
    # Grating: 1..7 cycles across the image, random orientation, phase and colour; absent in 20 %.
    th = _u(g, n, 1, 1, hi=math.pi)
    freq = torch.exp(_u(g, n, 1, 1, lo=math.log(1.0), hi=math.log(7.0))) * math.pi
    ph = _u(g, n, 1, 1, hi=2 * math.pi)
    grat = torch.sin(freq * (torch.cos(th) * xx + torch.sin(th) * yy) + ph)
    amp = col() * 0.6 * (_u(g, n, 1) < 0.8)
    img = img + amp[:, :, None, None] * grat[:, None]
    # Shapes: up to 4, painted in order over the image (soft alpha masks).
    K = 4
    present = torch.arange(K)[None] < torch.randint(1, K + 1, (n, 1), generator=g)  # n x K
    kind = torch.randint(0, 4, (n, K), generator=g)
    cx, cy = _u(g, n, K, lo=-0.8, hi=0.8), _u(g, n, K, lo=-0.8, hi=0.8)
    r = _u(g, n, K, lo=0.12, hi=0.45)
    rot = _u(g, n, K, hi=math.pi)
    colour = col(K) * 1.2
    for k in range(K):
        dx = xx - cx[:, k, None, None]
        dy = yy - cy[:, k, None, None]
        cr, sr = torch.cos(rot[:, k, None, None]), torch.sin(rot[:, k, None, None])
        u, v = cr * dx + sr * dy, -sr * dx + cr * dy
        rk = r[:, k, None, None]
        dist = torch.sqrt(dx * dx + dy * dy)
        sd = torch.stack([
            rk - dist,                                          # disk
            rk - torch.maximum(u.abs(), v.abs()),               # rotated square
            0.35 * rk - (dist - 0.65 * rk).abs(),               # ring
            torch.minimum(rk - u.abs(), 0.3 * rk - v.abs()),    # bar
        ], 1)  # n x 4 x S x S: signed distance-like, > 0 inside
        sd = sd.gather(1, kind[:, k, None, None, None].expand(n, 1, size, size))  # n x 1 x S x S
        m = torch.sigmoid(sd / soft) * present[:, k, None, None, None]
        img = img * (1 - m) + colour[:, k, :, None, None] * m
    img = img + 0.05 * torch.randn(img.shape, generator=g)
    return img.contiguous()


class SynthTeacher(torch.nn.Module):
    """The fixed random CNN that labels ``synth_images``: 3 -> 16 (5x5) -> pool -> 32 (3x3) -> pool -> 32
    (3x3), tanh after each conv; features are the channel means over the whole map and over its four
    quadrants (160 numbers); 10 logits from a linear read-out. Its weights, and the per-class offsets that
    balance the labels, depend only on ``seed``."""

    def __init__(self, seed: int = 0, size: int = 32, calibration: int = 4096) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(int(seed) * 7919 + 104729)

        def w(*shape, gain):
            fan_in = math.prod(shape[1:])
            return torch.randn(*shape, generator=g) * (gain / math.sqrt(fan_in))

        self.register_buffer("w1", w(16, 3, 5, 5, gain=2.0))
        self.register_buffer("b1", 0.3 * torch.randn(16, generator=g))
        self.register_buffer("w2", w(32, 16, 3, 3, gain=2.0))
        self.register_buffer("b2", 0.3 * torch.randn(32, generator=g))
        self.register_buffer("w3", w(32, 32, 3, 3, gain=2.0))
        self.register_buffer("b3", 0.3 * torch.randn(32, generator=g))
        self.register_buffer("wo", w(CLASSES, 160, gain=1.0))
        self.register_buffer("mu", torch.zeros(CLASSES))
        self.register_buffer("sd", torch.ones(CLASSES))
        self.register_buffer("bias", torch.zeros(CLASSES))
        # Calibration images from a stream of their own: standardise each logit, then equalise the classes.
        with torch.no_grad():
            z = self.raw_logits(synth_images(calibration, int(seed) * 7919 + 15485863, size))
            self.mu.copy_(z.mean(0))
            self.sd.copy_(z.std(0) + 1e-6)
            z = (z - self.mu) / self.sd
            for _ in range(50):  # a few rounds of moving each class's offset toward a 1/10 share
                freq = torch.bincount((z + self.bias).argmax(1), minlength=CLASSES).double() / len(z)
                self.bias.sub_(0.5 * torch.log((freq + 1e-3) / (1.0 / CLASSES)).float() * 0.3)

    def raw_logits(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.conv2d(x, self.w1, self.b1, padding=2))
        h = F.avg_pool2d(h, 2)
        h = torch.tanh(F.conv2d(h, self.w2, self.b2, padding=1))
        h = F.avg_pool2d(h, 2)
        h = torch.tanh(F.conv2d(h, self.w3, self.b3, padding=1))
        feats = torch.cat([h.mean((2, 3)), F.adaptive_avg_pool2d(h, 2).flatten(1)], 1)  # N x 160
        return feats @ self.wo.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Balanced logits: their argmax is the label."""
        return (self.raw_logits(x) - self.mu) / self.sd + self.bias

    @torch.no_grad()
    def label(self, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        return torch.cat([self(x[i:i + chunk]).argmax(1) for i in range(0, len(x), chunk)]) if len(x) else \
            torch.empty(0, dtype=torch.int64)


def make_synth(n: int, seed: int = 0, size: int = 32) -> Tuple[torch.Tensor, torch.Tensor]:
    """(images, labels): ``n`` images from ``seed`` labelled by ``SynthTeacher(seed, size)`` (CPU tensors)."""
    x = synth_images(n, seed, size)
    return x, SynthTeacher(seed, size).label(x)


def load_synth(device="cpu", n_train: int = 50000, n_test: int = 10000, seed: int = 0, size: int = 32):
    """(x_train, y_train, x_test, y_test) on ``device``, like ``hot.experiments.train.load_digits``: one generated
    set of n_train + n_test images split in order, standardised per channel with the training set's
    statistics."""
    x, y = make_synth(n_train + n_test, seed, size)
    xtr, xte = x[:n_train], x[n_train:]
    mean = xtr.mean((0, 2, 3), keepdim=True)
    std = xtr.std((0, 2, 3), keepdim=True)
    xtr, xte = (xtr - mean) / std, (xte - mean) / std
    return xtr.to(device), y[:n_train].to(device), xte.to(device), y[n_train:].to(device)
