"""hot parity --task synth: the synthetic dataset (hot.experiments.synth), its models, the device path of the
simulated baselines, and a tiny CPU parity run (no scikit-learn needed)."""
import copy
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICES

import hot
import hot.experiments.parity as hp
import hot.torch as ht
from hot.experiments import models
from hot.experiments import synth


def test_synth_images_are_a_function_of_the_seed():
    a = synth.synth_images(300, seed=3, size=32)
    assert a.shape == (300, 3, 32, 32) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.equal(a, synth.synth_images(300, seed=3, size=32))
    b = synth.synth_images(300, seed=4, size=32)
    assert (a - b).abs().mean() > 0.3  # another seed: other images, not a perturbation of the same ones
    # Images differ from one another (not one template plus noise), with structure: neighbouring pixels are
    # strongly correlated (shapes, gratings and gradients are smooth at the pixel scale; the noise is small).
    assert a.std(0).mean() > 0.3
    d = a - a.mean((2, 3), keepdim=True)
    corr = (d[..., 1:] * d[..., :-1]).mean() / (d * d).mean()
    assert corr > 0.8, float(corr)
    # A set generated in several chunks is deterministic too, and its chunks are not copies of one another.
    c = synth.synth_images(100, 9, 16, chunk=32)
    assert torch.equal(c, synth.synth_images(100, 9, 16, chunk=32))
    assert not torch.equal(c[:32], c[32:64])
    assert not torch.equal(c, synth.synth_images(100, 10, 16, chunk=32))


def test_synth_labels_deterministic_balanced_and_seed_dependent():
    x, y = synth.make_synth(3000, seed=0, size=16)
    x2, y2 = synth.make_synth(3000, seed=0, size=16)
    assert torch.equal(x, x2) and torch.equal(y, y2) and y.dtype == torch.int64
    counts = torch.bincount(y, minlength=10)
    assert len(counts) == 10 and (counts > 0).all()
    # Balanced-ish: every class between 5 % and 15 % of the set (the teacher's offsets target 10 % each).
    assert counts.min() >= 0.05 * len(y) and counts.max() <= 0.15 * len(y), counts.tolist()
    # Another seed: another teacher as well as other images; the same images relabelled by it disagree with the
    # first teacher on most of them (a different function, not a permutation of near-equal labels).
    y_other_teacher = synth.SynthTeacher(seed=1, size=16).label(x)
    assert (y_other_teacher != y).float().mean() > 0.5
    # Labels are the argmax of the balanced logits, and no class wins by a landslide on every image.
    t = synth.SynthTeacher(seed=0, size=16)
    z = t(x[:500])
    assert torch.equal(z.argmax(1), y[:500])
    top2 = z.topk(2, 1).values
    assert float((top2[:, 0] - top2[:, 1]).median()) < 1.0


