"""hot.torch.convert / summary / calibrate (LQS) / state_dict / LoRA."""
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot
import hot.torch as ht
from hot.experiments import models


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.nobias = nn.Linear(32, 32, bias=False)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, groups=8)
        self.grouped = nn.Conv2d(8, 8, 1, groups=2)
        self.reflect = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
        self.same_even = nn.Conv2d(8, 8, 2, padding="same")
        self.same_odd = nn.Conv2d(8, 8, 3, padding="same")
        self.conv1d = nn.Conv1d(4, 4, 3)
        self.conv3d = nn.Conv3d(4, 4, 3)
        self.mha = nn.MultiheadAttention(16, 2)
        self.mha_kdim = nn.MultiheadAttention(16, 2, kdim=8, vdim=8)
        self.mha_bias_kv = nn.MultiheadAttention(16, 2, add_bias_kv=True)
        self.head = nn.Linear(32, 10)
        self.f64 = nn.Linear(4, 4).double()


def test_report_lists_every_layer_with_reason():
    m = Mixed()
    w_before = m.fc.weight
    report = ht.convert(m, exclude="head")
    conv = {n for n, _, _ in report.converted}
    skipped = {n: why for n, _, why in report.skipped}
    assert conv == {"fc", "nobias", "conv", "same_odd", "conv1d", "mha.in_proj", "mha.out_proj"}
    assert "depthwise" in skipped["dw"] and "grouped" in skipped["grouped"]
    assert "padding_mode" in skipped["reflect"]
    assert "asymmetric" in skipped["same_even"]
    assert "not supported" in skipped["conv3d"] and type(m.conv1d) is ht.Conv1d
    assert "kdim / vdim" in skipped["mha_kdim"] and "add_bias_kv" in skipped["mha_bias_kv"]
    assert type(m.mha_kdim) is nn.MultiheadAttention and type(m.mha_kdim.out_proj) is not ht.Linear
    assert type(m.mha) is ht.MultiheadAttention and isinstance(m.mha.in_proj, ht.Linear)
    assert "excluded" in skipped["head"]
    assert "float64" in skipped["f64"]
    assert isinstance(m.fc, ht.Linear) and isinstance(m.fc, nn.Linear) and m.fc.weight is w_before
    assert m.nobias.bias is None
    assert type(m.head) is nn.Linear and type(m.dw) is nn.Conv2d
    text = str(report)
    for name in ["fc", "dw", "reflect", "mha.out_proj", "mha_kdim", "head", "f64"]:
        assert name in text
    # same_odd: 'same' padding became explicit (1, 1) and still matches nn.Conv2d
    x = torch.randn(2, 8, 5, 5, requires_grad=True)
    ref = F.conv2d(x, m.same_odd.weight, m.same_odd.bias, padding=1)
    torch.testing.assert_close(m.same_odd(x), ref)
    m.same_odd(x).sum().backward()


def test_include_and_predicate():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))
    rep = ht.convert(m, include=lambda name, mod: mod.out_features == 8, exclude=["0"])
    assert [n for n, _, _ in rep.converted] == ["2"]
    assert {n: w for n, _, w in rep.skipped} == {"0": "excluded by name/predicate", "3": "not matched by include"}


def test_nothing_eligible_raises_and_reconvert_warns():
    with pytest.raises(ValueError, match="no eligible layer"):
        ht.convert(nn.Sequential(nn.ReLU(), nn.Conv2d(4, 4, 3, groups=4)))
    m = nn.Sequential(nn.Linear(4, 4))
    ht.convert(m)
    with pytest.warns(UserWarning, match="already"):
        ht.convert(m)
    with pytest.raises(TypeError, match="hot.Config"):
        ht.convert(nn.Linear(4, 4), config="fast")


def test_root_module_and_state_dict_keys_unchanged():
    lin = nn.Linear(8, 8)
    keys = list(lin.state_dict())
    ht.convert(lin)
    assert isinstance(lin, ht.Linear) and list(lin.state_dict()) == keys
    # a plain nn.Linear checkpoint loads strictly into the converted layer
    lin.load_state_dict(nn.Linear(8, 8).state_dict(), strict=True)


def _model():
    torch.manual_seed(0)
    return models.build("vit", dim=32, depth=1, heads=2, mlp=64)


