"""A small model trained a few hundred steps on scikit-learn's digits: HOT within 1 point of exact."""
import copy

import pytest
import torch

import hot
import hot.torch as ht
from hot.experiments import models

pytest.importorskip("sklearn")
from hot.experiments.train import load_digits, train  # noqa: E402


@pytest.mark.parametrize("model", ["cnn"])
def test_digits_accuracy_close_to_exact(model):
    data = load_digits("cpu")
    torch.manual_seed(0)
    base = models.build(model, width=16) if model == "cnn" else models.build(model)
    acc = {}
    for name in ("exact", "hot"):
        m = copy.deepcopy(base)
        torch.manual_seed(1)
        if name == "hot":
            ht.convert(m, hot.Config())
        acc[name] = train(m, data, 300, 64, 3e-3, 0, "cpu", measure=False).accuracy
    assert acc["exact"] > 90.0, acc
    assert acc["hot"] >= acc["exact"] - 1.0, acc
