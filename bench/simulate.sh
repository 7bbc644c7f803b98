#!/usr/bin/env bash
# distc simulate against measured runs (issue 25, item 3): for 1 to 4 MPI ranks on this
# machine, a plan's step as `distc simulate` predicts it and as `mpirun -np N distc run`
# measures it (median step of worker 0's trace, the first 5 steps left out). Links come
# from `distc calibrate --transport mpi` at the same rank count. Three predictions: op
# times from one worker profiled alone; from the measured run's own trace (which holds
# what N ranks sharing the cores cost each other), which checks the communication model
# and the overlap alone; and from the profile with the N ranks sharing this machine's
# cores (`--shared-cores`, as the layout search prices them).
#
#   bash bench/simulate.sh [DISTC] [MODEL.dsl] [STRATEGY]
#
# DISTC     the distc binary, built with --features mpi (default target/release/distc)
# MODEL     default examples/dense_mlp.dsl (generated data: no files needed)
# STRATEGY  allreduce (default) or hybrid, ps, auto
set -euo pipefail
cd "$(dirname "$0")/.."
distc="${1:-target/release/distc}"
model="${2:-examples/dense_mlp.dsl}"
strategy="${3:-allreduce}"
steps="${STEPS:-30}"
[ -x "$distc" ] || { echo "simulate.sh: no distc at $distc (cargo build --release --features mpi)" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "simulate.sh: no mpirun (bash scripts/install-mpi.sh)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# One GEMM thread a rank (the profile too): N ranks on this machine's cores, not N
# times its threads.
export MATMUL_NUM_THREADS=1
mpi=(mpirun --oversubscribe --bind-to none -x MATMUL_NUM_THREADS)
[ "$(id -u)" = 0 ] && mpi+=(--allow-run-as-root)

# The median step of worker 0 in a Chrome trace, milliseconds.
measured() {
  python3 - "$1" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
ev = t["traceEvents"] if isinstance(t, dict) else t
names = {e["tid"]: e["args"]["name"] for e in ev if e.get("ph") == "M"}
steps = sorted((e["args"]["step"], e["dur"]) for e in ev
               if e.get("ph") == "X" and names.get(e["tid"]) == "worker 0"
               and e["name"].startswith("step "))
d = sorted(dur for s, dur in steps[5:]) or sorted(dur for s, dur in steps)
print(f"{d[len(d) // 2] / 1e3:.3f}")
PY
}
field() { python3 -c "import json,sys; print(f\"{json.load(open(sys.argv[1]))['$2'] * 1e3:.3f}\")" "$1"; }
err() { python3 -c "print(f'{100 * ($1 - $2) / $2:+.1f}%')"; }

echo "| ranks | link (fitted) | measured ms | predicted ms (profile) | error | predicted ms (run's trace) | error | predicted ms (profile, shared cores) | error | overlap |"
echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
for n in 1 2 3 4; do
  flags=(--strategy "$strategy" --workers "$n")
  [ "$strategy" != allreduce ] && flags+=(--servers 1)
  ranks=$n
  [ "$strategy" != allreduce ] && ranks=$((n + 1))
  "$distc" compile "$model" "${flags[@]}" -o "$work/p$n.json" 2>/dev/null
  "${mpi[@]}" -np "$ranks" "$distc" run "$work/p$n.json" --transport mpi --steps "$steps" \
    --trace "$work/t$n.json" >/dev/null 2>&1
  cal=()
  link="none (1 rank)"
  if [ "$n" -gt 1 ]; then
    "${mpi[@]}" -np "$n" "$distc" calibrate --transport mpi -o "$work/c$n.json" >/dev/null
    cal=(--calibration "inter=$work/c$n.json")
    link=$(python3 -c "import json,sys; l=json.load(open(sys.argv[1]))['link']; print(f\"{l['bandwidth']:.3g} B/s, {l['latency'] * 1e6:.1f} us\")" "$work/c$n.json")
  fi
  "$distc" simulate "$work/p$n.json" "${cal[@]}" --profile-steps 12 --format json >"$work/s$n.json"
  "$distc" simulate "$work/p$n.json" "${cal[@]}" --trace "$work/t$n.json" --format json >"$work/r$n.json"
  "$distc" simulate "$work/p$n.json" "${cal[@]}" --profile-steps 12 --shared-cores --format json >"$work/h$n.json"
  m=$(measured "$work/t$n.json")
  a=$(field "$work/s$n.json" step)
  b=$(field "$work/r$n.json" step)
  h=$(field "$work/h$n.json" step)
  o=$(python3 -c "import json,sys; print(f\"{100 * json.load(open(sys.argv[1]))['overlap']:.0f}%\")" "$work/r$n.json")
  echo "| $n | $link | $m | $a | $(err "$a" "$m") | $b | $(err "$b" "$m") | $h | $(err "$h" "$m") | $o |"
done
