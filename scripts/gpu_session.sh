#!/usr/bin/env bash
# One device call that does what a session needs, within one 10-minute command: the C++ build (with the
# Python module, so no second build is needed), ctest, the kernel benchmarks (scripts/gpu_check.sh), then the
# CUDA pytest cases against that build and, if asked, model benchmarks and GPU training parity.
# Everything is logged under $OUT/work and packed into $OUT/logs.tgz; bench.md and a summary stay beside it
# (the device tool brings back at most 8 files).
# Knobs: GPU_CHECK_STEPS (default "build test bench"), GPU_CHECK_BUDGET_S (default 330), PYTEST_ARGS
# (default: the CUDA cases; "none": skipped), BENCH_PLAN (run_bench_models.sh; empty: skipped), PARITY_ARGS (hot parity; empty:
# skipped), SESSION_BUDGET_S (default 570).
set -u
T0=$(date +%s)
FINAL=${OUT:-$PWD/gpu_out}
W=$FINAL/work
mkdir -p "$W"
left() { echo $(( ${SESSION_BUDGET_S:-570} - ( $(date +%s) - T0 ) )); }
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false  # logs survive a timeout; jax takes no 75% of the GPU
{
  OUT=$W HOT_BUILD_PYTHON=ON GPU_CHECK_STEPS="${GPU_CHECK_STEPS:-build test bench}" \
    GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-330} bash scripts/gpu_check.sh
  export PYTHONPATH=$PWD/python
  ROOT=$PWD
  if [[ ${PYTEST_ARGS:-} == none ]]; then
    echo "pytest skipped (PYTEST_ARGS=none)"
  elif ls python/hot/_C*.so > /dev/null 2>&1 && (( $(left) > 40 )); then
    (cd /tmp && python3 -m hot info) > "$W/hot_info.txt" 2>&1
    if [[ -n ${PYTEST_ARGS:-} ]]; then read -r -a PA <<< "$PYTEST_ARGS"; else PA=("$ROOT/tests" -k "cuda or gpu"); fi
    # SIGINT at the limit: pytest still prints its summary and the test it was in; -rfEs lists failures and skips
    (cd /tmp && timeout -s INT -k 10 $(( $(left) > 220 ? 200 : $(left) - 20 )) \
       python3 -m pytest -q -p no:cacheprovider -rfEs "${PA[@]}") > "$W/pytest.log" 2>&1
    echo "pytest rc=$?: $(tail -1 "$W/pytest.log")"
    grep -E "^(FAILED|ERROR)" "$W/pytest.log" | head -20
  else
    echo "pytest skipped (no python/hot/_C module or no time left)"
  fi
  if [[ -n ${BENCH_PLAN:-} ]] && (( $(left) > 60 )); then
    OUT=$W/models BENCH_CONFIG_TIMEOUT=${BENCH_CONFIG_TIMEOUT:-80} BENCH_DEADLINE=$(( $(date +%s) + $(left) - 25 )) \
      timeout $(( $(left) - 15 )) bash benchmarks/run_bench_models.sh > "$W/bench_models.log" 2>&1
    echo "bench_models rc=$?"; tail -30 "$W/bench_models.log"
  fi
  if [[ -n ${PARITY_ARGS:-} ]] && (( $(left) > 60 )); then
    (cd /tmp && timeout $(( $(left) - 15 )) python3 -m hot parity $PARITY_ARGS --out "$W/parity") > "$W/parity.log" 2>&1
    echo "parity rc=$?"; tail -25 "$W/parity.log"
  fi
  echo "session total $(( $(date +%s) - T0 )) s"
} 2>&1 | tee "$W/session.txt"
cp "$W/session.txt" "$FINAL/session.txt" 2>/dev/null
cp "$W/bench.md" "$FINAL/bench.md" 2>/dev/null
[[ -f $W/models/bench_models.md ]] && cp "$W/models/bench_models.md" "$FINAL/bench_models.md"
tar -czf "$FINAL/logs.tgz" -C "$W" . && rm -rf "$W"
