#!/usr/bin/env bash
# A/B comparison of two collectives_perf binaries on the cases of issue 2's bandwidth
# targets: ROUNDS rounds; in each, every case runs once with each binary back to back (order
# alternating between rounds), so slow spells of the (shared, virtualised) machine hit both
# alike. Prints one line per run:
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
IFS=';' read -r -a cases <<<"$CASES"
for round in $(seq "$rounds"); do
  for case in "${cases[@]}"; do
    read -r op n size <<<"$case"
    # Each case runs with every binary back to back, in forward order in odd rounds and in
    # reverse order in even ones, so neither binary always runs first after a case change.
    order=("${bins[@]}")
    if ((round % 2 == 0)); then
      order=()
      for ((i = ${#bins[@]} - 1; i >= 0; i--)); do order+=("${bins[i]}"); done
    fi
    for bin in "${order[@]}"; do
      iters=${ITERS:-30}
      [ -z "${ITERS:-}" ] && [ "$size" = 256M ] && iters=15
      # shellcheck disable=SC2086 # ARGS is a list of flags
      busbw=$("$bin" --op "$op" --nranks "$n" -b "$size" -e "$size" -n "$iters" -w "$warmup" ${ARGS:-} 2>&1 |
        grep -E '^ +[0-9]' | tail -1 | awk '{print $6}')
      echo "$(basename "$bin") $op $n $size $busbw"
      echo "$(basename "$bin") $op $n $size $busbw $round" >>"$runs"
    done
  done
done
# Reads "binary op ranks size value" lines and prints, per binary and case, the median of
# the values and, with BEST=1, the largest, to DIGITS decimals.
summarise() {
  sort -k1,4 -k5n | awk -v digits="$1" -v best="$2" '
    function flush() { if (n) { m = (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2;
      printf "%s %." digits "f", key, m; if (best) printf " %." digits "f", v[n]; print "" } n = 0 }
    { k = $1 " " $2 " " $3 " " $4; if (k != key) { flush(); key = k } v[++n] = $5 }
    END { flush() }'
}
echo "# binary op ranks size median best (busbw GB/s over $rounds runs)"
summarise 2 1 <"$runs"

# The paired ratio: each binary's busbw over the first binary's in the same round and case
# (the two ran back to back), and the median of those ratios over the rounds. A drift of the
# machine between rounds moves both runs of a pair alike, so this is steadier than a ratio
# of the medians.
first=$(basename "${bins[0]}")
echo "# binary op ranks size median-of-paired-ratios (busbw / $first's, over $rounds rounds)"
awk -v first="$first" '
  $1 == first { base[$2 " " $3 " " $4 " " $6] = $5 }
  $1 != first { other[NR] = $0 }
  END {
    for (i in other) { split(other[i], f, " "); b = base[f[2] " " f[3] " " f[4] " " f[6]]
      if (b > 0) print f[1], f[2], f[3], f[4], f[5] / b }
  }' "$runs" | summarise 3 0
