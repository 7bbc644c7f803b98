#!/usr/bin/env bash
# Single-GPU benchmark: distc against PyTorch on the same GPU, same models
# (WORKLOADS.md W1 sparse_lm, W2 dense_mlp), same batches, plain SGD, fp32 on both
# sides (TF32 off); then mixed precision: distc --precision bf16 beside PyTorch's
# torch.autocast(bfloat16) (gpu_bench.py --amp bf16), fp32 weights on both sides. For a GPU machine with no Rust toolchain: distc comes prebuilt.
#
#   here:    cargo build --release && mkdir -p gpu-bin && cp target/release/distc gpu-bin/
#   there:   bash bench/gpu.sh [DISTC] [DATA_DIR]
#
# DISTC     the distc binary (default gpu-bin/distc; gpu-bin/ is git-ignored)
# DATA_DIR  passed as --data (default $DISTC_DATA; both workloads' data is synthetic)
# Environment: RUNS (3), WARMUP (10), STEPS (50), PYTHON (python3, with PyTorch and
# the nvidia-* CUDA 13 wheels), TORCH_COMPILE=1 to add torch.compile(reduce-overhead),
# RESULTS (a folder for the raw metrics and JSON lines; default a new temp folder).
#
# distc: `distc train examples/W.dsl --device cuda --steps WARMUP+STEPS --preload
# --metrics F`, with CUDA graphs (the default) and with --no-cuda-graph; a run's
# figure is the median of the per-step samples/s after the warm-up steps, and the
# table shows the median of RUNS runs. PyTorch: bench/pytorch/gpu_bench.py, modes
# eager and graphs (torch.cuda.graph over the whole step), its samples/s taken as
# B / median step time (the same statistic), median of RUNS runs.
set -euo pipefail
cd "$(dirname "$0")/.."

distc="${1:-gpu-bin/distc}"
data="${2:-${DISTC_DATA:-}}"
runs="${RUNS:-3}"
warmup="${WARMUP:-10}"
steps="${STEPS:-50}"
py="${PYTHON:-python3}"

die() { echo "gpu.sh: $*" >&2; exit 1; }
say() { echo "[gpu.sh] $*" >&2; }

[ -x "$distc" ] || die "no distc binary at $distc: build it where Rust is (cargo build --release), copy target/release/distc to gpu-bin/distc here, or pass its path"
[ -z "$data" ] || [ -d "$data" ] || die "data directory $data does not exist"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this needs a machine with an NVIDIA GPU and driver"
gpus="$(nvidia-smi -L 2>&1)" || die "nvidia-smi sees no GPU: $gpus"
grep -q '^GPU ' <<<"$gpus" || die "nvidia-smi sees no GPU: $gpus"
gpu="$(head -1 <<<"$gpus")"
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
  || die "$py cannot import torch or torch sees no CUDA device (set PYTHON to an interpreter with PyTorch for CUDA)"

# The CUDA 13 libraries of the nvidia-* wheels (cuBLAS, NVRTC in nvidia/cu13/lib; NCCL
# in nvidia/nccl/lib), found from Python; `nvidia` is a namespace package, so every
# folder on its __path__ is searched.
libdirs="$("$py" - <<'PY'
import glob, os
import nvidia
roots = list(getattr(nvidia, "__path__", [])) or [os.path.dirname(nvidia.__file__)]
found = []
for root in roots:
    for pat in ("cu13/lib", "nccl/lib", "*/lib"):
        for d in sorted(glob.glob(os.path.join(root, pat))):
            if os.path.isdir(d) and d not in found:
                found.append(d)
