"""hot.torch.ReLU and hot.torch.MaxPool2d (SPEC §2): the exact gradients from a 1-bit mask and 1-byte window offsets,
what they keep, and what they let a converted layer after them save; convert's keep_less switch."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot
import hot.torch as ht
from hot.torch import lean
from hot.torch.lean import max_pool2d, relu
from conftest import DEVICES
from torch_reference import assert_compiles_like_eager, saved_during


def _storage_bytes(tensors):
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _packed(mask: torch.Tensor) -> torch.Tensor:
    """The reference packing of a bool tensor in its row-major order: bit j of byte k is element 8k + j (int8)."""
    flat = mask.reshape(-1).to(torch.int64)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)]).view(-1, 8)
    b = (flat << torch.arange(8)).sum(1)
    return torch.where(b > 127, b - 256, b).to(torch.int8)


def _special_input(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.view(-1)
    flat[:6] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-30])
    return x.to(dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_gradient_equals_nn_relu_bit_for_bit(device, dtype, inplace, layout):
    """Outputs and input gradients equal nn.ReLU's exactly, non-finite values included: a NaN input passes its g_y
    (torch's threshold_backward), a NaN or inf g_y where the output is 0 gives 0."""
    x = _special_input((3, 5, 6, 7), dtype, device, seed=1)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.transpose(1, 3)
    gy = _special_input(tuple(x.shape), dtype, device, seed=2)
    gy.view(-1)[6:9] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    res = {}
    for name, mod in (("exact", nn.ReLU(inplace)), ("hot", ht.ReLU(inplace))):
        a = x.detach().clone().requires_grad_(True)
        y = mod(a * 1)  # a non-leaf input, as in a network (in-place needs one)
        y.backward(gy)
        res[name] = (y.detach(), a.grad)
    for e, h in zip(res["exact"], res["hot"]):
        assert torch.equal(torch.isnan(e), torch.isnan(h))
        assert torch.equal(e.nan_to_num(0.0), h.nan_to_num(0.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gradient_of_a_broadcast_grad_output(device, layout):
    """A g_y that autograd hands over as a broadcast view (stride 0: the backward of a sum or a mean) gives nn.ReLU's
    gradient, not an error from the engine's contiguity check."""
    x = _special_input((2, 3, 4, 5), torch.float32, device, seed=3)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    grads = []
    for mod in (nn.ReLU(), ht.ReLU()):
        a = x.detach().clone().requires_grad_(True)
        (mod(a * 1).sum() * 3).backward()
        grads.append(a.grad)
    assert torch.equal(grads[0], grads[1])
    assert grads[1].abs().sum() > 0


@pytest.mark.parametrize("shape", [(5,), (4, 9), (2, 3, 5, 5)])
def test_keeps_one_bit_per_element(shape):
    x = torch.randn(shape, requires_grad=True)
    saved, y = saved_during(lambda: ht.ReLU()(x * 1))
    n = x.numel()
    assert [(t.dtype, t.numel()) for t in saved if t.dtype == torch.int8] == [(torch.int8, (n + 7) // 8)]
    assert not any(t.is_floating_point() and t.numel() == n for t in saved[1:]), "the output was kept"
    saved_exact, _ = saved_during(lambda: nn.ReLU()(x * 1))
    assert any(t.is_floating_point() and t.numel() == n for t in saved_exact)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_the_mask_is_packed_in_memory_order(layout):
    """The mask of a channels-last output is packed in its memory order (N, H, W, C): forming it needs no copy in
    logical order; a strided view (not dense) is packed in row-major order from a copy. The gradient test above
    checks it is unpacked back to the right positions."""
    x = torch.randn(2, 5, 3, 4)
    x = {"contiguous": x, "channels_last": x.to(memory_format=torch.channels_last),
         "transposed": x[:, :, :, ::2]}[layout]
    x.requires_grad_(True)
    saved, y = saved_during(lambda: ht.ReLU()(x * 1 if layout != "transposed" else x[..., :]))
    (bits,) = [t for t in saved if t.dtype == torch.int8]
    mask = y <= 0
    if layout == "channels_last":
        assert torch.equal(bits, _packed(mask.permute(0, 2, 3, 1)))
        assert not torch.equal(bits, _packed(mask))
    else:
        assert torch.equal(bits, _packed(mask))


def test_the_engine_functions_equal_the_reference():
    """hot.relu_mask / hot.relu_mask_backward on torch tensors: y equals torch.relu, the bits the reference packing,
    the gradient torch's selection, on any shape (row-major order)."""
    import hot

    x = _special_input((3, 37), torch.float32, "cpu", seed=3)
    y, bits = hot.relu_mask(x)
    assert y.shape == x.shape and torch.equal(torch.isnan(y), torch.isnan(x))
    assert torch.equal(y.nan_to_num(0.0), torch.relu(x).nan_to_num(0.0))
    assert torch.equal(bits, _packed(x <= 0))
    gy = _special_input((3, 37), torch.float32, "cpu", seed=4)
    gx = hot.relu_mask_backward(gy, bits)
    assert torch.equal(gx.nan_to_num(0.0), torch.where(x <= 0, 0.0, gy).nan_to_num(0.0))
    with pytest.raises(ValueError, match=r"relu_mask_backward: bits has shape \(3,\), expected \(14,\)"):
        hot.relu_mask_backward(gy, bits[:3])


def test_the_engine_relu_gives_the_amax_its_consumers_would_find():
    """hot.relu_mask(x, amax=True): y's amax (max |y|, NaN with a NaN in y); hot.quantize and hot.activation_codes of y
    given it return the bytes they return without it; the argument checks name amax."""
    for nan in (False, True):
        x = torch.randn(6, 40, generator=torch.Generator().manual_seed(7))
        if nan:
            x[2, 3] = float("nan")
        y, bits, amax = hot.relu_mask(x, amax=True)
        assert torch.equal(bits, hot.relu_mask(x)[1]) and amax.shape == (1,) and amax.dtype == torch.float32
        if nan:
            assert torch.isnan(amax).all()
        else:
            assert amax.item() == torch.relu(x).max().item()
        q0, s0 = hot.quantize(y)
        q1, s1 = hot.quantize(y, amax=amax)
        assert torch.equal(q0, q1) and torch.equal(s0.view(torch.int32), s1.view(torch.int32))
        c0, c1 = hot.activation_codes(y), hot.activation_codes(y, amax=amax)
        assert torch.equal(c0.q, c1.q) and torch.equal(c0.scale.view(torch.int32), c1.scale.view(torch.int32))
    assert hot.relu_mask(-x.nan_to_num().abs(), amax=True)[2].item() == 0.0  # no positive value
    with pytest.raises(ValueError, match="quantize: amax goes with scale tensor"):
        hot.quantize(y, scale="token", amax=amax)
    with pytest.raises(TypeError, match="amax.*float32"):
        hot.quantize(y, amax=amax.half())
    with pytest.raises(ValueError, match=r"amax has shape \(2,\), expected \(1,\)"):
        hot.activation_codes(y, amax=torch.zeros(2))
    with pytest.raises(TypeError, match="relu_mask: amax must be a bool"):
        hot.relu_mask(x, amax=1)


@pytest.mark.parametrize("inplace", [False, True])
def test_second_order_gradients(inplace):
    """The ReLU's gradient is linear in g_y: its derivative (the double backward) is the same selection, as
    nn.ReLU's."""
    x = _special_input((4, 6), torch.float32, "cpu", seed=5).nan_to_num(0.0)
    v = torch.randn(4, 6)
    res = []
    for mod in (nn.ReLU(inplace), ht.ReLU(inplace)):
        a = x.clone().requires_grad_(True)
        g = torch.ones(4, 6, requires_grad=True)
        (gx,) = torch.autograd.grad(mod(a * 1), a, g, create_graph=True)
        (ggy,) = torch.autograd.grad(gx, g, v)
        res.append((gx.detach(), ggy))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    assert torch.equal(res[1][1], torch.where(x <= 0, 0.0, v))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_the_output_may_be_changed_in_place(layout):
    """The output of the out-of-place ReLU is a tensor of its own (no view made inside the Function) in x's layout, and
    its backward reads only the mask: a model may add to it in place (a residual; nn.ReLU's backward would refuse, its
    output being saved). The values and gradients of adding out of place after nn.ReLU."""
    x = _special_input((2, 3, 4, 4), torch.float32, "cpu", seed=6).nan_to_num(0.0)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.transpose(1, 3)
    res = []
    for inplace_add in (False, True):
        a = x.clone().requires_grad_(True)
        if inplace_add:
            y = ht.ReLU()(a * 1)
            assert y.stride() == x.stride()
            y.add_(1.0)
        else:
            y = nn.ReLU()(a * 1) + 1.0
        y.square().sum().backward()
        res.append((y.detach(), a.grad))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


def test_float64_and_integers_keep_torch_relu():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    saved, y = saved_during(lambda: ht.ReLU()(x * 1))
    assert not any(t.dtype == torch.int8 for t in saved) and torch.equal(y, torch.relu(x))
    assert torch.autograd.gradcheck(relu, (x,))


def test_no_mask_without_a_graph():
    x = torch.randn(8)
    saved, y = saved_during(lambda: ht.ReLU()(x))
    assert saved == [] and y.grad_fn is None
    with torch.no_grad():
        xi = torch.randn(8, requires_grad=True)
        assert ht.ReLU()(xi).grad_fn is None
    assert torch.equal(ht.ReLU()(torch.tensor([-2, 0, 3])), torch.tensor([0, 0, 3]))  # integer input, as nn.ReLU


class _Block(nn.Module):
    """conv -> BN -> ReLU (in place, as torchvision's) -> conv -> ReLU -> 1x1 conv -> pooled linear."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.c3 = nn.Conv2d(8, 16, 1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        h = self.relu(self.bn(self.c1(x)))
        h = self.act(self.c2(h))
        h = self.relu(self.c3(h))  # the same module called twice
        return self.fc(h.mean((2, 3)))


def _step(model, x, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the layers' stochastic-rounding seeds
    saved, y = saved_during(lambda: model(x))
    y.square().sum().backward()
    kept = _storage_bytes([t for t in saved if not isinstance(t, nn.Parameter)])
    return kept, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
def test_convert_swaps_relus_same_gradients_less_kept(device):
    """convert's ReLUs keep masks; each conv after one keeps its int8 copy instead of the ReLU's output: the same
    gradients bit for bit as the converted model with nn.ReLU, and fewer bytes kept than exact training."""
    torch.manual_seed(0)
    base = _Block().to(device)
    x = torch.randn(4, 3, 12, 12, device=device)
    models = {}
    for masks in (False, True):
        m = _Block().to(device)
        m.load_state_dict(base.state_dict())
        rep = ht.convert(m, keep_less=masks)
        assert rep.lean == ([("bn", "BatchNorm2d"), ("relu", "ReLU"), ("act", "ReLU")] if masks else [])
        assert isinstance(m.relu, ht.ReLU) == masks and isinstance(m.act, ht.ReLU) == masks
        models[masks] = m
    assert "keep_less: 2 nn.ReLU module(s) keep a 1-bit mask" in str(ht.convert(_Block()))
    kept_exact, _ = _step(base, x, 3)
    kept_plain, g_plain = _step(models[False], x, 3)
    kept_masks, g_masks = _step(models[True], x, 3)
    for n in g_plain:
        assert torch.equal(g_plain[n], g_masks[n]), n
    assert kept_plain <= kept_exact  # never more than exact (SPEC §2)
    assert kept_masks < 0.8 * kept_exact, (kept_masks, kept_exact)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_convs_after_a_relu_take_its_amax(device, layout, monkeypatch):
    """A converted ReLU hands its output's amax to the convs that quantise that output (SPEC §8): the 3 x 3 conv's map
    and the stride-1 pointwise conv's codes take it (no pass over the map), the first conv (its input is no ReLU's)
    does not; gradients bit for bit those of the same model without the hand-over; and a ReLU output changed in place
    afterwards is quantised with its own amax again."""
    from hot import _api
    from hot.torch import ops

    given = []
    quantize, compress = _api._quantize, _api._compress
    monkeypatch.setattr(_api, "_quantize", lambda *a, **k: given.append(("map", k.get("amax") is not None)) or
                        quantize(*a, **k))
    monkeypatch.setattr(_api, "_compress", lambda *a, **k: given.append(("codes", k.get("amax") is not None)) or
                        compress(*a, **k))
    torch.manual_seed(0)
    m = _Block().to(device)
    ht.convert(m, keep_less=True)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    m = m.to(memory_format=fmt)
    x = torch.randn(4, 3, 12, 12, device=device).contiguous(memory_format=fmt)
    _, g_handed = _step(m, x, 3)
    # c1's map, c2's map, c3's codes, then fc's ABC buffer (a linear layer: no amax)
    assert given == [("map", False), ("map", True), ("codes", True), ("codes", False)], given
    monkeypatch.setattr(lean, "note_amax", lambda y, amax: None)
    given.clear()
    _, g_plain = _step(m, x, 3)
    assert not any(k for _, k in given), given
    for n in g_plain:
        assert torch.equal(g_handed[n], g_plain[n]), n
    monkeypatch.undo()
    seq = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1)).to(device)
    ht.convert(seq)
    conv = seq[0]
    h = relu(torch.randn(2, 8, 6, 6, device=device, requires_grad=True) * 1)
    assert ops._known_amax(h) is not None
    h.mul_(3.0)  # a new version: its amax is unknown
    assert ops._known_amax(h) is None
    torch.manual_seed(5)  # the layer's stochastic-rounding seed
    conv(h).square().sum().backward()
    g_w = conv.weight.grad.clone()
    conv.weight.grad = None
    torch.manual_seed(5)
    conv(h.detach().clone()).square().sum().backward()
    assert torch.equal(g_w, conv.weight.grad)


def test_convert_keep_less_selects_by_name_and_checks_its_type():
    m = _Block()
    rep = ht.convert(m, exclude="c2", keep_less="act")  # include / exclude select layers, keep_less the ReLUs / pools
    assert rep.lean == [("act", "ReLU")] and type(m.relu) is nn.ReLU and isinstance(m.act, ht.ReLU)
    assert type(m.c2) is nn.Conv2d
    m = _Block()
    assert ht.convert(m, keep_less=lambda name, mod: isinstance(mod, nn.ReLU) and not mod.inplace).lean == \
        [("act", "ReLU")]
    m = _Block()
    assert ht.convert(m, keep_less="bn").lean == [("bn", "BatchNorm2d")] and isinstance(m.bn, ht.BatchNorm2d)
    with pytest.raises(TypeError, match="keep_less must be a bool, a name pattern, a list of them or a predicate "
                                        "\\(name, module\\) -> bool; got int"):
        ht.convert(_Block(), keep_less=1)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.MaxPool2d(2, return_indices=True))
    assert ht.convert(m).lean == [("1", "MaxPool2d")] and type(m[2]) is nn.MaxPool2d
    m = nn.Sequential(nn.ReLU(), nn.Flatten())
    with pytest.raises(ValueError, match="no eligible layer"):
        ht.convert(m)
    assert type(m[0]) is nn.ReLU  # nothing changed when convert refuses


def test_masked_relu_model_survives_state_dict_and_deepcopy():
    import copy
    m = _Block()
    ht.convert(m)
    m2 = copy.deepcopy(m)
    assert isinstance(m2.relu, ht.ReLU) and m2.relu.inplace
    assert set(m.state_dict()) == set(_Block().state_dict()) | {k for k in m.state_dict() if k.endswith("_extra_state")}
    x = torch.randn(2, 3, 8, 8)
    torch.manual_seed(1)
    a = m(x)
    torch.manual_seed(1)
    b = m2(x)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiles_fullgraph_with_the_same_gradient(backend):
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    conv, relu, pool = nn.Conv2d(3, 4, 3, padding=1), ht.ReLU(inplace=True), ht.MaxPool2d(3, 2, 1)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)

    def f(x):
        return pool(relu(conv(x))).square().sum()

    dynamo.reset()
    assert dynamo.explain(f)(x).graph_break_count == 0
    grads = []
    for fn in (f, torch.compile(f, fullgraph=True, backend=backend)):
        conv.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        fn(xi).backward()
        grads.append((xi.grad, conv.weight.grad))
    # the ReLU's and the max-pool's selections are exact in both; the conv's fp32 sums may be ordered otherwise
    assert torch.equal(grads[0][0] == 0, grads[1][0] == 0)
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1])


class _Bottleneck(nn.Module):
    """torchvision's residual pattern: one in-place ReLU module used three times, a block input that feeds both a conv
    and the residual add (out += identity), an in-place ReLU after the add."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_compiled_residual_blocks_with_inplace_relus_match_eager(device, layout):
    """A converted network of residual blocks with in-place ReLUs (keep_less swaps them for hot.torch.ReLU) compiles
    in one graph and its gradients through aot_eager equal the eager ones (nearest rounding), the input's included: the
    ReLUs' masks select in the compiled backward too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          _Bottleneck(8), _Bottleneck(8), nn.Flatten(), nn.Linear(8 * 6 * 6, 5)).to(device)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model = model.to(memory_format=fmt)
    report = ht.convert(model, hot.Config(rounding="nearest"))
    assert len(report.lean) == 8  # 3 ReLU and 5 BatchNorm2d modules
    x = torch.randn(4, 3, 6, 6, device=device).contiguous(memory_format=fmt).requires_grad_(True)
    y = torch.randint(0, 5, (4,), device=device)
    assert_compiles_like_eager(model, lambda x, y: F.cross_entropy(model(x), y), x, y)  # x's gradient included


POOLS = [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2), dict(kernel_size=(3, 2), stride=(1, 2)),
         dict(kernel_size=3, stride=2, dilation=2, padding=1), dict(kernel_size=3, stride=2, ceil_mode=True),
         dict(kernel_size=16, stride=16), dict(kernel_size=2, stride=3),
         dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "unbatched"])
@pytest.mark.parametrize("args", POOLS, ids=[str(i) for i in range(len(POOLS))])
def test_max_pool_gradient_equals_nn_max_pool_bit_for_bit(args, layout, dtype, device):
    """Outputs equal nn.MaxPool2d's exactly and input gradients equal its gradients summed in float32 and rounded once
    (torch's CUDA backward; its CPU backward rounds after each add in bfloat16, the same bits in float32), with
    overlapping windows, dilation, ceil mode, ties of ReLU zeros and NaN, from one byte per output element."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 17, 16, generator=g).relu()  # many ties at 0, as after a ReLU
    x.view(-1)[5] = float("nan")
    x = x.to(dtype=dtype, device=device)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "unbatched":
        x = x[0]
    gy = torch.randn(nn.MaxPool2d(**args)(x.float().cpu()).shape, generator=g).to(dtype=dtype, device=device)
    res = {}
    for name, mod in (("exact", nn.MaxPool2d(**args)), ("hot", ht.MaxPool2d(**args))):
        a = x.detach().clone().requires_grad_(True)
        y = mod(a * 1)
        y.backward(gy)
        res[name] = (y.detach(), a.grad)
    a32 = x.detach().float().requires_grad_(True)  # the float32 sums of nn.MaxPool2d's gradient, rounded once
    nn.MaxPool2d(**args)(a32 * 1).backward(gy.float())
    res["exact"] = (res["exact"][0], a32.grad.to(dtype))
    assert res["hot"][1].is_contiguous(memory_format=torch.channels_last) == (layout == "channels_last")
    for e, h in zip(res["exact"], res["hot"]):
        assert torch.equal(torch.isnan(e), torch.isnan(h))
        assert torch.equal(e.nan_to_num(0.0), h.nan_to_num(0.0))


def test_max_pool_keeps_one_byte_per_output_element():
    x = torch.randn(2, 4, 9, 9, requires_grad=True)
    saved, y = saved_during(lambda: ht.MaxPool2d(3, 2, 1)(x * 1))
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(torch.int8, tuple(y.shape))]
    saved_exact, y_exact = saved_during(lambda: nn.MaxPool2d(3, 2, 1)(x * 1))
    assert _storage_bytes(saved_exact) == x.numel() * 4 + y.numel() * 8  # torch: the input and int64 indices


def test_max_pool_falls_back_where_offsets_do_not_fit_or_no_graph():
    x = torch.randn(1, 1, 20, 20, requires_grad=True)
    saved, y = saved_during(lambda: max_pool2d(x * 1, 12))  # 144 > 128 positions in a window: torch's max-pool
    assert any(t.dtype == torch.int64 for t in saved)
    with torch.no_grad():
        assert ht.MaxPool2d(2)(x).grad_fn is None
    with pytest.raises(ValueError, match="return_indices=True is not supported"):
        ht.MaxPool2d(2, return_indices=True)


class _Stem(nn.Module):
    """ResNet's stem and a first conv: conv -> BN -> ReLU (in place) -> max-pool -> 1x1 conv."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.conv2 = nn.Conv2d(8, 16, 1, bias=False)

    def forward(self, x):
        return self.conv2(self.maxpool(self.relu(self.bn1(self.conv1(x)))))


def test_resnet_stem_keeps_masks_and_offsets_instead_of_the_relu_output():
    torch.manual_seed(0)
    base = _Stem()
    x = torch.randn(2, 3, 32, 32)
    lean, plain = _Stem(), _Stem()
    lean.load_state_dict(base.state_dict())
    plain.load_state_dict(base.state_dict())
    assert ht.convert(lean).lean == [("bn1", "BatchNorm2d"), ("relu", "ReLU"), ("maxpool", "MaxPool2d")]
    ht.convert(plain, keep_less=False)
    kept = {}
    grads = {}
    for name, m in (("exact", base), ("lean", lean), ("plain", plain)):
        kept[name], grads[name] = _step(m, x, 4)
    for n in grads["plain"]:
        assert torch.equal(grads["plain"][n], grads["lean"][n]), n
    relu_out = 2 * 8 * 16 * 16 * 4  # fp32 bytes the ReLU (and the max-pool) keep in exact training
    pool_out = 2 * 8 * 8 * 8
    # exact: the ReLU's output (shared with the max-pool) and the max-pool's int64 indices; lean: the ReLU's mask and
    # the max-pool's offsets; the rest (conv1's input, BN's input and statistics, conv2's input) as before or smaller
    assert kept["exact"] - kept["lean"] >= relu_out + pool_out * 8 - (relu_out // 32 + pool_out), kept


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_compiled_calls_the_engine_ops(inplace, layout):
    """Under torch.compile the ReLU runs as the hot::relu_mask ops (in the graph, no break) and gives the eager
    output and gradient, also when the compiled function returns both the ReLU's output and its input; the in-place
    ReLU still writes its input."""
    import torch._dynamo as dynamo

    relu = ht.ReLU(inplace)
    x = _special_input((2, 3, 4, 5), torch.float32, "cpu", seed=7).nan_to_num(0.0)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)

    def f(a):
        h = a * 1
        y = relu(h)
        return y, h

    dynamo.reset()
    gm_ops = []

    def backend(gm, inputs):
        gm_ops.extend(str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)
        return gm.forward

    outs = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager"), torch.compile(f, fullgraph=True,
                                                                                      backend=backend)):
        a = x.clone().requires_grad_(True)
        y, h = fn(a)
        y.backward(torch.arange(y.numel(), dtype=y.dtype).view(y.shape))
        outs.append((y.detach(), a.grad, h.detach()))
    if inplace and not lean._TRACES_INPLACE:  # before torch 2.13 a compiled in-place ReLU is torch's own
        assert not any("relu_mask" in t for t in gm_ops), gm_ops
    else:
        assert any("relu_mask" in t for t in gm_ops), gm_ops
    for o in outs[1:]:
        assert torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1])
        assert torch.equal(o[2], outs[0][0] if inplace else x)


# ---- BatchNorm2d: G~'s amax handed to the converted convolution before it ----------------------------------------
def _spy_gy_amax(monkeypatch):
    """Records, per engine call of a converted convolution's backward, whether a G~ amax came with its g_y."""
    from hot import _api

    seen = []
    conv, lin = _api._backward_conv2d, _api._backward_linear
    monkeypatch.setattr(_api, "_backward_conv2d", lambda *a, **k: seen.append(a[-1] is not None) or conv(*a, **k))
    monkeypatch.setattr(_api, "_backward_linear", lambda *a, **k: seen.append(
        k.get("gy_amax", a[13] if len(a) > 13 else None) is not None) or lin(*a, **k))
    return seen


@pytest.mark.parametrize("pointwise", [False, True])
def test_the_handing_batch_norm_gives_the_conv_its_amax_cpu(pointwise, monkeypatch):
    """The hand-over's plumbing on the CPU: a converted conv (3 x 3 or pointwise) followed by the handing batch norm
    takes G~'s amax with its g_y and gets the gradients bit for bit of the same model without the hand-over; a g_y that
    is not the one handed over (the conv's output also used elsewhere: autograd sums the two) takes none."""
    from hot.torch import ops

    seen = _spy_gy_amax(monkeypatch)
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 16, 1 if pointwise else 3, padding=0 if pointwise else 1, bias=False)
    ht.convert(nn.Sequential(conv))
    x = torch.randn(4, 8, 6, 6).to(memory_format=torch.channels_last)
    w, b = torch.rand(16) + 0.5, torch.randn(16)

    def grads(hand: bool, also: bool):
        conv.weight.grad = None
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(3)  # the conv's stochastic-rounding seed
        y = conv(xi)
        z = lean._HandingBatchNorm.apply(y, w, b, None, None, 0.1, 1e-5, ops.conv_node(y) if hand else None)
        loss = z.square().sum() + (y.sum() if also else 0)
        loss.backward()
        return conv.weight.grad.clone(), xi.grad.clone()

    plain = grads(False, False)
    assert seen == [False]
    seen.clear()
    handed = grads(True, False)
    assert seen == [True]
    assert torch.equal(plain[0], handed[0]) and torch.equal(plain[1], handed[1])
    seen.clear()
    grads(True, True)
    assert seen == [False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tracked", [True, False])
def test_handing_batch_norm_forward_statistics(device, dtype, tracked):
    """The handing BatchNorm's forward is the engine's where its running statistics are float32 or untracked: the mean
    and invstd it keeps for the backward and the running statistics it updates within SPEC §2's bounds of the float64
    statistics of x's stored values (on a map far from zero), bit for bit hot.batch_norm_stats' on the CPU, and y the
    engine's batch_norm_transform of them bit for bit; 16-bit running statistics: torch's forward bit for bit."""
    import reference

    torch.manual_seed(0)
    C = 24
    x = (torch.randn(6, C, 9, 9) * 2 + 50).to(dtype).to(device, memory_format=torch.channels_last)
    w, b = torch.rand(C, device=device) + 0.5, torch.randn(C, device=device)
    rm, rv = torch.randn(C, device=device), torch.rand(C, device=device) + 0.5
    r0 = (rm.double().cpu().numpy(), rv.double().cpu().numpy())
    xi = x.clone().requires_grad_(True)
    y = lean._HandingBatchNorm.apply(xi, w, b, *((rm, rv) if tracked else (None, None)), 0.1, 1e-5, None)
    mean, invstd = y.grad_fn.saved_tensors[4:6]
    rows = x.permute(0, 2, 3, 1).reshape(-1, C)
    got = reference.bn_stats_bound(rows.double().cpu().numpy(), np.float32(1e-5), 0.1, r0)
    for t, want, bound in zip((mean, invstd) + ((rm, rv) if tracked else ()), got[:2] + got[4::2],
                              got[2:4] + got[5::2]):
        assert t.dtype == torch.float32
        assert np.all(np.abs(t.double().cpu().numpy() - want) <= bound)
    m_cpu, i_cpu = hot.batch_norm_stats(rows.cpu(), eps=1e-5)
    assert torch.equal(mean.cpu(), m_cpu) and torch.equal(invstd.cpu(), i_cpu)
    want_y = hot.batch_norm_transform(rows.cpu(), m_cpu, i_cpu, w.cpu(), b.cpu())
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y.permute(0, 2, 3, 1).reshape(-1, C).cpu(), want_y)
    if dtype != torch.bfloat16:
        return
    # a model cast to 16 bits: torch's forward
    rm16, rv16 = rm.to(torch.bfloat16), rv.to(torch.bfloat16)
    ref = (rm16.clone(), rv16.clone())
    y16 = lean._HandingBatchNorm.apply(x, w.to(dtype), b.to(dtype), rm16, rv16, 0.1, 1e-5, None)
    want16 = torch.nn.functional.batch_norm(x, *ref, w.to(dtype), b.to(dtype), True, 0.1, 1e-5)
    assert torch.equal(y16, want16) and torch.equal(rm16, ref[0]) and torch.equal(rv16, ref[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("shortcut", [None, "tensor", "batch_norm"])
def test_relu_after_the_handing_batch_norm_forms_its_sums(device, dtype, inplace, shortcut, monkeypatch):
    """A hot ReLU right after the handing BatchNorm, or after a residual add of its output and a shortcut (a tensor, or
    a second handing BatchNorm's output: torchvision's bottleneck end, ``out += identity``), forms the BatchNorm's sums
    in its own pass (the engine's reduce with the ReLU's bits) and hands them over: every gradient (the BatchNorms'
    weights and biases, the conv's, the input's, the shortcut's) bit for bit those of the same model with the sums
    formed by the BatchNorm's backward, and one reduce call instead of a ReLU pass and a reduce (the second BatchNorm
    forms its own); an output also used elsewhere (autograd sums its gradients) takes no hand-over."""
    from hot import _api
    from hot.torch import ops

    calls = []
    reduce = _api._batch_norm_backward_reduce
    monkeypatch.setattr(_api, "_batch_norm_backward_reduce", lambda *a, **k: calls.append(
        k.get("relu_bits") is not None) or reduce(*a, **k))
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 16, 3, padding=1, bias=False)
    ht.convert(nn.Sequential(conv))
    conv.to(device, dtype)
    x = torch.randn(4, 8, 6, 6, dtype=dtype, device=device).to(memory_format=torch.channels_last)
    w = (torch.rand(16, device=device) + 0.5).requires_grad_(True)
    b = torch.randn(16, device=device).requires_grad_(True)
    w2, b2 = (torch.rand(16, device=device) + 0.5).requires_grad_(True), torch.randn(16, device=device)
    extra = torch.randn(4, 16, 6, 6, dtype=dtype, device=device).to(memory_format=torch.channels_last)
    extra.requires_grad_(True)
    leaves = [conv.weight, w, b, w2, extra]

    def grads(fuse: bool, also: bool):
        for t in leaves:
            t.grad = None
        calls.clear()
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(3)  # the conv's stochastic-rounding seed
        y = conv(xi)
        z = lean._HandingBatchNorm.apply(y, w, b, None, None, 0.1, 1e-5, ops.conv_node(y))
        s = z
        if shortcut is not None:
            s = z + (extra if shortcut == "tensor" else
                     lean._HandingBatchNorm.apply(y, w2, b2, None, None, 0.1, 1e-5, None))
        r = lean.relu(s, inplace) if fuse else lean._MaskedReLU.apply(s, inplace, None)[0]
        loss = r.float().square().sum() + (z.float().sum() if also and not inplace else 0)
        loss.backward()
        got = [xi.grad.clone()] + [t.grad.clone() for t in leaves if t.grad is not None]
        return got, sorted(calls)

    extra_calls = [False] if shortcut == "batch_norm" else []
    plain, plain_calls = grads(False, False)
    assert plain_calls == extra_calls + [False]
    fused, fused_calls = grads(True, False)
    assert fused_calls == extra_calls + [True]
    assert len(plain) == len(fused) == 4 + (shortcut is not None)
    for a, c in zip(plain, fused):
        assert torch.equal(a, c)
    if not inplace:  # z also summed into the loss: the BatchNorm's g_y is no longer the ReLU's g_x
        summed, summed_calls = grads(True, True)
        assert summed_calls == sorted(extra_calls + [True, False])
        ref, _ = grads(False, True)
        for a, c in zip(ref, summed):
            assert torch.equal(a, c)


_UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _bn_backward_bound(g, x, mean, invstd, weight, gx_dtype, param_dtype):
    """float64 BatchNorm backward of the (N, C, H, W) g and x (mean, invstd: the forward's saved statistics, weight or
    None): (g_x as (N*H*W, C) rows, g_w, g_b) and the bounds SPEC §2's fp32 evaluation keeps to (the sums: chains of
    1024 / 32 + 5 adds and one a row group, two more roundings a term of sum_dy_xmu; g_x: those errors through its
    formula, a few fp32 steps and the rounding to gx_dtype; g_w, g_b: one product and the rounding to param_dtype)."""
    C = g.shape[1]
    g64, x64 = (t.double().permute(0, 2, 3, 1).reshape(-1, C) for t in (g, x))
    R = g64.shape[0]
    m, i = mean.double(), invstd.double()
    w = torch.ones_like(m) if weight is None else weight.double()
    xm = x64 - m
    sd, sdx = g64.sum(0), (g64 * xm).sum(0)
    u = _UNIT[torch.float32]
    chain = 1024 // 32 + 5 + (R + 1023) // 1024
    esd, esdx = 1.001 * chain * u * g64.abs().sum(0), 1.001 * (chain + 2) * u * (g64 * xm).abs().sum(0)
    f1 = i * i * sdx / R
    gx = (g64 - sd / R - xm * f1) * i * w
    terms = g64.abs() + (sd / R).abs() + (xm * f1).abs()
    egx = (esd / R + xm.abs() * i * i * esdx / R + 8 * u * terms) * (i * w).abs() + _UNIT[gx_dtype] * gx.abs()
    pu = _UNIT[param_dtype] + u
    return (gx, sdx * i, sd), (egx, esdx * i + pu * (sdx * i).abs(), esd + _UNIT[param_dtype] * sd.abs())


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, "autocast"])
@pytest.mark.parametrize("affine,momentum", [(True, 0.1), (False, None)])
def test_batch_norm_against_nn_batch_norm(dtype, affine, momentum, monkeypatch):
    """hot.torch.BatchNorm2d after a converted conv on a channels-last CUDA map against nn.BatchNorm2d after the same
    conv. Where its running statistics are float32 (float32 models, autocast) the forward is the engine's: the kept
    mean and invstd within SPEC §2's bounds of the float64 statistics, and they, the running statistics and y bit for
    bit the engine's on the CPU; a model cast to 16 bits keeps torch's forward (y and running statistics bit for bit
    nn's). The backward is then the engine's (the forward's or torch's native kernels) and hands the conv G~'s amax:
    its g_x (the conv output's gradient), g_w and g_b in their dtypes and within SPEC §2's bounds of a float64
    evaluation from the kept statistics."""
    import reference
    from hot import _api
    from hot.torch.ops import _call

    seen = _spy_gy_amax(monkeypatch)
    torch.manual_seed(0)
    dt = torch.float32 if dtype == "autocast" else dtype
    models = []
    for swap in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(16, 24, 3, padding=1, bias=False),
                          nn.BatchNorm2d(24, affine=affine, momentum=momentum)).cuda()
        ht.convert(m, hot.Config(rounding="nearest"), keep_less=swap)
        assert isinstance(m[1], ht.BatchNorm2d) == swap
        models.append(m.to(dt).to(memory_format=torch.channels_last))
    engine_forward = dt == torch.float32  # float32 running statistics
    start = [t.clone().cpu() for t in models[1][1].buffers()]
    x = torch.randn(8, 16, 20, 20, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
    outs = []
    for m in models:
        seen.clear()
        xi = x.clone().requires_grad_(True)
        kept = {}
        with torch.autocast("cuda", torch.bfloat16, enabled=dtype == "autocast"):
            y_conv = m[0](xi)
            y_conv.register_hook(lambda g: kept.__setitem__("gx", g))
            y = m[1](y_conv)
        native = m is models[1]
        assert not native or y.grad_fn.impl == 0  # the engine's forward, or torch's native kernels (16-bit maps)
        stats = y.grad_fn.saved_tensors[4:6] if native else None  # the forward's mean and invstd
        y.retain_grad()
        y.float().square().sum().backward()
        outs.append({"y": y, "buffers": list(m[1].buffers()), "gx": kept["gx"], "y_conv": y_conv, "g": y.grad,
                     "params": [p.grad for p in m[1].parameters()], "xi": xi.grad, "stats": stats})
        assert seen == [native]
    ref, got = outs
    assert torch.equal(ref["y_conv"], got["y_conv"])
    if engine_forward:
        rows = got["y_conv"].detach().permute(0, 2, 3, 1).reshape(-1, 24).cpu()
        mom = 1.0 if momentum is None else momentum  # the first step's cumulative average
        mean, invstd = _api._batch_norm_stats(_call("batch_norm_stats", rows), rows, 1e-5, start[0], start[1], mom)
        assert torch.equal(got["stats"][0].cpu(), mean) and torch.equal(got["stats"][1].cpu(), invstd)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got["buffers"], start[:2]))
        assert torch.equal(got["buffers"][2], ref["buffers"][2])  # num_batches_tracked
        bn = models[1][1]
        w32, b32 = (bn.weight.detach().float().cpu(), bn.bias.detach().float().cpu()) if affine else (None, None)
        want_y = hot.batch_norm_transform(rows, mean, invstd, w32, b32)
        assert torch.equal(got["y"].detach().permute(0, 2, 3, 1).reshape(-1, 24).cpu(), want_y)
        want = reference.bn_stats_bound(rows.double().numpy(), np.float32(1e-5))
        for t, w, e in zip(got["stats"], want[:2], want[2:]):
            assert np.all(np.abs(t.double().cpu().numpy() - w) <= e)
    else:
        for a, b in zip([ref["y"]] + ref["buffers"], [got["y"]] + got["buffers"]):
            assert a.dtype == b.dtype and torch.equal(a, b)
    bn = models[1][1]
    want, bound = _bn_backward_bound(got["g"], got["y_conv"], *got["stats"], bn.weight if affine else None,
                                     got["y_conv"].dtype, bn.weight.dtype if affine else torch.float32)
    grads = [got["gx"].permute(0, 2, 3, 1).reshape(-1, 24)] + got["params"]
    for k, (a, w, e) in enumerate(zip(grads, want, bound)):
        assert a.dtype == (got["y_conv"].dtype if k == 0 else bn.weight.dtype)
        assert torch.all((a.double() - w).abs() <= e), (k, (a.double() - w).abs().max())


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA GPU")
def test_batch_norm_is_nn_batch_norm_elsewhere():
    """The handing path needs a converted conv's output on a channels-last CUDA map in training: evaluation, NCHW, a
    producer that is no converted conv and torch.no_grad give nn.BatchNorm2d's own path (its backward node)."""
    bn = ht.BatchNorm2d(8).cuda()
    conv = nn.Conv2d(8, 8, 1).cuda()
    ht.convert(nn.Sequential(conv))
    x = torch.randn(2, 8, 5, 5, device="cuda").to(memory_format=torch.channels_last)
    handing = bn(conv(x))
    assert type(handing.grad_fn).__name__ == "_HandingBatchNormBackward"
    assert type(bn(conv(x.contiguous())).grad_fn).__name__ != "_HandingBatchNormBackward"
    assert type(bn(x.requires_grad_(True) * 2).grad_fn).__name__ != "_HandingBatchNormBackward"
    bn.eval()
    assert type(bn(conv(x)).grad_fn).__name__ != "_HandingBatchNormBackward"


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA GPU")
def test_batch_norm_under_create_graph_is_torch_backward():
    """create_graph=True: hot.torch.BatchNorm2d's backward is torch's differentiable one (no hand-over): its first-order
    gradients are torch's native_batch_norm_backward of the forward's kept statistics bit for bit; the second-order one
    (whose graph runs the BatchNorm's backward once more, without create_graph: the engine's sums, SPEC §2) within
    2^-6 of nn.BatchNorm2d's in norm: the engine's forward statistics differ from torch's in their last fp32 bits, so
    an element of the bf16 y (and of its gradient 2y) may round one unit (2^-8) apart, and the loss multiplies two such
    factors."""
    results = []
    for swap in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)).cuda()
        ht.convert(m, hot.Config(rounding="nearest"), keep_less=swap)
        m = m.to(memory_format=torch.channels_last)
        x = torch.randn(4, 8, 10, 10, device="cuda").to(memory_format=torch.channels_last)
        with torch.autocast("cuda", torch.bfloat16):
            y = m(x)
        assert (type(y.grad_fn).__name__ == "_HandingBatchNormBackward") == swap
        gw, gb = torch.autograd.grad(y.float().square().sum(), (m[1].weight, m[1].bias), create_graph=True)
        if swap:
            xs, w, rm, rv, mean, invstd, _ = y.grad_fn.saved_tensors
            g = (2 * y.detach().float()).to(y.dtype)  # the loss's gradient at y, exact
            _, gw_t, gb_t = torch.ops.aten.native_batch_norm_backward(g, xs, w, rm, rv, mean, invstd, True, 1e-5,
                                                                      [False, True, True])
            assert torch.equal(gw, gw_t) and torch.equal(gb, gb_t)
        (ggw,) = torch.autograd.grad(gw.square().sum() + gb.sum(), m[1].weight)
        results.append(ggw)
    assert torch.linalg.vector_norm(results[1] - results[0]) <= 2.0 ** -6 * torch.linalg.vector_norm(results[0])
