#!/usr/bin/env bash
# One-shot GPU check, run on the GPU machine from the repository root:
#   build (cmake + ninja, -j16, HOT_CUDA_ARCHS=${HOT_CUDA_ARCHS:-90a}), ctest (CPU + CUDA suites; the Emu_* CPU
#   emulation suites are CI's and not built here), compute-sanitizer memcheck on the CUDA gtests, the benchmarks,
#   and (if time allows) a compile-only build of the CUDA backend for sm_80. Logs go to $OUT (default ./gpu_out); a summary table is printed last.
# Needs: the nvidia-cutlass wheel in .whl/ (carried) unless third_party/cutlass is checked out;
# GoogleTest from the system, else built from /usr/src/googletest or .carry/googletest.
# Environment knobs: GPU_CHECK_BUDGET_S (default 520): later steps are skipped when it would be exceeded;
# GPU_CHECK_STEPS (default "build test sanitize bench sm80 profile"); profile: PROFILE_LAYERS, NCU_SKIP, NCU_COUNT,
# NCU_SECTIONS (Nsight Compute section names), NCU_LINES.
set -u
T0=$(date +%s)
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-520}
STEPS=${GPU_CHECK_STEPS:-"build test sanitize bench sm80 profile"}
ARCHS=${HOT_CUDA_ARCHS:-90a}
BUILD=/tmp/hot_build
declare -a SUMMARY
elapsed() { echo $(( $(date +%s) - T0 )); }
note() { SUMMARY+=("$(printf '| %-22s | %-9s | %5ss | %s |' "$1" "$2" "$(elapsed)" "$3")"); }
want() { [[ " $STEPS " == *" $1 "* ]]; }
left() { echo $(( BUDGET - $(elapsed) )); }

{
  echo "date: $(date -u)"; nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1
  nvcc --version | tail -2; cmake --version | head -1; ninja --version; python3 --version
  nproc; free -g | head -2
} > "$OUT/env.txt" 2>&1
GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)

# CUTLASS: the submodule if checked out, else the carried wheel.
CUTLASS_ARG=()
if [[ ! -f third_party/cutlass/include/cutlass/cutlass.h ]]; then
  if ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass-*.whl >> "$OUT/env.txt" 2>&1
    CUTLASS_ARG=(-DHOT_CUTLASS_DIR=/tmp/site/cutlass_library/source/include)
  fi
fi
# GoogleTest
GTEST_ARG=()
have_gtest() {
  local p
  for p in /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest.so /usr/local/lib/libgtest.a \
           /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/local/lib/cmake/GTest; do
    [[ -e $p ]] && return 0
  done
  return 1
}
if ! have_gtest; then
  SRC=/usr/src/googletest; [[ -f $SRC/CMakeLists.txt ]] || SRC=$PWD/.carry/googletest
  { cmake -S "$SRC" -B /tmp/gtest_build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF -DCMAKE_INSTALL_PREFIX=/tmp/gtest \
    && cmake --build /tmp/gtest_build -j16 && cmake --install /tmp/gtest_build; } > "$OUT/env.txt.gtest" 2>&1
  cat "$OUT/env.txt.gtest" >> "$OUT/env.txt"; rm -f "$OUT/env.txt.gtest"
  GTEST_ARG=(-DCMAKE_PREFIX_PATH=/tmp/gtest)
fi

PY_ARG=()
if [[ ${HOT_BUILD_PYTHON:-OFF} == ON ]]; then
  PY_ARG=(-Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python3)")
fi

if want build; then
  tb=$(date +%s)
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DHOT_CUDA=ON -DHOT_CUDA_ARCHS="$ARCHS" \
        -DHOT_BUILD_PYTHON=${HOT_BUILD_PYTHON:-OFF} -DHOT_BUILD_EMU_TESTS=OFF \
        "${PY_ARG[@]}" "${CUTLASS_ARG[@]}" "${GTEST_ARG[@]}" > "$OUT/build.log" 2>&1 \
    && ninja -C $BUILD -j16 -k 0 >> "$OUT/build.log" 2>&1
  rc=$?
  note "build ($ARCHS)" "$([[ $rc == 0 ]] && echo ok || echo FAIL)" "$(( $(date +%s) - tb ))s wall; $(grep -c 'C7510' "$OUT/build.log") wgmma-serialisation warnings"
  [[ $rc == 0 ]] || { grep -E "error|Error" "$OUT/build.log" | head -30; }
fi

