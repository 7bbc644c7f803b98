#!/usr/bin/env bash
# The layout search against measurement (issue 39, item 3): for each model and worker
# count, `distc compile --strategy auto` searches the layouts; then every candidate it
# priced is compiled with its own flags and trained here (threads of one process, or
# with TRANSPORT=mpi ranks of an mpirun job; CPU), and its measured step and memory are
# set beside the prediction.
#
#   bash bench/planner.sh [DISTC]
#
# Environment: MODELS (examples/dense_mlp.dsl examples/gpt.dsl), WORKERS (2 4),
# WARMUP (2), STEPS (6, a round), ROUNDS (3), RESULTS (a folder), DISTC_DATA (MNIST for dense_mlp),
# PRECISIONS (the search's --search-precision, e.g. fp32,bf16; default the model's),
# TRANSPORT (threads, or mpi: each layout's workers as `mpirun -np N` ranks, a build
# with --features mpi; MPIRUN_ARGS, default --oversubscribe, and --allow-run-as-root
# as root; MPIRUN, a command to run instead of `mpirun MPIRUN_ARGS`, such as one that
# starts the ranks on other hosts), SEARCH_FLAGS (more flags for the search: the
# hosts' links and --ranks-per-node), PROFILE_STEPS (the search's profile here, as
# `compile --profile-steps`; default the search's 3: on a noisy machine, more steady
# the op times the predictions rest on). Across three network-namespace hosts:
# `cargo test --features mpi -p distc --test netns -- --ignored --nocapture
# the_layout_search_across_three_hosts` makes the hosts, calibrates their link, and
# runs this script over them.
# Per candidate: the predicted step (ms) and the measured one (the global batch over
# the median samples/s of the metrics lines after the warm-up, in each of ROUNDS runs
# taken in turn with the other layouts'; the median of the rounds, and their spread:
# the slowest round less the fastest, over that median), and the predicted
# memory per worker beside the measured one (worker 0's variables, gradients, optimizer
# state, peak activations and buffers, as the metrics count them; for a pipeline, its
# largest stage's, as the metrics give each stage's). Then, per model and
# N: how far the pick's measured step is from the fastest measured, and the median
# prediction errors.
#
# The workers share this machine's cores. As `distc bench` measures (WORKLOADS.md),
# each of N workers' matrix products run on cores / N threads (at least 1;
# MATMUL_NUM_THREADS, exported to the search, the runs and every MPI rank, unless set
# already), and the search prices the N workers sharing the cores as it profiled one.
# Unless SEARCH_FLAGS gives a --link or a --calibration, the link is measured first,
# as the op times are: `distc calibrate` on N threads, or on N ranks of the same
# mpirun (to the search as `--calibration inter=FILE`).
set -euo pipefail
cd "$(dirname "$0")/.."

distc="${1:-target/release/distc}"
models="${MODELS:-examples/dense_mlp.dsl examples/gpt.dsl}"
workers="${WORKERS:-2 4}"
warmup="${WARMUP:-2}"
steps="${STEPS:-6}"
rounds="${ROUNDS:-3}"
out="${RESULTS:-$(mktemp -d)}"
search_flags="${SEARCH_FLAGS:-}"
[ -n "${PRECISIONS:-}" ] && search_flags="$search_flags --search-precision $PRECISIONS"
[ -n "${PROFILE_STEPS:-}" ] && search_flags="$search_flags --profile-steps $PROFILE_STEPS"
transport="${TRANSPORT:-threads}"
threads="${MATMUL_NUM_THREADS:-}"
cores=$(nproc)
say() { echo "[planner.sh] $*" >&2; }
case "$transport" in
  threads) ;;
  mpi)
    root_flag=""
    [ "$(id -u)" = 0 ] && root_flag="--allow-run-as-root"
    mpirun_cmd="${MPIRUN:-mpirun ${MPIRUN_ARGS:---oversubscribe $root_flag} -x MATMUL_NUM_THREADS}"
    ;;
  *) say "TRANSPORT is threads or mpi, not $transport"; exit 1 ;;
