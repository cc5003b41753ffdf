#!/usr/bin/env bash
# Two nodes on this machine (seed 3): two `rekindle run` agents, each with its own ranks,
# train the `ddp` example together, first with static membership, then (with `etcd`) through
# an etcd v3 rendezvous started here on a free port.
#
#   examples/scripts/multi_node.sh [static|etcd] [ddp flags...]
#
# e.g. examples/scripts/multi_node.sh etcd --steps 200 --checkpoint-dir /tmp/mn --checkpoint-every 50
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-static}
shift || true
cargo build --release -q -p rekindle-elastic --bin rekindle -p rekindle-examples --bin ddp
bin=target/release
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
nproc=${NPROC_PER_NODE:-1}
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; [[ -n "${etcd_dir:-}" ]] && rm -rf "$etcd_dir"; }
trap cleanup EXIT

case "$mode" in
static)
  port=$(free_port)
  for rank in 0 1; do
    "$bin/rekindle" run --nnodes 2 --node-rank "$rank" --master-addr 127.0.0.1 --master-port "$port" \
      --nproc-per-node "$nproc" "$bin/ddp" "$@" &
    pids+=($!)
  done
  ;;
etcd)
  etcd_dir=$(mktemp -d)
  client=$(free_port); peer=$(free_port)
  etcd --data-dir "$etcd_dir" --listen-client-urls "http://127.0.0.1:$client" \
    --advertise-client-urls "http://127.0.0.1:$client" --listen-peer-urls "http://127.0.0.1:$peer" \
    --heartbeat-interval 10 --election-timeout 100 >"$etcd_dir/etcd.log" 2>&1 &
  pids+=($!)
  for node in a b; do
    "$bin/rekindle" run --rdzv-backend etcd --rdzv-endpoint "127.0.0.1:$client" \
      --rdzv-id "multi-node-$$" --nnodes 2 --local-addr 127.0.0.1 \
      --nproc-per-node "$nproc" "$bin/ddp" "$@" &
    pids+=($!)
  done
  ;;
*)
  echo "usage: $0 [static|etcd] [ddp flags...]" >&2
  exit 2
  ;;
esac
status=0
for p in "${pids[@]: -2}"; do wait "$p" || status=$?; done
exit $status
