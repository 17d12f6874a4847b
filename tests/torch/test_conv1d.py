"""hot.torch.Conv1d: nn.Conv1d with HOT's backward, as the 2-D convolution of unit height it is (SPEC §8)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot
import hot.torch as ht
from conftest import DEVICES
from torch_reference import assert_compiles_like_eager

GEOMS = [dict(kernel_size=3, padding=1), dict(kernel_size=5, stride=2, padding=2), dict(kernel_size=3, dilation=2),
         dict(kernel_size=1), dict(kernel_size=1, stride=2), dict(kernel_size=3, padding="same", bias=False)]


def pair(device, geom, config=None):
    torch.manual_seed(0)
    ref = nn.Conv1d(12, 20, **geom).to(device)
    m = copy.deepcopy(ref)
    rep = ht.convert(nn.Sequential(m), config)
    return ref, m, rep


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("geom", GEOMS)
def test_forward_and_exact_gradients_are_nn_conv1d(device, geom, monkeypatch):
    # cuDNN's convolutions default to TF32 on the GPU, the engine's exact GEMMs to float32: compare float32 to float32
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    ref, m, rep = pair(device, geom, hot.Config(exact=True))
    assert type(m) is ht.Conv1d and isinstance(m, nn.Conv1d) and len(rep.converted) == 1
    for shape in ((3, 12, 37), (12, 37)):  # batched and unbatched
        x = torch.randn(*shape, device=device)
        outs = []
        for mod in (ref, m):
            mod.zero_grad()
            xi = x.clone().requires_grad_()
            y = mod(xi)
            (y * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum().backward()
            outs.append((y.detach(), xi.grad, [p.grad for p in mod.parameters()]))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-5)
        for a, b in zip(outs[1][2], outs[0][2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("geom", GEOMS[:3] + GEOMS[4:5])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_gradients_are_the_unit_height_conv2d(device, geom, rounding):
    # bit for bit the gradients of hot.torch.Conv2d on the (N, C, 1, L) map with the (O, C, 1, k) kernel (the same
    # seed draw), and within a few % of exact
    cfg = hot.Config(rounding=rounding)
    ref, m, _ = pair(device, geom, cfg)
    k = ref.kernel_size[0]
    c2 = nn.Conv2d(12, 20, (1, k), (1, ref.stride[0]), (0, ref.padding[0]), (1, ref.dilation[0]),
                   bias=ref.bias is not None).to(device)
    with torch.no_grad():
        c2.weight.copy_(ref.weight.unsqueeze(2))
        if ref.bias is not None:
            c2.bias.copy_(ref.bias)
    ht.convert(nn.Sequential(c2), cfg)
    x = torch.randn(4, 12, 64, device=device)
    g = torch.randn_like(ref(x))
    got = []
    for mod, xin, gin in ((m, x, g), (c2, x.unsqueeze(2), g.unsqueeze(2))):
        xi = xin.clone().requires_grad_()
        torch.manual_seed(7)
        mod(xi).backward(gin)
        got.append((xi.grad.reshape(x.shape), mod.weight.grad.reshape(ref.weight.shape)))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    xr = x.clone().requires_grad_()
    ref(xr).backward(g)
    err = float((got[0][1] - ref.weight.grad).norm() / ref.weight.grad.norm())
    assert 0 < err < 0.05


def test_convert_report_calibrate_summary_and_reuse():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv1d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv1d(16, 16, 5, padding=2),
                      nn.Conv1d(16, 16, 3, groups=16), nn.Conv1d(16, 4, 1))
    rep = ht.convert(m)
    assert [n for n, _, _ in rep.converted] == ["0", "2", "4"]
    assert [(n, "depthwise" in why) for n, _, why in rep.skipped] == [("3", True)]
    assert rep.converted[0][2] == "16 x 8 x 3, stride (1,)"
    x, y = torch.randn(4, 8, 32), torch.randn(4, 4, 30)
    ht.calibrate(m, (x, y), F.mse_loss)
    assert all(layer.hot_calibration is not None for _, layer in ht.hot_layers(m))
    from hot.torch.summary import summary_rows

    ht.summary(m, x)
    rows = summary_rows(m)
    assert [(r["name"], r["shape"], r["unit"]) for r in rows] == [("0", "16x8x3", "batch"), ("2", "16x16x5", "batch"),
                                                                   ("4", "4x16x1", "batch")]
    # the int8 map of a k > 1 conv's input: one byte per element and the scale (after a keep_less ReLU, which keeps a
    # bit mask only)
    assert rows[1]["hot_bytes"] == 4 * 16 * 32 + 4 and rows[1]["exact_bytes"] == 4 * 16 * 32 * 4
    with ht.weight_reuse() as r:  # W~ keyed on the parameter, not on the (O, C, 1, k) view a call runs with
        for _ in range(3):
            F.mse_loss(m(x), y).backward()
    assert r.formed == 2 and r.reused == 4  # layers 2 and 4 need g_x (layer 0's input needs none)
    cost = ht.summary(m, x, cost=True)  # the cost model counts each as the unit-height 2-D convolution
    assert cost.count("Conv1d") == 3 and "128x80x16" in cost


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv1d(8, 16, 3, padding=1), nn.GELU(), nn.Conv1d(16, 8, 1)).to(device)
    ht.convert(m, hot.Config(rounding="nearest"))
    x = torch.randn(2, 8, 32, device=device)

    def step(x):
        return m(x).square().mean()

    assert_compiles_like_eager(m, step, x)
