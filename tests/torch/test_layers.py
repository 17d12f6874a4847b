"""Gradients of hot.torch.Linear / Conv2d against a float64 reference, within bounds derived from
SPEC §5 (round-to-nearest via config), plus exact mode, frozen weights, inputs without grad, seeds."""
import pytest
import torch
import torch.nn.functional as F

import hot
import hot.torch as ht
from hot.torch import ops
from conftest import DEVICES
from torch_reference import check_bound, gw_reference, gx_reference, saved_during

NEAREST = hot.Config(rounding="nearest")


def _data(L, I, O, seed, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, I, generator=g)
    if outliers:
        x[:, 0] *= 20.0  # a channel outlier, which the Hadamard transforms spread
    gy = torch.randn(L, O, generator=g)
    return x, gy


LIN_CASES = [(64, 32, 48), (37, 24, 20), (100, 64, 16), (16, 8, 7), (1, 16, 32), (300, 40, 24)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gx_scale", ["tensor", "token"])
@pytest.mark.parametrize("gx_bits", [4, 8])
@pytest.mark.parametrize("L,I,O", LIN_CASES, ids=[f"L{a}_I{b}_O{c}" for a, b, c in LIN_CASES])
def test_linear_grads_within_derived_bounds(L, I, O, gx_bits, gx_scale, device):
    torch.manual_seed(0)
    cfg = NEAREST.replace(gx_bits=gx_bits, gx_scale=gx_scale)
    layer = ht.Linear(I, O, config=cfg).to(device)
    x, gy = _data(L, I, O, seed=L * 7 + O)
    xd = x.clone().to(device).requires_grad_(True)
    y = layer(xd)
    assert torch.allclose(y.cpu(), F.linear(x, layer.weight.detach().cpu(), layer.bias.detach().cpu()), atol=1e-5)
    y.backward(gy.to(device))
    w = layer.weight.detach().cpu()
    ref, bound, mag = gx_reference(gy, w, gx_bits, gx_scale == "token")
    check_bound(xd.grad.cpu(), ref, bound, mag, what="g_x")
    proj, bound, mag = gw_reference(gy, x, cfg.rank)
    check_bound(layer.weight.grad.cpu(), proj, bound, mag, what="g_w")
    torch.testing.assert_close(layer.bias.grad.cpu().double(), gy.double().sum(0), rtol=1e-5, atol=1e-5 * L)


@pytest.mark.parametrize("shape", [(2, 5, 24), (3, 1, 1, 24)], ids=["3d", "4d"])
def test_linear_nd_input_rank16_full(shape):
    """Batched (..., I) inputs; rank 16 makes HLA the identity, so g_w approximates g_y^T x itself."""
    torch.manual_seed(1)
    cfg = NEAREST.replace(rank=16, gx_bits=8)
    layer = ht.Linear(24, 32, bias=False, config=cfg)
    assert layer.bias is None
    x = torch.randn(*shape, requires_grad=True)
    gy = torch.randn(*shape[:-1], 32)
    layer(x).backward(gy)
    g2, x2 = gy.reshape(-1, 32), x.detach().reshape(-1, 24)
    proj, bound, mag = gw_reference(g2, x2, 16)
    torch.testing.assert_close(proj, g2.double().t() @ x2.double())  # P = I at r = 16
    check_bound(layer.weight.grad, proj, bound, mag, what="g_w")
    ref, bound, mag = gx_reference(g2, layer.weight.detach(), 8, False)
    check_bound(x.grad.reshape(-1, 24), ref, bound, mag, what="g_x")
    assert x.grad.shape == x.shape


CONV_CASES = [
    dict(N=2, C=3, H=9, W=8, O=16, k=3, stride=1, padding=1, dilation=1),
    dict(N=3, C=4, H=10, W=10, O=12, k=3, stride=2, padding=0, dilation=1),
    dict(N=1, C=2, H=11, W=9, O=8, k=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1)),
    dict(N=2, C=8, H=6, W=6, O=32, k=1, stride=1, padding=0, dilation=1),
    dict(N=2, C=3, H=8, W=8, O=16, k=3, stride=1, padding=1, dilation=1),  # 8 x 8 output: 4 x 4 patches
    dict(N=2, C=6, H=15, W=16, O=24, k=1, stride=2, padding=0, dilation=1),  # pointwise, strided: 8 x 8 output
    dict(N=1, C=5, H=8, W=12, O=16, k=1, stride=1, padding=0, dilation=1),   # pointwise, 4 x 4 patches
    dict(N=2, C=4, H=6, W=6, O=8, k=1, stride=1, padding=1, dilation=1),     # 1 x 1 with padding: im2col
]


