#!/usr/bin/env bash
# Compiles and lints every GPU feature combination on a machine without a GPU:
# - `rekindle-runtime/nccl`: the NCCL backend (loads NCCL and the driver at run time; needs
#   nothing from NVIDIA to build);
# - `cuda`: candle's CUDA backend under rekindle-runtime, rekindle-storage, rekindle-elastic
#   and the examples;
# - `cuda` and `nccl` together: the NCCL backend on candle's CUDA tensors.
# candle's CUDA kernels are compiled to PTX by nvcc at build time, so the `cuda` builds need
# nvcc: scripts/cuda-toolkit.sh unpacks NVIDIA's compiler wheels from PyPI when none is on
# PATH. Nothing is linked or run here: CUDA binaries link against the CUDA libraries, which a
# GPU machine provides (scripts/gpu-build.sh builds the binaries scripts/gpu-check.sh runs).
# It takes about 15 minutes on 2 cores, so it is not part of scripts/test.sh.
#
# Environment: CUDA_COMPUTE_CAP (default 90) picks the PTX target; CUDA_TARGET_DIR (default
# target/cuda) keeps these builds apart from the CPU ones.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo clippy -p rekindle-runtime --features nccl --all-targets -- -D warnings
echo "nccl: compiles and lints clean"

. scripts/cuda-toolkit.sh
export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-$PWD/target/cuda}"
nvcc --version | tail -n 2
crates=(-p rekindle-runtime -p rekindle-storage -p rekindle-elastic -p rekindle-examples)
cargo clippy "${crates[@]}" --features rekindle-examples/cuda,rekindle-runtime/cuda \
  --all-targets -- -D warnings
echo "cuda: compiles and lints clean"
cargo clippy "${crates[@]}" --features rekindle-examples/cuda,rekindle-examples/nccl \
  --all-targets -- -D warnings
echo "cuda + nccl: compiles and lints clean"
