#!/usr/bin/env bash
# Compiles and lints the CUDA builds (the `cuda` features: candle's CUDA backend under
# rekindle-runtime, rekindle-storage, rekindle-elastic and the examples) on a machine without a
# GPU. candle's CUDA kernels are compiled to PTX by nvcc at build time, so this needs nvcc; when
# none is on PATH, the script unpacks NVIDIA's CUDA compiler wheels from PyPI into
# target/cuda-toolkit (124 MB to download, 346 MB unpacked) and uses those. Nothing is linked
# or run: the CUDA binaries link against libcuda, which only a GPU driver provides. It takes
# about 12 minutes on 2 cores, so it is not part of scripts/test.sh.
#
# Environment: CUDA_COMPUTE_CAP (default 90) picks the PTX target when no GPU can be queried;
# CUDA_TARGET_DIR (default target/cuda) keeps these builds apart from the CPU ones.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvcc >/dev/null 2>&1; then
  toolkit="$PWD/target/cuda-toolkit"
  root="$toolkit/nvidia/cu13"
  if [ ! -x "$root/bin/nvcc" ]; then
    echo "nvcc not found: unpacking the CUDA 13.5 compiler wheels into $toolkit"
    wheels="$toolkit/wheels"
    mkdir -p "$wheels"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$wheels" \
      nvidia-cuda-nvcc==13.5.37 nvidia-nvvm==13.5.37 nvidia-cuda-runtime==13.5.37 \
      nvidia-cuda-crt==13.5.37 nvidia-cuda-cccl==13.3.5.0.6
    for w in "$wheels"/*.whl; do
      python3 -m zipfile -e "$w" "$toolkit"
    done
    rm -rf "$wheels"
    chmod +x "$root"/bin/* "$root"/nvvm/bin/*
  fi
  export PATH="$root/bin:$PATH" CUDA_ROOT="$root" CUDA_PATH="$root"
  # cudarc 0.19 knows CUDA versions up to 13.4; 13.5's driver API is a superset of it.
  export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13040}"
fi
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-$PWD/target/cuda}"

nvcc --version | tail -n 2
# `nccl` is left out: cudarc cannot be built with both dynamic loading (the NCCL backend,
# which must build without a toolkit) and dynamic linking (candle's CUDA backend).
cargo clippy -p rekindle-runtime -p rekindle-storage -p rekindle-elastic -p rekindle-examples \
  --features rekindle-examples/cuda,rekindle-runtime/cuda --all-targets -- -D warnings
echo "CUDA builds compile and lint clean"
