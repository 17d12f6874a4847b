"""hot.experiments.analysis: per-layer gradient fidelity of HOT and of the baselines it is compared with."""
import math

import dataclasses
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hot  # noqa: E402
import hot.experiments.analysis as ha  # noqa: E402


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):
        h = F.relu(self.conv(x))  # B x 8 x 6 x 6
        h = h.flatten(2).transpose(1, 2)  # B x 36 x 8: tokens
        return self.fc2(F.gelu(self.fc1(h))).mean(1)


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model = TinyNet()
    x = torch.randn(16, 1, 6, 6)
    y = torch.randint(0, 5, (16,))
    return model, (x, y), ha.capture(model, (x, y), F.cross_entropy)


def test_capture_matches_autograd(captured):
    model, (x, y), caps = captured
    assert [c.name for c in caps] == ["conv", "fc1", "fc2"]
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for c in caps:
        mod = dict(model.named_modules())[c.name]
        gw = c.gy.astype(np.float64).T @ c.x.astype(np.float64)
        ref = mod.weight.grad.reshape(mod.weight.shape[0], -1).double().numpy()
        np.testing.assert_allclose(gw, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())


def _check_against_autograd(model, batch, loss_fn, caps):
    """Each capture's g_yᵀ x and g_y W are the layer's weight gradient and (for a Linear) its input's gradient."""
    model.zero_grad()
    loss_fn(model(batch[0]), batch[1]).backward()
    for c in caps:
        mod = model.get_submodule(c.name)
        gw = c.gy.astype(np.float64).T @ c.x.astype(np.float64)
        ref = mod.weight.grad.reshape(mod.weight.shape[0], -1).double().numpy()
        np.testing.assert_allclose(gw, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())


CONV_PADDINGS = [dict(padding="same", kernel_size=2), dict(padding="valid", kernel_size=3),
                 dict(padding=1, kernel_size=3, padding_mode="reflect"),
                 dict(padding=(1, 2), kernel_size=3, padding_mode="circular"),
                 dict(padding="same", kernel_size=3, dilation=2, padding_mode="replicate")]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("conv", CONV_PADDINGS, ids=["same_even", "valid", "reflect", "circular", "same_replicate"])
def test_capture_of_conv_padding_modes_matches_autograd(conv, unbatched):
    """Columns padded as nn.Conv2d pads: string padding (asymmetric 'same' included), any padding_mode, and
    unbatched (C, H, W) input."""
    torch.manual_seed(2)
    model = nn.Conv2d(3, 4, **conv)
    x = torch.randn((3, 7, 6) if unbatched else (2, 3, 7, 6))
    loss_fn = lambda out, t: (out * t).sum()  # noqa: E731
    with torch.no_grad():
        target = torch.randn(model(x).shape)
    caps = ha.capture(model, (x, target), loss_fn)
    assert [c.name for c in caps] == [""]
    _check_against_autograd(model, (x, target), loss_fn, caps)


def test_capture_skips_a_frozen_first_layer():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model[0].requires_grad_(False)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    caps = ha.capture(model, batch, F.cross_entropy)
    assert [c.name for c in caps] == ["2"]  # no gradient reaches layer 0's output
    _check_against_autograd(model, batch, F.cross_entropy, caps)


def test_capture_of_a_converted_model_is_exact():
    """A model converted by hot.torch.convert is captured with exact gradients: the same x, W, g_y as the original."""
    import copy

    import hot.torch as ht

    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    converted = copy.deepcopy(model)
    ht.convert(converted)
    assert isinstance(converted[5], ht.Linear) and isinstance(converted[0], ht.Conv2d)
    batch = (torch.randn(8, 3, 6, 6), torch.randint(0, 4, (8,)))
    ref, got = ha.capture(model, batch, F.cross_entropy), ha.capture(converted, batch, F.cross_entropy)
    assert [c.name for c in got] == [c.name for c in ref] == ["0", "3", "5"]
    for r, g in zip(ref, got):
        for a, b in ((r.x, g.x), (r.w, g.w), (r.gy, g.gy)):
            np.testing.assert_array_equal(a, b)
    assert all(m._hot_capture is None for m in converted.modules() if hasattr(m, "_hot_capture"))


