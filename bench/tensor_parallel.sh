#!/usr/bin/env bash
# Tensor parallelism against ZeRO 3 with the same workers (issue 23), on
# bench/models/wide.dsl (its w1 is 200 MiB), CPU, threads of one process, one global
# batch for all:
#
#   --mesh data=1,model=T: w1 split by columns and w2 by rows over T workers, each
#     on the whole batch (Megatron's pair);
#   --strategy allreduce --zero 3 --workers T: every variable sharded over T workers
#     and gathered whole for each use, each worker on 1/T of the batch;
#   one device, for reference.
#
#   bash bench/tensor_parallel.sh [DISTC]
#
# Environment: RUNS (3), WARMUP (2), STEPS (8), BATCH (32, global), T (4), RESULTS (a
# folder). Per configuration: the median samples/s of the metrics lines after the
# warm-up (median of RUNS runs), worker 0's bytes sent per step (median), and the
# per-worker memory `explain` estimates (variables, gradients, optimizer state, peak
# activations, buckets) beside the largest variable a worker holds.
set -euo pipefail
cd "$(dirname "$0")/.."

distc="${1:-target/release/distc}"
runs="${RUNS:-3}"
warmup="${WARMUP:-2}"
steps="${STEPS:-8}"
batch="${BATCH:-32}"
t="${T:-4}"
out="${RESULTS:-$(mktemp -d)}"
say() { echo "[tensor_parallel.sh] $*" >&2; }
[ -x "$distc" ] || { say "no distc binary at $distc (cargo build --release)"; exit 1; }
mkdir -p "$out"
model=bench/models/wide.dsl

# Compiles NAME with the flags given, runs it RUNS times; prints "samples/s bytes/step".
measure() {
  local name="$1"
  shift
  "$distc" compile "$model" -o "$out/$name.plan.json" "$@" >/dev/null 2>&1
  "$distc" explain "$out/$name.plan.json" > "$out/$name.explain.txt"
  local rows=()
  for r in $(seq 1 "$runs"); do
    "$distc" run "$out/$name.plan.json" --steps $((warmup + steps)) -q --preload \
      --metrics "$out/$name.jsonl" >/dev/null
    rows+=("$(python3 - "$out/$name.jsonl" "$warmup" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
print(statistics.median(l["samples_per_sec"] for l in lines),
      statistics.median(l["bytes_sent"] for l in lines))
PY
)")
  done
  printf '%s\n' "${rows[@]}" | sort -g | sed -n "$(((runs + 1) / 2))p"
}

# The explain table's worker memory row: params, gradients, optimizer, activations,
# buckets, total.
memory() {
  awk '$1 == "worker" { $1 = ""; print; exit }' "$out/$1.explain.txt"
}

printf '%-40s %10s %14s  %s\n' configuration "samples/s" "bytes/step" "per-worker memory (explain): params gradients optimizer activations buckets total"
read -r rate bytes < <(measure one --batch "$batch")
printf '%-40s %10.1f %14.0f  %s\n' "one device, batch $batch" "$rate" "$bytes" "$(memory one)"
read -r rate bytes < <(measure tp --mesh "data=1,model=$t" --batch "$batch")
printf '%-40s %10.1f %14.0f  %s\n' "tensor parallel, model=$t, batch $batch" "$rate" "$bytes" "$(memory tp)"
read -r rate bytes < <(measure zero3 --strategy allreduce --zero 3 --workers "$t" --batch $((batch / t)))
printf '%-40s %10.1f %14.0f  %s\n' "ZeRO 3, $t workers of $((batch / t))" "$rate" "$bytes" "$(memory zero3)"
say "plans, explain tables and metrics in $out"
