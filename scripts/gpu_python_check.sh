#!/usr/bin/env bash
# GPU check of the Python layers, run on the GPU machine from the repository root: installs hot with
# the CUDA backend (pip, scikit-build-core), then runs `hot info`, the whole pytest suite (numpy, torch,
# cupy and jax CUDA cases included; nothing skips for lack of a GPU), `hot demo` on the GPU when DEMO_ARGS
# is set and `hot parity $PARITY_ARGS` when PARITY_ARGS is set (its table printed; files under $OUT/parity).
# Logs under $OUT. Needs the nvidia-cutlass wheel in .whl/ (carried) unless the submodule is checked out.
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
T0=$(date +%s)
ARCHS=${HOT_CUDA_ARCHS:-90a}
DEFS=(-C "cmake.define.HOT_CUDA=ON" -C "cmake.define.HOT_CUDA_ARCHS=$ARCHS" -C "build-dir=/tmp/hot_pybuild")
if [[ ! -f third_party/cutlass/include/cutlass/cutlass.h ]] && ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass-*.whl
  DEFS+=(-C "cmake.define.HOT_CUTLASS_DIR=/tmp/site/cutlass_library/source/include")
fi
CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -q "${DEFS[@]}" . > "$OUT/pip_install.log" 2>&1
echo "install rc=$? ($(( $(date +%s) - T0 )) s)"
(cd /tmp && python3 -m hot info) 2>&1 | tee "$OUT/hot_info.txt"
(cd /tmp && timeout ${PYTEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -rs "$OLDPWD/tests" ${PYTEST_ARGS:-}) > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?: $(tail -1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
grep -E "^SKIPPED" "$OUT/pytest.log" | sed -E 's/^SKIPPED \[[0-9]+\] //' | sort | uniq -c | sort -rn | head -8
if [[ -n ${DEMO_ARGS+x} ]]; then
  (cd /tmp && timeout ${DEMO_TIMEOUT:-240} hot demo $DEMO_ARGS) > "$OUT/demo.txt" 2>&1
  echo "demo rc=$?"; tail -25 "$OUT/demo.txt"
fi
if [[ -n ${PARITY_ARGS:-} ]]; then
  # e.g. PARITY_ARGS="--task synth --device cuda --methods exact,hot,naive-int4,lbp-wht --seeds 3 --steps 600
  #   --n-train 20000 --n-test 5000" (about 2.5-4 min on one H100: an estimate, not yet measured)
  (cd /tmp && PYTHONUNBUFFERED=1 timeout ${PARITY_TIMEOUT:-300} hot parity $PARITY_ARGS --out "$OUT/parity") > "$OUT/parity.txt" 2>&1
  echo "parity rc=$?"; grep -E "^hot parity|seed [0-9]+ " "$OUT/parity.txt" | tail -40
  if ls "$OUT"/parity/*.md >/dev/null 2>&1; then cat "$OUT"/parity/*.md; else tail -20 "$OUT/parity.txt"; fi
fi
echo "total $(( $(date +%s) - T0 )) s"