print(":".join(found))
PY
)" || die "cannot import the nvidia package from $py (the nvidia-* CUDA wheels PyTorch installs)"
[ -n "$libdirs" ] || die "no nvidia/*/lib folders under the nvidia package of $py"
find_lib() {  # find_lib NAME: the first folder of $libdirs holding NAME
  local d
  IFS=: read -ra dirs <<<"$libdirs"
  for d in "${dirs[@]}"; do [ -e "$d/$1" ] && { echo "$d"; return 0; }; done
  return 1
}
for lib in libcublas.so.13 libcublasLt.so.13 libnvrtc.so.13; do
  find_lib "$lib" >/dev/null || die "$lib not found in $libdirs"
done
nccl_dir="$(find_lib libnccl.so.2)" || die "libnccl.so.2 not found in $libdirs (pip wheel nvidia-nccl-cu13)"

results="${RESULTS:-$(mktemp -d)}"
mkdir -p "$results"
shim="$(mktemp -d)"  # cudarc loads libnccl.so, the wheel has libnccl.so.2
trap 'rm -rf "$shim"' EXIT
ln -s "$nccl_dir/libnccl.so.2" "$shim/libnccl.so"
export DISTC_CUDA_LIB_DIR="$shim:$libdirs"
export LD_LIBRARY_PATH="$shim:$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "$gpu; $("$distc" --version 2>/dev/null || echo '?'); $runs run(s) of $warmup warm-up + $steps timed steps; raw results in $results"

# ---------------------------------------------------------------- distc
total=$((warmup + steps))
for w in sparse_lm dense_mlp; do
  for g in graphs nograph bf16; do
    flags=()
    [ "$g" = nograph ] && flags+=(--no-cuda-graph)
    [ "$g" = bf16 ] && flags+=(--precision bf16)
    [ -n "$data" ] && flags+=(--data "$data")
    for r in $(seq 1 "$runs"); do
      m="$results/distc.$w.$g.run$r.jsonl"
      say "distc $w ($g) run $r"
      rc=0
      "$distc" train "examples/$w.dsl" --device cuda --steps "$total" --preload --quiet \
        --metrics "$m" "${flags[@]}" >"$results/distc.$w.$g.run$r.log" 2>&1 || rc=$?
      if [ "$rc" != 0 ]; then
        say "  FAILED (exit $rc): $(tail -3 "$results/distc.$w.$g.run$r.log" | tr '\n' ' ')"
        rm -f "$m"
      fi
    done
  done
done

# ---------------------------------------------------------------- PyTorch
modes=(eager graphs)
[ "${TORCH_COMPILE:-0}" = 1 ] && modes+=(compile)
say "PyTorch: bench/pytorch/gpu_bench.py --mode ${modes[*]}"
"$py" bench/pytorch/gpu_bench.py --workload sparse_lm dense_mlp --mode "${modes[@]}" --device cuda \
  --warmup "$warmup" --steps "$steps" --runs "$runs" >"$results/torch.jsonl" \
  || say "  some PyTorch configuration failed (see the \"error\" fields in $results/torch.jsonl)"
say "PyTorch autocast bf16: bench/pytorch/gpu_bench.py --amp bf16 --mode eager graphs"
"$py" bench/pytorch/gpu_bench.py --workload sparse_lm dense_mlp --mode eager graphs --amp bf16 \
  --device cuda --warmup "$warmup" --steps "$steps" --runs "$runs" >"$results/torch_bf16.jsonl" \
  || say "  some PyTorch autocast configuration failed (see $results/torch_bf16.jsonl)"

# ---------------------------------------------------------------- table
RESULTS_DIR="$results" WARMUP="$warmup" GPU="$gpu" python3 - <<'PY' | tee "$results/table.md"
import glob, json, os, statistics
d, warmup = os.environ["RESULTS_DIR"], int(os.environ["WARMUP"])

def distc_rate(path):
    """Median over the steps after the warm-up of the metrics lines' samples_per_sec."""
    rates = []
    for line in open(path):
        line = line.strip()
        if not line:
            continue
        m = json.loads(line)
        if "step" in m and "samples_per_sec" in m and m["step"] > warmup:
            rates.append(float(m["samples_per_sec"]))
    return statistics.median(rates) if rates else None

