"""hot.torch.MultiheadAttention: nn.MultiheadAttention with HOT in- and out-projections (made by hot.torch.convert)."""
import copy

import pytest
import torch
import torch.nn as nn

import hot
import hot.torch as ht
from conftest import DEVICES
from torch_reference import assert_compiles_like_eager

E, H, N, L, S = 32, 4, 3, 10, 7


def inputs(device, batch_first, kind, unbatched=False):
    g = torch.Generator().manual_seed(1)
    shape = (lambda n: (n, E)) if unbatched else ((lambda n: (N, n, E)) if batch_first else (lambda n: (n, N, E)))
    q = torch.randn(*shape(L), generator=g).to(device)
    kv = torch.randn(*shape(S), generator=g).to(device)
    v = torch.randn(*shape(S), generator=g).to(device)
    if kind == "self":
        return q, q, q
    if kind == "kv":
        return q, kv, kv
    return q, kv, v


def masks(device, kind, self_attn, unbatched=False):
    """(attn_mask, key_padding_mask) of the given kind; no row is masked out entirely."""
    Ls = L if self_attn else S
    g = torch.Generator().manual_seed(2)
    if kind == "none":
        return None, None
    if kind == "causal_bool":
        assert self_attn
        return torch.triu(torch.ones(L, L, dtype=torch.bool), 1).to(device), None
    if kind == "float3d":
        return (0.5 * torch.randn((1 if unbatched else N) * H, L, Ls, generator=g)).to(device), None
    if kind == "padding":
        kp = torch.zeros(1 if unbatched else N, Ls, dtype=torch.bool)
        kp[..., Ls - 2:] = True
        return None, (kp[0] if unbatched else kp).to(device)
    raise ValueError(kind)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", ["self", "kv", "cross"])
