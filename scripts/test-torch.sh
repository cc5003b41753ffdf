#!/usr/bin/env bash
# The PyTorch tests (elastic/tests/torch_ddp.rs): an unchanged PyTorch DDP script under
# `rekindle run` (standalone, two static nodes, two etcd nodes, a killed worker restarted),
# each compared with torchrun's run of the same script, and a node joining a running etcd job.
#
# Installs torch from PyPI into a virtualenv (target/torch-venv, or $REKINDLE_TORCH_VENV):
# about 3 GiB with the CUDA libraries the wheel pulls in and about 10 minutes the first time;
# the CPU is enough. Not part of scripts/test.sh, which stays free of that download (there the
# same tests print why they skip).
#
#   ./scripts/test-torch.sh                # the tests
#   ./scripts/test-torch.sh --bench        # and the restart benchmark (examples/torch/restart_bench.py)
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${REKINDLE_TORCH_VENV:-target/torch-venv}
probe='import torch.distributed as d; assert d.is_available() and d.is_gloo_available()'
if ! "$venv/bin/python" -c "$probe" >/dev/null 2>&1; then
  echo "installing torch into $venv (about 3 GiB)"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check torch numpy
fi
"$venv/bin/python" -c "$probe"
if ! command -v etcd >/dev/null 2>&1 && [ ! -x /usr/bin/etcd ]; then
  echo "etcd is missing: apt-get install -y etcd-server (the etcd test starts its own)" >&2
  exit 1
fi

export REKINDLE_TORCH_PYTHON="$PWD/$venv/bin/python"
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
cargo build --workspace --bins
# One test at a time: each runs two or four Python processes that import torch.
cargo test --workspace --test torch_ddp -- --test-threads=1 --nocapture

if [ "${1:-}" = "--bench" ]; then
  cargo build --release --workspace --bin rekindle
  "$REKINDLE_TORCH_PYTHON" examples/torch/restart_bench.py \
    --rekindle target/release/rekindle --rounds 3 --csv target/torch-restart.csv
fi
