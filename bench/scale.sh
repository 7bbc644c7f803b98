#!/usr/bin/env bash
# The reference cases at scale (issue 39, item 4): GPT-2 124M, GPT-2 1.5B and
# ResNet-50, searched by the layout planner at 8 to 1,024 GPUs of 80 GB in nodes of 8,
# priced from op times a GPU recorded. One script for the three steps, so that the
# models traced on the GPU are the models priced here:
#
#   bash bench/scale.sh models DIR            # writes the three models into DIR
#   bash bench/scale.sh trace DISTC DIR       # on a GPU: DIR/NAME.trace.json for each
#   bash bench/scale.sh tables DISTC [DIR]    # anywhere: the tables, from DIR's traces
#
# `trace` runs `distc train MODEL --device cuda --trace` (each op's kernels timed
# between events on the device's stream; scripts/gpu-suite.sh calls it with
# PROFILES=1). `tables` runs `distc compile MODEL --strategy auto --workers N
# --op-times TRACE` at each N and prints the pick, its predicted step and memory, and
# its model FLOP/s per GPU against PEAK. DIR defaults to bench/profiles, where the
# traces of a lent GPU are committed; a model without a trace is skipped, saying so.
# No CPU trace stands in: a CPU's op times would say nothing about these GPUs.
#
# Environment: WORKERS (8 64 256 1024), LINKS (NVLink within a node, 450 GB/s and
# 2 us; 400 Gb/s between nodes, 50 GB/s and 5 us), MEMORY_MIB (the 80 GB card, less
# 4 GiB for the CUDA context and NCCL: 77824), PEAK (the card's dense bf16 peak,
# FLOP/s; 989e12, an H100 SXM's), STEPS (the trace's steps, 5: the simulator leaves out the first 2).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[scale.sh] $*" >&2; }
names=(gpt2-124m gpt2-1.5b resnet50)
# Per-GPU batches: GPT-2 at 8 and 2 sequences of 1,024 tokens, ResNet-50 at its
# model's 32 images; bf16 with f32 masters throughout.
models() {
  local dir=$1
  mkdir -p "$dir"
  python3 scripts/gpt-dsl.py --layers 12 --dim 768 --heads 12 --context 1024 --vocab 50304 \
    --batch 8 --data tok >"$dir/gpt2-124m.dsl"
  python3 scripts/gpt-dsl.py --layers 48 --dim 1600 --heads 25 --context 1024 --vocab 50304 \
    --batch 2 --data tok >"$dir/gpt2-1.5b.dsl"
  cp bench/models/resnet50.dsl "$dir/resnet50.dsl"
}
# Random token ids for the GPT models (the op times do not depend on which ids).
tokens() {
  "${PYTHON:-python3}" - "$1/tok" <<'PY'
import os, sys
import numpy as np
os.makedirs(sys.argv[1], exist_ok=True)
r = np.random.default_rng(1)
r.integers(0, 50304, 2_000_000, dtype=np.uint16).tofile(f"{sys.argv[1]}/train.bin")
r.integers(0, 50304, 8 * 1025 + 1, dtype=np.uint16).tofile(f"{sys.argv[1]}/valid.bin")
PY
}
case "${1:-}" in
  models)
    models "${2:?bench/scale.sh models DIR}"
    exit 0
    ;;
  trace)
    distc=${2:?bench/scale.sh trace DISTC DIR}
    dir=${3:?bench/scale.sh trace DISTC DIR}
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    models "$work"
    tokens "$work"
    mkdir -p "$dir"
    failed=0
    for m in "${names[@]}"; do
      say "tracing $m on the GPU"
      if ! timeout "${TRACE_TIMEOUT:-300}" "$distc" train "$work/$m.dsl" --data "$work" --device cuda \
        --precision bf16 --steps "${STEPS:-5}" -q --trace "$dir/$m.trace.json" \
        >"$work/$m.log" 2>&1; then
        say "$m FAILED: $(tail -3 "$work/$m.log" | tr '\n' ' ')"
        failed=1
      fi
    done
    exit $failed
    ;;
  tables)
    distc=${2:?bench/scale.sh tables DISTC [DIR]}
    dir=${3:-bench/profiles}
    ;;
  *)
    echo "usage: bench/scale.sh models DIR | trace DISTC DIR | tables DISTC [DIR]" >&2
    exit 2
    ;;
esac

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
models "$work"
links=(${LINKS:---link intra=450e9,2e-6 --link inter=50e9,5e-6})
any=0
for m in "${names[@]}"; do
  trace="$dir/$m.trace.json"
  if [ ! -f "$trace" ]; then
    say "$m: no trace at $trace (bash bench/scale.sh trace DISTC $dir, on a GPU)"
    continue
  fi
  any=1
  echo
  echo "$m, op times from $trace"
  echo
  echo "| GPUs | pick | micro-batch | predicted step ms | samples/s | model TFLOP/s a GPU | MFU | memory a GPU |"
  echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
  for n in ${WORKERS:-8 64 256 1024}; do
    if ! "$distc" compile "$work/$m.dsl" --strategy auto --workers "$n" --precision bf16 \
      --ranks-per-node 8 "${links[@]}" --memory-per-worker "${MEMORY_MIB:-77824}" \
      --op-times "$trace" -o "$work/plan.json" >"$work/search.log" 2>&1; then
      echo "| $n | none: $(tail -1 "$work/search.log") | | | | | | |"
      continue
    fi
    python3 - "$work/plan.json" "$n" "${PEAK:-989e12}" <<'PY'
import json, sys
e = json.load(open(sys.argv[1]))
n, peak = int(sys.argv[2]), float(sys.argv[3])
s = e["search"]
c = s["candidates"][s["chosen"]]
p = c["verdict"]["priced"]
pick = f"data={c['data']},model={c['model']},pipe={c['pipe']}"
if c["pipe"] > 1:
    pick += f",micro={c['micro_batches']}"
if c["zero"]:
    pick += f",zero={c['zero']}"
if c["remat"]:
    pick += ",remat"
# Model FLOPs a sample (the plan's: the cost model's forward and backward, recomputation
# not counted, as MFU counts them).
flops = e["flops_per_sample"]
per_gpu = flops * p["samples_per_sec"] / n
print(f"| {n} | {pick} | {c['batch']} | {p['step'] * 1e3:.1f} | {p['samples_per_sec']:.0f} | "
      f"{per_gpu / 1e12:.1f} | {100 * per_gpu / peak:.1f}% | {p['memory_per_worker'] / 2**30:.1f} GiB |")
PY
  done
done
[ "$any" = 1 ] || { say "no trace in $dir: nothing to price"; exit 1; }
