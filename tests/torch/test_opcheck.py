"""torch.library.opcheck of hot's torch.library ops (the route under torch.compile): the schema, and fake outputs
whose shapes, dtypes and strides are those of the real outputs, for contiguous and channels-last / permuted operands.
A fake output laid out differently from the real one makes the compiled graph view memory in another order than it
runs in (a channels-last ResNet-50 failed so under torch.compile until the conv's fake output followed F.conv2d's
layout)."""
import pytest
import torch

import hot
import hot.torch  # noqa: F401  (registers the torch.library ops)
from hot.torch import ops
from conftest import DEVICES

CHECKS = ("test_schema", "test_faketensor")
CFG = hot.Config(rounding="nearest")


def _check(op, args):
    torch.library.opcheck(op, args, test_utils=CHECKS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("geom", [(3, 1, 1), (1, 0, 1), (3, 1, 2), (1, 0, 2)], ids=["3x3", "1x1", "3x3s2", "1x1s2"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_conv2d_ops(device, layout, geom, bias):
    k, pad, st = geom
    g = torch.Generator().manual_seed(k * 10 + st)
    x = torch.randn(2, 8, 8, 8, generator=g).to(device)
    w = torch.randn(16, 8, k, k, generator=g).to(device)
    if layout == "channels_last":
        x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    b = torch.randn(16, generator=g).to(device) if bias else None
    seed = torch.zeros((), dtype=torch.int64, device=device)
    for keep in (ops.KEEP_COMPRESSED, ops.KEEP_RAW):
        args = (x, w, b, seed, [st, st], [pad, pad], [1, 1], keep, CFG.code)
        _check(torch.ops.hot.conv2d.default, args)
        y, q, s = torch.ops.hot.conv2d(*args)
        gy = torch.randn(y.shape, generator=g).to(device).contiguous(memory_format=torch.channels_last
                                                                      if layout == "channels_last"
                                                                      else torch.contiguous_format)
        xr = x if keep == ops.KEEP_RAW else None
        _check(torch.ops.hot.conv2d_backward.default,
               (gy, w, xr, q, s, seed, list(x.shape), [st, st], [pad, pad], [1, 1], CFG.code, True, True, bias))

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["2d", "3d", "3d_permuted"])
def test_linear_ops(device, shape):
    g = torch.Generator().manual_seed(1)
    if shape == "2d":
        x = torch.randn(32, 16, generator=g)
    elif shape == "3d":
        x = torch.randn(4, 8, 16, generator=g)
    else:  # (L, N, I) memory read as (N, L, I): a sequence-first tensor transposed
        x = torch.randn(8, 4, 16, generator=g).transpose(0, 1)
    x = x.to(device)
    w = torch.randn(24, 16, generator=g).to(device)
    b = torch.randn(24, generator=g).to(device)
    seed = torch.zeros((), dtype=torch.int64, device=device)
    _check(torch.ops.hot.linear.default, (x, w, b, seed))
    _check(torch.ops.hot.compress_activation.default, (x, CFG.code))
    y = torch.ops.hot.linear(x, w, b, seed)
    for keep in (ops.KEEP_COMPRESSED, ops.KEEP_RAW):
        q, s = (torch.ops.hot.compress_activation(x, CFG.code) if keep == ops.KEEP_COMPRESSED
                else (torch.empty(0, dtype=torch.int8, device=device), torch.empty(0, device=device)))
        gy = torch.randn(y.shape, generator=g).to(device)
        xr = x if keep == ops.KEEP_RAW else None
        _check(torch.ops.hot.linear_backward.default,
               (gy, w, xr, q, s, seed, list(x.shape), CFG.code, True, True, True))

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_lean_ops(device, layout):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 9, 9, generator=g).to(device)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    flat = torch.randn(100, generator=g).to(device)
    _check(torch.ops.hot.relu_mask.default, (flat,))
    _check(torch.ops.hot.relu_mask_inplace.default, (flat.clone(),))
    _, bits = torch.ops.hot.relu_mask(flat)
    _check(torch.ops.hot.relu_mask_backward.default, (torch.randn(100, generator=g).to(device), bits))
    pool = ([3, 3], [2, 2], [1, 1], [1, 1])
    _check(torch.ops.hot.max_pool2d_offsets.default, (x, *pool, False))
    y, off = torch.ops.hot.max_pool2d_offsets(x, *pool, False)
    gy = torch.randn(y.shape, generator=g).to(device).contiguous(
        memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)
    _check(torch.ops.hot.max_pool2d_offsets_backward.default,
           (gy, off, list(x.shape), layout == "channels_last", *pool))
