"""Converted layers in a CUDA graph (torch.cuda.graph). The engine's calls are capturable (kernels and stream-ordered
scratch on the capturing stream, no host synchronisation), and the stochastic-rounding seeds are drawn on the GPU by
torch's CUDA generator and read by the kernels (SPEC §5), so every replay rounds with new seeds: replay k of a graph
recorded after ``torch.manual_seed(s)`` gives the gradients of the k-th eager step after ``torch.manual_seed(s)``, bit
for bit, and two replays differ where stochastic rounding acts.
"""
import pytest
import torch
from torch import nn

import hot
import hot.torch as ht

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and hot.cuda_available()),
                                reason="needs a CUDA GPU and hot built with CUDA")


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        m = nn.Sequential(nn.Linear(192, 320), nn.GELU(), nn.Linear(320, 96))
    else:  # a 3 x 3 conv (int8 map, the engine's conv backward) and a pointwise one (its pixel rows' codes)
        m = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 24, 1))
    ht.convert(m)
    return m.cuda()


def _step(m: nn.Module, x: torch.Tensor, gy: torch.Tensor, amp: bool) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        y = m(x)
    y.backward(gy)


def _grads(m: nn.Module, x: torch.Tensor):
    return [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]


def _clear(m: nn.Module, x: torch.Tensor) -> None:
    x.grad = None
    for p in m.parameters():
        p.grad = None


