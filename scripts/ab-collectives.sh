#!/usr/bin/env bash
# A/B comparison of two collectives_perf binaries on the large-buffer cases of issue 2's
# targets: ROUNDS rounds, each running every case once with each binary in turn, so slow
# spells of the (shared, virtualised) machine hit both alike. Prints one line per run:
# binary op ranks size busbw(GB/s); take the median per binary and case.
# usage: scripts/ab-collectives.sh ROUNDS BIN_A BIN_B
set -euo pipefail
rounds=$1
shift
bins=("$@")
for _ in $(seq "$rounds"); do
  for bin in "${bins[@]}"; do
    for case in "all_reduce 2 64M" "all_reduce 2 256M" "broadcast 2 16M" "broadcast 2 64M" \
      "all_gather 4 64M" "all_reduce 4 64M" "all_reduce 4 256M"; do
      read -r op n size <<<"$case"
      iters=30
      [ "$size" = 256M ] && iters=15
      busbw=$("$bin" --op "$op" --nranks "$n" -b "$size" -e "$size" -n "$iters" -w 3 2>&1 |
        grep -E '^ +[0-9]' | tail -1 | awk '{print $6}')
      echo "$(basename "$bin") $op $n $size $busbw"
    done
  done
done
