#!/usr/bin/env bash
# One device call that times a change: whole training steps, each recorded in one CUDA graph
# (benchmarks/graph_step.py), of this tree against a base revision built in the same call, every run its own
# process, base and this tree alternating (exact once per model first). The base travels as a source archive:
#   git archive BASE | gzip > scratch/base_src.tgz      (carry it, with .whl, to the device)
# This tree is built by scripts/gpu_session.sh's build step (its Python module in python/hot); the base's module
# alone into /tmp/ab_base. Results: $OUT/ab.md (the table), $OUT/ab_logs.tgz (every run's output).
# Knobs: AB_BASE (scratch/base_src.tgz), AB_MODELS ("vit_b16 resnet50"; resnet50 runs channels-last), AB_PAIRS (2),
# AB_BATCH (128), AB_STEPS (30), AB_BUILD (1: build this tree first; 0: use the module already in python/hot).
set -u
O=${OUT:-$PWD/gpu_out}
mkdir -p "$O" /tmp/ab_logs
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONUNBUFFERED=1
ROOT=$PWD
BASE_TGZ=${AB_BASE:-scratch/base_src.tgz}
[[ -f $BASE_TGZ ]] || { echo "gpu_ab: no base archive at $BASE_TGZ (git archive BASE | gzip > $BASE_TGZ)"; exit 2; }
if [[ ${AB_BUILD:-1} == 1 ]]; then
  OUT=/tmp/ab_build GPU_CHECK_STEPS=build PYTEST_ARGS=none SESSION_BUDGET_S=240 bash scripts/gpu_session.sh \
    > /tmp/ab_logs/build.txt 2>&1
  t "this tree: $(grep -E '^\| build' /tmp/ab_logs/build.txt)"
fi
ls python/hot/_C*.so > /dev/null 2>&1 || { echo "gpu_ab: no module in python/hot"; exit 3; }
rm -rf /tmp/ab_base && mkdir -p /tmp/ab_base && tar xzf "$BASE_TGZ" -C /tmp/ab_base
CUTLASS_ARG=()
[[ -f /tmp/site/cutlass_library/source/include/cutlass/cutlass.h ]] &&
  CUTLASS_ARG=(-DHOT_CUTLASS_DIR=/tmp/site/cutlass_library/source/include)
{ cmake -S /tmp/ab_base -B /tmp/ab_base_build -G Ninja -DCMAKE_BUILD_TYPE=Release -DHOT_CUDA=ON \
    -DHOT_CUDA_ARCHS="${HOT_CUDA_ARCHS:-90a}" -DHOT_BUILD_PYTHON=ON -DHOT_BUILD_TESTS=OFF -DHOT_BUILD_JAX=OFF \
    -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python3)" "${CUTLASS_ARG[@]}" \
  && ninja -C /tmp/ab_base_build -j16 _C; } > /tmp/ab_logs/build_base.txt 2>&1
t "base build rc=$?"
ls /tmp/ab_base/python/hot/_C*.so > /dev/null 2>&1 || { tail -20 /tmp/ab_logs/build_base.txt; exit 4; }
STEPS=${AB_STEPS:-30}
BATCH=${AB_BATCH:-128}
graphed_ms() {  # tree model mode tag: the CUDA-graph column of graph_step's row for `mode`
  local extra=() log=/tmp/ab_logs/$2_$4.txt
  [[ $2 == resnet50 ]] && extra=(--channels-last)
  (cd /tmp && PYTHONPATH=$1/python timeout 150 python3 "$ROOT/benchmarks/graph_step.py" --model "$2" "${extra[@]}" \
     --batch "$BATCH" --modes "$3" --steps "$STEPS") > "$log" 2>&1
  grep -E "^\| $3 " "$log" | head -1 | awk -F'|' '{gsub(/ /, "", $4); print $4}'
}
{
  echo "# Graphed steps, base against this tree (scripts/gpu_ab.sh), batch $BATCH, $STEPS replays, ms (median (min-max))"
  echo
  echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); $(cd /tmp && python3 -c \
    'import torch; print("torch", torch.__version__)' 2>/dev/null)"
  echo
  echo "| model | exact | runs (base, this, ...) |"
  echo "|---|---|---|"
} > "$O/ab.md"
for m in ${AB_MODELS:-vit_b16 resnet50}; do
  row="| $m | $(graphed_ms "$ROOT" "$m" exact exact) |"
  for i in $(seq 1 "${AB_PAIRS:-2}"); do
    row="$row base $(graphed_ms /tmp/ab_base "$m" hot base$i), this $(graphed_ms "$ROOT" "$m" hot this$i);"
  done
  echo "$row |" >> "$O/ab.md"
  t "$row"
done
tar czf "$O/ab_logs.tgz" -C /tmp ab_logs
t end