esac
# Trains the plan $1 of $2 workers for $3 steps, its metrics to $4; no evaluation
# (gpt.dsl's took 14 s a run, three times its steps).
train() {
  if [ "$transport" = mpi ]; then
    # mpirun forwards its standard input to rank 0: not the list of candidates.
    # shellcheck disable=SC2086
    $mpirun_cmd -np "$2" "$distc" run "$1" --transport mpi --steps "$3" -q --timeout 600 \
      --no-eval "${data[@]}" --metrics "$4" >/dev/null </dev/null
  else
    "$distc" run "$1" --steps "$3" -q --no-eval "${data[@]}" --metrics "$4" >/dev/null
  fi
}
[ -x "$distc" ] || { say "no distc binary at $distc (cargo build --release)"; exit 1; }
mkdir -p "$out"
# shellcheck source=bench/data.sh
source bench/data.sh

for model in $models; do
  name=$(basename "$model" .dsl)
  data=()
  dir=$(data_for "$model" "$out")
  [ -n "$dir" ] && data=(--data "$dir")
  for n in $workers; do
    tag="$name-$n"
    export MATMUL_NUM_THREADS="${threads:-$(( cores / n > 0 ? cores / n : 1 ))}"
    links="$search_flags"
    if [[ " $search_flags " != *" --calibration "* && " $search_flags " != *" --link "* ]]; then
      # The links the layouts will run over, measured as their op times are: N threads,
      # or N ranks of the same mpirun.
      if [ "$transport" = mpi ]; then
        # shellcheck disable=SC2086
        $mpirun_cmd -np "$n" "$distc" calibrate --transport mpi -o "$out/$tag.link.json" \
          >"$out/$tag.link.txt" </dev/null
      else
        "$distc" calibrate --workers "$n" -o "$out/$tag.link.json" >"$out/$tag.link.txt"
      fi
      links="$search_flags --calibration inter=$out/$tag.link.json"
    fi
    # shellcheck disable=SC2086
    "$distc" compile "$model" --strategy auto --workers "$n" "${data[@]}" $links \
      -o "$out/$tag.auto.json" 2> "$out/$tag.search.txt" >/dev/null
    "$distc" explain "$out/$tag.auto.json" --format json > "$out/$tag.search.json"
    # One line a priced candidate: index, label, flags, predicted step, memory.
    python3 - "$out/$tag.search.json" > "$out/$tag.candidates.txt" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["search"]
for i, c in enumerate(s["candidates"]):
    v = c["verdict"].get("priced")
    if not v:
        continue
    d, t, p = c["data"], c["model"], c["pipe"]
    flags = ["--mesh", f"data={d},model={t},pipe={p}", "--batch", str(c["batch"])]
    flags += ["--strategy", "allreduce" if d > 1 else "single"]
    if p > 1:
        flags += ["--micro-batches", str(c["micro_batches"])]
    if c["zero"]:
        flags += ["--zero", str(c["zero"])]
    if c["remat"]:
        flags += ["--remat", "layers"]
    precision = c.get("precision", "fp32")
    flags += ["--precision", precision]
    label = f"data={d},model={t},pipe={p}" + (f",micro={c['micro_batches']}" if p > 1 else "") \
        + (f",zero={c['zero']}" if c["zero"] else "") + (",remat" if c["remat"] else "") \
        + (f",{precision}" if precision != "fp32" else "")
    print(i, label, v["step"], v["memory_per_worker"], " ".join(flags), sep="\t")
