#!/usr/bin/env bash
# Installs what the tests need, builds hot once (C++ core, CUDA backend when nvcc is present, the
# Python module and the GoogleTest suites), installs the package, and runs ctest and pytest.
# Usage: bash scripts/test.sh     (environment: PYTHON, HOT_CUDA=AUTO|ON|OFF, HOT_CUDA_ARCHS, HOT_BUILD_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
BUILD_DIR=${HOT_BUILD_DIR:-build/test}

bash scripts/install_deps.sh test

CMAKE_ARGS=(-C "build-dir=$BUILD_DIR" -C cmake.define.HOT_BUILD_TESTS=ON -C "cmake.define.HOT_CUDA=${HOT_CUDA:-AUTO}")
if [ -n "${HOT_CUDA_ARCHS:-}" ]; then CMAKE_ARGS+=(-C "cmake.define.HOT_CUDA_ARCHS=$HOT_CUDA_ARCHS"); fi
start=$(date +%s)
"$PY" -m pip install --no-build-isolation --no-deps -q "${CMAKE_ARGS[@]}" .
echo "hot: build + install took $(( $(date +%s) - start )) s"
"$PY" -c "import hot; print(hot.build_info())"

status=0
ctest --test-dir "$BUILD_DIR" --output-on-failure -j2 || status=1
# Run pytest against the installed package, from outside the source tree.
(cd /tmp && "$PY" -m pytest -q -p no:cacheprovider "$REPO/tests") || status=1
exit $status
