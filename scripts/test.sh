#!/usr/bin/env bash
# The whole rekindle test suite. Installs what it needs when missing (as root), then builds
# with optimised dependencies and runs every test. Tests start their own services (etcd on
# 127.0.0.1 with free ports and temp data dirs) and stop them afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need_apt+=(etcd-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "missing ${need_apt[*]}: install them (apt-get install -y ${need_apt[*]}) or run as root" >&2
    exit 1
  fi
fi

# Python packages for the interop tests (files must load in Python safetensors).
if command -v python3 >/dev/null 2>&1; then
  if ! python3 -c 'import safetensors.numpy, numpy' >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check safetensors numpy
  fi
fi

# The Dockerfile (hadolint) and the Kubernetes manifests (schemas), in a few seconds.
./scripts/lint-deploy.sh

export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# A one-shot build gains nothing from incremental state (GBs on disk).
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
# Dependencies are built with opt-level 3 in the dev/test profile (see Cargo.toml).
# The chaos tests run the workspace's binaries (`rekindle`, `ddp`): build them all first.
cargo build --workspace --bins
cargo test --workspace --no-fail-fast -- --test-threads=2
# The NCCL backend builds without a CUDA toolkit, and its host-side logic (op queue, library
# search and loading, error mapping, bootstrap-root release, layouts) is tested without a GPU.
# Its GPU tests compile here and run in scripts/gpu-check.sh.
cargo test --workspace --features rekindle-runtime/nccl --lib --test nccl_smoke \
  --test nccl_multi_rank -- --test-threads=2 nccl