@pytest.mark.parametrize("mask", ["none", "causal_bool", "float3d", "padding"])
def test_forward_and_exact_backward_match_nn(device, batch_first, kind, mask):
    # the forward is nn.MultiheadAttention's (same outputs and attention weights), and with hot.Config(exact=True)
    # every gradient (parameters and inputs) is its gradient: the projections are wired to the right parameters
    if mask == "causal_bool" and kind != "self":
        pytest.skip("a causal mask needs L == S")
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=batch_first).to(device)
    m = copy.deepcopy(ref)
    ht.convert(m, config=hot.Config(exact=True))
    assert type(m) is ht.MultiheadAttention
    am, kp = masks(device, mask, kind == "self")
    for need_weights, average in ((False, True), (True, True), (True, False)):
        q, k, v = inputs(device, batch_first, kind)
        outs, grads = [], []
        for mod in (ref, m):
            mod.zero_grad()
            if kind == "self":
                x = q.detach().clone().requires_grad_()
                args = (x, x, x)
            elif kind == "kv":
                x, y = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
                args = (x, y, y)
            else:
                args = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
            out, w = mod(*args, key_padding_mask=kp, need_weights=need_weights, attn_mask=am,
                         average_attn_weights=average)
            loss = (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum()
            if w is not None:
                loss = loss + (w * w).sum()
            loss.backward()
            outs.append((out.detach(), None if w is None else w.detach()))
            grads.append([p.grad.clone() for p in mod.parameters()] + [a.grad.clone() for a in args
                                                                         if a.grad is not None])
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
        assert (outs[1][1] is None) == (outs[0][1] is None) == (not need_weights)
        if need_weights:
            assert outs[1][1].shape == outs[0][1].shape
            torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-6)
        assert len(grads[0]) == len(grads[1])
        for a, b in zip(grads[1], grads[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_unbatched_and_no_bias(device):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, bias=False).to(device)
    m = copy.deepcopy(ref)
    ht.convert(m, config=hot.Config(exact=True))
    assert m.in_proj.bias is None and m.out_proj.bias is None
    q, k, v = inputs(device, False, "cross", unbatched=True)
    am, _ = masks(device, "float3d", False, unbatched=True)
    _, kp = masks(device, "padding", False, unbatched=True)
    for mask_args in (dict(attn_mask=am), dict(key_padding_mask=kp)):
        o_ref, w_ref = ref(q, k, v, **mask_args)
        o, w = m(q.requires_grad_(), k, v, **mask_args)
        assert o.shape == (L, E) and w.shape == (L, S)
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
        q.grad = None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_projection_gradients_are_hot_linear_backward(device, rounding):
    # self-attention at a HOT configuration: the in- and out-projections' weight gradients are exactly what a
    # hot.torch.Linear with those weights gives for the input it saw and the gradient that reached it (the same seed
    # draws: the projections run in the same order), so the attention module runs HOT's backward, not autograd's
    cfg = hot.Config(rounding=rounding)
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H, batch_first=True).to(device)
    ref = copy.deepcopy(m)
    ht.convert(m, config=cfg)
    seen = {}
    for name in ("in_proj", "out_proj"):
        mod = getattr(m, name)
        mod.register_forward_hook(lambda mod, a, out, name=name: seen.__setitem__(name + ".x", a[0].detach()))
        mod.register_full_backward_hook(lambda mod, gi, go, name=name: seen.__setitem__(name + ".g", go[0].detach()))
    x = torch.randn(N, L, E, device=device, requires_grad=True)
    torch.manual_seed(5)
    out, _ = m(x, x, x, need_weights=False)
    (out * out).sum().backward()
    lins = []
    for weight, bias in ((m.in_proj_weight, m.in_proj_bias), (m.out_proj.weight, m.out_proj.bias)):
        lin = ht.Linear(weight.shape[1], weight.shape[0], device=device, config=cfg)
        with torch.no_grad():
            lin.weight.copy_(weight)
            lin.bias.copy_(bias)
        lins.append(lin)
    # the same seed draws: one per projection's forward, in_proj first
    torch.manual_seed(5)
    for lin, (name, weight, bias) in zip(lins, (("in_proj", m.in_proj_weight, m.in_proj_bias),
                                                ("out_proj", m.out_proj.weight, m.out_proj.bias))):
        lin(seen[name + ".x"]).backward(seen[name + ".g"])
        assert torch.equal(lin.weight.grad, weight.grad), name
        torch.testing.assert_close(lin.bias.grad, bias.grad, rtol=1e-5, atol=1e-6)
    # and it is not autograd's exact gradient
    xr = x.detach().clone().requires_grad_()
    out, _ = ref(xr, xr, xr, need_weights=False)
    (out * out).sum().backward()
    assert not torch.equal(ref.in_proj_weight.grad, m.in_proj_weight.grad)
    assert not torch.equal(ref.out_proj.weight.grad, m.out_proj.weight.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_attention_hot_gradients_close_to_exact(device):
    # cross-attention projects query and key / value with the rows of the packed weight they need; at the default
    # configuration the gradients are HOT's (not exact, bit for bit) and close to exact (8-bit, full rank)
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True).to(device)
    m = copy.deepcopy(ref)
    ht.convert(m)
    q, kv, _ = inputs(device, True, "kv")
    q = torch.cat([q] * 8, 1)  # 80 query rows, 56 key rows per sequence
    kv = torch.cat([kv] * 8, 1)
    for mod in (ref, m):
        out, _ = mod(q, kv, kv, need_weights=False)
        (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
    for (name, p), p_ref in zip(m.named_parameters(), ref.parameters()):
        if p.dim() != 2:
            continue
        err = float((p.grad - p_ref.grad).norm() / p_ref.grad.norm())
        assert 0 < err < 0.1, (name, err)


def test_state_dict_parameters_and_report():
    torch.manual_seed(0)
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 64, batch_first=True, dropout=0.0), 2)
    m = copy.deepcopy(ref)
    params = list(m.parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    report = ht.convert(m)
    names = {n for n, _, _ in report.converted}
    assert {"layers.0.self_attn.in_proj", "layers.0.self_attn.out_proj", "layers.1.linear2"} <= names
    attn = m.layers[0].self_attn
    assert attn.in_proj.weight is attn.in_proj_weight and attn.in_proj.bias is attn.in_proj_bias
    assert list(m.parameters()) == params  # the same objects, once each (the optimizer's)
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(m.state_dict()) == list(ref.state_dict())
    m.load_state_dict(ref.state_dict(), strict=True)
    fresh = copy.deepcopy(ref)
    fresh.load_state_dict(m.state_dict(), strict=True)
    # a calibrated in-projection's state travels under its own key, and loads back
    attn.in_proj.set_lqs("token")
    sd = m.state_dict()
    assert "layers.0.self_attn.in_proj._extra_state" in sd
    assert "layers.0.self_attn.in_proj.weight" not in sd
    m2 = copy.deepcopy(ref)
    ht.convert(m2)
    m2.load_state_dict(sd, strict=True)
    assert m2.layers[0].self_attn.in_proj.hot_config.gx_scale == "token"
    # training through the converted encoder moves the shared parameters
    x = torch.randn(4, 12, E)
    before = attn.in_proj_weight.detach().clone()
    m(x).square().mean().backward()
    opt.step()
    assert not torch.equal(before, attn.in_proj_weight.detach())
    # inference (no gradients): nn.MultiheadAttention's own forward, fast path included; the same outputs as exact
    m.eval()
    ref.eval()
    ref.load_state_dict({k: v for k, v in m.state_dict().items() if not k.endswith("_extra_state")}, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x))


