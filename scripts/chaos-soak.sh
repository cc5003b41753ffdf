#!/usr/bin/env bash
# The chaos soak: long random fault schedules against real jobs (not part of CI; see
# docs/chaos.md). Builds the workspace with the storage failpoints (for the commit-stage kills),
# then runs, each with its JSON report and timeline plot under $CHAOS_OUT (default target/chaos):
#   kill-worker         FAULTS SIGKILLs of a random worker
#   mixed               FAULTS mixed faults (kills, hangs, node kills, etcd restarts, partitions
#                       and slow links as root, sometimes two at once)
#   kill-during-commit  a kill at every one of the nine commit stages
# and stops at the first scenario whose invariants fail (exit 1).
#
#   scripts/chaos-soak.sh [FAULTS [SEED]] [-- PROGRAM ARGS]
#
# FAULTS defaults to 100 and SEED to the current time (printed, so a failing schedule can be
# run again). After `--`, your own program is attacked instead of the bundled ddp (see
# docs/chaos.md for its arguments' placeholders). CHAOS_PROFILE=debug uses a debug build.
set -euo pipefail
cd "$(dirname "$0")/.."

faults=100
seed=$(date +%s)
if [ $# -gt 0 ] && [ "$1" != "--" ]; then faults=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then seed=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi

profile=${CHAOS_PROFILE:-release}
out=${CHAOS_OUT:-target/chaos}
mkdir -p "$out"
flags=(--workspace --bins --features rekindle-storage/failpoints)
if [ "$profile" = release ]; then flags+=(--release); fi
cargo build "${flags[@]}"
chaos=target/$profile/chaos

echo "chaos soak: $faults faults, seed $seed, reports in $out"
run() {
  local name=$1; shift
  "$chaos" --scenario "$name" --seed "$seed" "$@" \
    --json "$out/$name-$seed.json" --plot "$out/$name-$seed.svg" \
    ${program:+-- "${program[@]}"}
}
program=("$@")
run kill-worker --faults "$faults"
run mixed --faults "$faults"
run kill-during-commit
echo "chaos soak: every invariant held (seed $seed)"
