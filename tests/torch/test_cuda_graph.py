"""Converted layers recorded in a CUDA graph (torch.cuda.graph): the engine's calls are capturable (kernels and
stream-ordered scratch on the capturing stream, no host synchronisation), and a replay gives the gradients of the
eager step with the same stochastic-rounding seed, bit for bit.

A replay reuses the seeds drawn while the graph was recorded (they are host values baked into the kernels'
arguments), so these tests pin the seed with torch.manual_seed before recording and before the eager step; a training
loop that replays one graph every step would round with the same noise each step (see benchmarks/NOTES.md, "CUDA
graphs").
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
    else:  # a 3 x 3 conv (int8 map, the engine's conv backward) and a pointwise one (ABC of its pixel rows)
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
def test_replay_equals_eager_step_with_the_same_seed(kind, amp):
    m = _model(kind)
    shape = (384, 192) if kind == "linear" else (4, 16, 12, 12)
    x = torch.randn(shape, device="cuda", requires_grad=True)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        y_shape, y_dtype = m(x).shape, m(x).dtype
    gy = torch.randn(y_shape, device="cuda", dtype=y_dtype)

    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph asks (lazy set-up out of the capture)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _clear(m, x)
            _step(m, x, gy, amp)
    torch.cuda.current_stream().wait_stream(side)

    _clear(m, x)
    g = torch.cuda.CUDAGraph()
    torch.manual_seed(1234)
    with torch.cuda.graph(g):
        _step(m, x, gy, amp)
    for p in [x] + list(m.parameters()):  # the replay must write them, not find them from the capture
        p.grad.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    replayed = _grads(m, x)

    _clear(m, x)
    torch.manual_seed(1234)
    _step(m, x, gy, amp)
    torch.cuda.synchronize()
    eager = _grads(m, x)
    for a, b in zip(replayed, eager):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.isfinite(b).all()
        assert torch.equal(a, b)
