#!/usr/bin/env python3
"""Where a kernel's instructions go: a summary of Nsight Compute's per-SASS-instruction counters.

The hot passes are issue-bound (benchmarks/NOTES.md), so the question for each of them is which instructions it
executes. Nsight Compute records, per SASS instruction, how often it ran and how often a warp stalled on it; this
script groups consecutive instructions that ran equally often (a straight-line region, or one loop body) and prints,
per kernel launch, the regions that hold the most executed instructions with their opcode mix and stall share.
No -lineinfo is needed.

Capture on the GPU machine, then summarise (here or there):
    ncu --kernel-name regex:qgo16 --launch-count 4 --section SourceCounters -o rep python3 script.py
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep_source.csv
    python3 benchmarks/ncu_hotspots.py rep_source.csv [--min-share 1.5]
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from typing import Dict, List

_OPCODE = re.compile(r"\s*(?:@!?U?P[0-9T]\s+)?([A-Z0-9_]+)")


def kernels(rows: List[List[str]]):
    """(kernel name, header, instruction rows) per launch in the CSV; a listing identical to the one before it (ncu's
    export repeats some) is given once."""
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] + [len(rows)]
    previous = None
    for a, b in zip(starts, starts[1:]):
        if a + 1 >= len(rows):
            continue
        listing = (rows[a][1], rows[a + 2:b])
        if listing != previous:
            yield rows[a][1], rows[a + 1], rows[a + 2:b]
        previous = listing


def summarise(name: str, header: List[str], body: List[List[str]], min_share: float) -> str:
    try:
        i_src, i_exe = header.index("Source"), header.index("Instructions Executed")
        i_thr = header.index("Thread Instructions Executed")
        i_stall = header.index("Warp Stall Sampling (All Samples)")
    except ValueError as e:
        raise SystemExit(f"ncu_hotspots: the CSV lacks a column ({e}); capture with --section SourceCounters and "
                         f"export with --page source --csv --print-source sass")
    regions: List[Dict] = []
    for r in body:
        if len(r) <= max(i_src, i_exe, i_thr, i_stall):
            continue
        count, thr, stall = int(r[i_exe] or 0), int(r[i_thr] or 0), int(r[i_stall] or 0)
        m = _OPCODE.match(r[i_src])
        op = m.group(1) if m else "?"
        if regions and regions[-1]["count"] == count:
            g = regions[-1]
        else:
            g = {"count": count, "n": 0, "thr": 0, "stall": 0, "ops": collections.Counter(), "first": r[i_src].strip()}
            regions.append(g)
        g["n"] += 1
        g["thr"] += thr
        g["stall"] += stall
        g["ops"][op] += 1
    warp = sum(g["count"] * g["n"] for g in regions)
    thr = sum(g["thr"] for g in regions) or 1
    stall = sum(g["stall"] for g in regions) or 1
    out = [f"## {name}", f"{warp:,} warp instructions executed, {thr:,} thread instructions", "",
           "| runs | instructions | thread instr. share | stall share | opcodes (static count) |",
           "|---|---|---|---|---|"]
    for g in regions:
        share = 100.0 * g["thr"] / thr
        if share < min_share:
            continue
        ops = ", ".join(f"{o} {c}" for o, c in g["ops"].most_common(10))
        out.append(f"| {g['count']:,} | {g['n']} | {share:.1f}% | {100.0 * g['stall'] / stall:.1f}% | {ops} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--min-share", type=float, default=1.5,
                    help="hide regions below this share of the instructions (%%)")
    a = ap.parse_args()
    with open(a.csv, newline="") as f:
        rows = list(csv.reader(f))
    found = False
    for name, header, body in kernels(rows):
        found = True
        print(summarise(name, header, body, a.min_share) + "\n")
    if not found:
        print(f"ncu_hotspots: no 'Kernel Name' rows in {a.csv}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
