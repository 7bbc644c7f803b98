#!/usr/bin/env bash
# What a lost MPI rank costs under `distc launch` (issue 40): for each model and layout,
# a job of 3 ranks (threads of none: each rank a process of mpirun's) is started under
# the supervisor, which writes a sharded state every K steps; once the state of step
# KILL_AT is complete, rank 1 is killed with SIGKILL. mpirun ends the job, and the
# supervisor starts it again with 2 ranks from the last state on disk. The restart's
# metrics line says how long the recovery took (mpirun's end noticed, the job started
# again, the plan compiled, the state read and resharded) and how much training the loss
# undid. Beside it, the wall time per step of the same job without a loss, with a
# state every K steps and without any.
#
#   bash bench/launch.sh [DISTC]      (a binary built with --features mpi)
#
# Environment: STEPS (30), EVERY (K, 5), KILL_AT (10), RESULTS (a folder), DISTC_DATA.
set -euo pipefail
cd "$(dirname "$0")/.."

distc="${1:-target/release/distc}"
steps="${STEPS:-30}"
every="${EVERY:-5}"
kill_at="${KILL_AT:-10}"
out="${RESULTS:-$(mktemp -d)}"
mkdir -p "$out"
# shellcheck source=bench/data.sh
source bench/data.sh
mpi_args=(--mpirun-arg=--allow-run-as-root --mpirun-arg=--oversubscribe)

# name | model | layout
cases=(
  "dense_mlp allreduce|examples/dense_mlp.dsl|--strategy allreduce"
  "dense_mlp ZeRO 3|examples/dense_mlp.dsl|--strategy allreduce --zero 3"
  "sparse_lm hybrid + 1 server|examples/sparse_lm.dsl|--strategy hybrid"
)

# The pid of rank $2 of the job whose command line names $1.
rank_pid() {
  for p in /proc/[0-9]*; do
    grep -qs -- "$1" "$p/cmdline" || continue
    tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" || continue
    basename "$p"
    return 0
  done
  return 1
}

printf '| run | ranks | lost at | resumed from | recovery (s) | training undone (s) | wall per step (ms) | with a state every %s (ms) |\n' "$every"
printf '| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n'
for c in "${cases[@]}"; do
  IFS='|' read -r name model layout <<<"$c"
  tag=$(echo "$name" | tr ' ,+' '___')
  servers=0
  [[ "$layout" == *hybrid* ]] && servers=1
  data=()
  dir=$(data_for "$model" "$out")
  [ -n "$dir" ] && data=(--data "$dir")
  state="$out/$tag.state"
  rm -rf "$state"
  # shellcheck disable=SC2086
  "$distc" launch --workers 3 --servers "$servers" --state "$state" --checkpoint-every "$every" \
    --metrics "$out/$tag.jsonl" "${mpi_args[@]}" -- "$model" $layout "${data[@]}" \
    --steps "$steps" -q 2>"$out/$tag.err" &
  sup=$!
  until grep -qs "step-0*\([1-9][0-9]*\)" "$state/latest" &&
    [ "$(sed 's/step-0*//' "$state/latest")" -ge "$kill_at" ]; do
    sleep 0.05
  done
  kill -KILL "$(rank_pid "$state" 1)"
  wait "$sup"
  walls=()
  for keep in no yes; do
    plain="$out/$tag.plain"
    rm -rf "$plain"
    flags=()
    [ "$keep" = yes ] && flags=(--checkpoint "$plain" --sharded --checkpoint-every "$every")
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086
    mpirun --allow-run-as-root --oversubscribe -np $((3 + servers)) "$distc" train "$model" \
      $layout --workers 3 --servers "$servers" "${data[@]}" --steps "$steps" -q \
      --transport mpi "${flags[@]}" >/dev/null
    walls+=("$t0" "$(date +%s.%N)")
  done
  python3 bench/restart_row.py "$out/$tag.jsonl" "$name" "$steps" "${walls[@]}"
done
echo "metrics: $out"
