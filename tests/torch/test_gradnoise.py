"""hot.experiments.gradnoise / hot gradnoise: end-to-end gradient error against exact and the batch-sampling noise."""
import json
import math

import pytest

import hot.experiments.gradnoise as hg
from hot.cli import main

SMALL = dict(model="vit", task="synth-tiny", draws=2, batch=32, ref_batches=3)


@pytest.fixture(scope="module")
def report():
    return hg.gradient_noise(methods=("exact", "hot-r8", "hot-gx8-r16"), **SMALL)


def test_exact_method_has_zero_error_and_batch_noise_is_positive(report):
    # The same model, batch and weights through the exact path: the gradients are the same numbers.
    assert set(report.weights) == set(report.batch_noise)
    assert report.weights[0] == "patch.weight" and report.weights[-1] == "head.weight"  # model order
    assert all(v == 0.0 for v in report.one_draw["exact"].values())
    assert all(v == 0.0 for v in report.mean_draw["exact"].values())
    assert all(0.05 < v < 2.0 for v in report.batch_noise.values()), report.batch_noise


def test_hot_errors_are_positive_and_ordered_by_bits(report):
    # 4-bit per-tensor g_x and rank-8 HLA against 8-bit full rank: on every weight the 8-bit run is closer.
    for w in report.weights:
        hot, hot8 = report.one_draw["hot-r8"][w], report.one_draw["hot-gx8-r16"][w]
        assert 0 < hot8 < hot, (w, hot8, hot)
    # The input layer stays exact, but its g_y comes through every HOT layer: it carries their error.
    assert report.one_draw["hot-r8"]["patch.weight"] > 0.05
    # The stochastic part shrinks in the mean of the draws: never above the one-draw error by much.
    for m in ("hot-r8", "hot-gx8-r16"):
        for w in report.weights:
            assert report.mean_draw[m][w] <= 1.05 * report.one_draw[m][w] + 1e-12, (m, w)


def test_report_is_reproducible_and_round_trips(report, tmp_path):
    again = hg.gradient_noise(methods=("exact", "hot-r8", "hot-gx8-r16"), **SMALL)
    assert again.to_json() == report.to_json()
    back = hg.GradNoiseReport.from_json(json.loads(json.dumps(report.to_json())))
    assert back == report
    md, js, png = hg.save(report, str(tmp_path), "g")
    text = open(md).read()
    assert "| patch.weight |" in text and "hot-gx8-r16" in text and open(png, "rb").read(4) == b"\x89PNG"
    assert math.isclose(report.power_ratio("hot-r8", "head.weight"),
                        (report.one_draw["hot-r8"]["head.weight"] / report.batch_noise["head.weight"]) ** 2)


@pytest.mark.parametrize("kw, words", [
    (dict(methods=("nope",)), "unknown method 'nope'"),
    (dict(draws=1), "draws must be at least 2"),
    (dict(trained_steps=5), "trained_steps must be 0 or at least 20"),
    (dict(ref_batches=1), "ref_batches"),
])
def test_bad_arguments_are_named(kw, words):
    args = dict(SMALL, methods=("hot",))
    args.update(kw)
    with pytest.raises(ValueError, match=words):
        hg.gradient_noise(**args)


def test_cli_writes_report_and_rejects_bad_method(tmp_path, capsys):
    rc = main(["gradnoise", "--task", "synth-tiny", "--methods", "exact,hot", "--draws", "2", "--batch", "16",
               "--ref-batches", "2", "--out", str(tmp_path), "--name", "gn"])
    assert rc == 0
    assert {p.name for p in tmp_path.iterdir()} == {"gn.md", "gn.json", "gn.png"}
    assert "hot gradnoise --task synth-tiny" in (tmp_path / "gn.md").read_text()
    assert main(["gradnoise", "--task", "synth-tiny", "--methods", "hot,bogus", "--out", str(tmp_path)]) == 2
    assert "unknown method 'bogus'" in capsys.readouterr().err


def test_g_y_concentration_per_token_never_leaves_more_entries_below_a_step(report):
    # Per-token scales use each row's own amax (<= the tensor's), so fewer or as many entries fall below a step.
    assert [r["layer"] for r in report.rows][0] == "patch" and report.rows[-1]["layer"] == "head"
    for r in report.rows:
        assert 0.0 <= r["below_token"] <= r["below_tensor"] <= 1.0, r
        assert 0.0 < r["top_rows_energy"] <= 1.0, r
    assert any(r["below_token"] < r["below_tensor"] for r in report.rows)
