#!/usr/bin/env bash
# A/B comparison of two collectives_perf binaries on the cases of issue 2's bandwidth
# targets: ROUNDS rounds, each running every case once with each binary in turn, so slow
# spells of the (shared, virtualised) machine hit both alike. Prints one line per run:
# binary op ranks size busbw(GB/s), then the median and the best busbw per binary and case
# (the best run is the one least disturbed by the machine's slow spells).
# usage: scripts/ab-collectives.sh ROUNDS BIN_A BIN_B [BIN_C ...]
# CASES (";"-separated "op ranks size"), ITERS and WARMUP override the defaults below; ARGS
# adds flags to every run (e.g. ARGS=--no-shm). To compare wire modes of one binary, give
# wrapper scripts that set REKINDLE_WIRE (binaries without the flag ignore the variable):
#   printf '#!/bin/sh\nREKINDLE_WIRE=encrypt exec %s "$@"\n' "$PWD/target/release/collectives_perf" >/tmp/perf-encrypt
# The binary column shows each binary's file name, so give them distinct names.
set -euo pipefail
rounds=$1
shift
bins=("$@")
CASES=${CASES:-"all_reduce 2 1M;all_reduce 2 16M;all_reduce 2 64M;all_reduce 2 256M;\
all_reduce 4 16M;all_reduce 4 64M;all_reduce 4 256M;broadcast 2 16M;broadcast 2 64M;\
all_gather 2 16M;all_gather 2 64M;all_gather 4 64M"}
warmup=${WARMUP:-3}
runs=$(mktemp)
trap 'rm -f "$runs"' EXIT
for _ in $(seq "$rounds"); do
  for bin in "${bins[@]}"; do
    IFS=';' read -r -a cases <<<"$CASES"
    for case in "${cases[@]}"; do
      read -r op n size <<<"$case"
      iters=${ITERS:-30}
      [ -z "${ITERS:-}" ] && [ "$size" = 256M ] && iters=15
      # shellcheck disable=SC2086 # ARGS is a list of flags
      busbw=$("$bin" --op "$op" --nranks "$n" -b "$size" -e "$size" -n "$iters" -w "$warmup" ${ARGS:-} 2>&1 |
        grep -E '^ +[0-9]' | tail -1 | awk '{print $6}')
      echo "$(basename "$bin") $op $n $size $busbw" | tee -a "$runs"
    done
  done
done
echo "# binary op ranks size median best (busbw GB/s over $rounds runs)"
sort -k1,4 -k5n "$runs" | awk '
  function flush() { if (n) { m = (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2;
    printf "%s %.2f %.2f\n", key, m, v[n] } n = 0 }
  { k = $1 " " $2 " " $3 " " $4; if (k != key) { flush(); key = k } v[++n] = $5 }
  END { flush() }'

