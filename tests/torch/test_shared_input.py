"""Converted linear layers that read one input tensor (query, key and value projections; a gated MLP's gate and up
projections) share its cast to autocast's dtype and its ABC buffer (SPEC §2): formed once, kept once, the same bits
as forming them per layer."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hot
import hot.torch as ht
from conftest import DEVICES


def _layers(device, dtype=torch.float32):
    torch.manual_seed(0)
    return [ht.Linear(48, o).to(device=device, dtype=dtype) for o in (32, 16, 40)]


def _run(layers, x, shared: bool, amp=None):
    """Forward and backward of the layers on x (one tensor for all when shared, else a copy each); (grads of x and
    of the layers' weights, the int8 tensors the layers saved for backward)."""
    torch.manual_seed(7)
    xs = x.detach().clone().requires_grad_()
    h = xs * 1  # a non-leaf input, as a norm's output is
    saved = []

    def pack(t):
        if t.dtype == torch.int8:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(x.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        ys = [m(h if shared else h.clone()) for m in layers]
    gen = torch.Generator(device="cpu").manual_seed(1)
    loss = sum((y.float() * torch.randn(y.shape, generator=gen).to(y.device)).sum() for y in ys)
    for m in layers:
        m.weight.grad = None
    loss.backward()
    return [xs.grad] + [m.weight.grad for m in layers], saved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "autocast_bf16"])
def test_layers_reading_one_input_keep_one_buffer_and_give_the_same_bits(device, amp):
    layers = _layers(device)
    x = torch.randn(4, 40, 48, device=device)
    got, saved = _run(layers, x, shared=True, amp=amp)
    want, saved_apart = _run(layers, x, shared=False, amp=amp)
    assert len(saved) == len(saved_apart) == 3
    assert len({t.untyped_storage().data_ptr() for t in saved}) == 1  # one buffer, saved by the three layers
    assert len({t.untyped_storage().data_ptr() for t in saved_apart}) == 3
    for a, b in zip(got, want):  # default configuration: stochastic rounding, seeds drawn in the same order
        assert a.dtype == b.dtype and torch.equal(a, b)