def test_load_synth_standardises_with_training_statistics():
    xtr, ytr, xte, yte = synth.load_synth("cpu", 400, 100, seed=0, size=16)
    assert xtr.shape == (400, 3, 16, 16) and xte.shape == (100, 3, 16, 16)
    assert ytr.shape == (400,) and yte.shape == (100,)
    torch.testing.assert_close(xtr.mean((0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(xtr.std((0, 2, 3)), torch.ones(3), atol=1e-4, rtol=0)
    x, y = synth.make_synth(500, seed=0, size=16)  # the same generated set, split in order
    assert torch.equal(torch.cat([ytr, yte]), y)
    assert torch.equal(hp.load_data("synth-tiny", "cpu", 400, 100)[1], ytr)


def test_synth_models():
    torch.manual_seed(0)
    vit = models.build("vit_synth")
    assert vit.pos.shape == (1, 65, 192) and len(vit.blocks) == 6 and vit.blocks[0].fc1.out_features == 768
    assert vit.blocks[0].attn.heads == 3
    cnn = models.build("cnn_synth")
    x = torch.randn(2, 3, 32, 32)
    assert vit(x).shape == (2, 10) and cnn(x).shape == (2, 10)
    assert 2.5e6 < sum(p.numel() for p in vit.parameters()) < 3e6
    assert cnn.layer3[1].conv2.out_channels == 128 and cnn.head.in_features == 128
    # HOT converts every block linear and the head (patch embedding kept exact, as in hot parity); on the CNN
    # every conv and the head, stem excluded.
    assert len(ht.convert(copy.deepcopy(vit), hot.Config(), exclude=["patch"]).converted) == 6 * 4 + 1
    assert len(ht.convert(copy.deepcopy(cnn), hot.Config(), exclude=["stem"]).converted) == 3 * 2 * 2 + 2 + 1
    # The digits models are unchanged by the new options (same parameters for the same seed).
    torch.manual_seed(0)
    a = models.build("cnn")
    torch.manual_seed(0)
    b = models.ResNet()
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    assert not hasattr(a, "layer3")


def _conv_kernels(model):
    """(1x1 convs, 3x3 convs) of a model, its stem left out."""
    convs = [m for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and n.split(".")[0] != "stem"]
    return sum(m.kernel_size == (1, 1) for m in convs), sum(m.kernel_size == (3, 3) for m in convs)


def test_bottleneck_models():
    # the bottleneck ResNets (1x1 -> 3x3 -> 1x1 blocks): digits and synth shapes give (batch, 10) logits; most of
    # their convolutions are pointwise; hot parity converts every conv but the stem, and the head
    torch.manual_seed(0)
    digits, synth_net = models.build("cnn_bneck"), models.build("cnn_bneck_synth")
    assert digits(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    assert synth_net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    # digits: 2 stages of 1 block (3 convs + a projection shortcut each); synth: 3 stages of 2 blocks (shortcut on
    # the first block of each stage)
    assert _conv_kernels(digits) == (6, 2)
    assert _conv_kernels(synth_net) == (3 * (2 * 2 + 1), 3 * 2)
    assert digits.stem.kernel_size == (3, 3) and not any(m.bias is not None for m in digits.modules()
                                                         if isinstance(m, nn.Conv2d))
    assert digits.layer1.conv3.out_channels == 64 and digits.layer2.conv2.stride == (2, 2)
    assert digits.head.in_features == 128 and synth_net.head.in_features == 256
    assert synth_net.layer2[0].short is not None and synth_net.layer2[1].short is None
    assert len(ht.convert(copy.deepcopy(digits), hot.Config(), exclude=["stem"]).converted) == 6 + 2 + 1
    assert len(ht.convert(copy.deepcopy(synth_net), hot.Config(), exclude=["stem"]).converted) == 15 + 6 + 1
    # the parity tasks' "bneck" models
    assert isinstance(hp.build_model("bneck", "digits"), models.BottleneckResNet)
    tiny = hp.build_model("bneck", "synth-tiny")
    assert tiny.stem.out_channels == 4 and tiny(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    for arg in ("width", "stages", "blocks", "expansion"):
        with pytest.raises(ValueError, match=arg):
            models.BottleneckResNet(**{arg: 0})


def _assert_learns(res, min_accuracy: float, min_drop: float) -> None:
    """Every run of a 100-step smoke run: finite losses, accuracy above min_accuracy, the mean loss of the last 10 steps
    below the first 10's by more than min_drop; and a finite paired gap of hot."""
    for r in res.runs:
        assert len(r.losses) == 100 and all(math.isfinite(v) for v in r.losses), r.method
        assert r.accuracy > min_accuracy, (r.method, r.accuracy)
        first, last = sum(r.losses[:10]) / 10, sum(r.losses[-10:]) / 10
        assert last < first - min_drop, (r.method, first, last)
    assert math.isfinite(res.paired_gap("hot")[0])


@pytest.mark.parametrize("device", DEVICES)
def test_parity_synth_tiny_bneck(device):
    # CI smoke run of the bottleneck ResNet on the tiny synthetic task (width 4, three stages of one block, 100
    # steps of 64): exact and HOT (real layers: 12 convs and the head) both learn (on this run both reach about
    # 35 %; chance is 10 %), with finite, decreasing losses
    res = hp.run_parity("bneck", ["exact", "hot"], seeds=[0], task="synth-tiny", device=device)
    assert [r.note for r in res.runs] == ["exact", "13 layers converted"]
    _assert_learns(res, 22.0, 0.4)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):  # tokens: the 8x8 positions of the conv output
        h = F.relu(self.conv(x)).flatten(2).transpose(1, 2)
        return self.fc2(F.gelu(self.fc1(h))).mean(1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["naive-int4", "lbp-wht", "hot", "hot-gx-only", "hot-gw-only", "exact"])
def test_sim_device_path_matches_numpy_path(name, device):
    # The torch twin of each simulated method (used for tensors off the CPU) against hot.experiments.analysis's numpy
    # function: the engine's integer paths agree bit for bit, the float64 parts up to rounding.
    torch.manual_seed(0)
    base = _Net().to(device)
    x, y = torch.randn(4, 3, 8, 8, device=device), torch.randint(0, 5, (4,), device=device)
    grads = []
    for path in (False, True):
        net = copy.deepcopy(base)
        assert hp.simulate(net, name, exclude=(), device_path=path) == ["conv", "fc1", "fc2"]
        net.zero_grad()
        torch.manual_seed(5)
        F.cross_entropy(net(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
    assert hp.device_fn("hot+lqs") is None  # no twin: numpy on the CPU
    for n in grads[0]:
        if name in ("naive-int4", "hot") and device == "cpu" and not n.endswith("bias"):
            assert torch.equal(grads[0][n], grads[1][n]), n
        else:
            torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6)


def test_naive_int4_gemm_past_int32_reach():
    # naive INT4's g_w contracts over all L rows; past 131,071 (a 32x32 conv at batch 128 has L = 131,072)
    # hot.gemm_s8 refuses, so both paths sum exact int32 chunks in int64.
    import numpy as np

    import hot.experiments.analysis as ha

    rng = np.random.default_rng(0)
    K = ha.GEMM_K_CHUNK + 4000
    a = rng.integers(-8, 8, (3, K), dtype=np.int8)
    b = rng.integers(-8, 8, (5, K), dtype=np.int8)
    with pytest.raises(ValueError, match="overflows"):
        hot.gemm_s8(a, b)
    ref = a.astype(np.int64) @ b.astype(np.int64).T
    got = ha._int_gemm(a, b)
    assert got.dtype == np.float64 and np.array_equal(got, ref.astype(np.float64))
    # The device twin on a layer whose L crosses the limit (CPU tensors through the torch path) agrees.
    L = ha.GEMM_K_CHUNK + 500
    x, w, gy = torch.randn(L, 6), torch.randn(4, 6), torch.randn(L, 4)
    gx_n, gw_n = ha.method_fn("naive-int4")(x.numpy(), w.numpy(), gy.numpy(), 3)
    gx_d, gw_d = hp.device_fn("naive-int4")(x, w, gy, 3)
    assert np.array_equal(gx_d.numpy(), gx_n) and np.array_equal(gw_d.numpy(), gw_n)


def test_parity_result_header_and_old_json():
    res = hp.ParityResult("vit", 100, 64, 3e-3, (0,), ("exact",), [hp.Run("exact", 0, 50.0, [1.0] * 20, 1.0)],
                          "cpu", "synth", 2048, 512)
    assert "synthetic 32x32 RGB images" in res.to_markdown() and "(2048 train / 512 test)" in res.to_markdown()
    d = res.to_json()
    assert hp.ParityResult.from_json(d) == res
    assert "autocast" not in res.to_markdown()
    for k in ("task", "n_train", "n_test", "amp"):  # JSON written before tasks and autocast existed: digits, float32
        del d[k]
    old = hp.ParityResult.from_json(d)
    assert "scikit-learn digits (1438 train / 359 test)" in old.to_markdown() and old.amp == "off"
    with pytest.raises(ValueError, match="unknown task"):
        hp.get_task("cifar")


@pytest.mark.parametrize("device", DEVICES)
def test_parity_synth_tiny(device, tmp_path):
    # CI smoke run of the synthetic task at its tiny size (16x16 images, 2048 train / 512 test, 100 steps of
    # 64; a 2-block dim-48 ViT): exact and HOT (real layers) both learn far above chance (10 %: on this run
    # exact reaches about 43 %), with finite, decreasing losses. (test_cli_parity_synth trains a simulated
    # baseline.)
    res = hp.run_parity("vit", ["exact", "hot"], seeds=[0], task="synth-tiny", device=device)
    assert (res.task, res.steps, res.batch, res.n_train, res.n_test) == ("synth-tiny", 100, 64, 2048, 512)
    assert [r.note for r in res.runs] == ["exact", "9 layers converted"]
    _assert_learns(res, 28.0, 0.5)
    assert res.runs[0].accuracy > 35.0
    assert "synthetic 16x16 RGB images" in res.to_markdown()
    paths = res.save(str(tmp_path), "s")
    assert hp.ParityResult.from_json(json.loads(open(paths[1]).read())).task == "synth-tiny"


def test_parity_bf16_autocast(tmp_path):
    # the training steps under bf16 autocast, for every method: the runs differ from the float32 runs of the same
    # seed (autocast took effect), both methods still learn (tiny synthetic ViT, 100 steps of 64), and the report
    # and its JSON say which precision trained
    kw = dict(seeds=[0], task="synth-tiny", n_train=512, n_test=256)
    f32 = hp.run_parity("vit", ["exact"], **kw)
    res = hp.run_parity("vit", ["exact", "hot"], amp="bf16", **kw)
    assert res.amp == "bf16" and res.runs[0].losses != f32.runs[0].losses
    for r in res.runs:
        assert all(math.isfinite(v) for v in r.losses), r.method
        first, last = sum(r.losses[:10]) / 10, sum(r.losses[-10:]) / 10
        assert last < first - 0.3, (r.method, first, last)
    assert ", bf16 autocast." in res.to_markdown()
    paths = res.save(str(tmp_path), "b")
    assert hp.ParityResult.from_json(json.loads(open(paths[1]).read())).amp == "bf16"
    with pytest.raises(ValueError, match="amp must be one of"):
        hp.run_parity("vit", ["exact"], amp="int8", **kw)


def test_cli_parity_synth(tmp_path, capsys):
    from hot.cli import main

    assert main(["parity", "--task", "synth-tiny", "--model", "vit", "--methods", "exact,lbp-wht", "--seeds", "1",
                 "--steps", "20", "--n-train", "256", "--n-test", "128", "--amp", "bf16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "synth-tiny (256 train / 128 test" in out and "| lbp-wht |" in out and "bf16 autocast" in out
    d = json.loads((tmp_path / "parity_synth-tiny_vit.json").read_text())
    assert d["task"] == "synth-tiny" and (d["n_train"], d["n_test"]) == (256, 128) and d["amp"] == "bf16"
    assert [r["method"] for r in d["runs"]] == ["exact", "lbp-wht"]
    assert all(math.isfinite(v) for r in d["runs"] for v in r["losses"])
    assert main(["parity", "--task", "digits", "--n-train", "100", "--out", str(tmp_path)]) == 2
    assert main(["parity", "--task", "synth-tiny", "--n-test", "0", "--out", str(tmp_path)]) == 2
