#!/usr/bin/env bash
# Validates rekindle on a machine with a GPU, in one go and in a few minutes, from the bundle
# scripts/gpu-build.sh makes on a build machine (the GPU machine needs no Rust): stripped test
# and example binaries in BUNDLE/bin.
#
#   scripts/gpu-check.sh [BUNDLE]
#
# BUNDLE defaults to the folder above this script when it holds bin/ (the unpacked
# target/gpu-check.tar.xz), else target/gpu-check.
#
# Steps (each PASS, FAIL or NOT RUN with the reason; the summary lists them all):
#  1. find NCCL: $REKINDLE_NCCL_LIBRARY, else the nvidia-nccl-cu* wheel of python3, else any
#     wheel under the usual prefixes, else the loader's path. None is a FAIL: this script never
#     passes without having run NCCL.
#  2. the NCCL unit tests against that library (loading, a real bootstrap root released);
#  3. single-rank collectives on cuda:0 that move data: every op, dtype and reduction (avg
#     included), out-of-place results read back, abort and rebuild (nccl_smoke);
#  4. NCCL 2.30.3 or newer: several ranks on the one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1):
#     grouped send/recv, scatter, gather, all-to-all, a killed rank process, an abort in
#     flight, 20 create/abort rounds with flat thread and memory counts (nccl_multi_rank);
#  5. NCCL on candle CUDA tensors, and training steps with gradients reduced on the device
#     (nccl_cuda_tensors);
#  6. candle CUDA training steps and a checkpoint loaded back onto cuda:0 (single_device: a run
#     stopped at step 20 and resumed to 40 through the map-location ends with the parameters of
#     a straight run to 40);
#  7. NCCL 2.30.3 or newer: a 2-rank elastic DDP job on the one GPU over NCCL with a worker
#     SIGKILLed ends with the fault-free run's fingerprint (`ddp --backend nccl`: the elastic
#     loop's groups on NCCL; a bundle whose `ddp` lacks the flag reports it NOT RUN).
#
# Exit status: 0 when every step passed; 1 when a step failed (or NCCL was not found); 2 when
# none failed but a step could not run here (the summary says why).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d bin ]; then default=.; else default=target/gpu-check; fi
bundle="${1:-$default}"
bin="$bundle/bin"
[ -d "$bin" ] || { echo "FAIL: no binaries in $bin (build them with scripts/gpu-build.sh)"; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
log="${GPU_CHECK_LOG:-$work/log}"
: >"$log"

declare -a summary=()
failed=0
not_run=0
record() { # status step detail
  summary+=("$(printf '%-8s %-34s %s' "$1" "$2" "$3")")
  case "$1" in FAIL) failed=1 ;; "NOT RUN") not_run=1 ;; esac
  echo "== $1: $2 ${3:+($3)}"
}
# run STEP TIMEOUT CMD...: runs CMD with output to the terminal and the log, records the result.
run() {
  local step="$1" limit="$2"
  shift 2
  echo "== $step: $*"
  local started=$SECONDS
  # Through bash -c so that CMD may be one of the exported step functions below.
  timeout --kill-after=10 "$limit" bash -c '"$@"' bash "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - started))
  if [ "$rc" = 0 ]; then record PASS "$step" "${took}s"; else record FAIL "$step" "exit $rc after ${took}s"; fi
  return "$rc"
}
# run_test STEP LIMIT NAME ARGS...: runs the bundle's test binary of cargo target NAME (a file
# NAME-<hash>).
run_test() {
  local step="$1" limit="$2" exe
  exe="$(ls "$bin/$3"-* 2>/dev/null | head -n 1)"
  if [ -z "$exe" ]; then
    record FAIL "$step" "no test binary $3 in $bin"
    return 1
  fi
  shift 3
  run "$step" "$limit" "$exe" "$@"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
  || echo "(nvidia-smi not available)"

# Where shared libraries may be: Python's package folders, the CUDA toolkit, the system.
search_dirs=()
if command -v python3 >/dev/null; then
  while IFS= read -r d; do [ -d "$d" ] && search_dirs+=("$d"); done < <(python3 -c \
    'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null)
fi
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu /usr/local/lib /opt; do
  [ -d "$d" ] && search_dirs+=("$d")
done
# find_lib NAME: the first file NAME in the search folders, else anywhere on this file system.
find_lib() {
  local f
  f="$(find "${search_dirs[@]}" -maxdepth 6 -name "$1" -print -quit 2>/dev/null)"
  [ -n "$f" ] || f="$(find / -xdev \( -path /proc -o -path /sys \) -prune -o -name "$1" -print -quit 2>/dev/null)"
  printf '%s' "$f"
}

# 1. NCCL.
lib="${REKINDLE_NCCL_LIBRARY:-}"
how="REKINDLE_NCCL_LIBRARY"
if [ -z "$lib" ] && command -v python3 >/dev/null; then
  lib="$(python3 - <<'EOF' 2>/dev/null
import glob, os
try:
    import nvidia.nccl as n
    for d in list(n.__path__):
        for f in glob.glob(os.path.join(d, "lib", "libnccl.so*")):
            print(f)
            raise SystemExit
except ImportError:
    pass
EOF
)"
  how="python3's nvidia.nccl"
fi
if [ -z "$lib" ]; then
  lib="$(find_lib libnccl.so.2)"
  how="a search of the disk"
fi
if [ -z "$lib" ]; then
  lib="$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')"
  how="the loader's cache"
fi
if [ -z "$lib" ] || [ ! -e "$lib" ]; then
  record FAIL "find NCCL" "no libnccl.so.2: not in REKINDLE_NCCL_LIBRARY, python3's nvidia-nccl wheel, on disk, or the loader's cache"
  printf '%s\n' "${summary[@]}"
  exit 1
fi
export REKINDLE_NCCL_LIBRARY="$lib"
version="$(grep -aom1 'NCCL version [0-9]*\.[0-9]*\.[0-9]*' "$lib" | awk '{print $3}')"
record PASS "find NCCL" "$lib (NCCL ${version:-unknown version}, via $how)"
# 2.30.3 or newer runs several ranks on one GPU.
multi=0
if [ -n "$version" ] && [ "$(printf '%s\n2.30.3\n' "$version" | sort -V | head -n 1)" = 2.30.3 ]; then
  multi=1
fi

# The CUDA libraries candle's binaries link (libcublas, libcublasLt, libcurand, libnvrtc):
# from the toolkit or the nvidia-* wheels.
cuda_dirs=""
for name in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
  found="$(find_lib "$name")"
  if [ -n "$found" ]; then
    cuda_dirs="$cuda_dirs:$(dirname "$found")"
  else
    echo "warning: $name not found; the candle CUDA steps will fail to start"
  fi
done
export LD_LIBRARY_PATH="${cuda_dirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export REKINDLE_REQUIRE_GPU=1 NCCL_SET_THREAD_NAME=1 RUST_BACKTRACE=1

# 2-5. The test binaries.
run_test "NCCL unit tests (real library)" 120 rekindle_runtime --test-threads=1 nccl
run_test "single-rank collectives" 180 nccl_smoke --test-threads=1 --nocapture
if [ "$multi" = 1 ]; then
  NCCL_MULTI_RANK_GPU_ENABLE=1 run_test "several ranks on one GPU" 300 \
    nccl_multi_rank --test-threads=1 --nocapture
else
  record "NOT RUN" "several ranks on one GPU" "NCCL ${version:-?} is older than 2.30.3"
fi
if [ "$multi" = 1 ]; then export NCCL_MULTI_RANK_GPU_ENABLE=1; fi
run_test "NCCL on candle CUDA tensors" 180 nccl_cuda_tensors --test-threads=1 --nocapture
unset NCCL_MULTI_RANK_GPU_ENABLE

# 6. candle on CUDA, a checkpoint loaded onto cuda:0.
single() { "$bin/single_device" --device cuda:0 --layers 64-128-10 --batch 64 --samples 8192 --log-every 0 "$@"; }
step6() {
  single --steps 40 --checkpoint-dir "$work/straight" >"$work/straight.out" || return 1
  single --steps 20 --checkpoint-dir "$work/resumed" --checkpoint-every 10 >/dev/null || return 1
  single --steps 40 --checkpoint-dir "$work/resumed" --map-location cuda:0 >"$work/resumed.out" 2>"$work/resumed.err" || return 1
  cat "$work/resumed.err"
  grep -q "cuda:0" "$work/resumed.err" || { echo "the resume did not report cuda:0"; return 1; }
  echo "straight: $(cat "$work/straight.out")"
  echo "resumed:  $(cat "$work/resumed.out")"
  [ -s "$work/straight.out" ] && cmp -s "$work/straight.out" "$work/resumed.out"
}
export work bin
export -f single step6
run "candle CUDA training, checkpoint to cuda:0" 180 step6

# 7. Elastic DDP on NCCL with a SIGKILLed worker (item: the elastic loop on NCCL).
if ! "$bin/ddp" --help 2>/dev/null | grep -q -- '--backend'; then
  record "NOT RUN" "elastic DDP on NCCL, SIGKILL" "this bundle's ddp has no --backend flag"
elif [ "$multi" != 1 ]; then
  record "NOT RUN" "elastic DDP on NCCL, SIGKILL" "NCCL ${version:-?} is older than 2.30.3"
else
  export NCCL_MULTI_RANK_GPU_ENABLE=1
  ddp_job() { # NAME [KILL]: a 2-rank job on the one GPU; with KILL, SIGKILLs rank 1 at step 40.
    "$bin/rekindle" run --standalone --nproc-per-node 2 --max-restarts 3 \
      "$bin/ddp" --backend nccl --steps 120 --batch 256 --layers 64-256-10 --dataset 20000 \
      --checkpoint-dir "$work/$1" --checkpoint-every 20 --log-every 10 >"$work/$1.out" 2>&1 &
    local job=$!
    if [ -n "${2:-}" ]; then
      local deadline=$((SECONDS + 120))
      until grep -q "step=40 " "$work/$1.out"; do
        [ $SECONDS -lt $deadline ] && kill -0 $job 2>/dev/null || { echo "no step 40"; return 1; }
        sleep 0.2
      done
      local victim
      victim="$(pgrep -f -- "--checkpoint-dir $work/$1" | while read -r p; do
        tr '\0' '\n' </proc/"$p"/environ 2>/dev/null | grep -qx 'RANK=1' && echo "$p"; done | head -n 1)"
      [ -n "$victim" ] || { echo "rank 1 not found"; return 1; }
      kill -9 "$victim"
      echo "SIGKILLed rank 1 (pid $victim) at step 40"
    fi
    wait $job || return 1
    grep -o 'final_step=[0-9]* params_sha256=[0-9a-f]*' "$work/$1.out" | tail -n 1 >"$work/$1.fp"
  }
  step7() {
    ddp_job clean || return 1
    ddp_job killed kill || return 1
    echo "fault-free: $(cat "$work/clean.fp")"
    echo "SIGKILL:    $(cat "$work/killed.fp")"
    [ -s "$work/clean.fp" ] && cmp -s "$work/clean.fp" "$work/killed.fp"
  }
  export -f ddp_job step7
  run "elastic DDP on NCCL, SIGKILL" 240 step7
  unset NCCL_MULTI_RANK_GPU_ENABLE
fi

echo
echo "== summary (NCCL ${version:-?} at $lib)"
printf '%s\n' "${summary[@]}"
if [ "$failed" = 1 ]; then exit 1; fi
if [ "$not_run" = 1 ]; then exit 2; fi
exit 0