def distc(w, g):
    runs = [r for r in (distc_rate(p) for p in sorted(glob.glob(f"{d}/distc.{w}.{g}.run*.jsonl"))) if r]
    return statistics.median(runs) if runs else None

torch, notes = {}, []
tpath = os.path.join(d, "torch.jsonl")
if os.path.exists(tpath):
    for line in open(tpath):
        if line.strip():
            t = json.loads(line)
            if "error" in t:
                notes.append(f"PyTorch {t['workload']} {t['mode']} failed: {t['error']}")
                continue
            torch[(t["workload"], t["mode"])] = t["samples_per_sec_median_step"]
            if t.get("emb_grad"):
                notes.append(f"PyTorch {t['workload']} {t['mode']}: embedding gradient {t['emb_grad']} ({t['emb_grad_note']})")
            notes.append(f"PyTorch {t['workload']} {t['mode']}: peak {t['peak_mem_bytes'] / 2**20:.1f} MiB, "
                         f"step median {t['step_ms_median']:.3f} ms, loss {t['loss_first_last'][0]} -> {t['loss_first_last'][1]}")

fmt = lambda v: "failed" if v is None else f"{v:,.0f}"
ratio = lambda a, b: "" if a is None or b is None else f"{a / b:.2f}x"
extra = [m for m in ("compile",) if any(k[1] == m for k in torch)]
print(f"{os.environ['GPU']}; samples/s, median of the per-step figures after {warmup} warm-up steps, median of runs; fp32, TF32 off\n")
head = ["workload", "distc graphs", "distc no-graph", "torch eager", "torch graphs"] + [f"torch {m}" for m in extra] \
       + ["distc / eager", "distc / graphs", "target"]
print("| " + " | ".join(head) + " |")
print("| --- |" + " ---: |" * (len(head) - 2) + " --- |")
targets = {"sparse_lm": 3.0, "dense_mlp": 1.2}
for w in ("sparse_lm", "dense_mlp"):
    dg, dn = distc(w, "graphs"), distc(w, "nograph")
    te, tg = torch.get((w, "eager")), torch.get((w, "graphs"))
    met = ""
    if dg is not None and te is not None and tg is not None:
        ok = dg >= targets[w] * te and dg >= tg
        met = ("met" if ok else "not met") + f" (>= {targets[w]}x eager, >= 1x graphs)"
    row = [w, fmt(dg), fmt(dn), fmt(te), fmt(tg)] + [fmt(torch.get((w, m))) for m in extra] \
          + [ratio(dg, te), ratio(dg, tg), met]
    print("| " + " | ".join(row) + " |")
print("\nRatios and targets use distc with CUDA graphs (its default); PyTorch: B / median step time.")
for n in notes:
    print(f"- {n}")

# Mixed precision: distc --precision bf16 (CUDA graphs) beside PyTorch autocast(bf16).
amp = {}
apath = os.path.join(d, "torch_bf16.jsonl")
if os.path.exists(apath):
    for line in open(apath):
        if line.strip():
            t = json.loads(line)
            if "error" not in t:
                amp[(t["workload"], t["mode"])] = t["samples_per_sec_median_step"]
print("\nbf16: distc --precision bf16 against PyTorch autocast(bfloat16), fp32 weights on both sides\n")
print("| workload | distc fp32 | distc bf16 | bf16 / fp32 | torch autocast eager | torch autocast graphs | distc bf16 / autocast graphs |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for w in ("sparse_lm", "dense_mlp"):
    f, b = distc(w, "graphs"), distc(w, "bf16")
    ae, ag = amp.get((w, "eager")), amp.get((w, "graphs"))
    print(f"| {w} | {fmt(f)} | {fmt(b)} | {ratio(b, f)} | {fmt(ae)} | {fmt(ag)} | {ratio(b, ag)} |")
PY
say "raw metrics, logs and torch.jsonl: $results"
