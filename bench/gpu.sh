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
# RESULTS (a folder for the raw metrics and JSON lines; default a new temp folder),
# MODELS (`workloads`, the default; `gpt2` for GPT-2 124M; `workloads gpt2` for both),
# GPT2_BATCH (8), GPT2_PROFILE=1 to add a `--profile` run of GPT-2, GPT2_TIMEOUT (seconds
# each GPT-2 command may run; 1800).
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

# MODELS picks the sections: `workloads` (W1, W2), `gpt2` (GPT-2 124M), or both.
models=" ${MODELS:-workloads} "
want() { [[ "$models" == *" $1 "* ]]; }
total=$((warmup + steps))

# ---------------------------------------------------------------- GPT-2 124M
# scripts/gpt-dsl.py at GPT-2 124M size (12 layers, 768 wide, 12 heads, context 1024,
# vocabulary 50,304), bf16 (f32 masters), AdamW with clipping as gpt.dsl trains, on
# uniform random token ids (the speed does not depend on which ids they are); beside
# it bench/pytorch/gpt_gpu_bench.py: the same model and batch in PyTorch eager and
# under torch.compile, both with SDPA flash attention. tokens/s = samples/s x 1024.
if want gpt2; then
  g2="$results/gpt2"
  mkdir -p "$g2/tok"
  gb="${GPT2_BATCH:-8}"
  "$py" - "$g2/tok" <<'PY'
import sys
import numpy as np
r = np.random.default_rng(1)
r.integers(0, 50304, 4_000_000, dtype=np.uint16).tofile(f"{sys.argv[1]}/train.bin")
r.integers(0, 50304, 8 * 1025 + 1, dtype=np.uint16).tofile(f"{sys.argv[1]}/valid.bin")
PY
  "$py" scripts/gpt-dsl.py --layers 12 --dim 768 --heads 12 --context 1024 --vocab 50304 \
    --batch "$gb" --steps "$total" --data tok >"$g2/gpt2-124m.dsl"
  say "distc GPT-2 124M, bf16, batch $gb"
  timeout "${GPT2_TIMEOUT:-1800}" "$distc" train "$g2/gpt2-124m.dsl" --data "$g2" --device cuda --precision bf16 \
    --steps "$total" --preload --metrics "$g2/distc.jsonl" >"$g2/distc.log" 2>&1 \
    || say "  distc FAILED: $(tail -3 "$g2/distc.log" | tr '\n' ' ')"
  say "PyTorch GPT-2 124M: eager and compiled, SDPA flash attention"
  timeout "${GPT2_TIMEOUT:-1800}" "$py" bench/pytorch/gpt_gpu_bench.py --batch "$gb" --warmup "$warmup" --steps "$steps" \
    --runs "$runs" --modes eager compiled >"$g2/torch.jsonl" \
    || say "  some PyTorch mode failed (see $g2/torch.jsonl)"
  if [ "${GPT2_PROFILE:-0}" = 1 ]; then
    say "distc GPT-2 124M --profile (where the step goes)"
    timeout "${GPT2_TIMEOUT:-1800}" "$distc" train "$g2/gpt2-124m.dsl" --data "$g2" --device cuda --precision bf16 \
      --steps 24 --profile >"$g2/profile.txt" 2>&1 || say "  profile run FAILED"
  fi
  RESULTS_DIR="$g2" WARMUP="$warmup" GPU="$gpu" python3 - <<'PY' | tee "$g2/table.md"
import json, os, statistics
d, warmup = os.environ["RESULTS_DIR"], int(os.environ["WARMUP"])
rows = []
lines = [json.loads(l) for l in open(f"{d}/distc.jsonl") if l.strip()] if os.path.exists(f"{d}/distc.jsonl") else []
timed = [m for m in lines if m.get("step", 0) > warmup]
if timed:
    med = lambda k: statistics.median(m[k] for m in timed if m.get(k) is not None) if any(m.get(k) is not None for m in timed) else None
    rows.append(("distc --precision bf16", med("samples_per_sec") * 1024, med("mfu"), lines[0]["loss"], None))
else:
    rows.append(("distc --precision bf16", None, None, None, "failed"))
if os.path.exists(f"{d}/torch.jsonl"):
    for l in open(f"{d}/torch.jsonl"):
        if l.strip():
            t = json.loads(l)
            rows.append((f"PyTorch {t['mode']}", t.get("tokens_per_sec"), t.get("mfu"), t.get("first_loss"), t.get("error")))
print(f"GPT-2 124M, {os.environ['GPU']}; tokens/s, median after {warmup} warm-up steps\n")
print("| run | tokens/s | MFU | first loss | vs PyTorch compiled |")
print("| --- | ---: | ---: | ---: | ---: |")
comp = next((r[1] for r in rows if r[0] == "PyTorch compiled" and r[1]), None)
for name, tps, mfu, loss, err in rows:
    if err or tps is None:
        print(f"| {name} | failed: {err} | | | |")
        continue
    print(f"| {name} | {tps:,.0f} | {'' if mfu is None else f'{100 * mfu:.1f}%'} | {loss:.4f} | {'' if not comp else f'{tps / comp:.2f}x'} |")
PY
fi

# ---------------------------------------------------------------- distc
if want workloads; then
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
fi
say "raw metrics, logs and torch.jsonl: $results"