def test_capture_refuses_a_layer_called_twice():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.fc(self.fc(x)))

    with pytest.raises(ValueError, match="fidelity: layer 'fc' \\(Linear\\) is called more than once per forward"):
        ha.capture(Shared(), (torch.randn(8, 16), torch.randint(0, 4, (8,))), F.cross_entropy)


def test_metrics_and_orderings(captured):
    _, _, caps = captured
    rep = ha.fidelity_of_captures(caps, seed=3)
    for r in rep.rows:
        for v in (r.gx_cos, r.gx_rel, r.gw_cos, r.gw_rel):
            assert math.isfinite(v)
        assert -1.0 <= r.gx_cos <= 1.0 + 1e-9 and -1.0 <= r.gw_cos <= 1.0 + 1e-9
    for layer in rep.layers:
        # g_x does not depend on the HLA rank; HQ-only is HOT at rank 16.
        assert rep.get(layer, "hot-r2").gx_rel == rep.get(layer, "hot-r16").gx_rel
        assert rep.get(layer, "hq-only").gw_rel == rep.get(layer, "hot-r16").gw_rel
        # Full rank (16) keeps every component: only 8-bit quantisation error remains, which is below the
        # error of the rank-2 projection plus quantisation, and below 4-bit naive quantisation.
        assert rep.get(layer, "hot-r16").gw_rel < rep.get(layer, "hot-r2").gw_rel
        assert rep.get(layer, "hq-only").gw_rel < rep.get(layer, "naive-int4").gw_rel
    md = rep.to_markdown()
    assert all(layer in md for layer in rep.layers) and "naive-int4" in md


