#!/usr/bin/env bash
# `distc verify` of examples/gpt.dsl (AdamW with its defaults, clipping at 1) in every
# layout issue 67 names, then with each planted bug, which must fail:
#   scripts/verify-gpt.sh DISTC DATA
# DISTC: the distc binary; DATA: a folder holding ptb-tokens/ (scripts/ptb-tokens.py).
# Each line is the verdict's summary; the script fails on the first surprise.
set -euo pipefail
distc="$1"
export DISTC_DATA="$2"
cd "$(dirname "$0")/.."
steps="${VERIFY_GPT_STEPS:-3}"
check() {
  local want="$1" bug="$2"
  shift 2
  local out rc=0
  out=$(DISTC_PLANTED_BUG="$bug" "$distc" verify examples/gpt.dsl --steps "$steps" "$@" 2>&1) || rc=$?
  printf '%-10s %-18s %-44s rc=%d: %s\n' "$want" "${bug:-none}" "$*" "$rc" \
    "$(printf '%s\n' "$out" | grep -E '^(verify|error)' | tail -1 | cut -c1-160)"
  if [ "$want" = pass ] && [ "$rc" -ne 0 ]; then
    printf '%s\n' "$out"
    echo "verify-gpt: $* should pass" >&2
    return 1
  fi
  if [ "$want" = fail ] && [ "$rc" -ne 1 ]; then
    printf '%s\n' "$out"
    echo "verify-gpt: $* with $bug planted should fail" >&2
    return 1
  fi
}
for layout in "--strategy allreduce --workers 2" "--strategy allreduce --workers 3" \
  "--strategy allreduce --workers 2 --zero 1" "--strategy allreduce --workers 2 --zero 2" \
  "--strategy allreduce --workers 2 --zero 3" "--pipeline 2 --micro-batches 2" \
  "--mesh data=2,model=2" "--strategy allreduce --workers 2 --precision bf16"; do
  # shellcheck disable=SC2086
  check pass "" $layout
done
check fail allreduce-mean --strategy allreduce --workers 2
check fail zero-slot --strategy allreduce --workers 2 --zero 1
check fail micro-batch-scale --strategy allreduce --workers 2 --accumulate 2
