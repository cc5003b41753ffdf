#!/usr/bin/env bash
# The main job: an elastic DDP training run of two ranks on this machine, through the embedded
# rendezvous (`rekindle run --standalone`). Installs protoc when missing (as root; the etcd
# client needs it to build), builds in release mode, then trains the example MLP for 300 steps
# with a checkpoint every 50 in /tmp/rekindle-ddp. Extra arguments go to the `ddp` program
# (e.g. `--steps 1000`). Run it again and it resumes from the newest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v protoc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing protobuf-compiler"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq protobuf-compiler >/dev/null
  else
    echo "missing protoc: install it (apt-get install -y protobuf-compiler) or run as root" >&2
    exit 1
  fi
fi

cargo build --release -q --workspace --bins
exec target/release/rekindle run --standalone --nproc-per-node 2 --max-restarts 3 \
  target/release/ddp --steps 300 --checkpoint-dir /tmp/rekindle-ddp --checkpoint-every 50 \
  --loss-csv /tmp/rekindle-ddp/loss.csv "$@"