class _Casts(TorchDispatchMode):
    """Counts the casts (aten._to_copy) of tensors of a given shape."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.n = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_an_input_is_cast_once_under_autocast(device, monkeypatch):
    """Under autocast the first layer casts x and compresses the cast by one engine call (compress_activation_cast);
    the others reuse both. Layers that keep x uncompressed (exact mode) cast it once, by torch."""
    calls = []
    real = hot._api._compress
    monkeypatch.setattr(hot._api, "_compress", lambda *a, **k: calls.append("x_cast" in k) or real(*a, **k))
    x = torch.randn(64, 48, device=device, requires_grad=True)
    for exact in (False, True):
        h = x * 1
        layers = ([ht.Linear(48, o, config=hot.Config(exact=True)).to(device) for o in (32, 16, 40)] if exact
                  else _layers(device))
        counts = []
        for shared in (True, False):
            calls.clear()
            with _Casts(h.shape) as casts, torch.autocast(device, dtype=torch.bfloat16):
                ys = [m(h if shared else h * 1) for m in layers]
            assert all(y.dtype == torch.bfloat16 for y in ys)
            counts.append((casts.n, list(calls)))
        assert counts == ([(1, []), (3, [])] if exact else [(0, [True]), (0, [True] * 3)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["rows", "padded_rows", "odd_width", "transposed", "float64"])
def test_cast_and_buffer_by_one_call_are_torchs_cast_and_its_buffer(device, dt, layout):
    """hot.torch.ops._compress_cast: the cast is torch's .to(dt) bit for bit (ties to even, subnormals, values past
    fp16's range, infinities; a NaN stays a NaN) and the buffer is that of the cast, for inputs the GPU reads in one
    pass (rows of 8-element multiples) and those it casts first (a padded row stride, an odd width, a transposed view;
    a float64 x, which the engine does not read, is cast by torch)."""
    from hot.torch import ops
    cfg = hot.Config()
    torch.manual_seed(3)
    width = 77 if layout == "odd_width" else 264
    base = torch.randn(300, width + (8 if layout == "padded_rows" else 0), device=device) * 3
    edge = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1e5, -7e4, 2 ** -130, 3e-8, float("inf"),
                         -float("inf")], device=device)
    base[5, :len(edge)] = edge
    base[17, 3] = float("nan")
    x = {"padded_rows": base[:, :width], "transposed": base.t(), "float64": base.double()}.get(layout, base)
    nan_at = (3, 17) if layout == "transposed" else (17, 3)
    xc, q, scale = ops._compress_cast(x, dt, cfg)
    want = x.to(dt)
    assert xc.dtype == dt and xc.shape == x.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(xc), nan) and bool(nan[nan_at])
    assert torch.equal(xc.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    q_want, s_want = ops._compress(want, cfg)
    assert torch.equal(q, q_want) and torch.equal(scale.view(torch.int32), s_want.view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_an_input_changed_in_place_is_compressed_again(device):
    # the second layer reads x after an in-place change: it must compress the new values (x's version counter), and
    # its gradients are those of a fresh tensor holding them
    cfg = hot.Config(rounding="nearest")
    torch.manual_seed(0)
    a, b = ht.Linear(48, 32, config=cfg).to(device), ht.Linear(48, 24, config=cfg).to(device)
    x = torch.randn(64, 48, device=device)
    gy = torch.randn(64, 24, device=device)

    h = x.clone().requires_grad_() * 1
    ya = a(h)  # alive: its graph keeps the buffer of the old values
    h.mul_(-1.5)
    b(h).backward(gy)
    got = b.weight.grad.clone()
    del ya

    b.weight.grad = None
    fresh = (x * -1.5).requires_grad_()
    b(fresh).backward(gy)
    assert torch.equal(got, b.weight.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_shared_buffers_go_with_the_graph(device):
    # nothing of a step outlives it: once the layers' saved tensors are freed by the backward, the shared buffer is
    # gone, and once the input dies its entry (and any cast held for it) goes too
    from hot.torch import ops
    layers = _layers(device)
    x = torch.randn(64, 48, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        h = x * 1.0  # an fp32 input under autocast: the layers share its cast
        ys = [m(h) for m in layers]
    e = ops._SHARED[id(h)]
    refs = list(e[4].values())
    assert len(e[3]) == 1 and len(refs) == 1 and refs[0][0]() is not None
    sum(y.float().sum() for y in ys).backward()
    assert refs[0][0]() is None  # the buffer went with the saved tensors
    key = id(h)
    del h, ys
    assert key not in ops._SHARED or ops._SHARED[key][0]() is not None


@pytest.mark.parametrize("device", DEVICES)
def test_summary_counts_a_shared_buffer_once(device):
    from hot.torch.summary import kept_bytes
    layers = _layers(device)
    x = torch.randn(64, 48, device=device, requires_grad=True)
    h = x * 1
    ys = [m(h) for m in layers]  # the graphs keep the buffer
    first = 48 * hot.torch.ops.padded_k(64, 16) + 4  # the ABC buffer of 64 rows of 48 at rank 16 and its scale
    assert [kept_bytes(m)[0] for m in layers] == [first, 0, 0]
    ys2 = [m(h * 1) for m in layers]  # three inputs: three buffers
    assert [kept_bytes(m)[0] for m in layers] == [first] * 3
    del ys, ys2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "autocast_bf16"])
def test_a_compiled_graph_compresses_a_shared_input_once(device, amp, monkeypatch):
    """Under torch.compile the layers reach the ABC buffer through the functional op hot::compress_activation, which
    AOTAutograd's common-subexpression elimination merges: three layers reading one input run one compression per
    step (the engine's compress called once), and the gradients are the eager ones bit for bit (aot_eager keeps
    torch's random ops, so the layers' seeds are the eager draws)."""
    import torch._dynamo as dynamo
    from hot.torch import ops

    calls = []
    compress = ops._compress

    def counting(x, cfg):
        calls.append(tuple(x.shape))
        return compress(x, cfg)

    monkeypatch.setattr(ops, "_compress", counting)
    layers = _layers(device)
    model = torch.nn.ModuleList(layers)
    x = torch.randn(6, 10, 48, device=device)

    def step(h):
        with torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None):
            ys = [m(h) for m in model]
        return sum((y.float() * (i + 1)).sum() for i, y in enumerate(ys))

    grads = []
    for compiled in (False, True):
        dynamo.reset()
        f = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        for m in layers:
            m.weight.grad = None
        torch.manual_seed(3)
        xs = x.clone().requires_grad_()
        calls.clear()
        f(xs * 1).backward()
        if compiled:
            assert len(calls) == 1, calls
        grads.append([xs.grad] + [m.weight.grad for m in layers])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
