"""Small built-in models for the demo, ``hot summary`` and tests: a vision transformer and a
ResNet-style CNN sized for 8x8 single-channel images (scikit-learn's digits), and larger ones for the
synthetic 32x32 RGB task of ``hot parity --task synth`` (``vit_synth``, ``cnn_synth``); a bottleneck ResNet (1x1 ->
3x3 -> 1x1 blocks, mostly pointwise convolutions) for each (``cnn_bneck``, ``cnn_bneck_synth``)."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    """Multi-head self-attention with nn.Linear projections (so they can be converted); the score and
    value matmuls stay in the framework's precision (SPEC §8)."""

    def __init__(self, dim: int, heads: int, causal: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int, causal: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """Vision transformer: Conv2d patch embedding, pre-norm blocks, linear head.

    pool="mean" (default): no class token; the head reads the mean of the patch tokens. With 8x8 images
    and 2x2 patches each image is exactly 16 tokens (a 4x4 grid in raster order), so every HLA block of
    16 consecutive rows is one image's patch grid and H_16 = H_4 (x) H_4 acts as a 2-D transform over
    it: the low-sequency rows HLA keeps are a 2-D low-pass over neighbouring patches (the LBP-WHT view
    HOT adopts, SPEC §4). pool="cls" prepends a class token (17 tokens per image), which shifts the
    blocks across images and makes rank-8 HLA noticeably less accurate on this tiny model."""

    def __init__(self, image: int = 8, patch: int = 2, channels: int = 1, classes: int = 10, dim: int = 64,
                 depth: int = 2, heads: int = 4, mlp: int = 128, pool: str = "mean") -> None:
        super().__init__()
        if pool not in ("mean", "cls"):
            raise ValueError(f"ViT: pool must be 'mean' or 'cls', got {pool!r}")
        self.pool = pool
        self.patch = nn.Conv2d(channels, dim, patch, stride=patch)
        n = (image // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, dim)) if pool == "cls" else None
        self.pos = nn.Parameter(torch.randn(1, n + (pool == "cls"), dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1)
        x = x + self.pos
        for b in self.blocks:
            x = b(x)
        x = x[:, 0] if self.cls is not None else x.mean(1)
        return self.head(self.norm(x))


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class _StagedCNN(nn.Module):
    """The frame of :class:`ResNet` and :class:`BottleneckResNet`: a 3x3 stem (``channels`` -> ``width``) with
    BatchNorm and ReLU, ``stages`` stages of ``blocks`` blocks each (``block(i, cin, stride)`` -> (the block of stage
    i, its output channels); every stage after the first starts at stride 2), global average pool, linear head."""

    def __init__(self, channels: int, classes: int, width: int, stages: int, blocks: int, block) -> None:
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.stages = stages
        cin = width
        for i in range(stages):
            layer = []
            for j in range(blocks):
                b, cin = block(i, cin, 2 if (i > 0 and j == 0) else 1)
                layer.append(b)
            setattr(self, f"layer{i + 1}", layer[0] if blocks == 1 else nn.Sequential(*layer))
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.head(x.mean((2, 3)))


class ResNet(_StagedCNN):
    """ResNet-style CNN: 3x3 stem, ``stages`` residual stages (the first at ``width`` channels, each next one
    at twice the channels and half the resolution) of ``blocks`` blocks each, global average pool, linear
    head. The default (two stages of one block) is the digits model."""

    def __init__(self, channels: int = 1, classes: int = 10, width: int = 32, stages: int = 2,
                 blocks: int = 1) -> None:
        if stages < 1 or blocks < 1:
            raise ValueError(f"ResNet: stages and blocks must be >= 1, got {stages}, {blocks}")

        def block(i, cin, stride):
            return ResBlock(cin, width * 2 ** i, stride=stride), width * 2 ** i

        super().__init__(channels, classes, width, stages, blocks, block)


class Bottleneck(nn.Module):
    """ResNet-50-style bottleneck block: 1x1 conv (cin -> mid), 3x3 conv (mid -> mid, ``stride``), 1x1 conv
    (mid -> cout), each followed by BatchNorm (ReLU after the first two); the shortcut is the identity, or a
    strided 1x1 conv + BatchNorm where the shape changes; ReLU of the sum. Convolutions have no bias."""

    def __init__(self, cin: int, mid: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class BottleneckResNet(_StagedCNN):
    """Bottleneck ResNet (ResNet-50's block shape, most of its convolutions pointwise): 3x3 stem (``channels`` ->
    ``width``), ``stages`` stages of ``blocks`` :class:`Bottleneck` blocks each (stage i: ``mid = width * 2**i``
    channels inside the block, ``mid * expansion`` out; every stage after the first starts at half the resolution),
    global average pool, linear head. The default (two stages of one block, width 16) is the digits model
    ``cnn_bneck``."""

    def __init__(self, channels: int = 1, classes: int = 10, width: int = 16, stages: int = 2, blocks: int = 1,
                 expansion: int = 4) -> None:
        for arg, v in (("channels", channels), ("classes", classes), ("width", width), ("stages", stages),
                       ("blocks", blocks), ("expansion", expansion)):
            if v < 1:
                raise ValueError(f"BottleneckResNet: {arg} must be >= 1, got {v}")

        def block(i, cin, stride):
            mid = width * 2 ** i
            return Bottleneck(cin, mid, mid * expansion, stride=stride), mid * expansion

        super().__init__(channels, classes, width, stages, blocks, block)


class CharLM(nn.Module):
    """Causal character-level transformer language model: token and learned position embeddings, pre-norm blocks
    with causal attention, linear head. Input (B, T) integer tokens; output logits laid out (B, vocab, T), the layout
    ``F.cross_entropy(logits, targets)`` takes for (B, T) targets."""

    def __init__(self, vocab: int = 96, context: int = 128, dim: int = 256, depth: int = 4, heads: int = 4,
                 mlp: int = 1024) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList([self._block(dim, heads, mlp) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    @staticmethod
    def _block(dim: int, heads: int, mlp: int) -> nn.Module:
        return Block(dim, heads, mlp, causal=True)

    def _run_blocks(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, idx):
        idx = idx.long()
        T = idx.shape[1]
        if T > self.context:
            raise ValueError(f"{type(self).__name__}: sequence of {T} tokens, longer than the context of "
                             f"{self.context}")
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        return self.head(self.norm(self._run_blocks(x))).transpose(1, 2)


class CharLMTorch(CharLM):
    """The same language model as :class:`CharLM` (sizes, embeddings, head, initialisation order) with PyTorch's own
    ``nn.TransformerEncoderLayer`` as its blocks (pre-norm, GELU, no dropout, causal mask): their attention is
    ``nn.MultiheadAttention``, which ``hot.torch.convert`` converts as ``hot.torch.MultiheadAttention``."""

    def __init__(self, vocab: int = 96, context: int = 128, dim: int = 256, depth: int = 4, heads: int = 4,
                 mlp: int = 1024) -> None:
        super().__init__(vocab, context, dim, depth, heads, mlp)
        self.register_buffer("causal", torch.triu(torch.ones(context, context, dtype=torch.bool), 1),
                             persistent=False)

    @staticmethod
    def _block(dim: int, heads: int, mlp: int) -> nn.Module:
        return nn.TransformerEncoderLayer(dim, heads, mlp, dropout=0.0, activation="gelu", batch_first=True,
                                          norm_first=True)

    def _run_blocks(self, x):
        T = x.shape[1]
        for b in self.blocks:
            x = b(x, src_mask=self.causal[:T, :T], is_causal=True)
        return x


MODELS = {
    "vit": ViT,
    "cnn": ResNet,
    # 32x32 RGB (hot parity --task synth): 4x4 patches -> 64 tokens + a class token (65 per image, so HLA's
    # 16-row blocks straddle images, as with ViT-B's 197 tokens), dim 192, 6 blocks, 3 heads, MLP 4x (ViT-Tiny
    # widths at 6 blocks; 2.7 M parameters).
    "vit_synth": functools.partial(ViT, image=32, patch=4, channels=3, dim=192, depth=6, heads=3, mlp=768,
                                   pool="cls"),
    # 32x32 RGB: three stages (32 -> 64 -> 128 channels at 32x32 -> 16x16 -> 8x8) of two residual blocks
    # (ResNet-14-like; 0.7 M parameters).
    "cnn_synth": functools.partial(ResNet, channels=3, width=32, stages=3, blocks=2),
    # bottleneck ResNet (1x1 -> 3x3 -> 1x1 blocks, as ResNet-50's) for digits: width 16, two stages of one block
    # (16 / 32 channels inside the blocks, 64 / 128 out)
    "cnn_bneck": BottleneckResNet,
    # 32x32 RGB: three stages of two bottleneck blocks (16 -> 32 -> 64 channels inside, 64 -> 128 -> 256 out, at
    # 32x32 -> 16x16 -> 8x8)
    "cnn_bneck_synth": functools.partial(BottleneckResNet, channels=3, width=16, stages=3, blocks=2),
    # character-level language model (hot parity --task text): context 128, dim 256, 4 blocks, 4 heads (3.2 M
    # parameters with the KJV's 75 characters)
    "char_lm": CharLM,
    # the same model from nn.TransformerEncoderLayer (nn.MultiheadAttention; hot parity --task text --model lm_torch)
    "char_lm_torch": CharLMTorch,
}


def build(name: str, **kw) -> nn.Module:
    """A built-in model by name: 'vit', 'cnn' or 'cnn_bneck' (digits, 8x8 x 1), 'vit_synth', 'cnn_synth' or
    'cnn_bneck_synth' (32x32 x 3), 'char_lm' or 'char_lm_torch' (characters); keyword arguments override the model's
    defaults."""
    if name not in MODELS:
        raise ValueError(f"hot.experiments.models.build: unknown model {name!r}, expected one of {sorted(MODELS)}")
    return MODELS[name](**kw)
