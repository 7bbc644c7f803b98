#!/usr/bin/env bash
# Runs the GPU suite on a GPU machine from what scripts/gpu-pack.sh built: every GPU
# test binary, then the single-GPU benchmark (bench/gpu.sh). Finds the CUDA 13
# libraries in the nvidia-* wheels of the Python that has PyTorch (PYTHON, default
# python3), as bench/gpu.sh does. Writes each part's log to RESULTS (default $OUT,
# else a temp folder) and exits non-zero if a test binary failed.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
results="${RESULTS:-${OUT:-$(mktemp -d)}}"
mkdir -p "$results"

libs=$("$py" - <<'PY'
import os, nvidia
dirs = []
for base in getattr(nvidia, "__path__", []):
    for sub in ("cu13/lib", "nccl/lib", "cublas/lib", "cuda_nvrtc/lib"):
        d = os.path.join(base, sub)
        if os.path.isdir(d):
            dirs.append(d)
print(":".join(dirs))
PY
) || { echo "gpu-suite: no nvidia-* wheels in $py" >&2; exit 1; }
# cudarc loads NCCL as libnccl.so; the wheel has libnccl.so.2: a symlink in a folder
# of our own, searched first.
shim="$(mktemp -d)"
trap 'rm -rf "$shim"' EXIT
IFS=: read -ra libdirs <<<"$libs"
for d in "${libdirs[@]}"; do
  [ -e "$d/libnccl.so.2" ] && { ln -sf "$d/libnccl.so.2" "$shim/libnccl.so"; break; }
done
export DISTC_CUDA_LIB_DIR="$shim:$libs"
export LD_LIBRARY_PATH="$shim:$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The test binaries find examples/ through DISTC_REPO (their build path is not here).
export DISTC_REPO="$PWD"
nvidia-smi -L | tee "$results/gpu.txt"

failed=0
# Each test binary in its own process, all at once (the GPU is shared by processes;
# tests inside a binary run one at a time), each stopped after TEST_TIMEOUT seconds
# so that one hang cannot eat a lease. FILTER narrows every binary's tests.
test_timeout="${TEST_TIMEOUT:-400}"
pids=()
for t in gpu-bin/distc-*; do
  name=$(basename "$t")
  timeout "$test_timeout" "$t" --nocapture --test-threads 1 ${FILTER:-} >"$results/$name.log" 2>&1 &
  pids+=("$!:$name")
done
for p in "${pids[@]}"; do
  pid=${p%%:*} name=${p#*:}
  echo "== $name"
  if wait "$pid"; then
    grep -E "^test result|skipping" "$results/$name.log" | tail -5
  else
    failed=1
    grep -E "^test .* FAILED|^test result|panicked" "$results/$name.log" | head -20
    tail -25 "$results/$name.log"
  fi
done
[ "${TESTS_ONLY:-0}" = 1 ] && exit $failed
# The user's commands on the GPU: verify (a distributed plan on the GPU against one
# device), --profile (where a step's time goes), NCCL with one rank.
cli() {  # cli NAME ARGS...: runs gpu-bin/distc ARGS, logs to NAME.log
  local name=$1
  shift
  echo "== cli $name: distc $*"
  if timeout "${CLI_TIMEOUT:-120}" gpu-bin/distc "$@" >"$results/cli.$name.log" 2>&1; then
    tail -12 "$results/cli.$name.log"
  else
    failed=1
    echo "FAILED: distc $*"
    tail -40 "$results/cli.$name.log"
  fi
}
data=()
[ -n "${DISTC_DATA:-}" ] && data=(--data "$DISTC_DATA")
for ex in mlp sparse_lm recsys; do
  cli "verify.$ex" verify "examples/$ex.dsl" --strategy allreduce --workers 2 --steps 3 \
    --device cuda "${data[@]}"
done
cli verify.hybrid verify examples/recsys.dsl --strategy hybrid --workers 2 --servers 1 --steps 3 \
  --device cuda "${data[@]}"
for w in sparse_lm dense_mlp; do
  cli "profile.$w" train "examples/$w.dsl" --device cuda --steps 30 --preload --profile "${data[@]}"
  cli "profile.$w.nograph" train "examples/$w.dsl" --device cuda --steps 30 --preload --profile \
    --no-cuda-graph "${data[@]}"
  cli "profile.$w.bf16" train "examples/$w.dsl" --device cuda --steps 30 --preload --profile \
    --precision bf16 "${data[@]}"
done
# Where NCCL with one rank spends its extra time (the same plan as bench/nccl.sh's).
for w in sparse_lm dense_mlp; do
  cli "profile.$w.nccl1" train "examples/$w.dsl" --device cuda --steps 30 --preload --profile \
    --strategy allreduce --workers 1 --collectives nccl "${data[@]}"
done
# Op times for the planner's scale tables (issue 39): each reference model traced on
# this GPU, each op's kernels timed between events on its stream. Copy
# $results/profiles/*.trace.json into bench/profiles/ and commit them; then
# `bash bench/scale.sh tables target/release/distc` prices any layout on any machine.
if [ "${PROFILES:-1}" = 1 ]; then
  echo "== scale profiles: bench/scale.sh trace"
  bash bench/scale.sh trace gpu-bin/distc "$results/profiles" || failed=1
  ls -la "$results/profiles"
fi
[ "${SUITE_ONLY:-0}" = 1 ] && exit $failed

RESULTS="$results" bash bench/gpu.sh gpu-bin/distc 2>&1 | tee "$results/bench.txt"
[ "${BENCH_NCCL:-1}" = 1 ] &&
  RESULTS="$results/nccl" bash bench/nccl.sh gpu-bin/distc 2>&1 | tee "$results/nccl.txt"
exit $failed