def _patch_rows(N, Ho, Wo):
    """(n, ho, wo) row indices in 4 x 4 spatial patch order (SPEC §8), patch after patch, raster order in each."""
    return torch.arange(N * Ho * Wo).reshape(N, Ho // 4, 4, Wo // 4, 4).permute(0, 1, 3, 2, 4).reshape(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [NEAREST, hot.Config.paper(rounding="nearest")], ids=["default", "paper"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[f"conv{i}" for i in range(len(CONV_CASES))])
def test_conv2d_grads_within_derived_bounds(case, cfg, device):
    torch.manual_seed(2)
    c = dict(case)
    N, C, H, W, O = c.pop("N"), c.pop("C"), c.pop("H"), c.pop("W"), c.pop("O")
    layer = ht.Conv2d(C, O, c["k"], c["stride"], c["padding"], c["dilation"], config=cfg).to(device)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, C, H, W, generator=g)
    xd = x.clone().to(device).requires_grad_(True)
    y = layer(xd)
    wt = layer.weight.detach().cpu()
    torch.testing.assert_close(y.detach().cpu(), F.conv2d(x, wt, layer.bias.detach().cpu(), layer.stride,
                                                          layer.padding, layer.dilation), rtol=1e-5, atol=1e-5)
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy.to(device))
    k = layer.kernel_size
    if ops.pointwise(k, layer.padding):
        # a pointwise conv is a linear layer over the pixels it reads: it keeps their codes (or ABC buffer; SPEC
        # §8), whose quantisation of the raw x is what the g_w bound below covers
        xq = x.double()
    else:
        # what the layer keeps: the int8 RTN feature map (the engine's quantiser, deterministic)
        q, s = hot.quantize(x.reshape(N * C, -1), bits=8, scale="tensor", rounding="nearest")
        assert float((q.double() * s.double() - x.reshape(N * C, -1).double()).abs().max()) <= float(s) / 2 * (1 + 1e-5)
        xq = (q.double() * s.double()).reshape(N, C, H, W)
    cols = F.unfold(xq, k, dilation=layer.dilation, padding=layer.padding, stride=layer.stride)
    P = cols.shape[-1]
    cols = cols.transpose(1, 2).reshape(N * P, -1)
    g2 = gy.permute(0, 2, 3, 1).reshape(N * P, O)
    Ho, Wo = y.shape[2], y.shape[3]
    # below rank 16 the projection takes the rows in 4 x 4 patch order where the output map tiles (SPEC §8)
    patches = cfg.rank < 16 and Ho % 4 == 0 and Wo % 4 == 0
    assert ops.conv_patch_rows(Ho, Wo, cfg) == patches
    perm = _patch_rows(N, Ho, Wo) if patches else torch.arange(N * P)
    proj, bound, mag = gw_reference(g2[perm], cols[perm], cfg.rank)
    check_bound(layer.weight.grad.cpu().reshape(O, -1), proj, bound, mag, what="conv g_w")
    ref, bound, mag = gx_reference(g2, wt.reshape(O, -1), cfg.gx_bits, False)
    fold = lambda t: F.fold(t.reshape(N, P, -1).transpose(1, 2), (H, W), k, dilation=layer.dilation,  # noqa: E731
                            padding=layer.padding, stride=layer.stride)
    check_bound(xd.grad.cpu(), fold(ref), fold(bound), fold(mag), what="conv g_x")
    torch.testing.assert_close(layer.bias.grad.cpu().double(), gy.double().sum((0, 2, 3)), rtol=1e-5, atol=1e-4)


