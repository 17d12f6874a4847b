"""The hot command: info, summary, demo (short run), python -m hot."""
import subprocess
import sys

import pytest

import hot
from hot.__main__ import main


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"hot {hot.__version__}" in out and "cpu backend" in out and "cuda:" in out and "torch:" in out


@pytest.mark.parametrize("model", ["vit", "cnn"])
def test_summary(model, capsys):
    assert main(["summary", model, "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "converted" in out and "kept (HOT)" in out and "int8 full rank" in out and "int8 tensor" in out
    assert main(["summary", model, "--batch", "16", "--rank", "8", "--gx-bits", "4"]) == 0
    out = capsys.readouterr().out
    assert "int8 HLA r=8" in out and "int4 tensor" in out and "paper" in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_demo_short_run(capsys):
    pytest.importorskip("sklearn")
    assert main(["demo", "--steps", "12", "--batch", "32", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for key in ("test accuracy (%)", "kept for backward", "step time", "exact", "HOT"):
        assert key in out


def test_python_dash_m(tmp_path):
    # The same interpreter and environment as this test run, so the same hot package.
    r = subprocess.run([sys.executable, "-m", "hot", "info"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "backends" in r.stdout


BAD_OPTIONS = [(["summary", "vit", "--rank", "0"], "--rank"), (["summary", "vit", "--rank", "17"], "--rank"),
               (["summary", "vit", "--batch", "-3"], "--batch"), (["demo", "--rank", "0"], "--rank"),
               (["parity", "--threads", "-1"], "--threads"), (["parity", "--device", "foo"], "--device"),
               (["gradnoise", "--device", "foo"], "--device"), (["fidelity", "--batch", "0"], "--batch")]


@pytest.mark.parametrize("argv,option", [pytest.param(a, o, id=" ".join(a)) for a, o in BAD_OPTIONS])
def test_bad_option_values_are_usage_errors(argv, option, capsys):
    """argparse refuses them (exit 2, the option named) before any work, instead of a traceback later."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: expected" in err and argv[-1] in err
