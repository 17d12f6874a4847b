#!/usr/bin/env bash
# Runs benchmarks/bench_models.py one process per (model, precision, mode), so that nothing one configuration
# leaves on the GPU can squeeze the next, then merges everything into one report under $OUT.
# Usage (on the GPU machine, hot installed): bash benchmarks/run_bench_models.sh [extra bench_models args]
set -u
OUT=${OUT:-$PWD/bench_models_out}
HERE=$(cd "$(dirname "$0")" && pwd)
TMP=$(mktemp -d)
dirs=()
# BENCH_PLAN: "model:mode,mode ..." (default: every mode for ViT-B/16; exact and HOT for the others)
for entry in ${BENCH_PLAN:-vit_b16:exact,hot,lora,hot+lora resnet50:exact,hot llama_block:exact,hot}; do
  model=${entry%%:*}
  for dtype in fp32 bf16; do
    for mode in $(echo "${entry#*:}" | tr ',' ' '); do
      d="$TMP/${model}_${dtype}_${mode/+/_}"
      (cd /tmp && timeout ${BENCH_CONFIG_TIMEOUT:-90} python3 "$HERE/bench_models.py" --models "$model" --dtypes "$dtype" \
         --modes "$mode" --out "$d" --budget-s ${BENCH_CONFIG_BUDGET:-60} "$@" > "$d.log" 2>&1)
      echo "$model $dtype $mode: rc=$? $(grep -E 'batch' "$d.log" | sed -E 's/^ +//' | tr '\n' ';' | cut -c1-300)"
      dirs+=("$d")
    done
  done
done
(cd /tmp && python3 "$HERE/bench_models.py" --merge "${dirs[@]}" --out "$OUT")
