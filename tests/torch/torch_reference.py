"""Float64 reference of the HOT backward (SPEC §3-§5), error bounds for round-to-nearest, and saved_during (the
tensors autograd keeps while a function runs).

With nearest rounding every dequantised value is within s/2 of the value it quantises (SPEC §5), so
for a product of two quantised operands A~ = A + dA, B~ = B + dB (|dA| <= s_a/2, |dB| <= s_b/2):
|A~ B~ - A B| <= |dA||B| + |A||dB| + |dA||dB| elementwise, summed over the contraction. These bounds
are exact consequences of the quantiser definition; the tests add a small relative slack for the fp32
arithmetic of the engine (transforms and scales are computed in fp32).
"""
from __future__ import annotations

import torch

ORDER = [0, 8, 2, 12, 10, 3, 4, 14, 11, 1, 6, 15, 9, 7, 13, 5]


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def block_size(O: int) -> int:
    b = 16
    while b > 1 and O % b:
        b //= 2
    return b


def hla64(x: torch.Tensor, rank: int) -> torch.Tensor:
    """Rows of blockdiag(H^) x for x (L x C), float64."""
    x = x.double()
    L, C = x.shape
    Lp = (L + 15) // 16 * 16
    xp = torch.zeros(Lp, C, dtype=torch.float64)
    xp[:L] = x
    Hh = hadamard(16)[ORDER[:rank]]
    return torch.einsum("rk,bkc->brc", Hh, xp.view(-1, 16, C)).reshape(-1, C)


def gx_reference(g: torch.Tensor, w: torch.Tensor, bits: int, per_token: bool):
    """(exact g_x, bound) for g (L x O), w (O x I), nearest rounding, float64."""
    g, w = g.double(), w.double()
    O = w.shape[0]
    b = block_size(O)
    Hb = hadamard(b)
    Gt = (g.reshape(g.shape[0], O // b, b) @ Hb).reshape(g.shape)
    Wt = (Hb @ w.reshape(O // b, b, -1)).reshape(w.shape)
    qmax = 2 ** (bits - 1) - 1
    s_w = Wt.abs().max() / qmax
    s_g = (Gt.abs().amax(1, keepdim=True) if per_token else Gt.abs().max()) / qmax
    exact = g @ w
    bound = (s_g / 2 * Wt.abs().sum(0, keepdim=True) + (Gt.abs().sum(1, keepdim=True) * s_w / 2)
             + O * s_g * s_w / 4) / b
    mag = (Gt.abs() @ Wt.abs()) / b
    return exact, bound, mag


def gw_reference(g: torch.Tensor, x: torch.Tensor, rank: int):
    """(g_y^T P x, bound, magnitude) for g (L x O), x (L x I), 8-bit nearest, float64."""
    Gh = hla64(g, rank)
    Xh = hla64(x, rank)
    s_g = Gh.abs().max() / 127
    s_x = Xh.abs().max() / 127
    proj = Gh.t() @ Xh / 16
    K = Gh.shape[0]
    bound = (s_g / 2 * Xh.abs().sum(0, keepdim=True) + Gh.abs().sum(0)[:, None] * s_x / 2 + K * s_g * s_x / 4) / 16
    mag = Gh.abs().t() @ Xh.abs() / 16
    return proj, bound, mag


def check_bound(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, mag: torch.Tensor, rel: float = 1e-4,
                what: str = ""):
    """|got - ref| <= bound * (1 + 1e-3) + rel * mag + tiny, elementwise; raises AssertionError with details."""
    err = (got.double() - ref).abs()
    lim = bound * (1 + 1e-3) + rel * mag + 1e-12
    bad = err > lim
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements exceed the derived bound; first at "
                             f"flat index {i}: err {err.flatten()[i]:.3e} > bound {lim.flatten()[i]:.3e}")
    return float((err / lim).max())


def saved_during(fn):
    """The tensors autograd saves while fn() runs (saved_tensors_hooks), and fn's result."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


def assert_compiles_like_eager(model, step, *args):
    """step(*args) (a scalar loss of model) traces under torch.compile in one graph without breaks, and its gradients
    through the aot_eager backend equal the eager ones (nearest rounding: the same integers): the model's parameters'
    and those of the arguments that require a gradient."""
    import torch._dynamo as dynamo

    leaves = list(model.parameters()) + [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    dynamo.reset()
    explain = dynamo.explain(step)(*args)
    assert explain.graph_break_count == 0, explain.break_reasons
    for t in leaves:
        t.grad = None
    torch.compile(step, fullgraph=True, backend="aot_eager")(*args).backward()
    compiled = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    step(*args).backward()
    for a, t in zip(compiled, leaves):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-5)
