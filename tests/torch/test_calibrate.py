"""hot.torch.calibrate (SPEC §7.2), hot.torch.Warmup (§10) and the accurate default."""
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot
import hot.torch as ht
from hot.experiments import models


def _layer_and_batch(smooth: bool, L=256, I=32, O=32, seed=0):
    """A Linear layer, an input x (L x I) and an output gradient gy (L x O). smooth: x and gy constant over each
    block of 16 consecutive tokens (only the DC Hadamard row is non-zero along the tokens, so every HLA rank keeps
    all of g_w); else white noise (every rank below 16 drops most of it)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = nn.Linear(I, O)
    if smooth:
        x = torch.randn(L // 16, I, generator=g).repeat_interleave(16, 0)
        gy = torch.randn(L // 16, O, generator=g).repeat_interleave(16, 0)
    else:
        x = torch.randn(L, I, generator=g)
        gy = torch.randn(L, O, generator=g)
    ht.convert(layer)
    return layer, x.requires_grad_(True), gy


def _calibrate(layer, x, gy, **kw):
    return ht.calibrate(layer, x, lambda y: (y * gy).sum(), **kw)[""]


def test_default_is_the_accurate_configuration():
    c = hot.Config()
    assert (c.gx_bits, c.rank) == (8, 16)
    layer = ht.Linear(8, 8)
    assert layer.hot_config == c and layer.hot_config_source() == "default"
    assert ht.convert(nn.Linear(8, 8), hot.Config.paper()).config == hot.Config(gx_bits=4, rank=8)


def test_smooth_token_dimension_gets_low_rank_white_does_not():
    layer, x, gy = _layer_and_batch(smooth=True)
    r = _calibrate(layer, x, gy)
    assert r["config"].rank == 4, r["e_gw"]
    assert all(e < 0.05 for e in r["e_gw"].values()), r["e_gw"]  # only 8-bit quantisation noise left
    assert all(b < 1e-5 for b in r["bias_gw"].values()), r["bias_gw"]  # the projection keeps all of g_w
    assert layer.hot_config.rank == 4 and layer.hot_config_source().startswith("calibrated")
    layer, x, gy = _layer_and_batch(smooth=False)
    r = _calibrate(layer, x, gy)
    assert r["config"].rank == 16, r["e_gw"]
    assert r["e_gw"]["r8"] > 0.5 and r["e_gw"]["r16"] < 0.05, r["e_gw"]
    assert r["bias_gw"]["r16"] < 1e-5 and r["bias_gw"]["r8"] > 0.5, r["bias_gw"]
    # the projection's error is measured apart from the quantisation noise: a loose noise budget does not let a
    # biased rank through
    r = _calibrate(layer, x, gy, budget=10.0)
    assert r["config"].rank == 16
    r = _calibrate(layer, x, gy, budget=10.0, bias_budget=10.0)
    assert r["config"].rank == 4
    # the errors fall as the rank grows (a larger projection of white noise)
    e = [r["e_gw"][f"r{k}"] for k in ht.calibrate.__globals__["RANKS"]]
    assert e == sorted(e, reverse=True)


def test_four_bits_only_where_cheaper_and_within_budget():
    layer, x, gy = _layer_and_batch(smooth=False)
    # no INT4 tensor cores (the CPU, Hopper): 4-bit is never a candidate, whatever the budget
    r = _calibrate(layer, x, gy, budget=10.0, int4=False)
    assert r["config"].gx_bits == 8 and not any(k.startswith("4-bit") for k in r["e_gx"])
    assert not ht.int4_tensor_cores("cpu")
    # with INT4 tensor cores: 4-bit when its error is within the budget, 8-bit when not
    r = _calibrate(layer, x, gy, budget=10.0, int4=True)
    assert r["config"].gx_bits == 4
    e4 = min(r["e_gx"]["4-bit tensor"], r["e_gx"]["4-bit token"])
    assert 0.05 < e4 < 1.0
    r = _calibrate(layer, x, gy, budget=e4 / 2, int4=True)
    assert r["config"].gx_bits == 8
    # a rank-4 budget that nothing meets: full rank, and 8-bit with the smaller error
    r = _calibrate(layer, x, gy, budget=1e-9, int4=True)
    assert r["config"].gx_bits == 8 and r["config"].rank == 16
    best = min(("tensor", "token"), key=lambda s: r["e_gx"][f"8-bit {s}"])
    assert r["config"].gx_scale == best


def test_measured_errors_are_the_layer_backward_against_exact():
    """With round-to-nearest every candidate is deterministic: recompute two of them by hand."""
    layer, x, gy = _layer_and_batch(smooth=False)
    layer.hot_config = hot.Config(rounding="nearest")
    r = _calibrate(layer, x, gy, ranks=(8,))
    assert set(r["e_gw"]) == {"r8", "r16"}  # full rank is always a candidate
    w = layer.weight.detach().requires_grad_(True)
    xi = x.detach().requires_grad_(True)
    ex_x, ex_w = torch.autograd.grad(F.linear(xi, w), (xi, w), gy)
    for cfg, key_x, key_w in ((hot.Config(rounding="nearest", rank=8), "8-bit tensor", "r8"),
                              (hot.Config(rounding="nearest", gx_scale="token"), "8-bit token", "r16")):
        gx, gw = torch.autograd.grad(ht.hot_linear(xi, w, None, cfg), (xi, w), gy)
        rel = lambda a, b: float(torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double()))
        assert r["e_gx"][key_x] == pytest.approx(rel(gx, ex_x), rel=1e-9)
        assert r["e_gw"][key_w] == pytest.approx(rel(gw, ex_w), rel=1e-9)


def test_calibration_leaves_grads_buffers_and_rng_alone():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    ht.convert(m)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    stats = [b.clone() for b in m.buffers()]
    torch.manual_seed(123)
    ht.calibrate(m, (x, y), F.cross_entropy)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))
    assert all(p.grad is None for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(stats, m.buffers()))


def test_frozen_weight_keeps_rank_and_first_layer_keeps_gx_setting():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    m[2].weight.requires_grad_(False)
    ht.convert(m, hot.Config(rank=12, gx_scale="token"))
    r = ht.calibrate(m, (torch.randn(64, 16), torch.randint(0, 4, (64,))), F.cross_entropy)
    assert not r["2"]["need_gw"] and r["2"]["config"].rank == 12
    assert not r["0"]["need_gx"] and r["0"]["config"].gx_scale == "token"  # the model input needs no gradient


def test_state_dict_round_trip_and_warmup_resume():
    def model():
        torch.manual_seed(0)
        return models.build("vit", dim=32, depth=1, heads=2, mlp=64)

    m = model()
    ht.convert(m)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    ht.calibrate(m, (x, y), F.cross_entropy)
    m.blocks[0].fc1.set_hot_config(hot.Config(rank=4))  # a known choice, so the round trip is meaningful
    warm = ht.Warmup(m, 5)
    assert warm.left == 5 and m.blocks[0].fc1.hot_config == hot.Config()
    for _ in range(2):
        warm.step()
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    m2 = model()
    ht.convert(m2)
    m2.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    for (n, a), (_, b) in zip(ht.hot_layers(m), ht.hot_layers(m2)):
        assert (a.hot_config, a.hot_warmup, a.hot_calibration) == (b.hot_config, b.hot_warmup, b.hot_calibration), n
    resumed = ht.Warmup(m2)  # no steps: picks up the restored state
    assert resumed.left == 3
    for _ in range(3):
        resumed.step()
    assert resumed.left == 0 and m2.blocks[0].fc1.hot_config == hot.Config(rank=4)
    assert "warm-up" not in m2.blocks[0].fc1.hot_config_source()
    # a version-1 entry (config and LQS only) still loads
    sd = m2.state_dict()
    sd["blocks.0.fc1._extra_state"] = {"version": 1, "config": hot.Config(rank=2).to_dict(), "lqs": None}
    m2.load_state_dict(sd)
    assert m2.blocks[0].fc1.hot_config.rank == 2 and m2.blocks[0].fc1.hot_warmup is None


def test_warmup_switches_once_and_calibration_during_it_sets_the_target():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ht.convert(m, hot.Config.paper())
    w = ht.Warmup(m, 2)
    assert all(l.hot_config == hot.Config() for _, l in ht.hot_layers(m))
    ht.lqs(m, (torch.randn(32, 16), torch.randint(0, 4, (32,))), F.cross_entropy)
    assert all(l.hot_config == hot.Config() for _, l in ht.hot_layers(m))  # still warming up
    w.step()
    assert m[0].hot_config == hot.Config()
    w.step()
    for _, l in ht.hot_layers(m):
        assert l.hot_config == hot.Config.paper(gx_scale=l.hot_lqs["choice"]) and l.hot_warmup is None
    w.step()  # past the end: nothing changes
    assert m[0].hot_warmup is None


def test_warmup_under_compile_recompiles_once_not_every_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ht.convert(m, hot.Config.paper())
    warm = ht.Warmup(m, 3)
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    step = torch.compile(m, backend=backend)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    for _ in range(8):
        F.cross_entropy(step(x), y).backward()
        opt.step()
        opt.zero_grad()
        warm.step()
    assert m[0].hot_config == hot.Config.paper()
    assert len(compiles) == 2, len(compiles)  # the warm-up graph, then the one after the switch
    torch._dynamo.reset()


def test_recalibrator_runs_every_n_steps():
    layer, x, gy = _layer_and_batch(smooth=True)
    rc = ht.Recalibrator(layer, lambda y: (y * gy).sum(), every=3)
    runs = [rc.step(x) is not None for _ in range(7)]
    assert runs == [True, False, False, True, False, False, True]
    assert layer.hot_config.rank == 4
    rc2 = ht.Recalibrator(layer, lambda y: (y * gy).sum(), every=3)
    rc2.load_state_dict(rc.state_dict())
    assert rc2.step(x) is None  # step 7 of 9: not due


@pytest.mark.parametrize("call,match", [
    (lambda m: ht.calibrate(m, torch.randn(4, 8), lambda y: y.sum(), budget=0), "budget must be a positive"),
    (lambda m: ht.calibrate(m, torch.randn(4, 8), lambda y: y.sum(), bias_budget=-1), "bias_budget must be a posit"),
    (lambda m: ht.calibrate(m, torch.randn(4, 8), lambda y: y.sum(), ranks=(0,)), "ranks must be integers in 1..16"),
    (lambda m: ht.calibrate(m, torch.randn(4, 8), lambda y: y), "loss_fn must return a scalar"),
    (lambda m: ht.Recalibrator(m, lambda y: y.sum(), every=0), "every must be a positive integer"),
    (lambda m: ht.Warmup(m, -1), "steps must be a non-negative integer"),
    (lambda m: ht.Warmup(m, 3, config="int8"), "config must be a hot.Config"),
    (lambda m: ht.Warmup(nn.Linear(2, 2), 3), "no HOT layers"),
    (lambda m: ht.calibrate(nn.Linear(2, 2), torch.randn(4, 2), lambda y: y.sum()), "no HOT layers"),
], ids=["budget", "bias_budget", "ranks", "loss", "every", "steps", "config", "warmup_unconverted", "calibrate_unconverted"])
def test_bad_arguments_are_named(call, match):
    m = ht.Linear(8, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        call(m)
