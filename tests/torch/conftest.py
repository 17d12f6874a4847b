import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

torch = pytest.importorskip("torch")
hot = pytest.importorskip("hot")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and hot.cuda_available() else [])


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes long on a 2-core CPU (deselect with -m \"not slow\")")
