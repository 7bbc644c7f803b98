#!/usr/bin/env bash
# Pipeline parallelism against data parallelism with the same workers (issue 22), on
# examples/deep_mlp.dsl (ten tanh layers, MNIST), CPU, threads of one process:
#
#   pipeline P = 2 and 4, M micro-batches of b samples (global batch M*b), both
#   schedules; data parallelism with P workers of M*b/P samples each (the same global
#   batch), and one device of M*b.
#
#   bash bench/pipeline.sh [DISTC] [DATA_DIR]
#
# Environment: RUNS (3), WARMUP (5), STEPS (30), MICRO (8), BATCH (32), RESULTS (a
# folder). Per configuration: the median over the steps after the warm-up of the
# metrics lines' samples/s, median of RUNS runs; for pipelines also the measured
# bubble (1 - stage compute / (P x slowest stage's step), mean over those steps)
# beside explain's predictions ((P-1)/(M+P-1), and simulated with the stages'
# FLOPs), and per stage the activations at their peak as the metrics measure them
# (the stash of the micro-batches in flight included) beside explain's prediction
# and its stash part, and the variables' bytes.
set -euo pipefail
cd "$(dirname "$0")/.."

distc="${1:-target/release/distc}"
data="${2:-${DISTC_DATA:-}}"
runs="${RUNS:-3}"
warmup="${WARMUP:-5}"
steps="${STEPS:-30}"
micro="${MICRO:-8}"
batch="${BATCH:-32}"
out="${RESULTS:-$(mktemp -d)}"
say() { echo "[pipeline.sh] $*" >&2; }
[ -x "$distc" ] || { say "no distc binary at $distc (cargo build --release)"; exit 1; }
[ -n "$data" ] || { say "give the data directory (deep_mlp trains on MNIST): DISTC_DATA or the 2nd argument"; exit 1; }
mkdir -p "$out"
model=examples/deep_mlp.dsl
global=$((micro * batch))

# Runs one configuration RUNS times; prints the median samples/s and keeps the last
# run's metrics as $out/NAME.jsonl.
measure() {
  local name="$1"
  shift
  local rates=()
  for r in $(seq 1 "$runs"); do
    "$distc" train "$model" --data "$data" --steps $((warmup + steps)) -q \
      --metrics "$out/$name.jsonl" "$@" >/dev/null
    rates+=("$(python3 - "$out/$name.jsonl" "$warmup" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
print(statistics.median(l["samples_per_sec"] for l in lines))
PY
)")
  done
  printf '%s\n' "${rates[@]}" | sort -g | sed -n "$(((runs + 1) / 2))p"
}

printf '%-34s %12s %10s %10s %10s  %s\n' configuration "samples/s" bubble "predicted" "with FLOPs" "per stage: activations at their peak measured / predicted (of which stash), variables"
one=$(measure one --batch "$global")
printf '%-34s %12.0f\n' "one device, batch $global" "$one"
for p in 2 4; do
  dp=$(measure "dp$p" --strategy allreduce --workers "$p" --batch $((global / p)))
  printf '%-34s %12.0f\n' "allreduce, $p workers of $((global / p))" "$dp"
  for schedule in gpipe 1f1b; do
    name="p${p}_$schedule"
    rate=$(measure "$name" --pipeline "$p" --micro-batches "$micro" --schedule "$schedule" --batch "$batch")
    "$distc" compile "$model" --pipeline "$p" --micro-batches "$micro" --schedule "$schedule" \
      --batch "$batch" -o "$out/$name.plan.json" >/dev/null 2>&1
    "$distc" explain "$out/$name.plan.json" >"$out/$name.explain.txt"
    python3 - "$out/$name.jsonl" "$out/$name.explain.txt" "$warmup" "$rate" \
      "pipeline $p x $micro of $batch ($schedule)" <<'PY'
import json, re, sys
lines = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[3]):]
explain = open(sys.argv[2]).read()
m = re.search(r"\(P-1\)/\(M\+P-1\) = ([0-9.]+)%, ([0-9.]+)% with these stages' FLOPs", explain)
uniform, flops = (m.group(1), m.group(2)) if m else ("?", "?")
bubble = 100 * sum(l["pipeline"]["bubble"] for l in lines) / len(lines)
stages = len(lines[0]["pipeline"]["stages"])
peak = [max(l["pipeline"]["stages"][s]["activations"] for l in lines) for s in range(stages)]
rows = re.findall(
    r"^(\d+)\s+(\S+ \S+)\s+\S+\s+\S+\s+\S+ \S+\s+\d+\s+(\S+ \S+)\s+(\S+ \S+)", explain, re.M
)
def mib(b):
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"
cells = []
for s in range(stages):
    params, stash, act = rows[s][1:4] if s < len(rows) else ("?", "?", "?")
    cells.append(f"{s}: {mib(peak[s])} / {act} (stash {stash}), {params}")
print(f"{sys.argv[5]:<34} {float(sys.argv[4]):12.0f} {bubble:9.1f}% {uniform:>9}% {flops:>9}%  " + "; ".join(cells))
PY
  done
done
say "metrics and explain output in $out"
