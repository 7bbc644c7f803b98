#!/usr/bin/env bash
# The comparison users make, measured side by side in one run: for each standard
# workload (WORKLOADS.md), one process and two worker processes of distc (in-process
# threads and MPI processes) against one PyTorch process and PyTorch DDP with two
# processes (gloo). sparse_lm runs as distc's hybrid plan (1 parameter server),
# dense_mlp as all-reduce. Every figure is global samples/s, median of 3 runs of
# 10 warm-up + 50 timed steps.
#
#   bash scripts/install-mpi.sh && bash scripts/install-pytorch.sh
#   cargo build --release --features mpi
#   bash bench/compare.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"
distc=target/release/distc
py=.venv-bench/bin/python
[ -x "$distc" ] || { echo "build first: cargo build --release --features mpi" >&2; exit 1; }
[ -x "$py" ] || { echo "install PyTorch first: bash scripts/install-pytorch.sh" >&2; exit 1; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

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
