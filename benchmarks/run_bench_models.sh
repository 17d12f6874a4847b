#!/usr/bin/env bash
# Runs benchmarks/bench_models.py one process per (model, precision, mode, batch size), so that nothing one
# configuration leaves on the GPU (cached blocks, fragmentation) can squeeze the next, then merges everything
# into one report under $OUT.
# Usage (on the GPU machine, hot installed): bash benchmarks/run_bench_models.sh [extra bench_models args]
# BENCH_PLAN: space-separated "model:mode,mode[:batch,batch]" entries (default below; batches default to the
# model's list in bench_models.DEFAULT_BATCHES). BENCH_DTYPES: default "fp32 bf16". BENCH_DEADLINE: a time (epoch
# seconds) by which everything must be done: each run gets at most the time left, runs that no longer fit are skipped.
# The report is merged again after every run, so a run that is cut short loses nothing of the ones before it; the
# runs' own outputs and logs stay under $OUT/runs.
set -u
OUT=${OUT:-$PWD/bench_models_out}
HERE=$(cd "$(dirname "$0")" && pwd)
TMP=$OUT/runs
mkdir -p "$TMP"
DEADLINE=${BENCH_DEADLINE:-0}
dirs=()
default_batches() {
  case $1 in
    vit_b16|resnet50) echo "64 128 256" ;;
    vit_b16_tv) echo "64 128" ;;
    llama_block) echo "1 2 4" ;;
    *) echo "" ;;
  esac
}
for entry in ${BENCH_PLAN:-vit_b16:exact,hot,lora,hot+lora resnet50:exact,hot,hot-plain llama_block:exact,hot}; do
  IFS=: read -r model modes batches <<< "$entry"
  batches=${batches:-$(default_batches "$model")}
  for dtype in ${BENCH_DTYPES:-fp32 bf16}; do
    for mode in $(echo "$modes" | tr ',' ' '); do
      for b in $(echo "$batches" | tr ',' ' '); do
        d="$TMP/${model}_${dtype}_${mode/+/_}_b$b"
        t=${BENCH_CONFIG_TIMEOUT:-90}
        if (( DEADLINE > 0 )); then
          rem=$(( DEADLINE - $(date +%s) - 10 ))
          if (( rem < 30 )); then echo "$model $dtype $mode b$b: skipped (out of time)"; continue; fi
          (( rem < t )) && t=$rem
        fi
        # --foreground: the run stays in this script's process group, so a timeout of the whole script ends it too
        (cd /tmp && timeout --foreground "$t" python3 "$HERE/bench_models.py" --models "$model" --dtypes "$dtype" \
           --modes "$mode" --batches "$model=$b" --out "$d" --budget-s ${BENCH_CONFIG_BUDGET:-60} "$@" > "$d.log" 2>&1)
        echo "$model $dtype $mode b$b: rc=$? $(grep -E 'batch' "$d.log" | sed -E 's/^ +//' | tr '\n' ';' | cut -c1-200)"
        dirs+=("$d")
        (cd /tmp && python3 "$HERE/bench_models.py" --merge "${dirs[@]}" --out "$OUT" > "$TMP/merge.log" 2>&1) \
          || { echo "merge failed:"; tail -5 "$TMP/merge.log"; }
      done
    done
  done
done
if (( ${#dirs[@]} > 0 )); then head -60 "$OUT/bench_models.md"; else echo "no configuration ran"; fi
