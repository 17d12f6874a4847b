"""torch.compile (fullgraph, no graph breaks), autocast (bf16/fp16) and GradScaler."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot
import hot.torch as ht
from hot.experiments import models
from conftest import DEVICES
from torch_reference import assert_compiles_like_eager


def _small_models():
    torch.manual_seed(0)
    vit = models.build("vit", dim=32, depth=1, heads=2, mlp=64)
    cnn = models.build("cnn", width=8)
    return {"vit": vit, "cnn": cnn}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["vit", "cnn"])
def test_compile_fullgraph_no_graph_breaks(name, device):
    import torch._dynamo as dynamo

    model = _small_models()[name].to(device)
    ht.convert(model, hot.Config(rounding="nearest"))
    if name == "cnn":
        # BatchNorm in training mode reduces over the batch in its backward, and eager CUDA (cuDNN) and the compiled
        # graph (aten decomposition) sum in different orders: the g_y reaching the HOT layers then differs by ulps,
        # and an element within an ulp of one of the 255 rounding boundaries of the 8-bit quantisers rounds the other
        # way (seen on an H100: the stem's g_w differed in 70 of 72 elements). In eval mode BatchNorm's backward is
        # elementwise, so both graphs feed the quantisers the same values.
        model.eval()
    x = torch.randn(8, 1, 8, 8, device=device)
    y = torch.randint(0, 10, (8,), device=device)

    def step(m, x, y):
        return F.cross_entropy(m(x), y)

    dynamo.reset()
    explain = dynamo.explain(step)(model, x, y)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss_c = compiled(model, x, y)
    loss_c.backward()
    g_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss_e = step(model, x, y)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e)
    # nearest rounding: the same integer backward in both (compiled graphs may reorder fp32 sums elsewhere)
    for a, p in zip(g_c, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_channels_last_matches_eager(device):
    """A channels-last network (how cuDNN runs convolutions fastest) compiles fullgraph: the torch.library ops' fake
    outputs have the layouts of their real ones (a conv's output is channels-last for a channels-last input, as
    F.conv2d's is; the g_x of a channels-last g_y too), so the lean ReLU after a conv views the same memory order at
    trace time as at run time, and the compiled gradients equal the eager ones (nearest rounding)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 1, bias=False), nn.ReLU(),
        nn.Conv2d(16, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 1, stride=2), nn.Flatten(), nn.Linear(32, 10)).to(device).to(memory_format=torch.channels_last)
    ht.convert(model, hot.Config(rounding="nearest"))
    x = torch.randn(4, 8, 16, 16, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (4,), device=device)
    eager_out = model[0](x)
    assert eager_out.is_contiguous(memory_format=torch.channels_last) and not eager_out.is_contiguous()

    assert_compiles_like_eager(model, lambda x, y: F.cross_entropy(model(x), y), x, y)


