#!/usr/bin/env bash
# Runs the collective benchmarks recorded in docs/benchmarks.md and writes
# docs/data/collectives.csv (run on a quiet machine).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p rekindle-examples --bin collectives_perf -p rekindle-chaos-tests --bin kill_bench --bin collective_peer
out=docs/data/collectives.csv
rm -f "$out"
perf=./target/release/collectives_perf
$perf --op all_reduce --nranks 2 -b 4K -e 4K -n 200 -w 20 --csv "$out"
$perf --op all_reduce --nranks 2 -b 1M -e 256M -f 4 -n 10 -w 3 --csv "$out"
$perf --op all_reduce --nranks 4 -b 1M -e 256M -f 4 -n 10 -w 3 --csv "$out"
$perf --op broadcast --nranks 2 -b 1M -e 64M -f 4 -n 10 -w 3 --csv "$out"
$perf --op broadcast --nranks 4 -b 1M -e 64M -f 4 -n 10 -w 3 --csv "$out"
$perf --op all_gather --nranks 2 -b 1M -e 64M -f 4 -n 10 -w 3 --csv "$out"
$perf --op all_gather --nranks 4 -b 1M -e 64M -f 4 -n 10 -w 3 --csv "$out"
for op in reduce reduce_scatter scatter gather all_to_all sendrecv; do
  for n in 2 4; do
    $perf --op $op --nranks $n -b 1M -e 64M -f 8 -n 10 -w 3 --csv "$out"
  done
done
$perf --op all_reduce --nranks 2 -b 1M -e 256M -f 4 -n 10 -w 3 --no-shm --csv "$out"
$perf --op all_reduce --nranks 2 -b 1M -e 256M -f 4 -n 10 -w 3 --no-shm --wire encrypt --csv "$out"
./target/release/kill_bench --world 2 --trials 20 --csv docs/data/kill_detect.csv
./target/release/kill_bench --world 4 --trials 20