def test_lqs_choice_rule_and_state_dict_round_trip():
    m = _model()
    ht.convert(m)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    res = ht.lqs(m, (x, y), F.cross_entropy)
    assert all(p.grad is None for p in m.parameters())  # calibration leaves .grad alone
    names = {n for n, _ in ht.hot_layers(m)}
    assert set(res) == names
    for name, r in res.items():
        assert r["choice"] == ("token" if r["e_token"] < 0.5 * r["e_tensor"] else "tensor")
        layer = m.get_submodule(name)
        assert layer.hot_config.gx_scale == r["choice"]
    # the measured errors are those of 4-bit RTN on g_y . blockdiag(H_16): recompute one layer by hand
    layer = m.head
    caps = []
    layer._hot_capture = caps
    out = m(x)
    layer._hot_capture = None
    (g,) = torch.autograd.grad(F.cross_entropy(out, y), [yy for _, yy in caps])
    e_ten, e_tok = ht.lqs_errors(g)
    assert e_ten == pytest.approx(res["head"]["e_tensor"], rel=1e-6)
    assert e_tok == pytest.approx(res["head"]["e_token"], rel=1e-6)
    # force a known mix so the round trip is meaningful
    m.blocks[0].fc1.set_lqs("token", 1.0, 0.1)
    m.blocks[0].fc2.set_lqs("tensor", 1.0, 0.9)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert "blocks.0.fc1._extra_state" in sd
    m2 = _model()
    ht.convert(m2)
    m2.load_state_dict(sd, strict=True)
    for (n1, l1), (n2, l2) in zip(ht.hot_layers(m), ht.hot_layers(m2)):
        assert l1.hot_config == l2.hot_config and l1.hot_lqs == l2.hot_lqs, n1
    assert m2.blocks[0].fc1.hot_config.gx_scale == "token"
    # an uncalibrated model's state_dict has the plain keys and loads into the calibrated one
    m3 = _model()
    ht.convert(m3)
    assert not any(k.endswith("_extra_state") for k in m3.state_dict())
    m2.load_state_dict(m3.state_dict(), strict=True)


@pytest.mark.parametrize("kind", ["linear_nhwc", "conv_unbatched", "conv_batched"])
def test_lqs_takes_the_output_dim_by_layer_type(kind):
    """O is a Linear's last dim, also on an (N, H, W, C) input, and a Conv2d's dim 1, or dim 0 unbatched: calibrate
    measures the L x O rows of g_y, as computed here directly from SPEC §7.1."""
    torch.manual_seed(3)
    layer, x = {"linear_nhwc": (nn.Linear(16, 32), torch.randn(2, 3, 5, 16)),
                "conv_unbatched": (nn.Conv2d(3, 16, 3), torch.randn(3, 10, 12)),
                "conv_batched": (nn.Conv2d(3, 16, 3), torch.randn(2, 3, 10, 12))}[kind]
    ht.convert(layer)
    with torch.no_grad():
        gy = torch.randn(layer(x).shape)
    gy *= torch.rand(gy.shape[:-1]).unsqueeze(-1) * 10  # rows of different magnitude along the last dim
    res = ht.lqs(layer, x, lambda y: (y * gy).sum())[""]  # the loss's g_y is gy
    o_dim = {"linear_nhwc": -1, "conv_unbatched": 0, "conv_batched": 1}[kind]
    rows = gy.movedim(o_dim, -1).reshape(-1, gy.shape[o_dim]).contiguous()
    gt = hot.hadamard_transform(rows, block=16)
    for mode in ("tensor", "token"):
        q, s = hot.quantize(gt, bits=4, scale=mode, rounding="nearest")
        err = torch.linalg.vector_norm((gt - hot.dequantize(q, s)).double()).item()
        assert res[f"e_{mode}"] == pytest.approx(err, rel=1e-6), mode


BAD_EXTRA = [({"config": {"rank": 99}, "lqs": None}, "rank must be an integer in 1..16, got 99"),
             ({"config": {"foo": 1}, "lqs": None}, r"unknown fields \['foo'\]"),
             ("junk", "expected a dict"), ({"lqs": None}, "expected a dict"),
             ({"config": {"rank": 4}, "lqs": "x"}, "got 'lqs': 'x'")]


@pytest.mark.parametrize("extra,match", BAD_EXTRA, ids=["bad_rank", "unknown_field", "not_a_dict", "no_config",
                                                        "lqs_not_a_dict"])
def test_malformed_extra_state_is_named_and_loads_nothing_into_the_layer(extra, match):
    m = nn.Sequential(nn.Linear(8, 4))
    ht.convert(m)
    w0, cfg0 = m[0].weight.detach().clone(), m[0].hot_config
    sd = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}  # weights that would change the layer
    sd["0._extra_state"] = extra
    with pytest.raises(RuntimeError, match=r"0\._extra_state: .*" + match):
        m.load_state_dict(sd)
    assert torch.equal(m[0].weight, w0) and m[0].hot_config == cfg0 and m[0].hot_lqs is None