def test_exact_mode_matches_torch():
    torch.manual_seed(4)
    lin = torch.nn.Linear(24, 40)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    hl, hc = ht.Linear(24, 40, config=hot.Config(exact=True)), ht.Conv2d(3, 8, 3, padding=1, config=hot.Config(exact=True))
    hl.load_state_dict(lin.state_dict())
    hc.load_state_dict(conv.state_dict())
    for ref, mod, shape in ((lin, hl, (5, 7, 24)), (conv, hc, (2, 3, 6, 5))):
        x = torch.randn(shape)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(x1).square().sum().backward()
        mod(x2).square().sum().backward()
        torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mod.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(mod.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_exact_mode_with_frozen_weight_gives_exact_gx_and_keeps_nothing(kind):
    """Config(exact=True) on a frozen weight: g_x is the exact one (not the quantised path) and no activation is
    kept (g_x needs only W)."""
    torch.manual_seed(6)
    if kind == "linear":
        ref, mod, shape = torch.nn.Linear(24, 40), ht.Linear(24, 40, config=hot.Config(exact=True)), (5, 7, 24)
    else:
        ref = torch.nn.Conv2d(3, 8, 3, padding=1)
        mod, shape = ht.Conv2d(3, 8, 3, padding=1, config=hot.Config(exact=True)), (2, 3, 6, 5)
    mod.load_state_dict(ref.state_dict())
    for p in (*ref.parameters(), *mod.parameters()):
        p.requires_grad_(False)
    x = torch.randn(shape)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x1).square().sum().backward()
    y2, saved = _count_saved(lambda: mod(x2))
    assert not any(dt == torch.int8 and n > 0 for dt, n in saved), saved
    assert not any(n == x.numel() and dt == x.dtype for dt, n in saved), saved
    y2.square().sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)


def test_non_contiguous_input_is_accepted_like_nn_linear():
    """A transposed (column-strided) input works as with nn.Linear, with the same result as its contiguous copy."""
    torch.manual_seed(8)
    layer = ht.Linear(16, 8, config=NEAREST)
    base = torch.randn(16, 5)
    xt = base.clone().requires_grad_()
    xc = base.t().contiguous().requires_grad_()
    yt, yc = layer(xt.t()), layer(xc)
    torch.testing.assert_close(yt, yc)  # F.linear itself may sum in another order for a strided input
    gy = torch.randn(yt.shape)
    yt.backward(gy)
    gw_t = layer.weight.grad.clone()
    layer.weight.grad = None
    yc.backward(gy)
    assert torch.equal(gw_t, layer.weight.grad)
    assert torch.equal(xt.grad.t(), xc.grad)


def _count_saved(fn):
    sizes = []

    def pack(t):
        sizes.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sizes


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_frozen_weight_keeps_nothing_and_gives_gx_only(kind):
    torch.manual_seed(5)
    layer = ht.Linear(32, 16, config=NEAREST) if kind == "linear" else ht.Conv2d(4, 16, 3, config=NEAREST)
    layer.weight.requires_grad_(False)
    x = torch.randn((40, 32) if kind == "linear" else (2, 4, 7, 7), requires_grad=True)
    y, saved = _count_saved(lambda: layer(x))
    assert not any(dt == torch.int8 and n > 0 for dt, n in saved), saved  # no ABC buffer / feature map
    assert not any(n == x.numel() and dt == x.dtype for dt, n in saved)  # and not x itself
    y.sum().backward()
    assert layer.weight.grad is None and x.grad is not None and layer.bias.grad is not None


@pytest.mark.parametrize("rank,k_pad", [(8, 64), (16, 112)])
def test_abc_buffer_size_linear(rank, k_pad):
    layer = ht.Linear(64, 32, config=hot.Config(rank=rank))
    x = torch.randn(100, 64)
    _, saved = _count_saved(lambda: layer(x))
    int8 = [n for dt, n in saved if dt == torch.int8 and n > 0]
    # I x K_pad with K = ceil(100/16) * rank (56 or 112) -> K_pad = 64 or 112
    assert int8 == [64 * k_pad]
    assert not any(dt == torch.float32 and n == x.numel() for dt, n in saved)


