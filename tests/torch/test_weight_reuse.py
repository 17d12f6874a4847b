"""hot.torch.weight_reuse: a layer's W~ (SPEC §3) formed once per weight version inside the block, reused by the next
backward passes; gradients bit-identical to forming it every call."""
import pytest
import torch
import torch.nn.functional as F

import hot
import hot.torch as ht
from hot.experiments import models


def _model(name, config=hot.Config(rounding="stochastic")):
    torch.manual_seed(0)
    m = models.build(name, width=8) if name == "cnn" else models.build(name, dim=32, depth=1, heads=2, mlp=64)
    ht.convert(m, config=config)
    return m


def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)) for _ in range(n)]


def _run(m, batches, reuse, step_between=False, autocast=False):
    """Gradients accumulated over the batches (an SGD step after the first when step_between), and the block's
    counters."""
    m.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.manual_seed(7)
    r = None

    def body():
        for i, (x, y) in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(m(x), y)
            loss.backward()
            if step_between and i == 0:
                opt.step()
    if reuse:
        with ht.weight_reuse() as r:
            body()
            kept = r.nbytes
        assert r.nbytes == 0  # freed at the end of the block
    else:
        body()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    return grads, (r.formed, r.reused, kept) if r is not None else None


def _gx_layers(m):
    """The converted layers whose backward computes g_x (all but a first layer fed by the data)."""
    return [l for _, l in ht.hot_layers(m)][1:]


@pytest.mark.parametrize("name", ["vit", "cnn"])
@pytest.mark.parametrize("autocast", [False, True])
def test_accumulation_reuses_and_gives_the_same_bits(name, autocast):
    batches = _batches(3)
    m = _model(name)
    want, _ = _run(m, batches, reuse=False, autocast=autocast)
    got, (formed, reused, kept) = _run(m, batches, reuse=True, autocast=autocast)
    n = len(_gx_layers(m))
    assert (formed, reused) == (n, 2 * n)
    O_I = [(l.weight.shape[0], l.weight[0].numel()) for l in _gx_layers(m)]
    assert kept == sum(I * hot._C.padded_k(O) + 4 for O, I in O_I)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_a_weight_update_forms_a_new_w():
    """An optimizer step inside the block bumps the weights' versions: the next backward forms W~ again (no stale
    reuse), and the gradients equal those of the same steps without the block."""
    batches = _batches(3)
    m = _model("vit")
    state = {k: v.clone() for k, v in m.state_dict().items()}
    want, _ = _run(m, batches, reuse=False, step_between=True)
    m.load_state_dict(state)
    got, (formed, reused, _) = _run(m, batches, reuse=True, step_between=True)
    n = len(_gx_layers(m))
    assert (formed, reused) == (2 * n, n)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_outside_the_block_and_exact_layers_keep_nothing():
    m = _model("vit")
    x, y = _batches(1)[0]
    with ht.weight_reuse() as r:
        pass
    F.cross_entropy(m(x), y).backward()  # forward outside the block: nothing recorded
    assert (r.formed, r.reused) == (0, 0)
    m = _model("vit", hot.Config(exact=True))
    with ht.weight_reuse() as r:
        F.cross_entropy(m(x), y).backward()
        F.cross_entropy(m(x), y).backward()
    assert (r.formed, r.reused) == (0, 0)
