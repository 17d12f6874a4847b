"""A command whose optional packages are missing says, before any work, which packages and which extra to install."""
import os
import sys

import pytest

from hot.__main__ import main
from hot.cli import _extras


@pytest.mark.parametrize("argv,missing,want", [
    (["demo", "--steps", "20"], ["sklearn"], "pip install scikit-learn (or pip install 'hot[demo]')"),
    (["demo"], ["torch", "sklearn"], "needs torch and scikit-learn, which are not installed: pip install torch "
                                     "scikit-learn (or pip install 'hot[demo]')"),
    (["fidelity"], ["matplotlib"], "pip install matplotlib (or pip install 'hot[demo,analysis]')"),
    (["parity"], ["sklearn"], "pip install scikit-learn (or pip install 'hot[analysis,demo]')"),
    (["parity", "--task", "synth-tiny"], ["matplotlib"], "pip install matplotlib (or pip install 'hot[analysis]')"),
    (["gradnoise"], ["torch"], "pip install torch (or pip install 'hot[analysis]')"),
])
def test_missing_package_named_with_its_extra(argv, missing, want, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing may be written; if it were, not into the caller's directory
    for m in missing:
        monkeypatch.setitem(sys.modules, m, None)  # importlib.util.find_spec(m) is None: not installed
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hot {argv[0]}: error: needs ") and want in err, err
    assert os.listdir(tmp_path) == []


def test_extras_exist_in_pyproject():
    """Every extra a message names installs the package it is named for (pyproject.toml of this checkout)."""
    tomllib = pytest.importorskip("tomllib")
    path = os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")
    with open(path, "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for package, extra in _extras.PACKAGES.values():
        assert any(r.split(">")[0].split("=")[0].strip() == package for r in extras[extra]), (package, extra)
    # hot demo needs torch and scikit-learn: hot[demo] alone installs both
    assert {"torch", "scikit-learn"} <= {r.split(">")[0].split("=")[0].strip() for r in extras["demo"]}
