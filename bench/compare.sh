#!/usr/bin/env bash
# The comparison users make, measured side by side in one run: for each standard
# workload (WORKLOADS.md), one process and two worker processes of distc (in-process
# threads and MPI processes) against one PyTorch process and PyTorch DDP with two
# processes (gloo). sparse_lm runs as distc's hybrid plan (1 parameter server),
# dense_mlp as all-reduce. Every figure is global samples/s, median of 3 runs of
# 10 warm-up + 50 timed steps.
#
# Then the GPT of examples/gpt.dsl (scripts/gpt-dsl.py; AdamW, clipping, f32, batch
# 16 per worker): distc `train` with one process and with 2 all-reduce workers
# (threads) against bench/pytorch/gpt_bench.py's twin of the model in one PyTorch
# process and in DDP with 2 processes; global tokens/s, median of RUNS runs of
# 5 warm-up + 20 timed steps.
#
#   bash scripts/install-mpi.sh && bash scripts/install-pytorch.sh
#   cargo build --release --features mpi
#   bash bench/compare.sh [all|gpt] [RUNS]     # default: all (the workloads, then gpt), 3 runs
set -euo pipefail
cd "$(dirname "$0")/.."
part=all
case "${1:-}" in all|gpt) part="$1"; shift ;; esac
runs="${1:-3}"
distc=target/release/distc
py=.venv-bench/bin/python
[ -x "$distc" ] || { echo "build first: cargo build --release --features mpi" >&2; exit 1; }
[ -x "$py" ] || { echo "install PyTorch first: bash scripts/install-pytorch.sh" >&2; exit 1; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

workloads() {
"$distc" bench --workloads sparse_lm,dense_mlp --strategies single --workers 1 --runs "$runs" --json "$out/single.json" >&2
"$distc" bench --workloads sparse_lm --strategies hybrid --workers 2 --servers 1 --runs "$runs" --json "$out/sparse_in.json" >&2
"$distc" bench --workloads sparse_lm --strategies hybrid --workers 2 --servers 1 --runs "$runs" --transport mpi --json "$out/sparse_mpi.json" >&2
"$distc" bench --workloads dense_mlp --strategies allreduce --workers 2 --runs "$runs" --json "$out/dense_in.json" >&2
"$distc" bench --workloads dense_mlp --strategies allreduce --workers 2 --runs "$runs" --transport mpi --json "$out/dense_mpi.json" >&2
"$py" bench/pytorch/ddp_bench.py --workload sparse_lm dense_mlp --workers 1 2 --runs "$runs" --json > "$out/torch.jsonl"

OUT="$out" python3 - <<'PY'
import json, os
d = os.environ["OUT"]
load = lambda f: json.load(open(os.path.join(d, f)))
single = {r["workload"]: r["samples_per_sec"] for r in load("single.json")}
torch = {(r["workload"], r["workers"]): r["samples_per_sec"]
         for r in map(json.loads, open(os.path.join(d, "torch.jsonl")))}
rows = [
    ("sparse_lm", "hybrid, 1 server", load("sparse_in.json")[0], load("sparse_mpi.json")[0]),
    ("dense_mlp", "allreduce", load("dense_in.json")[0], load("dense_mpi.json")[0]),
]
print("| workload | distc 1 process | PyTorch 1 process | distc 2 workers, threads | distc 2 workers, MPI | PyTorch DDP 2 processes | MPI / DDP |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for w, plan, inproc, mpi in rows:
    ddp = torch[(w, 2)]
    print(f"| {w} ({plan}) | {single[w]:,.0f} | {torch[(w, 1)]:,.0f} | {inproc['samples_per_sec']:,.0f} "
          f"| {mpi['samples_per_sec']:,.0f} | {ddp:,.0f} | {mpi['samples_per_sec'] / ddp:.2f}x |")
PY
}

# GPT: distc's figure comes from `train --metrics`: every step's line has the
# global samples/s of that step (its compute plus communication wait); the rate of
# the timed steps is their samples over the sum of their step times, the warm-up
# steps and the final evaluation left out. --preload draws the batches before the
# first step, as gpt_bench.py does. The token ids are uniform random on both sides
# (the speed does not depend on them); valid.bin is two batches, so the evaluation
# at the end (not timed) is short.
gpt() {
  local dsl=examples/gpt.dsl warmup=5 steps=20 d="$out/gpt"
  mkdir -p "$d/ptb-tokens"
  "$py" - "$d/ptb-tokens" <<'PY'
import sys, numpy as np
rng = np.random.default_rng(1)
rng.integers(0, 10000, size=1 << 20, dtype=np.uint16).tofile(f"{sys.argv[1]}/train.bin")
rng.integers(0, 10000, size=2 * 16 * 64 + 1, dtype=np.uint16).tofile(f"{sys.argv[1]}/valid.bin")
PY
  for run in $(seq "$runs"); do
    echo "distc gpt run $run/$runs: 1 process, then 2 workers (allreduce)" >&2
    "$distc" train "$dsl" --data "$d" --steps $((warmup + steps)) --preload -q \
      --metrics "$d/single.$run.jsonl"
    "$distc" train "$dsl" --data "$d" --steps $((warmup + steps)) --preload -q \
      --strategy allreduce --workers 2 --metrics "$d/allreduce.$run.jsonl"
  done
  "$py" bench/pytorch/gpt_bench.py --workers 1 2 --warmup "$warmup" --steps "$steps" \
    --runs "$runs" > "$d/torch.jsonl"

  D="$d" DSL="$dsl" WARMUP="$warmup" STEPS="$steps" RUNS="$runs" python3 - <<'PY'
import glob, json, os, statistics
d, warmup = os.environ["D"], int(os.environ["WARMUP"])

def distc_tokens_per_sec(plan):
    rates = []
    for f in sorted(glob.glob(os.path.join(d, f"{plan}.*.jsonl"))):
        tps = [l["tokens_per_sec"] for l in map(json.loads, open(f))
               if "tokens_per_sec" in l and l["step"] > warmup]
        # Each step trains the same global batch, so the tokens over the summed
        # step times is the harmonic mean of the per-step rates.
        rates.append(len(tps) / sum(1 / r for r in tps))
    return statistics.median(rates)

torch = {r["workers"]: r["tokens_per_sec"] for r in map(json.loads, open(os.path.join(d, "torch.jsonl")))}
print(f"\nGPT (examples/gpt.dsl), global tokens/s: median of {os.environ['RUNS']} run(s) "
      f"of {warmup} warm-up + {os.environ['STEPS']} timed steps\n")
print("| model | distc 1 process | PyTorch 1 process | distc 2 workers | PyTorch DDP 2 processes |")
print("| --- | ---: | ---: | ---: | ---: |")
print(f"| gpt | {distc_tokens_per_sec('single'):,.0f} | {torch[1]:,.0f} "
      f"| {distc_tokens_per_sec('allreduce'):,.0f} | {torch[2]:,.0f} |")
PY
}

[ "$part" = gpt ] || workloads
gpt