PY
    global=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['search']['global_batch'])" "$out/$tag.search.json")
    chosen=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['search']['chosen'])" "$out/$tag.search.json")
    : > "$out/$tag.measured.txt"
    : > "$out/$tag.plans.txt"
    while IFS=$'\t' read -r idx label predicted memory flags; do
      # shellcheck disable=SC2086
      if "$distc" compile "$model" $flags "${data[@]}" -o "$out/$tag.$idx.json" >/dev/null 2>&1; then
        printf '%s\t%s\t%s\t%s\n' "$idx" "$label" "$predicted" "$memory" >> "$out/$tag.plans.txt"
      else
        say "$tag $label: does not compile with its own flags"
      fi
    done < "$out/$tag.candidates.txt"
    # Every layout once a round: a slow spell of a shared machine slows one round of
    # a layout, not all of its steps, and the median of the rounds leaves it out.
    for round in $(seq 1 "$rounds"); do
      while IFS=$'\t' read -r idx _; do
        train "$out/$tag.$idx.json" "$n" $((warmup + steps)) "$out/$tag.$idx.r$round.jsonl"
      done < "$out/$tag.plans.txt"
    done
    while IFS=$'\t' read -r idx label predicted memory; do
      python3 - "$out/$tag.$idx" "$rounds" "$warmup" "$global" "$idx" "$label" "$predicted" "$memory" \
        >> "$out/$tag.measured.txt" <<'PY'
import json, statistics, sys
base, rounds, warmup, g, idx, label, predicted, memory = sys.argv[1:9]
steps = []
for r in range(1, int(rounds) + 1):
    lines = [json.loads(l) for l in open(f"{base}.r{r}.jsonl")][int(warmup):]
    steps.append(int(g) / statistics.median(l["samples_per_sec"] for l in lines))
step = statistics.median(steps)
m = lines[-1]["memory"]
held = sum(m[k] for k in ("params", "gradients", "optimizer", "activations", "comm_buffers"))
# A pipeline's `memory` sums its stages: its largest stage holds what one worker does.
stages = (lines[-1].get("pipeline") or {}).get("stages") or []
if stages and all("held" in s for s in stages):
    held = max(s["held"] for s in stages)
print(idx, label, float(predicted), step, int(memory), held, (max(steps) - min(steps)) / step, sep="\t")
PY
    done < "$out/$tag.plans.txt"
    python3 - "$out/$tag.measured.txt" "$chosen" "$tag" "$transport" "$MATMUL_NUM_THREADS" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
chosen, tag = sys.argv[2], sys.argv[3]
print(f"\n{tag} ({sys.argv[4]}, products on {sys.argv[5]} thread(s) a worker): {len(rows)} layouts priced and measured")
print(f"{'':2}{'layout':<34} {'pred ms':>9} {'meas ms':>9} {'spread':>7} {'error':>7} {'pred MiB':>9} {'meas MiB':>9} {'error':>7}")
errs, merrs = [], []
spreads = []
for idx, label, p, m, pm, mm, spread in rows:
    p, m, pm, mm = float(p) * 1e3, float(m) * 1e3, int(pm) / 2**20, int(mm) / 2**20
    spreads.append(float(spread))
    e = (p - m) / m
    errs.append(abs(e))
    mark = "*" if idx == chosen else " "
    me = (pm - mm) / mm
    merrs.append(abs(me))
    mem = f"{mm:9.2f} {100*me:6.1f}%"
    print(f"{mark} {label:<34} {p:9.2f} {m:9.2f} {100*float(spread):6.1f}% {100*e:6.1f}% {pm:9.2f} {mem}")
fastest = min(float(r[3]) for r in rows)
pick = [float(r[3]) for r in rows if r[0] == chosen]
if pick:
    print(f"pick's measured step: {100 * (pick[0] / fastest - 1):.1f}% above the fastest measured")
mem = f"{100 * statistics.median(merrs):.1f}%" if merrs else "-"
print(f"median |error|: step {100 * statistics.median(errs):.1f}%, memory {mem}; "
      f"median spread of the rounds: {100 * statistics.median(spreads):.1f}%")
PY
  done
done
say "searches, plans and metrics in $out"