@pytest.mark.parametrize("kind", ["vit", "cnn"])
def test_compiled_step_draws_the_eager_seeds(kind):
    """Stochastic rounding under torch.compile (aot_eager keeps torch's random ops): after the same torch.manual_seed
    the compiled step draws each layer's seed in the forward, in the eager order, so its gradients are the eager ones
    bit for bit (a seed read only by the backward op would let the partitioner move its draw into the backward graph:
    the layers' seeds drawn in another order)."""
    import torch._dynamo as dynamo

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = models.build("vit", dim=32, depth=1, heads=2, mlp=64) if kind == "vit" else nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10))
        ht.convert(model)  # the default configuration: stochastic rounding
        dynamo.reset()
        f = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        torch.manual_seed(100)
        F.cross_entropy(f(x), y).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_compile_traces_hot_ops():
    """The compiled graphs call the hot torch.library ops (not a fallback to exact layers)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"fw": [], "bw": []}

    def recorder(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm.code)
            return gm.forward
        return compiler

    layer = ht.Linear(16, 16)
    backend = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"))
    f = torch.compile(lambda x: layer(x).sum(), backend=backend, fullgraph=True)
    f(torch.randn(4, 16, requires_grad=True)).backward()
    fw, bw = "\n".join(graphs["fw"]), "\n".join(graphs["bw"])
    assert "hot.linear" in fw and "hot.compress_activation" in fw and "hot.linear_backward" in bw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_autocast_dtypes(kind, dtype, device):
    torch.manual_seed(1)
    cfg = hot.Config(rounding="nearest", rank=16, gx_bits=8)  # isolate the autocast plumbing from HLA/4-bit error
    if kind == "linear":
        ref = nn.Linear(32, 48)
        layer = ht.Linear(32, 48, config=cfg)
        x = torch.randn(64, 32)
    else:
        ref = nn.Conv2d(4, 16, 3, padding=1)
        layer = ht.Conv2d(4, 16, 3, padding=1, config=cfg)
        x = torch.randn(2, 4, 6, 6)
    layer.load_state_dict(ref.state_dict())
    ref, layer, x = ref.to(device), layer.to(device), x.to(device)
    xr, xh = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast(device, dtype=dtype):
        yr, yh = ref(xr), layer(xh)
    assert yh.dtype == dtype and yr.dtype == dtype
    torch.testing.assert_close(yh, yr)
    gy = torch.randn(yh.shape, device=device)
    yr.backward(gy.to(dtype))
    yh.backward(gy.to(dtype))
    # grads come back in each input's dtype: fp32 weight, bias and input
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
    assert xh.grad.dtype == torch.float32
    # HOT gradient (8-bit, full rank) close to the autocast reference: relative Frobenius error
    for a, b in ((xh.grad, xr.grad), (layer.weight.grad, ref.weight.grad)):
        rel = float((a - b).norm() / b.norm())
        assert rel < 0.05, rel
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["linear", "conv3x3", "conv1x1"])
def test_autocast_gradients_in_the_operands_dtypes(kind, dtype, device):
    # Under autocast a converted layer casts its fp32 weight itself and writes g_w in fp32, the engine's fp32 result
    # rounded once (SPEC §4, "g_w's dtype"); a Linear does the same with an fp32 input's g_x (SPEC §3). The same
    # layer with its parameters and input in the compute dtype gets g_w and g_x in that dtype: the same fp32 results
    # rounded to it, so the fp32 gradients cast down are those bit for bit, and y and g_b are the same. Default
    # configuration: stochastic rounding, the seeds drawn in the same order in both runs.
    torch.manual_seed(3)
    if kind == "linear":
        layer, x = ht.Linear(48, 40), torch.randn(2, 40, 48)
    else:
        k = 3 if kind == "conv3x3" else 1
        layer, x = ht.Conv2d(6, 16, k, padding=k // 2), torch.randn(2, 6, 8, 8)
    low = copy.deepcopy(layer).to(dtype)
    layer, low, x = layer.to(device), low.to(device), x.to(device)
    gy = torch.randn(layer(x).shape, device=device)

    def run(m, x):
        torch.manual_seed(7)
        xi = x.clone().requires_grad_()
        with torch.autocast(device, dtype=dtype):
            y = m(xi)
        y.backward(gy.to(y.dtype))
        return y, xi.grad

    y32, gx32 = run(layer, x)
    ylo, gxlo = run(low, x.to(dtype))
    assert torch.equal(y32, ylo)
    assert layer.weight.grad.dtype == torch.float32 and low.weight.grad.dtype == dtype
    assert torch.equal(layer.weight.grad.to(dtype), low.weight.grad)
    assert not torch.equal(layer.weight.grad, low.weight.grad.float())  # the fp32 result, not a cast of the other
    assert gx32.dtype == torch.float32 and gxlo.dtype == dtype and torch.equal(gx32.to(dtype), gxlo)
    # a Linear's g_x is the engine's fp32 result; a convolution's g_x is cast by autograd, as exact training's is
    assert torch.equal(gx32, gxlo.float()) == (kind != "linear")
    assert torch.equal(layer.bias.grad.to(dtype), low.bias.grad)


def test_gradscaler_sees_inf():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ht.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    w0 = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(8, 16)

    def poison(g):
        g = g.clone()
        g[0, 0] = float("inf")
        return g

    with torch.autocast("cpu", dtype=torch.float16):
        h = model[0](x)
        h.register_hook(poison)
        out = model[2](model[1](h))
    scaler.scale(out.float().sum()).backward()
    assert not torch.isfinite(model[0].weight.grad).all()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9  # the step was skipped and the scale backed off
    for a, p in zip(w0, model.parameters()):
        assert torch.equal(a, p)
    # a clean step goes through
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    scaler.scale(out.float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(w0[0], model[0].weight)


def test_mixed_devices_error():
    layer = ht.Linear(4, 4)
    x = torch.randn(2, 4, device="meta", requires_grad=True)
    with pytest.raises(ValueError, match="input is on meta but the weight is on cpu"):
        layer(x)


@pytest.mark.slow
def test_compile_inductor_trains():
    """The inductor backend (generates C++ on CPU; slow to compile) runs a converted model, fullgraph."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    ht.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    step = torch.compile(lambda: F.cross_entropy(model(x), y), fullgraph=True, backend="inductor")
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = step()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA GPU and hot's CUDA backend")
def test_compile_inductor_matches_eager_cuda():
    """The inductor backend (Triton kernels around the hot torch.library ops) on the GPU, fullgraph: with nearest
    rounding the compiled training run follows the eager one (same integer backward each step)."""
    import copy

    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)).cuda()
    ht.convert(base, hot.Config(rounding="nearest"))
    x, y = torch.randn(256, 64, device="cuda"), torch.randint(0, 8, (256,), device="cuda")

    def train(model, compile_step):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fn = lambda: F.cross_entropy(model(x), y)  # noqa: E731
        step = torch.compile(fn, fullgraph=True, backend="inductor") if compile_step else fn
        losses = []
        for _ in range(10):
            opt.zero_grad()
            loss = step()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    eager = train(copy.deepcopy(base), False)
    compiled = train(copy.deepcopy(base), True)
    assert eager[-1] < eager[0]
    # Inductor may reorder fp32 sums in the forward; the backward's integers are the same.
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=2e-3, atol=1e-4)
