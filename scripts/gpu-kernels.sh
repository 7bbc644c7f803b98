#!/usr/bin/env bash
# Where a replayed step's GPU time goes, kernel by kernel: Nsight Compute (ncu, on the
# GPU machines) times every kernel of STEPS training steps of each workload, with CUDA
# graphs (each graph node profiled on its own), and prints the per-kernel summary.
# `--profile` times each op from the host (launch and wait included); this is the
# device's own time. For a GPU machine with distc prebuilt (scripts/gpu-pack.sh):
#
#   bash scripts/gpu-kernels.sh [WORKLOAD...]     (default: sparse_lm dense_mlp)
#
# Environment: FLAGS (more flags for distc train, e.g. "--precision bf16"), STEPS (8), PYTHON (python3, with the nvidia-* CUDA 13 wheels),
# RESULTS (a folder for the raw ncu output; default a temp folder).
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
steps="${STEPS:-8}"
results="${RESULTS:-$(mktemp -d)}"
mkdir -p "$results"
command -v ncu >/dev/null || { echo "gpu-kernels: ncu (Nsight Compute) is not on the PATH" >&2; exit 1; }
libs=$("$py" - <<'PY'
import glob, os, nvidia
found = []
for root in getattr(nvidia, "__path__", []):
    for d in sorted(glob.glob(os.path.join(root, "*/lib"))):
        if os.path.isdir(d) and d not in found:
            found.append(d)
print(":".join(found))
PY
) || { echo "gpu-kernels: no nvidia-* wheels in $py" >&2; exit 1; }
export DISTC_CUDA_LIB_DIR="$libs"
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
data=()
[ -n "${DISTC_DATA:-}" ] && data=(--data "$DISTC_DATA")
[ $# -gt 0 ] || set -- sparse_lm dense_mlp
for w in "$@"; do
  echo "== $w: $steps steps, CUDA graphs, every kernel timed by ncu"
  # --clock-control none: the card's clocks as the training runs find them (ncu's
  # default locks them to the base clock, which stretches every kernel).
  ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum \
    --print-summary per-kernel \
    gpu-bin/distc train "examples/$w.dsl" --device cuda --steps "$steps" --preload --quiet \
    ${FLAGS:-} "${data[@]}" >"$results/ncu.$w.txt" 2>&1 || echo "ncu failed on $w (see $results/ncu.$w.txt)"
  # Kernel name, invocations and mean duration, longest total first.
  "$py" - "$results/ncu.$w.txt" <<'PY'
import re, sys
rows, name, calls = [], None, 0
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"\s+(\S.*?)\s+\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
    if m:
        name = m.group(1)
        continue
    m = re.search(r"Section: Command line profiler metrics", line)
    m2 = re.match(r"\s+gpu__time_duration\.sum\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", line)
    m3 = re.search(r"(\d+) kernel invocations? profiled|Invocations\s+(\d+)", line)
    if name and m2:
        unit, mn, mx, avg = m2.groups()
        scale = {"ns": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3}.get(unit, 1)
        rows.append((name, float(avg.replace(",", "")) * scale))
total = sum(r[1] for r in rows)
for n, us in sorted(rows, key=lambda r: -r[1])[:25]:
    print(f"  {us:9.2f} us  {n[:90]}")
print(f"  kernels listed: {len(rows)}, sum of their mean durations {total:.1f} us")
PY
  tail -5 "$results/ncu.$w.txt"
done