def test_input_without_grad_computes_no_gx(monkeypatch):
    # The layers reach the engine through hot._C.backward_linear; its 7th argument is need_grad_input.
    calls = []
    real = hot._C.backward_linear

    def spy(*a):
        calls.append(a[6])
        return real(*a)

    monkeypatch.setattr(hot._C, "backward_linear", spy)
    layer = ht.Linear(16, 16)
    layer(torch.randn(8, 16)).sum().backward()
    assert calls == [False] and layer.weight.grad is not None


def test_seeds_vary_per_step_and_are_reproducible():
    def run():
        torch.manual_seed(123)
        layer = ht.Linear(32, 32)
        x = torch.randn(64, 32)
        grads = []
        for _ in range(2):
            layer.weight.grad = None
            xi = x.clone().requires_grad_()
            layer(xi).backward(torch.ones(64, 32) + torch.linspace(0, 1, 32))
            grads.append((xi.grad.clone(), layer.weight.grad.clone()))
        return grads

    a, b = run(), run()
    for (gx1, gw1), (gx2, gw2) in zip(a, b):
        assert torch.equal(gx1, gx2) and torch.equal(gw1, gw2)
    assert not torch.equal(a[0][0], a[1][0])  # stochastic rounding: a new seed per step


def test_nonfinite_gradient_stays_visible():
    layer = ht.Linear(16, 16)
    x = torch.randn(20, 16, requires_grad=True)
    gy = torch.randn(20, 16)
    gy[3, 5] = float("inf")
    layer(x).backward(gy)
    assert not torch.isfinite(x.grad).all()
    assert not torch.isfinite(layer.weight.grad).all()
    assert not torch.isfinite(layer.bias.grad).all()


def test_bad_inputs_raise_clear_errors():
    layer = ht.Linear(8, 4)
    with pytest.raises(TypeError, match="input dtype torch.float16 differs from weight dtype torch.float32"):
        layer(torch.randn(3, 8, dtype=torch.float16, requires_grad=True))
    with pytest.raises(TypeError, match="float64"):
        ht.Linear(8, 4).double()(torch.randn(3, 8, dtype=torch.float64, requires_grad=True))
    with pytest.raises(ValueError, match="groups=2"):
        ht.Conv2d(4, 4, 3, groups=2)
    with pytest.raises(ValueError, match="padding_mode"):
        ht.Conv2d(4, 4, 3, padding_mode="reflect")
    with pytest.raises(TypeError, match="hot.Config"):
        ht.Linear(8, 4, config={"rank": 8})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["eager", "ops"])
@pytest.mark.parametrize("stride,HW,rank,channels_last", [(1, (8, 12), 8, False), (2, (7, 9), 16, False),
                                                          (1, (6, 5), 16, True), (2, (16, 16), 8, True)],
                         ids=["patches", "strided", "channels_last", "strided_patches_cl"])
