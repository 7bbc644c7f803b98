#!/usr/bin/env bash
# Regenerates the figure tables of the README, one section at a time or all of them,
# each printed as the markdown table the README holds (and kept in RESULTS/SECTION.md).
# Every table in the README names the section that made it.
#
#   cargo build --release --features mpi        # MPI sections need it; the others not
#   bash bench/figures.sh [SECTION...]          # default: every CPU section
#
# Sections (CPU, this machine):
#   examples         every example trained as written: its summary line (Figures)
#   traffic          W1's predicted bytes per step per worker under three plans (Figures)
#   bench            `distc bench`: both workloads, every strategy, 1 2 4 workers
#   compile          `distc bench --compile`: compile time against model size
#   profile          W1's step, op by op (`distc train ... --profile`)
#   pipeline         bench/pipeline.sh: pipelines against data parallelism
#   tensor_parallel  bench/tensor_parallel.sh: a model axis against ZeRO 3
#   large_batch      bench/large_batch.sh: LARS/LAMB at 8x the batch
#   grad_wire        bench/grad_wire.sh (MPI): f32 against bf16 gradients
#   simulate         bench/simulate.sh (MPI): simulate against measured runs
#   resnet50         bench/resnet50.sh: ResNet-50 at 8 to 1,024 simulated workers
#   compare          bench/compare.sh (MPI, PyTorch): distc against PyTorch and DDP
# On a GPU machine (not in the default list): gpu (bench/gpu.sh), nccl (bench/nccl.sh).
#
# DISTC (default target/release/distc), DISTC_DATA or DATA (the data folder), RESULTS
# (default a new temporary folder). Timings are this machine's: 2 cores, so
# throughput is noisy (about ±15% run to run); byte counts and accuracies are exact.
set -euo pipefail
cd "$(dirname "$0")/.."
distc="${DISTC:-target/release/distc}"
data="${DATA:-${DISTC_DATA:-}}"
results="${RESULTS:-$(mktemp -d -t distc-figures.XXXXXX)}"
mkdir -p "$results"
[ -x "$distc" ] || { echo "figures.sh: no distc at $distc (cargo build --release)" >&2; exit 1; }
need_data() {
  [ -n "$data" ] && [ -d "$data" ] ||
    { echo "figures.sh: $1 needs the data folder (DISTC_DATA or DATA)" >&2; exit 1; }
}
work="$(mktemp -d -t distc-figures-work.XXXXXX)"
trap 'rm -rf "$work"' EXIT

examples() {
  need_data examples
  echo "| run | command | result |"
  echo "| --- | --- | --- |"
  for ex in mlp cnn lm recsys sparse_lm dense_mlp deep_mlp; do
    local summary
    summary=$("$distc" train "examples/$ex.dsl" --data "$data" 2>&1 | grep -E "^$ex .*steps in" | tail -1)
    [ -n "$summary" ] || { echo "figures.sh: examples/$ex.dsl printed no summary" >&2; exit 1; }
    echo "| $ex | \`distc train examples/$ex.dsl --data DIR\` | ${summary#*: } |"
  done
}

traffic() {
  echo "| plan | predicted bytes per step per worker |"
  echo "| --- | --- |"
  local flags
  for flags in "--strategy allreduce --sparse-as-dense" "--strategy allreduce" \
    "--strategy hybrid --servers 2"; do
    # shellcheck disable=SC2086
    "$distc" compile examples/sparse_lm.dsl --workers 4 $flags -o "$work/t.plan.json" >/dev/null 2>&1
    local predicted
    predicted=$("$distc" explain "$work/t.plan.json" | sed -n 's/.*predicted \(.*\) per step per worker.*/\1/p')
    echo "| \`$flags\` | $predicted |"
  done
}

section() {
  case "$1" in
    examples) examples ;;
    traffic) traffic ;;
    bench) "$distc" bench --runs 3 ;;
    compile) "$distc" bench --compile ;;
    profile) "$distc" train examples/sparse_lm.dsl --steps 30 --preload --profile ;;
    pipeline) RESULTS="$results/pipeline" bash bench/pipeline.sh "$distc" "$data" ;;
    tensor_parallel) RESULTS="$results/tensor_parallel" bash bench/tensor_parallel.sh "$distc" ;;
    large_batch) bash bench/large_batch.sh "$distc" "$data" ;;
    grad_wire) RESULTS="$results/grad_wire" bash bench/grad_wire.sh "$distc" ;;
    simulate) bash bench/simulate.sh "$distc" ;;
    resnet50) bash bench/resnet50.sh "$distc" ;;
    compare) bash bench/compare.sh ;;
    gpu) RESULTS="$results/gpu" bash bench/gpu.sh "$distc" "$data" ;;
    nccl) RESULTS="$results/nccl" bash bench/nccl.sh "$distc" ;;
    *) echo "figures.sh: unknown section $1 (see the list at the top of bench/figures.sh)" >&2
       exit 2 ;;
  esac
}

sections=("$@")
[ ${#sections[@]} -gt 0 ] || sections=(examples traffic bench compile profile pipeline tensor_parallel
  large_batch grad_wire simulate resnet50 compare)
for s in "${sections[@]}"; do
  echo "## $s"
  t0=$(date +%s)
  section "$s" | tee "$results/$s.md"
  echo "($s: $(($(date +%s) - t0)) s; $results/$s.md)"
  echo
done
