#!/usr/bin/env bash
# What losing a worker costs an elastic run (issue 40): for each model and layout, a run
# with --elastic loses one worker (--fail-worker) and carries on with one replica
# fewer; the restart's metrics line says which step it resumed from, how many shards
# it read from disk (none where the survivors' memory holds the state; under ZeRO the
# lost worker's shard of the last sharded state), how long the recovery took (the plan
# compiled again, the workers started, the state put together and moved in) and how
# much training the loss undid. Beside it, what keeping the state every step costs: the
# wall time of the same run without a loss, with and without --elastic, over its steps
# (each worker copies what it holds to the host after a step's timing, so the metrics'
# step times do not show it). Threads of one process, CPU.
#
#   bash bench/elastic.sh [DISTC]
#
# Environment: STEPS (8), FAIL (the failure, W:K; 1:5), RESULTS (a folder), DISTC_DATA
# (MNIST and Penn Treebank for the examples that read them).
set -euo pipefail
cd "$(dirname "$0")/.."

distc="${1:-target/release/distc}"
steps="${STEPS:-8}"
fail="${FAIL:-1:5}"
out="${RESULTS:-$(mktemp -d)}"
mkdir -p "$out"
# shellcheck source=bench/data.sh
source bench/data.sh

# name | model | layout
cases=(
  "dense_mlp allreduce 4|examples/dense_mlp.dsl|--strategy allreduce --workers 4"
  "dense_mlp ZeRO 3, 4, sharded state every 2|examples/dense_mlp.dsl|--strategy allreduce --zero 3 --workers 4 --checkpoint $out/zero3-state --sharded --checkpoint-every 2"
  "dense_mlp data 2 x model 2|examples/dense_mlp.dsl|--mesh data=2,model=2"
  "dense_mlp data 2 x pipe 2, 4 micro-batches|examples/dense_mlp.dsl|--mesh data=2,pipe=2 --micro-batches 4"
  "sparse_lm hybrid 4 + 2 servers|examples/sparse_lm.dsl|--strategy hybrid --workers 4 --servers 2"
  "gpt.dsl allreduce 4|examples/gpt.dsl|--strategy allreduce --workers 4"
)

printf '| run | workers | lost at | resumed from | shards read | recovery (s) | training undone (s) | wall per step (ms) | with --elastic (ms) |\n'
printf '| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n'
for c in "${cases[@]}"; do
  IFS='|' read -r name model layout <<<"$c"
  m="$out/$(echo "$name" | tr ' ,+' '___').jsonl"
  data=()
  dir=$(data_for "$model" "$out")
  [ -n "$dir" ] && data=(--data "$dir")
  # shellcheck disable=SC2086
  "$distc" train "$model" $layout "${data[@]}" --steps "$steps" --elastic \
    --fail-worker "$fail" --metrics "$m" -q
  walls=()
  for flag in "" --elastic; do
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086
    "$distc" train "$model" $layout "${data[@]}" --steps "$steps" $flag -q
    walls+=("$t0" "$(date +%s.%N)")
  done
  python3 bench/restart_row.py "$m" "$name" "$steps" "${walls[@]}" --shards
done
echo "metrics: $out"