def test_pointwise_conv_is_the_linear_layer_over_its_pixels(stride, HW, rank, channels_last, route, device):
    """SPEC §8: a 1 x 1 conv without padding keeps the codes of the pixel rows it reads at rank 16 (every stride-th
    pixel; hot.activation_codes, g_w from G~'s codes, SPEC §4), below it their ABC buffer (rows in 4 x 4 patch order
    where the output map tiles), and its backward is hot.backward_linear over those rows: bit-identical to that
    composition of hot's public API, with zeros at the pixels a stride skips."""
    from hot.torch import ops

    N, C, O = 2, 6, 20
    cfg = hot.Config(rank=rank, rounding="stochastic")
    g = torch.Generator().manual_seed(4)
    x0, w0, b0 = torch.randn(N, C, *HW, generator=g), torch.randn(O, C, 1, 1, generator=g), torch.randn(O, generator=g)
    if channels_last:
        x0 = x0.contiguous(memory_format=torch.channels_last)
    x, w, b = (t.clone().to(device).requires_grad_(True) for t in (x0, w0, b0))
    seed = torch.tensor(424242, dtype=torch.int64)
    geom = ([stride, stride], [0, 0], [1, 1])
    if route == "eager":
        saved, y = saved_during(lambda: ops.conv2d(x, w, b, seed, *geom, ops.KEEP_COMPRESSED, cfg))
    else:
        saved, y = saved_during(lambda: ops.conv2d_ops(x, w, b, seed, *geom, ops.KEEP_COMPRESSED, cfg.code))
    Ho, Wo = y.shape[2:]
    L = N * Ho * Wo
    int8 = [t for t in saved if t.dtype == torch.int8 and t.numel() > 0]
    assert [tuple(t.shape) for t in int8] == [(C, ops.padded_k(L, rank))]  # no feature map: the pixels' codes / ABC
    gy = torch.randn(y.shape, generator=g).to(device)
    if channels_last:  # a channels-last network's g_y: g_x comes back channels-last (strided: the engine's scatter)
        gy = gy.contiguous(memory_format=torch.channels_last)
    y.backward(gy)
    patches = rank < 16 and Ho % 4 == 0 and Wo % 4 == 0
    xs = x0[:, :, ::stride, ::stride].permute(0, 2, 3, 1).to(device)
    g2 = gy.permute(0, 2, 3, 1)
    if patches:
        xs, g2 = ops._patch_split(xs, 1), ops._patch_split(g2, 1)
    xs, g2 = xs.reshape(L, C).contiguous(), g2.reshape(L, O).contiguous()
    saved = hot.activation_codes(xs) if hot._api.gw_from_codes(cfg) else hot.compress_activation(xs, cfg)
    assert saved.codes == (rank == 16)
    rx, rw, rb = hot.backward_linear(g2, w0.reshape(O, C).to(device), saved, bias=True, config=cfg, seed=int(seed))
    assert torch.equal(w.grad.reshape(O, C), rw) and torch.equal(b.grad, rb)
    gx = torch.zeros_like(x0).to(device)
    if patches:
        rx = rx.reshape(N, Ho // 4, Wo // 4, 4, 4, C).permute(0, 1, 3, 2, 4, 5)
    gx[:, :, ::stride, ::stride] = rx.reshape(N, Ho, Wo, C).permute(0, 3, 1, 2)
    assert torch.equal(x.grad, gx)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("keep", [1, 2], ids=["abc", "exact"])
def test_eager_route_matches_ops_route(kind, keep, device):
    """Eager layers run the op bodies directly (no dispatcher); torch.compile graphs call the torch.library ops. For
    the same seed both routes give identical outputs and gradients (stochastic rounding)."""
    from hot.torch import ops

    torch.manual_seed(11)
    seed = torch.tensor(987654321, dtype=torch.int64)
    cfg = hot.Config(gx_bits=4, rank=8, rounding="stochastic", gx_scale="tensor", exact=keep == 2)
    if kind == "linear":
        x0, w0, b0 = torch.randn(3, 37, 24), torch.randn(20, 24), torch.randn(20)
        geom = ()
    else:
        x0, w0, b0 = torch.randn(2, 3, 9, 9), torch.randn(5, 3, 3, 3), torch.randn(5)
        geom = ([2, 1], [1, 0], [1, 1])
    gy = None
    results = []
    for route in ("eager", "ops"):
        x, w, b = (t.clone().to(device).requires_grad_(True) for t in (x0, w0, b0))
        if route == "eager":
            fn = ops.linear if kind == "linear" else ops.conv2d
            y = fn(x, w, b, seed, *geom, keep, cfg)
        else:  # the torch.library ops, the configuration as its code
            fn = ops.linear_ops if kind == "linear" else ops.conv2d_ops
            y = fn(x, w, b, seed, *geom, keep, cfg.code)
        if gy is None:
            gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(device)
        y.backward(gy)
        results.append((y.detach(), x.grad, w.grad, b.grad))
    for a, b_ in zip(*results):
        assert torch.equal(a, b_)


def test_unsupported_torch_device_is_named():
    with pytest.raises(ValueError, match="compress_activation: x is on torch device 'meta', expected a CPU or CUDA"):
        hot.compress_activation(torch.randn(4, 16, device="meta"))


EMPTY_CASES = [("linear", 16, 8, (0, 16)), ("linear", 16, 8, (2, 0, 16)), ("linear", 0, 8, (4, 0)),
               ("linear", 16, 0, (4, 16)), ("conv", 3, 4, (0, 3, 8, 8))]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("exact", [False, True], ids=["hot", "exact"])
@pytest.mark.parametrize("kind,i,o,shape", EMPTY_CASES, ids=["L0", "L0_3d", "I0", "O0", "conv_N0"])
def test_empty_operands_behave_like_torch(kind, i, o, shape, exact):
    """Empty batches and zero-width layers give nn.Linear / nn.Conv2d's outputs and gradients (empty, zero, or for
    I = 0 the bias gradient sum(g_y)) instead of the engine's empty-array errors."""
    torch.manual_seed(9)
    cfg = hot.Config(exact=exact)
    ref = torch.nn.Linear(i, o) if kind == "linear" else torch.nn.Conv2d(i, o, 3)
    mod = ht.Linear(i, o, config=cfg) if kind == "linear" else ht.Conv2d(i, o, 3, config=cfg)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(shape)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), mod(x2)
    assert torch.equal(y1, y2)
    gy = torch.randn(y1.shape)
    y1.backward(gy)
    y2.backward(gy)
    for a, b in ((x2.grad, x1.grad), (mod.weight.grad, ref.weight.grad), (mod.bias.grad, ref.bias.grad)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("gy_depends_on_x", [True, False], ids=["penalty", "constant_gy"])
@pytest.mark.parametrize("route", ["eager", "ops"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_double_backward_raises(kind, route, gy_depends_on_x):
    """HOT's backward is not differentiable: create_graph=True still gives the first-order gradient, but
    differentiating it again raises instead of silently dropping the second-order terms (the constant_gy case:
    g_x = g_y W still depends on W)."""
    from hot.torch import ops

    torch.manual_seed(12)
    seed = torch.zeros((), dtype=torch.int64)
    cfg = hot.Config(gx_bits=4, rank=8, rounding="stochastic", gx_scale="tensor", exact=True)
    if kind == "linear":
        x, w, b = torch.randn(5, 16), torch.randn(8, 16), torch.randn(8)
        geom, ref_fn = (), F.linear
    else:
        x, w, b = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3), torch.randn(4)
        geom, ref_fn = ([1, 1], [1, 1], [1, 1]), lambda x, w, b: F.conv2d(x, w, b, 1, 1)
    if route == "eager":
        fn = ops.linear if kind == "linear" else ops.conv2d
        config = cfg
    else:  # the torch.library ops (the route under torch.compile), the configuration as its code
        fn = ops.linear_ops if kind == "linear" else ops.conv2d_ops
        config = cfg.code
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    y = fn(x, w, b, seed, *geom, ops.KEEP_RAW, config)
    loss = y.square().sum() if gy_depends_on_x else y.sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    y_ref = ref_fn(x, w, b)
    (g_ref,) = torch.autograd.grad(y_ref.square().sum() if gy_depends_on_x else y_ref.sum(), x)
    torch.testing.assert_close(g.detach(), g_ref, rtol=1e-5, atol=1e-5)  # exact mode: the first order is right
    with pytest.raises(RuntimeError, match=f"hot.torch.{'Linear' if kind == 'linear' else 'Conv2d'}: double "
                                           "backward is not supported"):
        (y.sum() + g.square().sum()).backward()


@pytest.mark.parametrize("geom", [(2, 1, 1), ((2, 1), (1, 0), (1, 2)), (1, (0, 1), 2)],
                         ids=["ints", "pairs", "mixed"])
def test_functional_conv2d_takes_ints_or_pairs_like_f_conv2d(geom):
    torch.manual_seed(13)
    x, w, b = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3), torch.randn(4)
    x1, w1, b1 = (t.clone().requires_grad_() for t in (x, w, b))
    x2, w2, b2 = (t.clone().requires_grad_() for t in (x, w, b))
    y1 = F.conv2d(x1, w1, b1, *geom)
    y2 = ht.hot_conv2d(x2, w2, b2, *geom, config=hot.Config(exact=True))
    assert torch.equal(y1, y2)
    gy = torch.randn(y1.shape)
    y1.backward(gy)
    y2.backward(gy)
    for a, r in ((x2.grad, x1.grad), (w2.grad, w1.grad), (b2.grad, b1.grad)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-4)


def test_functional_bad_geometry_or_weight_is_refused_up_front():
    x, w = torch.randn(2, 3, 8, 8, requires_grad=True), torch.randn(4, 3, 3, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"hot_conv2d: stride must be an int or a pair of ints \(h, w\), got \(2,\)"):
        ht.hot_conv2d(x, w, None, (2,), 0, 1)
    with pytest.raises(ValueError, match=r"hot_conv2d: padding must be an int or a pair of ints \(h, w\), got "
                                         r"\(1, 1, 1\)"):
        ht.hot_conv2d(x, w, None, 1, (1, 1, 1), 1)
    with pytest.raises(ValueError, match=r"hot_conv2d: padding .* got 'same'"):
        ht.hot_conv2d(x, w, None, 1, "same", 1)
    with pytest.raises(ValueError, match=r"hot_linear: weight has 1 dims, expected 2 \(O x I\) \(got shape \(5,\)\)"):
        ht.hot_linear(torch.randn(4, 5, requires_grad=True), torch.randn(5, requires_grad=True))


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_input_its_producer_keeps_is_kept_as_it_is_not_copied(kind):
    """SPEC §2: after a ReLU (which keeps its output), a converted layer keeps that same tensor and no int8 copy, and
    its gradients equal those of the same layer fed an equal tensor that nothing keeps (compressed in the forward):
    the backward compresses the same values the same deterministic way (bit for bit)."""
    torch.manual_seed(5)
    if kind == "linear":
        pre, layer, x0 = torch.nn.Linear(16, 32), ht.Linear(32, 8), torch.randn(4, 6, 16)
    else:
        pre, layer, x0 = torch.nn.Conv2d(3, 6, 3, padding=1), ht.Conv2d(6, 5, 3, padding=1), torch.randn(2, 3, 8, 8)
    grads = {}
    for mode in ("kept", "copied"):
        layer.zero_grad(set_to_none=True)
        h = torch.relu(pre(x0))
        src = h if mode == "kept" else h.clone()  # CloneBackward keeps nothing
        torch.manual_seed(9)  # the layer's stochastic-rounding seed
        saved, y = saved_during(lambda: layer(src))
        int8 = [t for t in saved if t.dtype == torch.int8 and t.numel() > 0]
        if mode == "kept":
            assert not int8, "an int8 copy was kept although the ReLU keeps the input"
            assert any(t.untyped_storage().data_ptr() == h.untyped_storage().data_ptr() for t in saved)
        else:
            assert int8, "nothing keeps the input: the layer must keep its int8 copy"
        y.square().sum().backward()
        grads[mode] = (layer.weight.grad.clone(), layer.bias.grad.clone())
    # the same ABC buffer (linear) or int8 feature map (conv), formed in the backward instead of the forward
    assert torch.equal(grads["kept"][0], grads["copied"][0]) and torch.equal(grads["kept"][1], grads["copied"][1])


def test_input_kept_by_its_producer_and_then_modified_in_place_is_an_error():
    """The layer saves the input through autograd, so a later in-place change is caught at backward (as the ReLU's
    own check would), not silently used."""
    pre, layer = torch.nn.Linear(16, 32), ht.Linear(32, 8)
    h = torch.relu(pre(torch.randn(4, 16)))
    y = layer(h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
