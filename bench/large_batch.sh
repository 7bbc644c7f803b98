#!/usr/bin/env bash
# Large-batch training (issue 25, item 2): examples/cnn.dsl as written (batch 64, Adam,
# 600 steps: 0.64 epoch of MNIST) against the same model at 8 times the batch for the
# same number of epochs (batch 512, 75 steps): with the example's optimizer unchanged,
# and with LARS or LAMB behind a warm-up and a polynomial decay. Every run evaluates
# on the whole MNIST test set (the train block's eval_samples raised to 10000).
#
#   bash bench/large_batch.sh [DISTC] [DATA_DIR]
#
# DISTC     the distc binary (default target/release/distc)
# DATA_DIR  MNIST's folder (default $DISTC_DATA)
set -euo pipefail
cd "$(dirname "$0")/.."
distc="${1:-target/release/distc}"
data="${2:-${DISTC_DATA:-}}"
[ -x "$distc" ] || { echo "large_batch.sh: no distc at $distc (cargo build --release)" >&2; exit 1; }
[ -n "$data" ] || { echo "large_batch.sh: give MNIST's folder (DATA_DIR or DISTC_DATA)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# run LABEL BATCH STEPS OPTIMIZER [SCHEDULE [FLAGS...]]: one training run, one table
# row; BATCH is per worker, the epochs count every worker's samples.
run() {
  local label=$1 batch=$2 steps=$3 opt=$4 sched=${5:-}
  shift $(($# < 5 ? $# : 5))
  local workers=1
  [ "${1:-}" = --workers ] && workers=$2
  local dsl="$work/$label.dsl"
  # The schedule's horizon is the train block's steps (not --steps): set them.
  sed -e "s|^  optimizer .*|  optimizer    = $opt|" -e "s|^  eval_samples .*|  eval_samples = 10000|" \
    -e "s|^  steps .*|  steps        = $steps|" examples/cnn.dsl >"$dsl"
  [ -n "$sched" ] && sed -i "s|^  optimizer .*|&\n  lr_schedule  = $sched|" "$dsl"
  local out
  out=$("$distc" train "$dsl" --batch "$batch" --steps "$steps" --data "$data" "$@" 2>&1 | tail -1)
  local acc=${out##*eval_accuracy }
  printf '| %s | %s | %s | %s | `%s` | `%s` | %s |\n' "$label" "$workers x $batch" "$steps" \
    "$(python3 -c "print(f'{$workers * $batch * $steps / 60000:.2f}')")" "$opt" "${sched:-constant()}" "${acc%% *}"
}

echo "| run | workers x batch | steps | epochs | optimizer | lr_schedule | test accuracy |"
echo "| --- | ---: | ---: | ---: | --- | --- | ---: |"
run small 64 600 "adam(lr = 0.002)"
run large-unchanged 512 75 "adam(lr = 0.002)"
run large-lars 512 75 "lars(lr = 5, momentum = 0.9, trust = 0.01)" "poly(warmup = 8, power = 2)"
run large-lamb 512 75 "lamb(lr = 0.1)" "poly(warmup = 8, power = 2)"
# The same LARS run as 8 all-reduce workers of 64 samples each (what `verify` checks
# against one device with batch 512).
run large-lars-8-workers 64 75 "lars(lr = 5, momentum = 0.9, trust = 0.01)" \
  "poly(warmup = 8, power = 2)" --workers 8 --strategy allreduce
