#!/usr/bin/env python3
"""Static report of hot's CUDA kernels: registers, spills and SASS instruction counts, with no GPU.

Recompiles one CUDA source of a configured build directory with `-Xptxas -v` (the build's own command line, so
the same flags and architectures), then, if cuobjdump and nvdisasm are on the PATH, disassembles the object and
counts instructions per kernel. The numbers are what benchmarks/NOTES.md quotes as "ptxas" / "SASS" figures.

    python3 scripts/kernel_report.py BUILD_DIR [--source cpp/src/cuda/layer_ops.cu] [--filter REGEX]

cuobjdump and nvdisasm ship with the CUDA toolkit; where the toolkit lacks them, the PyPI wheels
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm carry them (bin/ inside the unpacked wheel).
"""
import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile


def demangle(names):
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out))


def short(name):
    name = re.sub(r"hot::cuda::\(anonymous namespace\)::", "", name)
    name = re.sub(r"^void ", "", name)
    return re.sub(r"\(.*\)$", "", name)


def parse_ptxas(log):
    """{mangled entry: (registers, spill stores, spill loads, stack bytes)} from `ptxas -v` output."""
    res, cur, active = {}, None, False
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur, active = m.group(1), True
            res[cur] = [0, 0, 0, 0]
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            active = m.group(1) == cur  # properties of a called (non-entry) function follow too
            continue
        if cur is None or not active:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            res[cur][3], res[cur][1], res[cur][2] = int(m.group(1)), int(m.group(2)), int(m.group(3))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            res[cur][0] = int(m.group(1))
    return res


def parse_sass(text):
    """{mangled function: {"all": n, "BRA": n, ...}} from `cuobjdump -sass`."""
    res = {}
    for part in text.split("Function : ")[1:]:
        name = part.split("\n", 1)[0].strip()
        ins = [re.sub(r"^@!?U?P\w+\s+", "", i.strip()) for i in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", part)]
        ops = [i.split()[0].split(".")[0] if i else "" for i in ins]
        c = {"all": len(ins)}
        for op in ("BRA", "STL", "LDL", "LDS", "STS", "SHFL", "F2I", "BAR"):
            c[op] = sum(1 for o in ops if o == op)
        res[name] = c
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--source", default="cpp/src/cuda/layer_ops.cu")
    ap.add_argument("--filter", default="qgo", help="regex on the demangled kernel name")
    a = ap.parse_args()

    target = None
    cmds = subprocess.run(["ninja", "-C", a.build_dir, "-t", "commands"], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    for c in cmds:
        if "nvcc" in c and os.path.basename(a.source) in c and " -c " in c:
            target = c
    if target is None:
        sys.exit(f"no nvcc command for {a.source} in {a.build_dir} (configure with -DHOT_CUDA=ON)")
    args = shlex.split(target)
    with tempfile.TemporaryDirectory() as tmp:
        obj = os.path.join(tmp, "k.o")
        out = []
        skip = False
        for x in args:  # our own object file and no dependency file
            if skip:
                skip = False
                continue
            if x in ("-o", "-MF", "-MT"):
                skip = x in ("-MF", "-MT")
                if x == "-o":
                    out += ["-o", obj]
                    skip = True
                continue
            if x == "-MD":
                continue
            out.append(x)
        out += ["-Xptxas", "-v"]
        r = subprocess.run(out, cwd=a.build_dir, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(r.stderr[-4000:])
        regs = parse_ptxas(r.stderr + r.stdout)
        sass = {}
        if shutil.which("cuobjdump") and shutil.which("nvdisasm"):
            sass = parse_sass(subprocess.run(["cuobjdump", "-sass", obj], capture_output=True, text=True).stdout)
        names = demangle(sorted(set(regs) | set(sass)))
    print(f"| kernel | registers | spill st/ld B | stack B | SASS instr | BRA | LDS | STS | SHFL | F2I | STL | LDL |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m, dn in sorted(names.items(), key=lambda kv: short(kv[1])):
        n = short(dn)
        if not re.search(a.filter, n):
            continue
        rg = regs.get(m, [0, 0, 0, 0])
        s = sass.get(m)
        cols = [str(s[k]) for k in ("all", "BRA", "LDS", "STS", "SHFL", "F2I", "STL", "LDL")] if s else ["-"] * 8
        print(f"| {n} | {rg[0]} | {rg[1]}/{rg[2]} | {rg[3]} | " + " | ".join(cols) + " |")
    if not sass:
        print("\n(no cuobjdump/nvdisasm on the PATH: SASS columns left out)")


if __name__ == "__main__":
    main()