@pytest.mark.parametrize("kind,amp", [("linear", False), ("linear", True), ("conv", False), ("conv", True)])
def test_each_replay_equals_the_eager_step_with_the_same_generator_state(kind, amp):
    m = _model(kind)
    shape = (384, 192) if kind == "linear" else (4, 16, 12, 12)
    x = torch.randn(shape, device="cuda", requires_grad=True)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        y0 = m(x)
    gy = torch.randn(y0.shape, device="cuda", dtype=y0.dtype)

    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph asks (lazy set-up out of the capture)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _clear(m, x)
            _step(m, x, gy, amp)
    torch.cuda.current_stream().wait_stream(side)

    _clear(m, x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _step(m, x, gy, amp)
    torch.manual_seed(1234)
    replays = []
    for _ in range(2):
        for p in [x] + list(m.parameters()):  # each replay must write them
            p.grad.fill_(float("nan"))
        g.replay()
        replays.append(_grads(m, x))
    torch.cuda.synchronize()

    torch.manual_seed(1234)
    eager = []
    for _ in range(2):
        _clear(m, x)
        _step(m, x, gy, amp)
        eager.append(_grads(m, x))
    torch.cuda.synchronize()
    for k in range(2):
        for a, b in zip(replays[k], eager[k]):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.isfinite(b).all()
            assert torch.equal(a, b), f"replay {k}"
    # new seeds at the second replay: the stochastically rounded g_x and g_w of the converted layers change, g_b not
    weights = [i + 1 for i, (n, _) in enumerate(m.named_parameters()) if n.endswith("weight")]
    assert not torch.equal(replays[0][0], replays[1][0])
    assert all(not torch.equal(replays[0][i], replays[1][i]) for i in weights)


def test_functional_backward_with_a_seed_drawn_in_the_graph():
    """hot.backward_linear with a seed tensor that a graph redraws: each replay equals the call with the integer the
    tensor then holds."""
    torch.manual_seed(0)
    gy = torch.randn(300, 48, device="cuda")
    w = torch.randn(48, 40, device="cuda") * 0.05
    x = torch.randn(300, 40, device="cuda")
    saved = hot.compress_activation(x)
    seed = torch.zeros((), dtype=torch.int64, device="cuda")
    out = {}

    def call():
        seed.copy_(torch.randint(0, 2**62, (), dtype=torch.int64, device="cuda"))
        out["r"] = hot.backward_linear(gy, w, saved, seed=seed, bias=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    got, seeds = [], []
    for _ in range(3):
        g.replay()
        got.append([t.clone() for t in out["r"]])
        seeds.append(int(seed.item()))
    assert len(set(seeds)) == 3
    for s, r in zip(seeds, got):
        want = hot.backward_linear(gy, w, saved, seed=s, bias=True)
        for a, b in zip(r, want):
            assert torch.equal(a, b)


def test_compiled_reduce_overhead_records_the_step_in_cuda_graphs():
    """torch.compile(mode="reduce-overhead") of a converted model: no graph is skipped for CUDA graphs (the seeds are
    GPU tensors, no CPU tensor enters the graph), and each step rounds with new seeds."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = _model("linear")
    x = torch.randn(256, 192, device="cuda")
    gy = torch.randn(256, 96, device="cuda")

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def fwd(inp):
        return m(inp)

    grads = []
    for _ in range(4):
        for p in m.parameters():
            p.grad = None
        y = fwd(x)
        y.backward(gy)
        grads.append([p.grad.clone() for p in m.parameters()])
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert all(torch.isfinite(t).all() for g in grads for t in g)
    w0 = [i for i, (n, _) in enumerate(m.named_parameters()) if n.endswith("weight")][0]
    assert not torch.equal(grads[2][w0], grads[3][w0])  # replays of the recorded graphs, with new seeds


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_compiled_reduce_overhead_steps_equal_the_compiled_default_steps(kind):
    """Inductor's CUDA graphs change how the compiled step is launched, not what it computes: after the same
    torch.manual_seed, the k-th step of a converted model compiled with mode="reduce-overhead" (warm-up, recording,
    then replays) has the gradients of the k-th step compiled with the default mode, bit for bit, stochastic rounding
    and bf16 autocast included, so the seeds drawn inside the recorded graphs advance as they do without graphs."""
    import copy

    base = _model(kind)
    if kind == "conv":
        base = base.to(memory_format=torch.channels_last)
    shape = (384, 192) if kind == "linear" else (4, 16, 12, 12)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(shape, device="cuda", generator=g)
    if kind == "conv":
        x = x.contiguous(memory_format=torch.channels_last)
    runs = {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        m = copy.deepcopy(base)
        f = torch.compile(m, mode=None if mode == "default" else mode, fullgraph=True)
        torch.manual_seed(1234)
        steps = []
        for _ in range(5):  # reduce-overhead: a warm-up run, the recording, then replays
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = f(x).float().square().mean()
            loss.backward()
            steps.append([p.grad.clone() for p in m.parameters()])
            for p in m.parameters():
                p.grad = None
        torch.cuda.synchronize()
        runs[mode] = steps
    for k in range(5):
        for a, b in zip(runs["default"][k], runs["reduce-overhead"][k]):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b), f"step {k}"
    w0 = [i for i, (n, _) in enumerate(base.named_parameters()) if n.endswith("weight")][0]
    assert not torch.equal(runs["reduce-overhead"][3][w0], runs["reduce-overhead"][4][w0])


@pytest.mark.parametrize("amp", [False, True])
def test_recorded_training_step_equals_the_eager_steps(amp):
    """The README's recipe: forward, backward and AdamW(capturable=True) recorded as one graph, new batches copied into
    its static inputs; after the same warm-up and torch.manual_seed, N replays leave every parameter bit for bit where
    N eager steps do (the converted layers' seeds are redrawn at each replay as in each eager step)."""
    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 1), nn.Flatten(),
                          nn.Linear(16 * 8 * 8, 10))
        ht.convert(m)
        m = m.cuda()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True)

    torch.manual_seed(7)
    batches = [(torch.randn(8, 3, 8, 8, device="cuda"), torch.randint(0, 10, (8,), device="cuda")) for _ in range(6)]

    def step(m, opt, x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        return loss

    # eager: 2 warm-up steps, then the seed, then 4 steps
    m_e, opt_e = build()
    for x, y in batches[:2]:
        opt_e.zero_grad(set_to_none=True)
        step(m_e, opt_e, x, y)
    torch.manual_seed(1234)
    eager_losses = []
    for x, y in batches[2:]:
        opt_e.zero_grad(set_to_none=True)
        eager_losses.append(step(m_e, opt_e, x, y).detach())
    torch.cuda.synchronize()

    # graphed: the same warm-up on a side stream, the step recorded on static inputs, then 4 replays
    m_g, opt_g = build()
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[:2]:
            static_x.copy_(x), static_y.copy_(y)
            opt_g.zero_grad(set_to_none=True)
            step(m_g, opt_g, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    opt_g.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_loss = step(m_g, opt_g, static_x, static_y)
    torch.manual_seed(1234)
    graph_losses = []
    for x, y in batches[2:]:
        static_x.copy_(x), static_y.copy_(y)
        g.replay()
        graph_losses.append(static_loss.clone())
    torch.cuda.synchronize()

    assert all(torch.isfinite(v) for v in eager_losses)
    for a, b in zip(graph_losses, eager_losses):
        assert torch.equal(a, b)
    for (n, a), b in zip(m_g.named_parameters(), m_e.parameters()):
        assert torch.equal(a, b), n
    assert not torch.equal(m_e[0].weight, build()[0][0].weight)  # the steps did train


def test_a_static_input_read_by_two_layers_is_cast_and_compressed_by_each_replay():
    # Two layers reading one input share its bf16 cast and ABC buffer (SPEC §2). The graph, recorded after eager
    # warm-up steps on the same static input, must form them itself: after the caller refills the input, a replay
    # gives the gradients of an eager step on the new values.
    torch.manual_seed(0)
    cfg = hot.Config(rounding="nearest")
    a, b = ht.Linear(192, 96, config=cfg).cuda(), ht.Linear(192, 64, config=cfg).cuda()
    x = torch.randn(256, 192, device="cuda")  # the static input, fp32: cast by the layers under autocast

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = a(x).float().square().sum() + b(x).float().sum()
        loss.backward()

    def clear():
        a.weight.grad = a.bias.grad = b.weight.grad = b.bias.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            clear()
            step()
    torch.cuda.current_stream().wait_stream(side)
    clear()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    new = torch.randn(256, 192, device="cuda")
    x.copy_(new)
    g.replay()
    replay = [p.grad.clone() for p in (a.weight, b.weight)]
    clear()
    step()
    torch.cuda.synchronize()
    for r, e in zip(replay, (a.weight.grad, b.weight.grad)):
        assert torch.equal(r, e)