def test_converting_twice_and_partial_selection():
    torch.manual_seed(0)
    m = nn.Sequential(nn.MultiheadAttention(E, H))
    ht.convert(m, exclude="0.in_proj")
    assert type(m[0]) is ht.MultiheadAttention
    assert type(m[0].in_proj) is nn.Linear and type(m[0].out_proj) is ht.Linear
    with pytest.warns(UserWarning, match="already a HOT layer"):
        rep = ht.convert(m)
    assert any(n == "0" and "already" in why for n, _, why in rep.skipped)
    x = torch.randn(L, N, E, requires_grad=True)
    m[0](x, x, x)[0].sum().backward()
    assert m[0].in_proj_weight.grad is not None
    with pytest.raises(ValueError, match="no eligible layer"):
        ht.convert(nn.Sequential(nn.MultiheadAttention(E, H)), exclude="0.*")


def test_bad_input_errors():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H, batch_first=True)
    ht.convert(m)
    x = torch.randn(N, L, E, requires_grad=True)
    with pytest.raises(ValueError, match="embed_dim=32"):
        m(x[..., :16], x[..., :16], x[..., :16])
    with pytest.raises(ValueError, match="3-D .batched. or all"):
        m(x, x[0], x[0])
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        m(x, x, x, attn_mask=torch.zeros(L + 1, L))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        m(x, x, x, key_padding_mask=torch.zeros(N, L + 1, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="is_causal"):
        m(x, x, x, is_causal=True)
    with pytest.raises(TypeError, match="bool or floating"):
        m(x, x, x, attn_mask=torch.zeros(L, L, dtype=torch.int64))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    # under torch.compile (fullgraph, no graph break) the converted attention runs the same HOT backward (nearest
    # rounding: the same integers) as eagerly
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(E, H, batch_first=True).to(device)
    head = nn.Linear(E, 5).to(device)
    model = nn.ModuleDict({"attn": attn, "head": head})
    ht.convert(model, hot.Config(rounding="nearest"))
    x = torch.randn(N, L, E, device=device)
    kp = torch.zeros(N, L, dtype=torch.bool, device=device)
    kp[:, -2:] = True
    y = torch.randint(0, 5, (N,), device=device)

    def step(x, y):
        a, _ = model["attn"](x, x, x, key_padding_mask=kp, need_weights=False)
        return torch.nn.functional.cross_entropy(model["head"](a.mean(1)), y)

    assert_compiles_like_eager(model, step, x, y)
