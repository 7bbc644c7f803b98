#!/usr/bin/env bash
# The reference case (issue 25, item 3): ResNet-50 (bench/models/resnet50.dsl, 25.5 M
# parameters, batch 32 a worker) all-reduced over 8, 64, 256 and 1024 workers in nodes
# of 8, one ring (flat) against the hierarchical all-reduce, as `distc simulate`
# predicts it. Op times: the model trained on one worker of this machine's CPU, traced
# once (`distc train --trace`) and read by every simulation; or TRACE, a trace of the
# model on one GPU (`bash bench/scale.sh trace`, bf16: give PRECISION=bf16 with it),
# each op's kernels timed on the device. Links: LINKS (default
# NVLink-class within a node, 100 Gb/s InfiniBand-class between nodes), or
# INTER_CAL / INTRA_CAL, calibrations from `distc calibrate`.
#
#   bash bench/resnet50.sh [DISTC]
set -euo pipefail
cd "$(dirname "$0")/.."
distc="${1:-target/release/distc}"
[ -x "$distc" ] || { echo "resnet50.sh: no distc at $distc (cargo build --release)" >&2; exit 1; }
model=bench/models/resnet50.dsl
links=(${LINKS:---link intra=100e9,5e-6 --link inter=12.5e9,10e-6})
[ -n "${INTER_CAL:-}" ] && links+=(--calibration "inter=$INTER_CAL")
[ -n "${INTRA_CAL:-}" ] && links+=(--calibration "intra=$INTRA_CAL")
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

precision=(--precision "${PRECISION:-fp32}")
if [ -n "${TRACE:-}" ]; then
  cp "$TRACE" "$work/one.json"
else
  "$distc" train "$model" "${precision[@]}" --steps "${PROFILE_STEPS:-4}" -q --trace "$work/one.json" >/dev/null
fi
"$distc" compile "$model" "${precision[@]}" --strategy allreduce --workers 8 -o "$work/plan.json" 2>/dev/null

echo "| workers | all-reduce | step ms | communication ms | exposed ms | overlap | scaling efficiency | memory per worker |"
echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
for n in 8 64 256 1024; do
  for how in flat hierarchical; do
    nodes=()
    [ "$how" = hierarchical ] && nodes=(--ranks-per-node 8)
    "$distc" simulate "$work/plan.json" --workers "$n" "${nodes[@]}" "${links[@]}" \
      --trace "$work/one.json" --format json >"$work/s.json"
    python3 - "$work/s.json" "$n" "$how" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
kinds = sorted({c["how"] for c in s["comms"] if c["op"] == "all_reduce"})
print(f"| {sys.argv[2]} | {sys.argv[3]} ({', '.join(kinds)}) | {s['step'] * 1e3:.1f} | "
      f"{s['comm'] * 1e3:.2f} | {s['exposed_comm'] * 1e3:.2f} | {100 * s['overlap']:.0f}% | "
      f"{100 * s['scaling_efficiency']:.1f}% | {s['memory_per_worker'] / 2**20:.0f} MiB |")
PY
  done
done
