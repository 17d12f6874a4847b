#!/usr/bin/env bash
# Installs hot with what the demo needs and runs the main job: `hot demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install_deps.sh demo
"$PY" -m pip install --no-build-isolation -q -C build-dir=build/demo .
hot demo "$@"
