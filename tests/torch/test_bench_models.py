"""benchmarks/bench_models.py on the CPU with tiny sizes (--cpu-smoke): every model, mode and precision runs,
the report has the expected rows, and the bytes kept for backward are what ABC prescribes (SPEC §2, §8)."""
import importlib.util
import json
import os

import pytest

torch = pytest.importorskip("torch")
hot = pytest.importorskip("hot")
ht = pytest.importorskip("hot.torch")
pytest.importorskip("hot.torch.summary")

from hot.torch.ops import padded_k  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_models.py")
MODELS = ("vit_b16", "resnet50", "llama_block")
MODES = ("exact", "hot", "hot-plain", "hot-paper", "lora", "hot+lora")
DTYPES = ("fp32", "bf16")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("bench_models")
    torch.manual_seed(0)
    # the built-in peft-style LoRA wrapper: importing peft (and transformers) alone takes seconds
    assert mod.main(["--cpu-smoke", "--out", str(out), "--warmup", "0", "--steps", "1", "--hooked-steps", "1",
                     "--lora-fallback"]) == 0
    with open(out / "bench_models.json") as f:
        data = json.load(f)
    md = (out / "bench_models.md").read_text()
    return data, md


def _get(data, model, mode, dtype):
    rows = [r for r in data["results"] if (r["model"], r["mode"], r["dtype"]) == (model, mode, dtype)]
    assert len(rows) == 1, (model, mode, dtype, len(rows))
    return rows[0]


def test_every_configuration_ran(report):
    data, md = report
    assert len(data["results"]) == len(MODELS) * len(MODES) * len(DTYPES)
    for m in MODELS:
        for mode in MODES:
            for dt in DTYPES:
                r = _get(data, m, mode, dt)
                assert r["status"] == "ok", r
                assert r["batch"] == 2 and r["layers"] > 0
                for k in ("step_ms", "fwd_ms", "bwd_ms", "opt_ms", "hooked_bwd_ms", "layers_bwd_ms"):
                    assert r[k] > 0, (m, mode, dt, k, r[k])
                # the layers' backward intervals lie inside the backward pass of the same steps
                assert r["layers_bwd_ms"] <= r["hooked_bwd_ms"] * 1.001
                assert r["layers_timed"] > 0
                s = r["saved"]
                assert s["total"] > 0 and sum(s["categories"].values()) == s["total"]
    env = data["environment"]
    for k in ("gpu", "driver", "torch", "torch_cuda", "timm", "hot_build"):
        assert k in env
    for heading in ("## All configurations", "## Speed: HOT against exact", "## What is kept for backward",
                    "## Why HOT's saving", "paper (analytic)", "| vit_b16 | hot | fp32 | 2 |"):
        assert heading in md, heading


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hot_layers_keep_the_abc_buffer(report, model, dtype):
    data, _ = report
    ex, ho = _get(data, model, "exact", dtype), _get(data, model, "hot", dtype)
    elt = 4 if dtype == "fp32" else 2
    # measured int8 buffers + scales = the analytic sizes hot.torch.summary computes
    assert ho["saved"]["layers_hot"] == ho["abc_analytic"] > 0
    assert ho["saved"]["layers_input"] == 0 and ex["saved"]["layers_hot"] == 0
    checked = 0
    for name, info in ho["layer_info"].items():
        hb = ho["saved"]["per_layer"][name]["hot"]
        xb = ex["saved"]["per_layer"][name]["input"]
        rows, i = info["rows"], info["in"]
        if info["keeps_input"] or info["shares_buffer"]:  # its producer keeps its input, or another layer keeps the
            # ABC buffer of it (SPEC §2): no int8 copy of its own
            assert hb == 0, name
            checked += 1
            continue
        if info["type"] == "Linear" or info["pointwise"]:  # a pointwise conv: its pixel rows' codes (ABC's bytes)
            assert hb == i * padded_k(rows, info["rank"]) + 4, name
            if rows % 32 == 0:  # no padding: r/16 of the rows at 1 byte for elt (r = 16: 1/4 of fp32, 1/2 of bf16)
                read = rows * i * elt  # the rows the layer reads (a stride-s pointwise conv: 1/s^2 of its input)
                assert xb == read if info["type"] == "Linear" else xb % read == 0, name
                assert hb - 4 == read * info["rank"] // (16 * elt), name
                checked += 1
        else:  # Conv2d: the int8 input feature map + the scale
            assert hb - 4 == xb // elt, name
            checked += 1
    assert checked >= 3
    assert ho["saved"]["layers_hot"] < ex["saved"]["layers_input"]


@pytest.mark.parametrize("model", ["vit_b16", "llama_block"])
def test_hot_keeps_less_in_total(report, model):
    data, _ = report
    for dt in DTYPES:
        ex, ho = _get(data, model, "exact", dt), _get(data, model, "hot", dt)
        assert ho["saved"]["total"] < ex["saved"]["total"]
        # what HOT does not touch (norms, attention, activations) is the same in both
        for k, v in ex["saved"]["categories"].items():
            if k.startswith(("normalisation", "attention", "activation")):
                assert ho["saved"]["categories"][k] == v, k


def test_hot_lora_base_layers_keep_nothing(report):
    data, _ = report
    for m in MODELS:
        for dt in DTYPES:
            r = _get(data, m, "hot+lora", dt)
            assert r["saved"]["layers_hot"] == 0 and r["saved"]["layers_input"] == 0
            assert all(not v["trainable"] for v in r["layer_info"].values())
            assert r["saved"]["categories"].get("LoRA adapters (their own inputs)", 0) > 0


def test_explanation_paragraphs(report):
    _, md = report
    assert md.count("Saved-tensor hooks count") == len(MODELS)
    assert "What HOT leaves in place" in md and "Under LoRA (base frozen)" in md


def test_keep_less_makes_resnet_lighter_than_exact(report):
    """convert's keep_less (SPEC §2): the convs after ReLUs keep int8 copies in place of the ReLUs' outputs, which the
    ReLUs replace by 1-bit masks, and the max-pool keeps window offsets, so the model keeps less than exact training;
    without (hot-plain) the convs keep the ReLUs' outputs: no more than exact, and more than with keep_less."""
    data, _ = report
    for dt in DTYPES:
        ex, ho, hr = (_get(data, "resnet50", m, dt) for m in ("exact", "hot", "hot-plain"))
        assert ho["saved"]["total"] < hr["saved"]["total"] <= ex["saved"]["total"], dt
        act = [k for k in ex["saved"]["categories"] if k.startswith("activation")]
        assert act and all(ho["saved"]["categories"].get(k, 0) < ex["saved"]["categories"][k] for k in act), dt
        assert ho["saved"]["layers_hot"] > hr["saved"]["layers_hot"], dt  # the int8 copies the masks make room for
