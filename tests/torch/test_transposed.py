"""Linear layers whose weight is stored I x O (transformers' Conv1D, GPT-2's projections): hot.torch.TransposedLinear."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot
import hot.torch as ht
from conftest import DEVICES
from torch_reference import assert_compiles_like_eager


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D as transformers defines it: y = x @ W + b with W (nx, nf)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


Conv1D.__module__ = "transformers.pytorch_utils"  # what convert recognises


def mlp(device):
    torch.manual_seed(0)
    return nn.Sequential(Conv1D(48, 32), nn.GELU(), Conv1D(32, 48)).to(device)


def test_convert_keeps_class_parameters_and_keys():
    m = mlp("cpu")
    ref = copy.deepcopy(m)
    params = list(m.parameters())
    rep = ht.convert(m)
    assert [(n, t, d) for n, t, d in rep.converted] == [("0", "Conv1D", "48 x 32 (stored I x O)"),
                                                        ("2", "Conv1D", "32 x 48 (stored I x O)")]
    c = m[0]
    assert isinstance(c, Conv1D) and isinstance(c, ht.TransposedLinear) and not isinstance(c, nn.Linear)
    assert (c.in_features, c.out_features) == (32, 48) and "weight stored I x O" in repr(c)
    assert list(m.parameters()) == params and list(m.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in ht.hot_layers(m)] == ["0", "2"]
    with pytest.warns(UserWarning, match="already"):
        ht.convert(m)
    x = torch.randn(5, 7, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x))


@pytest.mark.parametrize("device", DEVICES)
def test_exact_config_gradients_are_autograds(device):
    m = mlp(device)
    ref = copy.deepcopy(m)
    ht.convert(m, hot.Config(exact=True))
    x = torch.randn(4, 9, 32, device=device)
    for mod in (m, ref):
        xi = x.clone().requires_grad_()
        mod(xi).square().sum().backward()
        mod.x_grad = xi.grad
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.x_grad, ref.x_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_gradients_are_hot_linear_on_the_transposed_weight(device, rounding):
    # the layer's gradients are bit for bit those of a hot.torch.Linear holding W.t() (same input, same output
    # gradient, same seed draw), laid out as the stored weight
    cfg = hot.Config(rounding=rounding)
    torch.manual_seed(0)
    c = Conv1D(48, 32).to(device)
    lin = ht.Linear(32, 48, device=device, config=cfg)
    with torch.no_grad():
        lin.weight.copy_(c.weight.t())
        lin.bias.copy_(c.bias)
    ht.convert(nn.Sequential(c), cfg)
    x = torch.randn(6, 20, 32, device=device)
    g = torch.randn(6, 20, 48, device=device)
    grads = []
    for mod in (c, lin):
        xi = x.clone().requires_grad_()
        torch.manual_seed(3)
        mod(xi).backward(g)
        grads.append((xi.grad, mod.weight.grad, mod.bias.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1].t())
    torch.testing.assert_close(grads[0][2], grads[1][2])
    exact = g.reshape(-1, 48).t() @ x.reshape(-1, 32)
    err = float((grads[0][1].t() - exact).norm() / exact.norm())
    assert 0 < err < 0.05


def test_calibrate_summary_and_weight_reuse():
    m = mlp("cpu")
    ht.convert(m)
    x, y = torch.randn(8, 16, 32), torch.randn(8, 16, 32)
    ht.calibrate(m, (x, y), F.mse_loss)
    assert all(layer.hot_calibration is not None for _, layer in ht.hot_layers(m))
    from hot.torch.summary import summary_rows

    ht.summary(m, x)
    rows = summary_rows(m)
    assert [(r["name"], r["shape"]) for r in rows] == [("0", "48x32"), ("2", "32x48")]
    # W~ (the g_x path's; the first layer's input needs no gradient) formed once and reused by the next two
    # micro-batches: kept under the stored parameter, not under the view a call multiplies by
    with ht.weight_reuse() as r:
        for _ in range(3):
            F.mse_loss(m(x), y).backward()
    assert (r.formed, r.reused) == (1, 2)


def test_gpt2_from_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    try:
        m = transformers.GPT2LMHeadModel(cfg)
    except ImportError as e:  # transformers refuses its models under an older torch than it supports
        pytest.skip(f"transformers' GPT-2 is unavailable here: {str(e).strip().splitlines()[0]}")
    rep = ht.convert(m)
    assert len(rep.converted) == 9 and not rep.skipped  # 4 Conv1D per block and the head
    ids = torch.randint(0, 96, (2, 32))
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and m.transformer.h[0].attn.c_attn.weight.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    m = mlp(device)
    ht.convert(m, hot.Config(rounding="nearest"))
    x = torch.randn(4, 16, 32, device=device)

    def step(x):
        return m(x).square().mean()

    assert_compiles_like_eager(m, step, x)
