#!/usr/bin/env bash
# Parameter server against ring all-reduce with every rank on its own "host": a network
# namespace with a private /dev/shm, joined to the others through a bridge by a veth pair
# rate-limited with `tc tbf` in both directions. For 1..MAX_WORKERS workers it runs
# `ps_bench rank` for the ring (DDP) and for the synchronous parameter server with 1 and 2
# servers (2 with and without the in-memory shard copies), ROUNDS times each (alternating),
# appends every run's communication time per step to $OUT/ps-bench.csv, then writes the
# table (stdout) and $OUT/ps-bench.svg.
#
#   sudo scripts/ps-bench-netns.sh                  # 1 Gbit/s, 16 MiB of parameters
#   RATE_MBIT=200 PARAMS=1048576 ROUNDS=1 MAX_WORKERS=2 sudo -E scripts/ps-bench-netns.sh
#
# Needs root (ip netns, tc), the release binaries (cargo build --release -p rekindle-examples
# -p rekindle-elastic --bins), and a quiet machine. Namespaces, links and processes are named
# after a random id and removed on exit, also after a failure or Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

RATE_MBIT=${RATE_MBIT:-1000}
PARAMS=${PARAMS:-4194304}
ROUNDS=${ROUNDS:-3}
MAX_WORKERS=${MAX_WORKERS:-4}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
BIN=${BIN:-target/release}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
CSV=$OUT/ps-bench.csv
# The ranks talk across namespaces, off loopback: they share a job secret of this run's own.
export REKINDLE_SECRET_FILE=$OUT/job-secret
( umask 077; od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$REKINDLE_SECRET_FILE" )

for b in rekindle ps_bench; do
  [ -x "$BIN/$b" ] || { echo "missing $BIN/$b: build the release binaries first" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, tc)" >&2; exit 1; }

ID=$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
HUB=psb$ID-hub
NODES=()
PIDS=()
# An address range of this run's own (10.x.y.0/24 inside its namespaces only).
NET="10.$((16#${ID:0:2} % 200 + 20)).$((16#${ID:2:2})).0"
PREFIX=${NET%.0}

cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true; done
  for n in "${NODES[@]:-}"; do
    [ -n "$n" ] || continue
    # Whatever still runs in the namespace goes with it.
    for p in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$n" 2>/dev/null || true
  done
  ip netns del "$HUB" 2>/dev/null || true
}
trap cleanup EXIT INT TERM

ip netns add "$HUB"
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" link set br0 up
ip -n "$HUB" link set lo up

# Node i: namespace psb<id>-i, address $PREFIX.(i+1), a veth v0 to the hub's b<i>, shaped both
# ways (v0's egress is the node's upload, b<i>'s the node's download).
add_node() {
  local i=$1 ns=psb$ID-$1
  ip netns add "$ns"
  NODES+=("$ns")
  ip link add "psb$ID-v$i" type veth peer name "psb$ID-b$i"
  ip link set "psb$ID-v$i" netns "$ns" name v0
  ip link set "psb$ID-b$i" netns "$HUB" name "b$i"
  ip -n "$ns" addr add "$PREFIX.$((i + 1))/24" dev v0
  ip -n "$ns" link set v0 up
  ip -n "$ns" link set lo up
  ip -n "$HUB" link set "b$i" master br0
  ip -n "$HUB" link set "b$i" up
  ip netns exec "$ns" tc qdisc add dev v0 root tbf rate "${RATE_MBIT}mbit" burst 256kb latency 50ms
  ip netns exec "$HUB" tc qdisc add dev "b$i" root tbf rate "${RATE_MBIT}mbit" burst 256kb latency 50ms
}

MAX_NODES=$((MAX_WORKERS + 2))
for i in $(seq 0 $((MAX_NODES - 1))); do add_node "$i"; done

# One run: NRANKS ranks, rank i on node i, the store on node 0 (a port of its own per run,
# inside namespaces no other process uses).
RUN_NO=0
run() {
  local nranks=$1; shift
  RUN_NO=$((RUN_NO + 1))
  local port=$((29400 + RUN_NO)) pids=()
  PIDS=()
  rm -f "$OUT"/run-*.log
  for i in $(seq 0 $((nranks - 1))); do
    ip netns exec "psb$ID-$i" unshare -m --propagation private sh -c \
      'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"' sh \
      "$BIN/rekindle" run --nnodes "$nranks" --node-rank "$i" --nproc-per-node 1 \
      --master-addr "$PREFIX.1" --master-port "$port" --local-addr "$PREFIX.$((i + 1))" \
      --log-dir "$OUT/logs" \
      "$BIN/ps_bench" rank --steps "$STEPS" --warmup "$WARMUP" --params "$PARAMS" \
      --rate-mbit "$RATE_MBIT" --csv "$CSV" "$@" \
      > "$OUT/run-$i.log" 2>&1 &
    pids+=($!)
    PIDS+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  PIDS=()
  if [ "$rc" != 0 ]; then
    echo "a run failed (exit $rc); logs:" >&2
    tail -n 20 "$OUT"/run-*.log >&2
    exit 1
  fi
  grep -h "^.*ps_bench arch=" "$OUT"/run-*.log | sed 's/^.*ps_bench/ps_bench/'
}

for round in $(seq 1 "$ROUNDS"); do
  for w in $(seq 1 "$MAX_WORKERS"); do
    echo "round $round, $w worker(s)" >&2
    run "$w" --arch ring
    run $((w + 1)) --arch ps --servers 1
    run $((w + 2)) --arch ps --servers 2
    run $((w + 2)) --arch ps --servers 2 --shard-copies off
  done
done

"$BIN/ps_bench" plot "$CSV" "$OUT/ps-bench.svg"
echo "CSV: $CSV  plot: $OUT/ps-bench.svg" >&2