# sm_80 compile-only check in the background (CPU only) while the GPU steps run.
if want sm80 && [[ -f $BUILD/build.ninja ]]; then
  ( cmake -S . -B /tmp/hot_build80 -G Ninja -DCMAKE_BUILD_TYPE=Release -DHOT_CUDA=ON -DHOT_CUDA_ARCHS=80 \
      -DHOT_BUILD_PYTHON=OFF -DHOT_BUILD_TESTS=OFF -DHOT_BUILD_BENCHMARKS=OFF "${CUTLASS_ARG[@]}" > "$OUT/build80.log" 2>&1 \
    && nice ninja -C /tmp/hot_build80 -j6 hot_cuda >> "$OUT/build80.log" 2>&1; echo "rc=$?" >> "$OUT/build80.log" ) &
  SM80_PID=$!
fi

if want test && [[ -x $BUILD/hot_cuda_tests || -x $BUILD/hot_tests ]]; then
  # what the later steps need is held back from ctest's time: the benchmarks ~90 s, memcheck ~110 s
  reserve=10
  want bench && reserve=$(( reserve + 90 ))
  want sanitize && reserve=$(( reserve + 110 ))
  ct=$(( $(left) - reserve ))
  (( ct < 60 )) && ct=60
  (cd $BUILD && timeout $ct ctest -j4 --output-on-failure > "$OUT/ctest.log" 2>&1)
  rc=$?
  note "ctest" "$([[ $rc == 0 ]] && echo ok || echo FAIL)" "$(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
  grep -E "^\s*[0-9]+ - .*\(Failed|Timeout|SEGFAULT|Subprocess" "$OUT/ctest.log" | head -20
fi

if want sanitize && [[ -x $BUILD/hot_cuda_tests ]] && (( $(left) > 150 )); then
  HOT_CUDA_TEST_SMALL=1 timeout $(( $(left) - 110 )) compute-sanitizer --tool memcheck --leak-check no --error-exitcode 99 \
    $BUILD/hot_cuda_tests --gtest_brief=1 > "$OUT/sanitizer.log" 2>&1
  rc=$?
  note "memcheck (small shapes)" "$([[ $rc == 0 ]] && echo ok || echo "rc=$rc")" "$(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
else
  want sanitize && note "memcheck" "skipped" "not enough time left or no test binary"
fi

if want bench && [[ -x $BUILD/hot_bench ]] && (( $(left) > 45 )); then
  timeout $(( $(left) - 15 )) $BUILD/hot_bench "$OUT/bench.md" > "$OUT/bench.log" 2>&1
  rc=$?
  note "benchmarks" "$([[ $rc == 0 ]] && echo ok || echo "rc=$rc")" "see bench.md"
fi

# Profile: SASS size of the layer kernels and an Nsight Compute look at the g_y pass / weight kernels.
if want profile && [[ -x $BUILD/hot_bench ]] && (( $(left) > 60 )); then
  {
    echo "== SASS instructions per kernel (layer_ops, ops_basic)"
    for o in $(find $BUILD -name 'layer_ops.cu.o' -o -name 'ops_basic.cu.o'); do
      cuobjdump -sass "$o" | awk '/Function :/{name=$3} /\/\*[0-9a-f]+\*\//{n[name]++} END{for(k in n) print n[k], k}' | sort -n | tail -12
    done
    echo "== ncu"
    HOT_BENCH_LAYERS=${PROFILE_LAYERS:-0} HOT_BENCH_GEMMS=0 timeout $(( $(left) - 30 )) ncu --kernel-name regex:'qgo(16)?_kernel|weight_quant' \
      --launch-skip ${NCU_SKIP:-8} --launch-count ${NCU_COUNT:-4} \
      $(printf -- '--section %s ' ${NCU_SECTIONS:-SpeedOfLight Occupancy LaunchStats WarpStateStats MemoryWorkloadAnalysis}) \
      $BUILD/hot_bench /dev/null 2>&1 | grep -v "^hot\||" | tail -${NCU_LINES:-400}
  } > "$OUT/profile.txt" 2>&1
  note "profile" "done" "profile.txt"
fi

if [[ -n ${SM80_PID:-} ]]; then
  if (( $(left) > 5 )); then timeout $(( $(left) > 5 ? $(left) : 5 )) tail --pid=$SM80_PID -f /dev/null; fi
  note "compile-only sm_80" "$(grep -q '^rc=0' "$OUT/build80.log" && echo ok || echo 'FAIL/unfinished')" "$(tail -1 "$OUT/build80.log" | cut -c1-60)"
fi

echo
echo "GPU: $GPU"
[[ -f $OUT/bench.md ]] && sed -n '/## Per-layer/,$p' "$OUT/bench.md" | grep -E '^\|' | cut -d'|' -f2,6,11,13-18 | head -12
[[ -f $OUT/bench.md ]] && sed -n '/## g_y pass and ABC kernels/,/## Integer/p' "$OUT/bench.md" | grep -E '^\|' | head -10
echo
echo "| step                   | result    | t     | detail |"
printf '%s\n' "${SUMMARY[@]}"