def test_lbp_wht_is_the_float_projection(captured):
    _, _, caps = captured
    c = caps[1]
    gx, gw = ha.method_fn("lbp-wht")(c.x, c.w, c.gy, 0)
    # Explicit float64 projector P = blockdiag(ĤᵀĤ/16) over zero-padded token blocks.
    L = c.gy.shape[0]
    H = np.array([[1.0]])
    while H.shape[0] < 16:
        H = np.block([[H, H], [H, -H]])
    Hh = H[list(ha.HLA_ORDER[:8])]
    P16 = Hh.T @ Hh / 16
    Lp = (L + 15) // 16 * 16
    P = np.kron(np.eye(Lp // 16), P16)[:L, :L]
    gy, x, w = (a.astype(np.float64) for a in (c.gy, c.x, c.w))
    np.testing.assert_allclose(gw, gy.T @ P @ x, rtol=1e-4, atol=1e-5 * np.abs(gw).max())
    np.testing.assert_allclose(gx, P @ gy @ w, rtol=1e-4, atol=1e-5 * np.abs(gx).max())


def test_lqs_choice_prefers_token_scales_for_rows_of_different_magnitude():
    rng = np.random.default_rng(0)
    gy = rng.standard_normal((64, 32)).astype(np.float32) * np.logspace(-3, 0, 64, dtype=np.float32)[:, None]
    assert ha.lqs_choice(gy) == "token"
    assert ha.lqs_choice(rng.standard_normal((64, 32)).astype(np.float32)) == "tensor"


def test_gxcodes_is_exact_where_its_quantisation_is():
    """hot-gxcodes rests on g_yᵀ x = blockdiag(H_b) G̃ᵀ x / b and on g_x = G̃ W̃ / b: with G̃ = g_y blockdiag(H_16), W̃
    and x integers of amax 127 (scales 1, every rounding exact), both gradients are the exact products, and its g_x is
    the default's to a rounding."""
    rng = np.random.default_rng(5)
    L, O, I = 48, 32, 24
    h16 = np.asarray(hot.hadamard_transform(np.eye(16, dtype=np.float32), block=16, axis=0), dtype=np.float64)
    hb = np.kron(np.eye(O // 16), h16)
    gt = rng.integers(-127, 128, (L, O)).astype(np.float64)
    gt[0, 0] = 127
    wt = rng.integers(-127, 128, (O, I)).astype(np.float64)
    wt[1, 2] = -127
    x = rng.integers(-127, 128, (L, I)).astype(np.float32)
    x[3, 4] = 127
    gy = (gt @ hb / 16).astype(np.float32)  # dyadic: exact, and gy H_16 = gt exactly
    w = (hb @ wt / 16).astype(np.float32)
    gx, gw = ha.method_fn("hot-gxcodes")(x, w, gy, 7)
    np.testing.assert_allclose(np.asarray(gx, dtype=np.float64), gy.astype(np.float64) @ w, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gw, dtype=np.float64), gy.astype(np.float64).T @ x, rtol=0, atol=1e-6)
    gx_hot, _ = ha.method_fn("hot")(x, w, gy, 7)
    np.testing.assert_allclose(np.asarray(gx_hot, dtype=np.float64), np.asarray(gx, dtype=np.float64), rtol=1e-6)


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="hot-r99"):
        ha.method_fn("hot-r99")


def test_plot_writes_png(captured, tmp_path):
    pytest.importorskip("matplotlib")
    _, _, caps = captured
    rep = ha.fidelity_of_captures(caps, methods=("naive-int4", "hot"))
    path = tmp_path / "fid.png"
    rep.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_single_path_methods_isolate_one_path(captured):
    _, _, caps = captured
    for c in caps:
        gx_ref = c.gy.astype(np.float64) @ c.w.astype(np.float64)
        gw_ref = c.gy.astype(np.float64).T @ c.x.astype(np.float64)
        gx_h, gw_h = ha.method_fn("paper")(c.x, c.w, c.gy, 7)
        gx_a, gw_a = ha.method_fn("hot-gx-only")(c.x, c.w, c.gy, 7)
        gx_b, gw_b = ha.method_fn("hot-gw-only")(c.x, c.w, c.gy, 7)
        gx_e, gw_e = ha.method_fn("exact")(c.x, c.w, c.gy, 7)
        # The same seed gives the same stochastic rounding: each single-path method reproduces HOT's path bit
        # for bit and the exact product (rounded to float32) on the other one.
        np.testing.assert_array_equal(np.asarray(gx_a), np.asarray(gx_h))
        np.testing.assert_array_equal(np.asarray(gw_b), np.asarray(gw_h))
        np.testing.assert_array_equal(gw_a, gw_ref.astype(np.float32))
        np.testing.assert_array_equal(gx_b, gx_ref.astype(np.float32))
        np.testing.assert_array_equal(gx_e, gx_ref.astype(np.float32))
        np.testing.assert_array_equal(gw_e, gw_ref.astype(np.float32))
    rep = ha.fidelity_of_captures(caps, methods=("paper", "hot-gx8", "hot-gx8-r16", "hot-token", "hot", "hot-gxcodes"),
                                  seed=1)
    kinds = {c.name: c.kind for c in caps}
    for layer in rep.layers:
        # 8-bit g_x: 16x finer steps than 4-bit, so a far smaller error (same Hadamard transform).
        assert rep.get(layer, "hot-gx8").gx_rel < 0.5 * rep.get(layer, "paper").gx_rel
        assert rep.get(layer, "hot-gx8").gw_rel == rep.get(layer, "paper").gw_rel
        # Full rank has no projection error, only 8-bit quantisation (~5 % here); rank 8 also drops the 8 highest
        # sequencies of each 16-row block, most of its error on the conv (0.68) and fc1 (0.16) captures. fc2 has one
        # block of 16 rows and 5 outputs: what rank 8 drops is below the quantisation noise, and rank 16's 16 quantised
        # rows per block come out no better there (48 seeds: 0.0326 against 0.0308), so no order is asserted for it.
        if layer != "fc2":
            assert rep.get(layer, "hot-gx8-r16").gw_rel < 0.5 * rep.get(layer, "paper").gw_rel
        # hot's default is 8-bit g_x at full rank: the same numbers as hot-gx8-r16, but on a convolution, whose g_w
        # comes from G~'s codes (SPEC §4): hot-gxcodes' numbers there
        same = "hot-gxcodes" if kinds[layer] == "conv2d" else "hot-gx8-r16"
        assert rep.get(layer, "hot") == dataclasses.replace(rep.get(layer, same), method="hot")
    assert "conv2d" in kinds.values()


def test_cli_fidelity_writes_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("sklearn")
    from hot.cli import main

    out = tmp_path / "fid"
    assert main(["fidelity", "--model", "vit", "--batch", "16", "--trained-steps", "0", "--methods",
                 "naive-int4,lbp-wht,hot", "--out", str(out)]) == 0
    md = (out / "fidelity.md").read_text()
    assert "blocks.0.attn.qkv" in md and "naive-int4" in md and "HOT closer to exact than" in md
    assert (out / "fidelity.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["fidelity", "--methods", "nope", "--out", str(out)]) == 2
