"""benchmarks/ncu_hotspots.py on a small Nsight Compute source-page CSV: regions are runs of equally often executed
instructions, their shares are of the thread instructions, and a repeated listing is summarised once."""
import csv
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "ncu_hotspots.py")
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "Thread Instructions Executed"]


def _load():
    spec = importlib.util.spec_from_file_location("ncu_hotspots", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path, listings):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for name, instrs in listings:
            w.writerow(["Kernel Name", name])
            w.writerow(HEADER)
            for i, (src, stall, count) in enumerate(instrs):
                w.writerow([hex(i * 16), src, stall, count, count * 32])


def test_regions_shares_and_repeated_listings(tmp_path, capsys, monkeypatch):
    prologue = [("LDC R1, c[0x0][0x28]", 6, 10), ("S2R R0, SR_TID.X", 0, 10)]
    loop = [("@!P0 FADD R2, R2, R3", 1, 40), ("IMAD R4, R4, R5, RZ", 1, 40), ("BRA 0x40", 2, 40)]
    tail = [("EXIT", 0, 10)]
    k1 = ("kernel_a", prologue + loop + tail)
    _write(tmp_path / "a.csv", [k1, k1, ("kernel_b", tail)])  # kernel_a listed twice, as ncu's export does
    monkeypatch.setattr("sys.argv", ["ncu_hotspots.py", str(tmp_path / "a.csv"), "--min-share", "0"])
    assert _load().main() == 0
    out = capsys.readouterr().out
    assert out.count("## kernel_a") == 1 and out.count("## kernel_b") == 1
    # kernel_a: 2 * 10 + 3 * 40 + 10 = 150 warp instructions; the loop holds 120 of them (80 %) and 4 of the 10 stall
    # samples; the tail (EXIT, also 10 runs) follows the loop, so it is a region of its own
    assert "150 warp instructions executed, 4,800 thread instructions" in out
    rows = [line for line in out.splitlines() if line.startswith("| 40 |")]
    assert rows == ["| 40 | 3 | 80.0% | 40.0% | FADD 1, IMAD 1, BRA 1 |"]
    assert "| 10 | 2 | 13.3% | 60.0% | LDC 1, S2R 1 |" in out
    assert "| 10 | 1 | 6.7% | 0.0% | EXIT 1 |" in out


def test_missing_columns_are_named(tmp_path, monkeypatch):
    (tmp_path / "b.csv").write_text('"Kernel Name","k"\n"Address","Source"\n"0x0","EXIT"\n')
    monkeypatch.setattr("sys.argv", ["ncu_hotspots.py", str(tmp_path / "b.csv")])
    try:
        _load().main()
    except SystemExit as e:
        assert "SourceCounters" in str(e)
    else:
        raise AssertionError("a CSV without the counters must be refused")
