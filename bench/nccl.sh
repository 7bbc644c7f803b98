#!/usr/bin/env bash
# Distributed GPU benchmark (issue 11), for a GPU machine with distc prebuilt
# (scripts/gpu-pack.sh) and PyTorch:
#
#   1. NCCL overhead at world size 1: the one-device loop (`--device cuda
#      --no-cuda-graph`) against one worker of an allreduce plan whose collectives go
#      through NCCL (`--strategy allreduce --workers 1 --collectives nccl
#      --no-cuda-graph`, eager too), for W1 sparse_lm and W2 dense_mlp; then both with
#      CUDA graphs (the one loop captures NCCL collectives with the step).
#   2. Two workers sharing the one GPU: distc (`--workers 2 --collectives host`,
#      worker threads, host-staged collectives) against PyTorch DDP with 2 processes
#      on the same GPU, gloo backend (bench/pytorch/ddp_bench.py --device cuda).
#
#   bash bench/nccl.sh [DISTC] [DATA_DIR]
#
# Environment: RUNS (3), WARMUP (10), STEPS (50), PYTHON (python3), RESULTS (a folder).
# distc's figure: the median over the steps after the warm-up of the metrics lines'
# global samples/s, median of RUNS runs; PyTorch's: N B steps / elapsed over the
# timed steps, median of RUNS runs (ddp_bench.py).
set -euo pipefail
cd "$(dirname "$0")/.."

distc="${1:-gpu-bin/distc}"
data="${2:-${DISTC_DATA:-}}"
runs="${RUNS:-3}"
warmup="${WARMUP:-10}"
steps="${STEPS:-50}"
py="${PYTHON:-python3}"
say() { echo "[nccl.sh] $*" >&2; }
[ -x "$distc" ] || { say "no distc binary at $distc"; exit 1; }

# The nvidia-* wheels' libraries, and a libnccl.so shim (cudarc loads libnccl.so).
libdirs="$("$py" - <<'PY'
import glob, os, nvidia
found = []
for root in getattr(nvidia, "__path__", []):
    for d in sorted(glob.glob(os.path.join(root, "*/lib"))):
        if os.path.isdir(d) and d not in found:
            found.append(d)
print(":".join(found))
PY
)"
shim="$(mktemp -d)"
trap 'rm -rf "$shim"' EXIT
IFS=: read -ra dirs <<<"$libdirs"
for d in "${dirs[@]}"; do
  [ -e "$d/libnccl.so.2" ] && { ln -sf "$d/libnccl.so.2" "$shim/libnccl.so"; break; }
done
export DISTC_CUDA_LIB_DIR="$shim:$libdirs"
export LD_LIBRARY_PATH="$shim:$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
results="${RESULTS:-$(mktemp -d)}"
mkdir -p "$results"
total=$((warmup + steps))
common=(--device cuda --steps "$total" --preload --quiet)
[ -n "$data" ] && common+=(--data "$data")

run_distc() {  # run_distc NAME WORKLOAD FLAGS...
  local name=$1 w=$2
  shift 2
  for r in $(seq 1 "$runs"); do
    say "distc $name $w run $r"
    "$distc" train "examples/$w.dsl" "${common[@]}" --metrics "$results/$name.$w.run$r.jsonl" "$@" \
      >"$results/$name.$w.run$r.log" 2>&1 || { say "  FAILED: $(tail -3 "$results/$name.$w.run$r.log" | tr '\n' ' ')"; rm -f "$results/$name.$w.run$r.jsonl"; }
  done
}
for w in sparse_lm dense_mlp; do
  run_distc single "$w" --no-cuda-graph
  run_distc nccl1 "$w" --strategy allreduce --workers 1 --collectives nccl --no-cuda-graph
  # The same plan (bucket packing, sparse compaction) with its collectives on the host.
  run_distc host1 "$w" --strategy allreduce --workers 1 --collectives host --no-cuda-graph
  run_distc single_graphs "$w"
  run_distc nccl1_graphs "$w" --strategy allreduce --workers 1 --collectives nccl
  run_distc host2 "$w" --strategy allreduce --workers 2 --collectives host
done
say "PyTorch DDP, 2 processes on the GPU, gloo"
"$py" bench/pytorch/ddp_bench.py --workload sparse_lm dense_mlp --workers 2 --device cuda \
  --warmup "$warmup" --steps "$steps" --runs "$runs" --json >"$results/ddp.jsonl" \
  || say "  PyTorch DDP failed (see $results/ddp.jsonl)"

RESULTS_DIR="$results" WARMUP="$warmup" python3 - <<'PY' | tee "$results/table.md"
import glob, json, os, statistics
d, warmup = os.environ["RESULTS_DIR"], int(os.environ["WARMUP"])
def rate(path):
    r = [json.loads(l)["samples_per_sec"] for l in open(path) if l.strip()
         and json.loads(l).get("step", 0) > warmup]
    return statistics.median(r) if r else None
def distc(name, w):
    rs = [x for x in (rate(p) for p in sorted(glob.glob(f"{d}/{name}.{w}.run*.jsonl"))) if x]
    return statistics.median(rs) if rs else None
ddp = {}
if os.path.exists(f"{d}/ddp.jsonl"):
    for l in open(f"{d}/ddp.jsonl"):
        if l.strip():
            j = json.loads(l)
            ddp[j["workload"]] = j["samples_per_sec"]
f = lambda v: "failed" if v is None else f"{v:,.0f}"
print("| workload | single (eager) | host, 1 worker (same plan) | NCCL, 1 worker | NCCL vs same plan | NCCL vs single | single (graphs) | NCCL, 1 worker (graphs) | overhead | distc 2 workers, 1 GPU | DDP gloo 2 procs, 1 GPU | distc / DDP |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
over = lambda a, b: "" if not (a and b) else f"{(a / b - 1) * 100:+.1f}%"
for w in ("sparse_lm", "dense_mlp"):
    s, n, h, p = distc("single", w), distc("nccl1", w), distc("host2", w), ddp.get(w)
    h1 = distc("host1", w)
    sg, ng = distc("single_graphs", w), distc("nccl1_graphs", w)
    rat = "" if not (h and p) else f"{h / p:.2f}x"
    print(f"| {w} | {f(s)} | {f(h1)} | {f(n)} | {over(h1, n)} | {over(s, n)} | {f(sg)} | {f(ng)} | {over(sg, ng)} | {f(h)} | {f(p)} | {rat} |")
PY
