#!/usr/bin/env bash
# Builds, on a machine without a GPU, what scripts/gpu-check.sh runs on one: the NCCL and CUDA
# test binaries of rekindle-runtime (features `nccl` and `cuda`) and the examples built with
# both, stripped, in target/gpu-check/bin, plus target/gpu-check.tar.xz (the same folder and
# the check script) for a machine that has no Rust. Prints the sizes.
#
#   scripts/gpu-build.sh && scp target/gpu-check.tar.xz gpu-host:
#   gpu-host$ tar xf gpu-check.tar.xz && scripts/gpu-check.sh
#
# candle's kernels are compiled to PTX by nvcc (scripts/cuda-toolkit.sh provides a CUDA 13.0
# compiler when none is installed). The binaries link the CUDA 13 libraries candle uses
# (libcuda.so.1, libcublas.so.13, libcublasLt.so.13, libcurand.so.10, libnvrtc.so.13); where
# they are not installed, link-time stand-ins are made in target/cuda-stubs from the function
# names of cudarc's bindings. The binaries then load the real libraries on the GPU machine.
#
# Environment: CUDA_COMPUTE_CAP (default 90); CUDA_TARGET_DIR (default target/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/cuda-toolkit.sh
export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-$PWD/target/cuda}"
nvcc --version | tail -n 2
out="$PWD/target/gpu-check"
features=rekindle-runtime/nccl,rekindle-runtime/cuda,rekindle-examples/nccl,rekindle-examples/cuda
packages=(-p rekindle-runtime -p rekindle-examples -p rekindle-elastic)

# Link-time stand-ins for the CUDA libraries that are not installed here.
cudarc="$(cargo metadata --format-version 1 --all-features 2>/dev/null | python3 -c '
import json, os, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "cudarc":
        print(os.path.dirname(p["manifest_path"]))
        break')"
stubs="$PWD/target/cuda-stubs"
mkdir -p "$stubs"
for spec in cuda:libcuda.so.1:driver cublas:libcublas.so.13:cublas \
  cublasLt:libcublasLt.so.13:cublaslt curand:libcurand.so.10:curand nvrtc:libnvrtc.so.13:nvrtc; do
  IFS=: read -r name soname bindings <<<"$spec"
  if ldconfig -p 2>/dev/null | grep -q "lib$name\.so "; then
    continue
  fi
  if [ ! -e "$stubs/lib$name.so" ]; then
    grep -ohE 'pub unsafe fn [A-Za-z_][A-Za-z0-9_]*\(' "$cudarc/src/$bindings/sys/mod.rs" |
      sed -E 's/pub unsafe fn ([A-Za-z0-9_]+)\(/void \1(void) {}/' | sort -u >"$stubs/$name.c"
    cc -shared -fPIC -o "$stubs/lib$name.so" -Wl,-soname,"$soname" "$stubs/$name.c"
  fi
done
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$stubs"

cargo test --release "${packages[@]}" --features "$features" --no-run --lib \
  --test nccl_smoke --test nccl_multi_rank --test nccl_cuda_tensors 2>&1 | tee "$stubs/tests.log"
cargo build --release "${packages[@]}" --features "$features" \
  --bin single_device --bin ddp --bin rekindle

rm -rf "$out"
mkdir -p "$out/bin"
# The test executables cargo just built (the newest of each name).
for name in rekindle_runtime nccl_smoke nccl_multi_rank nccl_cuda_tensors; do
  exe="$(sed -nE "s|.*Executable .*\((.*/$name-[0-9a-f]+)\)|\1|p" "$stubs/tests.log" | tail -n 1)"
  [ -n "$exe" ] || { echo "no test executable $name in the build output" >&2; exit 1; }
  strip -o "$out/bin/$(basename "$exe")" "$exe"
done
for name in single_device ddp rekindle; do
  strip -o "$out/bin/$name" "$CARGO_TARGET_DIR/release/$name"
done
# The binaries must at least load here with the stand-ins (every symbol they import resolves).
LD_LIBRARY_PATH="$stubs" "$out/bin/single_device" --help >/dev/null

mkdir -p "$out/scripts"
cp scripts/gpu-check.sh "$out/scripts/"
tar -C "$out" -cJf "$PWD/target/gpu-check.tar.xz" bin scripts
du -b "$out"/bin/* | sort -n
echo "bin/ in all: $(du -sb "$out/bin" | cut -f1) bytes;" \
  "target/gpu-check.tar.xz: $(stat -c %s target/gpu-check.tar.xz) bytes"
