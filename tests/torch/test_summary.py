"""hot.torch.cost / hot.torch.summary(cost=True) / hot summary MODEL (issue 20): operation counts by hand, kept bytes
against the saved-tensor hooks of a real forward, the formats, the plot, the command."""
import copy
import csv
import io

import pytest
import torch
import torch.nn as nn

import hot
import hot.torch as ht
from hot.__main__ import main
from hot.torch import cost

PAPER = hot.Config.paper()
DEFAULT = hot.Config()


# ---------------------------------------------------------------------------------------------------------------
# operation counts, by hand
# ---------------------------------------------------------------------------------------------------------------
def test_vanilla_backward_is_4LIO():
    ex = cost.exact_ops(49, 1792, 448)
    assert ex.fp == 157_351_936 == 4 * 49 * 1792 * 448
    assert ex.int8 == ex.int4 == ex.overhead_total == 0
    assert ex.bops == 2 * 49 * 448 * 1792 * 32 * 32 == cost.paper_bops(49, 448, 1792, scheme="FP")
    assert cost.exact_ops(49, 1792, 448, need_gx=False).fp == 78_675_968  # g_w only (a first layer)
    assert cost.exact_ops(49, 1792, 448, need_gw=False).fp == 78_675_968  # g_x only (a frozen weight)
    assert cost.exact_ops(10, 20, 30, fp_bits=16).bops == 2 * 10 * 20 * 30 * 16 * 16  # bf16 GEMMs


def test_efficientformer_l1_stage3_fc2_paper_config():
    """L = 49 tokens (7 x 7), I = 1792, O = 448, g_x 4-bit, HLA rank 8 (the supplement's example, docs/cost.md)."""
    h = cost.hot_ops(49, 1792, 448, PAPER)
    assert h.overhead == {
        "gx: H(g_y)": 87_808,     # L·O·log2(16) = 49·448·4
        "gx: H(W)": 3_211_264,    # O·I·4
        "gx: Q(g_y)": 21_952,     # L·O
        "gx: Q(W)": 802_816,      # O·I
        "gx: dequant": 87_808,    # L·I
        "gw: HLA(g_y)": 114_688,  # L_pad·O·4 = 64·448·4
        "gw: HLA(x)": 458_752,    # 64·1792·4
        "gw: Q(g_y)": 14_336,     # K·O, K = 4 blocks x 8 rows = 32
        "gw: Q(x)": 57_344,       # K·I
        "gw: dequant": 802_816,   # O·I
    }
    assert h.int4 == 78_675_968  # 2·L·O·I
    assert h.int8 == 51_380_224  # 2·K·O·I = 2·32·448·1792
    assert h.fp == 0
    assert h.overhead_total == 5_659_584
    assert h.bops == 51_380_224 // 2 * 64 + 78_675_968 // 2 * 16 + 5_659_584 * 1024 == 8_068_988_928
    # the released code's count: unpadded L (24.5 projected rows, not 32) and I·(r/n)·O for the X^ quantiser
    assert cost.paper_bops(49, 448, 1792) == pytest.approx(7_894_892_544)


@pytest.mark.parametrize("L", [64, 256])
def test_hot_matches_the_released_formula_but_for_its_x_quantiser_term(L):
    """With L a multiple of 16·16/r (no padding), the two counts differ only where the released code quantises
    (r/n)·I·O elements of X^ instead of its (r/n)·L·I."""
    I, O, r = 96, 48, 8
    ours = cost.hot_ops(L, I, O, PAPER).bops
    assert ours - cost.paper_bops(L, O, I) == pytest.approx((r / 16) * I * (L - O) * 1024)


@pytest.mark.parametrize("O,lg", [(64, 4), (24, 3), (20, 2), (6, 1), (5, 0)])
def test_gx_block_follows_O(O, lg):
    assert cost.gx_block(O) == 2 ** lg
    h = cost.hot_ops(32, 16, O, DEFAULT, need_gw=False)
    assert h.overhead["gx: H(g_y)"] == 32 * O * lg and h.overhead["gx: H(W)"] == O * 16 * lg
    assert h.int8 == 2 * 32 * O * 16 and h.int4 == 0 and "gw: Q(x)" not in h.overhead


