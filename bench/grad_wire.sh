#!/usr/bin/env bash
# The gradient wire (issue 24): f32 against bf16 gradient all-reduces on N MPI workers
# (ranks of this machine), `--strategy allreduce`, on both standard workloads' dense
# models of the examples (mlp on MNIST, lm on Penn Treebank) and dense_mlp:
#
#   bash bench/grad_wire.sh [DISTC]       # a distc built with --features mpi
#
# Environment: RUNS (3), WARMUP (5), STEPS (40), NP (2), MODELS ("mlp lm dense_mlp"),
# RESULTS (a folder). Per model and wire: the median samples/s of the metrics lines
# after the warm-up (median of RUNS runs) and rank 0's bytes sent per step, beside the
# plan's predicted bytes per step per worker.
set -euo pipefail
cd "$(dirname "$0")/.."

distc="${1:-target/release/distc}"
runs="${RUNS:-3}"
warmup="${WARMUP:-5}"
steps="${STEPS:-40}"
np="${NP:-2}"
models="${MODELS:-mlp lm dense_mlp}"
out="${RESULTS:-$(mktemp -d)}"
say() { echo "[grad_wire.sh] $*" >&2; }
[ -x "$distc" ] || { say "no distc binary at $distc (cargo build --release --features mpi)"; exit 1; }
command -v mpirun >/dev/null || { say "no mpirun (bash scripts/install-mpi.sh)"; exit 1; }
mkdir -p "$out"
mpi=(mpirun --allow-run-as-root --oversubscribe -np "$np")

printf '%-10s %-5s %14s %14s %12s\n' model wire "bytes/step" "predicted" "samples/s"
for m in $models; do
  for wire in fp32 bf16; do
    plan="$out/$m.$wire.plan.json"
    "$distc" compile "examples/$m.dsl" --strategy allreduce --workers "$np" \
      --grad-wire "$wire" -o "$plan" >/dev/null 2>&1
    predicted=$("$distc" explain "$plan" | sed -n 's/.*predicted .* per step per worker (\([0-9]*\) bytes).*/\1/p')
    rows=()
    for r in $(seq 1 "$runs"); do
      "${mpi[@]}" "$distc" run "$plan" --steps $((warmup + steps)) -q --preload \
        --transport mpi --metrics "$out/$m.$wire.jsonl" >/dev/null 2>&1
      rows+=("$(python3 - "$out/$m.$wire.jsonl" "$warmup" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
print(statistics.median(l["samples_per_sec"] for l in lines),
      int(statistics.median(l["bytes_sent"] for l in lines)))
PY
)")
    done
    read -r sps bytes < <(printf '%s\n' "${rows[@]}" | sort -g | sed -n "$(((runs + 1) / 2))p")
    printf '%-10s %-5s %14s %14s %12.0f\n' "$m" "$wire" "$bytes" "$predicted" "$sps"
  done
done
say "plans, metrics: $out"
