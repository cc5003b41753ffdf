# Sourced by scripts/check-cuda.sh and scripts/gpu-build.sh: puts a CUDA compiler on PATH.
#
# When no `nvcc` is on PATH, unpacks NVIDIA's CUDA 13.0 compiler wheels from PyPI into
# target/cuda-toolkit (about 100 MB to download, 300 MB unpacked) and uses those. CUDA 13.0
# matches the R580 drivers: PTX from a newer nvcc does not load on them (candle compiles its
# kernels to PTX, which the driver compiles when a program starts).
#
# Environment: CUDA_COMPUTE_CAP (default 90, Hopper) picks the PTX target when no GPU can be
# queried.

if ! command -v nvcc >/dev/null 2>&1; then
  toolkit="$PWD/target/cuda-toolkit"
  cuda_root="$toolkit/nvidia/cu13"
  if [ ! -x "$cuda_root/bin/nvcc" ]; then
    echo "nvcc not found: unpacking the CUDA 13.0 compiler wheels into $toolkit"
    wheels="$toolkit/wheels"
    mkdir -p "$wheels"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$wheels" \
      nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 \
      nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
    for w in "$wheels"/*.whl; do
      python3 -m zipfile -e "$w" "$toolkit"
    done
    rm -rf "$wheels"
    chmod +x "$cuda_root"/bin/* "$cuda_root"/nvvm/bin/*
  fi
  export PATH="$cuda_root/bin:$PATH" CUDA_ROOT="$cuda_root" CUDA_PATH="$cuda_root"
fi
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