def test_hla_padding_and_rank():
    # L = 17 rows: 2 blocks of 16; rank 4 keeps 8 rows, padded to K = 16
    h = cost.hot_ops(17, 10, 32, DEFAULT.replace(rank=4), need_gx=False)
    assert h.int8 == 2 * 16 * 32 * 10
    assert h.overhead == {"gw: HLA(g_y)": 32 * 32 * 4, "gw: HLA(x)": 32 * 10 * 4, "gw: Q(g_y)": 16 * 32,
                          "gw: Q(x)": 16 * 10, "gw: dequant": 32 * 10}
    # full rank: K = L_pad
    assert cost.hot_ops(40, 10, 32, DEFAULT, need_gx=False).int8 == 2 * 48 * 32 * 10


def test_exact_config_counts_as_exact():
    assert cost.hot_ops(49, 1792, 448, DEFAULT.replace(exact=True)).fp == 4 * 49 * 1792 * 448


def test_conv_counts():
    """A 3x3 conv (non-pointwise) keeps the int8 feature map: quantised forward, g_w of its integer columns times its
    scale in the backward (SPEC §8), col2im. At the default g_w comes from G~'s codes (SPEC §4): no HLA, no second
    quantisation, H_b along O on the O x I result; G~ is formed for g_w alone where no g_x is wanted."""
    h = cost.hot_ops(128, 27, 8, DEFAULT, fmap=384, col2im=True)
    assert h.overhead["gw: Q(fmap)"] == 384 and h.overhead["gw: H(g_w)"] == 8 * 27 * 3  # O = 8: block 8
    assert not any(k.startswith("gw: HLA") or k == "gw: Q(x)" or k.startswith("gw: H(g_y)") for k in h.overhead)
    assert h.overhead["gx: col2im"] == 128 * 27
    assert h.overhead["gx: H(g_y)"] == 128 * 8 * 3
    assert h.int8 == 2 * 128 * 8 * 27 * 2  # g_x at 8 bits and g_w at full rank (L = 128, no padding)
    first = cost.hot_ops(128, 27, 8, DEFAULT, need_gx=False, fmap=384)  # a network's first conv: G~ for g_w alone
    assert first.overhead["gw: H(g_y)"] == 128 * 8 * 3 and first.overhead["gw: Q(g_y)"] == 128 * 8
    assert first.int8 == 2 * 128 * 8 * 27
    r8 = cost.hot_ops(128, 27, 8, hot.Config(rank=8), fmap=384, col2im=True)  # below full rank: HLA of the columns
    assert r8.overhead["gw: Q(fmap)"] == 384 and r8.overhead["gw: scale g_w"] == 8 * 27
    assert r8.overhead["gw: HLA(x)"] == 128 * 27 * 4
    assert r8.int8 == 2 * 128 * 8 * 27 + 2 * 64 * 8 * 27  # K = 128 / 16 * 8 = 64