def test_token_scale_is_used_in_backward(monkeypatch):
    # The layers reach the engine through hot._C.backward_linear; its 10th argument is the whole hot.Config.
    seen = []
    real = hot._C.backward_linear
    monkeypatch.setattr(hot._C, "backward_linear", lambda *a: (seen.append(a[9].gx_scale), real(*a))[1])
    layer = ht.Linear(16, 16)
    layer.set_lqs("token")
    layer(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert seen == ["token"]


def test_summary_table():
    m = _model()
    ht.convert(m)
    buf = io.StringIO()
    text = ht.summary(m, torch.randn(32, 1, 8, 8), file=buf)
    assert "blocks.0.fc1" in text and "int8 tensor" in text and "int8 full rank" in text and "default" in text
    fc1 = m.blocks[0].fc1
    hot_b, exact_b, unit = ht.summary.__globals__["kept_bytes"](fc1)
    L = 32 * 16  # 16 patch tokens per 8x8 image (mean pooling, no class token)
    assert unit == "batch" and exact_b == L * 32 * 4
    assert hot_b == 32 * ((((L + 15) // 16 * 16) + 15) // 16 * 16) + 4  # rank 16: L_pad int8 rows
    ht.convert(m := _model(), hot.Config.paper())
    text = ht.summary(m, torch.randn(32, 1, 8, 8), file=io.StringIO())
    assert "int4 tensor" in text and "int8 HLA r=8" in text and "paper" in text
    hot_b, _, _ = ht.summary.__globals__["kept_bytes"](m.blocks[0].fc1)
    assert hot_b == 32 * ((((L + 15) // 16 * 8) + 15) // 16 * 16) + 4
    assert "total kept for backward" in text
    m2 = _model()
    ht.convert(m2)
    assert "per token" in ht.summary(m2, file=io.StringIO())


class LoraLinear(nn.Module):
    """The structure of peft's lora.Linear: base_layer plus lora_A / lora_B ModuleDicts."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        nn.init.normal_(self.lora_B["default"].weight)
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def _check_lora(model, base_names, adapter_names):
    rep = ht.convert(model)
    conv = {n for n, _, _ in rep.converted}
    skipped = {n: w for n, _, w in rep.skipped}
    for n in base_names:
        assert n in conv
        assert isinstance(model.get_submodule(n), ht.Linear)
    for n in adapter_names:
        assert "LoRA adapter" in skipped[n]
        assert type(model.get_submodule(n)) is nn.Linear
    return rep


def test_lora_equivalent_module():
    torch.manual_seed(0)
    model = nn.Sequential(LoraLinear(nn.Linear(16, 32)), nn.ReLU(), LoraLinear(nn.Linear(32, 8)))
    _check_lora(model, ["0.base_layer", "2.base_layer"], ["0.lora_A.default", "0.lora_B.default"])
    x = torch.randn(10, 16, requires_grad=True)
    int8 = []
    # ABC buffers are 2-D int8 (I x K_pad); the ReLU's mask (keep_less) is a 1-D int8 vector
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: (int8.append(t.dtype == torch.int8 and t.dim() == 2 and t.numel() > 0), t)[1], lambda t: t):
        out = model(x)
    assert not any(int8)  # frozen base weights keep nothing
    out.sum().backward()
    assert model[0].base_layer.weight.grad is None
    assert model[0].lora_A["default"].weight.grad is not None and x.grad is not None


def test_lora_with_peft():
    peft = pytest.importorskip("peft")

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(16, 16)
            self.v = nn.Linear(16, 16)
            self.out = nn.Linear(16, 4)

        def forward(self, x):
            return self.out(F.relu(self.q(x) + self.v(x)))

    torch.manual_seed(0)
    model = peft.get_peft_model(Tiny(), peft.LoraConfig(r=4, target_modules=["q", "v"], lora_alpha=8))
    rep = ht.convert(model, exclude="*.out")
    conv = {".".join(n.split(".")[-2:]) for n, _, _ in rep.converted}
    assert conv == {"q.base_layer", "v.base_layer"}, rep
    assert sum("LoRA adapter" in w for _, _, w in rep.skipped) == 4
    x = torch.randn(8, 16)
    model(x).sum().backward()
    base = model.base_model.model.q.base_layer
    assert isinstance(base, ht.Linear) and base.weight.grad is None
    assert model.base_model.model.q.lora_A["default"].weight.grad is not None


def test_transformers_conv1d_without_a_2d_weight_is_reported():
    # transformers' Conv1D converts (tests/torch/test_transposed.py); one whose weight is not a matrix is listed with
    # the reason
    Conv1D = type("Conv1D", (nn.Module,), {"__module__": "transformers.pytorch_utils",
                                           "forward": lambda self, x: x @ self.weight})
    c = Conv1D()
    c.weight = nn.Parameter(torch.randn(8, 24, 1))
    c.bias = None
    m = nn.Sequential(c, nn.Linear(24, 4))
    rep = ht.convert(m)
    assert [n for n, _, _ in rep.converted] == ["1"]
    assert [(n, t) for n, t, _ in rep.skipped] == [("0", "Conv1D")]
    assert "2-D weight" in rep.skipped[0][2] and type(m[0]) is Conv1D
