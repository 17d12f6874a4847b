"""hot.experiments.parity: the training-parity harness (simulated baselines, real HOT layers, report) and a CI smoke run."""
import copy
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot
import hot.experiments.parity as hp
import hot.torch as ht
from hot.experiments import models

pytest.importorskip("sklearn")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 48)
        self.fc2 = nn.Linear(48, 40)
        self.fc3 = nn.Linear(40, 5)

    def forward(self, x):  # x: B x T x 24 tokens
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x))))).mean(1)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(F.relu(self.conv2(F.relu(self.conv1(x)))).mean((2, 3)))


def _grads(model, x, y, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_sim_hot_is_bit_identical_to_the_real_layers():
    # The simulation path with HOT's own numerics draws the same seeds as hot.torch.Linear, so the whole
    # backward pass (every layer's g_x and g_w, through the GELUs) must agree bit for bit: the harness that
    # trains the baselines adds nothing of its own.
    torch.manual_seed(0)
    base = MLP()
    x, y = torch.randn(6, 20, 24), torch.randint(0, 5, (6,))
    real, sim = copy.deepcopy(base), copy.deepcopy(base)
    ht.convert(real, hot.Config())
    assert hp.simulate(sim, "hot", exclude=()) == ["fc1", "fc2", "fc3"]
    g_real, g_sim = _grads(real, x, y, 5), _grads(sim, x, y, 5)
    for n in g_real:
        if n.endswith("bias"):  # summed by different code (engine vs torch): equal up to float rounding
            torch.testing.assert_close(g_sim[n], g_real[n], rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(g_sim[n], g_real[n]), n
    exact = _grads(base, x, y, 5)
    assert not torch.equal(g_real["fc1.weight"], exact["fc1.weight"])  # HOT did change the gradient


@pytest.mark.parametrize("model_cls,shape", [(MLP, (4, 16, 24)), (ConvNet, (3, 3, 9, 7))])
def test_sim_exact_matches_autograd(model_cls, shape):
    # With the 'exact' method the simulated layers (linear, and conv through im2col / fold) reproduce torch's
    # gradients up to float32 rounding.
    torch.manual_seed(1)
    base = model_cls()
    x = torch.randn(*shape)
    y = torch.randint(0, 4, (shape[0],))
    sim = copy.deepcopy(base)
    names = hp.simulate(sim, "exact", exclude=())
    assert len(names) == 3
    g_ref, g_sim = _grads(base, x, y, 0), _grads(sim, x, y, 0)
    for n in g_ref:
        torch.testing.assert_close(g_sim[n], g_ref[n], rtol=1e-4, atol=1e-6)
    xin = x.clone().requires_grad_(True)
    sim(xin).sum().backward()
    xr = x.clone().requires_grad_(True)
    base(xr).sum().backward()
    torch.testing.assert_close(xin.grad, xr.grad, rtol=1e-4, atol=1e-6)


def test_simulate_keeps_the_input_layer_and_prepare_names_errors():
    torch.manual_seed(0)
    vit = models.build("vit")
    names = hp.simulate(vit, "naive-int4")
    assert "patch" not in names and "head" in names and type(vit.patch) is nn.Conv2d
    with pytest.raises(ValueError, match="unknown method 'bogus'"):
        hp.method("bogus")
    with pytest.raises(ValueError, match="calibration batch"):
        hp.prepare(models.build("vit"), "hot+lqs")


def test_parity_smoke(tmp_path):
    # CI smoke run: 2 seeds x 60 steps on digits with a small ViT (the demo's, narrower and one block deep).
    # Exact and HOT (real layers) must learn well above chance (10 %), with finite losses, and the report must
    # hold what it says. (test_cli_parity trains a simulated baseline.)
    small_vit = lambda: models.build("vit", dim=32, depth=1, heads=2, mlp=64)  # noqa: E731
    res = hp.run_parity("vit", ["exact", "hot"], seeds=[0, 1], steps=60, batch=64, lr=1e-2,
                        model_fn=small_vit)
    assert len(res.runs) == 4
    for r in res.runs:
        assert len(r.losses) == 60 and all(math.isfinite(v) for v in r.losses), (r.method, r.seed)
        assert 0.0 <= r.accuracy <= 100.0
    for m in ("exact", "hot"):
        mean, std = res.accuracy(m)
        assert mean > 30.0, (m, mean, [r.accuracy for r in res.of(m)])
        assert all(r.losses[-1] < r.losses[0] for r in res.of(m))
    gap = res.paired_gap("hot")
    assert gap is not None and math.isfinite(gap[0])
    md = res.to_markdown()
    for m in ("exact", "hot"):
        assert f"| {m} |" in md
    paths = res.save(str(tmp_path), "p")
    again = hp.ParityResult.from_json(json.loads(open(paths[1]).read()))
    assert again.accuracy("hot") == res.accuracy("hot") and again.runs[0].losses == res.runs[0].losses
    assert open(paths[2], "rb").read(4) == b"\x89PNG"


def test_cli_parity(tmp_path, capsys):
    from hot.cli import main

    assert main(["parity", "--steps", "20", "--seeds", "1", "--batch", "32", "--methods", "exact,naive-int4",
                 "--out", str(tmp_path), "--name", "x"]) == 0
    out = capsys.readouterr().out
    assert "| exact |" in out and "| naive-int4 |" in out
    d = json.loads((tmp_path / "x.json").read_text())
    assert [r["method"] for r in d["runs"]] == ["exact", "naive-int4"]
    assert all(math.isfinite(v) for r in d["runs"] for v in r["losses"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.md", "x.png"]
    assert main(["parity", "--methods", "exact,nope", "--out", str(tmp_path)]) == 2


@pytest.mark.slow
def test_parity_three_seeds_hot_close_to_exact_cnn():
    # Longer: the CNN (stem exact, as in hot demo), 3 seeds x 300 steps; HOT within 1 point of exact on average.
    res = hp.run_parity("cnn", ["exact", "hot"], seeds=[0, 1, 2], steps=300, batch=128)
    assert res.accuracy("exact")[0] > 95.0
    assert res.paired_gap("hot")[0] > -1.0, res.to_markdown()