# ---------------------------------------------------------------------------------------------------------------
# bytes against the saved-tensor hooks of a real forward
# ---------------------------------------------------------------------------------------------------------------
def _hooked_bytes(model, x, exclude_shared):
    """Per converted-or-not Linear/Conv2d: bytes of the non-parameter tensors its forward saved for backward
    (optionally without the tensors that some op outside the layers saved too), from saved_tensors_hooks."""
    params = {p.data_ptr() for p in model.parameters()}
    names = {id(m): n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    cur = [None]
    log = []

    def pack(t):
        if t.data_ptr() not in params:
            log.append((cur[0], (t.data_ptr(), t.numel(), t.dtype), t.numel() * t.element_size()))
        return t

    hooks = []
    for n, m in model.named_modules():
        if id(m) in names:
            hooks.append(m.register_forward_pre_hook(lambda m, a: cur.__setitem__(0, names[id(m)])))
            hooks.append(m.register_forward_hook(lambda m, a, o: cur.__setitem__(0, None)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    for h in hooks:
        h.remove()
    outside = {k for layer, k, _ in log if layer is None}
    out = {n: 0 for n in names.values()}
    for layer, k, nb in log:
        if layer is not None and not (exclude_shared and k in outside):
            out[layer] += nb
    return out


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 48)  # input: a GELU output (GELU keeps its input): an ABC buffer
        self.fc3 = nn.Linear(48, 10)  # input: a ReLU output (ReLU keeps it): nothing of its own (SPEC §2)
        self.frozen = nn.Linear(10, 10)
        self.frozen.weight.requires_grad_(False)
        self.frozen.bias.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.fc3(torch.relu(self.fc2(nn.functional.gelu(self.fc1(x))))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 1, stride=2)   # pointwise, strided: the codes of its pixel rows (ABC bytes)
        self.c3 = nn.Conv2d(16, 16, 3, padding=1)  # 3x3: the int8 feature map
        self.c4 = nn.Conv2d(16, 8, 1)              # input: a ReLU output
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = nn.functional.gelu(self.c1(x))
        y = nn.functional.gelu(self.c2(y))
        y = torch.relu(self.c3(y))
        return self.fc(self.c4(y).mean((2, 3)))


CASES = [(MLP, lambda: torch.randn(5, 7, 32)), (CNN, lambda: torch.randn(3, 3, 12, 12))]


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast_bf16"])
@pytest.mark.parametrize("config", [DEFAULT, PAPER, DEFAULT.replace(rank=4)], ids=["default", "paper", "rank4"])
@pytest.mark.parametrize("make,inp", CASES, ids=["mlp", "cnn"])
def test_kept_bytes_are_what_the_hooks_see(make, inp, config, amp):
    torch.manual_seed(0)
    exact = make()
    model = copy.deepcopy(exact)
    ht.convert(model, config)
    x = inp()
    # under autocast the layers compute in bf16: the casts of x and W are new tensors both kinds of layer keep
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        rep = cost.report(model, x)
        hot_seen = _hooked_bytes(model, x, exclude_shared=True)
        exact_seen = _hooked_bytes(exact, x, exclude_shared=False)
    rows = {r["name"]: r for r in rep.rows}
    assert set(rows) == set(hot_seen)
    for name, r in rows.items():
        assert r["kept_hot"] == hot_seen[name] == r["kept_measured"], name
        assert r["kept_exact"] == exact_seen[name], name
    assert rep.total["kept_hot"] == sum(hot_seen.values())
    if amp:
        assert "float GEMMs at bfloat16" in " ".join(rep.notes)
        if make is CNN:  # fc: its bf16 input (3 x 8) and the bf16 copy of its weight (5 x 8)
            assert rows["fc"]["kept_exact"] == 3 * 8 * 2 + 5 * 8 * 2
            assert rows["fc"]["kept_hot"] == 8 * cost.ops.padded_k(3, config.rank) + 4 + 5 * 8 * 2
        return
    if make is MLP:
        assert rows["fc3"]["kept_hot"] == 0 and rows["fc3"]["kept_exact"] == 35 * 48 * 4  # shared with the ReLU
        assert rows["frozen"]["kept_hot"] == rows["frozen"]["kept_exact"] == 0
        assert rows["fc2"]["kept_hot"] == 64 * cost.ops.padded_k(35, config.rank) + 4
        assert "producer keeps the input either way" in rows["fc3"]["verdict"]
        assert rows["frozen"]["gw"] == "none (frozen)" and rows["frozen"]["fp_exact"] == 2 * 35 * 10 * 10
        assert rows["fc1"]["gx"].startswith("none")  # the model input needs no gradient: no g_x path
    else:
        assert rows["c3"]["kept_hot"] == 3 * 16 * 6 * 6 + 4  # the int8 feature map and its scale
        assert rows["c4"]["kept_hot"] == 0


def test_report_at_another_config_and_layers_called_twice():
    lin = nn.Linear(16, 16)
    model = nn.Sequential(lin, nn.GELU(), lin)  # one layer, two calls
    ht.convert(model)
    rep = cost.report(model, torch.randn(20, 16), config="paper")
    (row,) = rep.rows
    assert "x2 calls" in row["LIO"] and row["gw"] == "int8 HLA r=8" and row["gx"].startswith("none")
    assert row["kept_measured"] is None  # measured at the layer's own configuration (default), not the paper's
    assert row["int4"] == 2 * 20 * 16 * 16  # the second call's g_x (the first call's input needs no gradient)
    assert row["int8"] == 2 * (2 * 16 * 16 * 16)  # K = 16 rows for 20 at rank 8, both calls
    with pytest.raises(ValueError, match="config"):
        cost.report(model, torch.randn(4, 16), config="fast")


# ---------------------------------------------------------------------------------------------------------------
# summary(cost=True): formats, plot; backward compatible without it
# ---------------------------------------------------------------------------------------------------------------
def _small():
    torch.manual_seed(0)
    m = CNN()
    ht.convert(m)
    return m


def test_summary_cost_formats():
    m, x = _small(), torch.randn(2, 3, 12, 12)
    text = ht.summary(m, x, cost=True, file=io.StringIO())
    assert "GBOPs HOT" in text and "total" in text and "not measured" in text and "kept (HOT)" in text
    md = ht.summary(m, x, format="markdown", file=io.StringIO())
    assert md.startswith("| layer |") and "|---|" in md
    rows = list(csv.DictReader(io.StringIO(ht.summary(m, x, format="csv", file=io.StringIO()))))
    assert [r["name"] for r in rows] == ["c1", "c2", "c3", "c4", "fc", "total"]
    for k in ("kept_hot", "kept_exact", "fp_exact", "int8", "overhead"):
        assert float(rows[-1][k]) == sum(float(r[k]) for r in rows[:-1]), k
    assert "ms_hot" not in rows[0]  # no timing columns on the CPU
    old = ht.summary(m, x, file=io.StringIO())  # without cost: the memory table as before
    assert "kept (HOT)" in old and "GBOPs" not in old
    with pytest.raises(ValueError, match="input"):
        ht.summary(m, cost=True, file=io.StringIO())
    with pytest.raises(ValueError, match="format"):
        ht.summary(m, x, format="html", file=io.StringIO())


def test_summary_plot(tmp_path):
    pytest.importorskip("matplotlib")
    p = tmp_path / "cost.png"
    text = ht.summary(_small(), torch.randn(2, 3, 12, 12), plot=str(p), file=io.StringIO())
    assert f"plot written to {p}" in text
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU timing needs CUDA")
def test_gpu_timing():
    m = _small().cuda()
    rep = cost.report(m, torch.randn(8, 3, 32, 32, device="cuda"), iters=3)
    assert rep.timed and all(r["ms_hot"] > 0 and r["ms_exact"] > 0 for r in rep.rows)
    assert all(r["fwd_ms_hot"] > 0 and r["fwd_ms_exact"] > 0 for r in rep.rows)
    assert rep.total["fwd_ms_hot"] == pytest.approx(sum(r["fwd_ms_hot"] for r in rep.rows))
    text = rep.render("text")
    assert "bwd ms HOT" in text and "fwd ms HOT" in text and "forward + backward" in text


# ---------------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------------
def test_cli_builtin_and_factory(capsys, tmp_path):
    assert main(["summary", "cnn", "--batch", "4", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert "name,type,LIO" in out and "\ntotal," in out
    assert main(["summary", "cnn", "--batch", "4", "--amp", "bf16", "--no-time"]) == 0
    out = capsys.readouterr().out
    assert "under bf16 autocast" in out and "float GEMMs at bfloat16" in out
    assert main(["summary", "hot.experiments.models:ViT", "--input-shape", "1,8,8", "--batch", "2", "--paper"]) == 0
    out = capsys.readouterr().out
    assert "int4 tensor" in out and "int8 HLA r=8" in out and "GBOPs" in out
    assert main(["summary", "vit", "--batch", "2", "--config", "paper"]) == 0
    assert "paper (asked)" in capsys.readouterr().out
    assert main(["summary", "no_such_model_anywhere"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_cli_state_dict(capsys, tmp_path):
    from hot.experiments import models

    torch.manual_seed(0)
    m = models.build("cnn")
    ht.convert(m)
    m.head.set_hot_config(PAPER)  # stands in for a calibrated layer
    m.head.hot_calibration = {"budget": 0.1}
    torch.save(m.state_dict(), tmp_path / "sd.pt")
    assert main(["summary", "cnn", "--batch", "2", "--state-dict", str(tmp_path / "sd.pt")]) == 0
    out = capsys.readouterr().out
    head = [line for line in out.splitlines() if line.startswith("head ")]
    assert head and "calibrated" in head[0] and "int4 tensor" in head[0]


def test_cli_torchvision_resnet(capsys):
    pytest.importorskip("torchvision")
    assert main(["summary", "resnet18", "--batch", "1", "--input-shape", "3,64,64"]) == 0
    assert "layer4.1.conv2" in capsys.readouterr().out


def test_cli_timm_vit_b16(capsys):
    pytest.importorskip("timm")
    assert main(["summary", "vit_b16", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "blocks.11.mlp.fc2" in out
    assert "197x768x2304" in out  # L = 197 tokens (196 patches + class token)


def test_verdict_gives_no_memory_credit_for_an_input_its_producer_keeps():
    """A layer slower than exact is worth converting only for a real memory saving: none where the producer (a ReLU)
    keeps the input either way (measured on an H100: ResNet-50's 3x3 convs had said 'convert for memory')."""
    base = dict(kept_exact=4096, gbops_exact=10.0, gbops_hot=2.0, ms_exact=0.4, ms_hot=4.0)
    assert cost._verdict(dict(base, kept_hot=0, shared=True)).startswith("keep exact: 0.10x")
    # under autocast both keep the weight's bf16 copy (512 bytes) beside the input the producer keeps (4096)
    v = cost._verdict(dict(base, kept_exact=4096 + 512, kept_hot=512, shared=True, shared_bytes=4096))
    assert v == "keep exact: 0.10x backward speed, no memory change (its producer keeps the input either way)"
    assert cost._verdict(dict(base, kept_hot=1024, shared=False)).startswith("convert for memory: 0.10x")
    assert cost._verdict(dict(base, kept_hot=1024, ms_hot=0.2)).startswith("convert: 2.00x faster backward")


def test_verdict_weighs_the_forward_where_it_was_timed():
    """HOT's forward also forms the int8 copy of the input (ABC): a layer whose backward is faster than exact's but
    whose forward costs more than that gain is not 'faster' (ViT-B's fc2 on an H200: backward 1.35x, forward +
    backward 0.97x)."""
    row = dict(kept_exact=4096, kept_hot=1024, gbops_exact=10.0, gbops_hot=2.0, ms_exact=0.33, ms_hot=0.28)
    assert cost._verdict(row).startswith("convert: 1.18x faster backward")
    slow_fwd = dict(row, fwd_ms_exact=0.20, fwd_ms_hot=0.30)
    assert cost._verdict(slow_fwd) == "convert for memory: 0.91x forward + backward speed, 4.0x less kept"
    fast = dict(row, fwd_ms_exact=0.20, fwd_ms_hot=0.21)
    assert cost._verdict(fast).startswith("convert: 1.08x faster forward + backward")


def test_report_counts_the_relu_masks():
    """A converted model's hot.torch.ReLU keeps a 1-bit mask instead of its output (SPEC §2): the report names the
    masks' bytes and the outputs' in a note, and the conv after it keeps its own int8 map (not the ReLU's output)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    ht.convert(model)
    x = torch.randn(2, 3, 5, 5)
    rep = cost.report(model, x)
    rows = {r["name"]: r for r in rep.rows}
    n = 2 * 8 * 5 * 5  # the ReLU's output elements
    assert rows["2"]["kept_hot"] == n + 4 and rows["2"]["kept_exact"] == n * 4
    note = [t for t in rep.notes if "hot.torch.ReLU" in t]
    assert len(note) == 1 and note[0].startswith(f"1 hot.torch.ReLU module(s) keep 1-bit masks, {(n + 7) // 8} B")
    assert f"in place of their outputs, {cost._fmt_bytes(n * 4)} in exact training" in note[0]
