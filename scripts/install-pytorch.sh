#!/usr/bin/env bash
# Install a CPU-usable PyTorch, numpy and safetensors into .venv-bench/ (repository
# root) for the PyTorch reference benchmarks and the parity check in bench/pytorch/.
# Idempotent: a second run finds a working environment and does nothing; an
# environment that fails the check (say, one made before safetensors was added)
# gets the same pinned pip install again, which skips what is already there.
#
# Only PyPI is reachable here (not download.pytorch.org), and PyPI's Linux x86_64
# torch wheels are CUDA builds: libtorch_cpu.so itself links libcudart/libcupti,
# and libtorch.so links cuBLAS, cuDNN, NCCL, ... so `import torch` fails without
# the nvidia-* runtime wheels even on a machine with no GPU. The lightest install
# that works is therefore:
#   torch --no-deps
#   + only the nvidia-* wheels whose libraries torch links (no triton, cusolver,
#     cuda-bindings, cccl, cuda-toolkit meta-package: about 1.3 GB less)
#   + torch's pure-Python dependencies.
#   + safetensors (bench/pytorch/parity.py writes distc's --init file with it;
#     a self-contained wheel with no dependencies).
# If that environment fails its check (import torch, a gloo process group, DDP
# with a sparse gradient), the script falls back to a plain `pip install torch`
# with all of its dependencies.
#
# Usage: bash scripts/install-pytorch.sh      (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="$ROOT/.venv-bench"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION="2.15.0"
NUMPY_VERSION="2.4.6"
SAFETENSORS_VERSION="0.8.0"
# The exact versions that `pip install torch==2.15.0` resolves to (CUDA 13.2 build).
NVIDIA_WHEELS=(
  nvidia-cuda-runtime==13.2.86
  nvidia-cuda-cupti==13.2.86
  nvidia-cuda-nvrtc==13.2.86
  nvidia-cublas==13.4.1.3
  nvidia-cufft==12.2.0.57
  nvidia-cufile==1.17.1.22
  nvidia-cusparse==12.7.10.12
  nvidia-nvjitlink==13.5.37
  nvidia-cudnn-cu13==9.26.0.51
  nvidia-cusparselt-cu13==0.8.1
  nvidia-nccl-cu13==2.30.7
  nvidia-nvshmem-cu13==3.7.2
)
PURE_DEPS=(
  "filelock==4.2.11"
  "typing-extensions==4.16.0"
  "sympy==1.14.0"
  "mpmath==1.3.0"
  "networkx==3.6.1"
  "jinja2==3.1.6"
  "MarkupSafe==3.0.4"
  "fsspec==2026.9.0"
  "setuptools==84.2.1"
)

say() { echo "[install-pytorch] $*"; }

# The check: torch imports, its version is the pinned one, numpy and
# safetensors.torch work, and a one-process gloo group runs DDP over a sparse
# embedding gradient.
check_env() {
  "$VENV/bin/python" - "$TORCH_VERSION" <<'PY' 2>&1
import os, sys, socket
want = sys.argv[1]
import numpy as np
import torch, torch.distributed as dist
import safetensors, safetensors.torch
from torch.nn.parallel import DistributedDataParallel as DDP
assert torch.__version__.split("+")[0] == want, f"torch {torch.__version__}, want {want}"
assert dist.is_gloo_available(), "gloo not available"
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
dist.init_process_group("gloo", rank=0, world_size=1)
emb = DDP(torch.nn.Embedding(10, 4, sparse=True))
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
emb(torch.tensor([1, 2, 2])).sum().backward()
assert emb.module.weight.grad.is_sparse
opt.step()
dist.barrier(); dist.destroy_process_group()
print(f"ok: torch {torch.__version__}, numpy {np.__version__}, safetensors {safetensors.__version__}, gloo + DDP sparse grad")
PY
}

START=$(date +%s)

if [ -x "$VENV/bin/python" ] && out=$(check_env); then
  say "$VENV already works ($out); nothing to do"
  exit 0
fi
if [ -x "$VENV/bin/python" ]; then
  say "$VENV exists but fails its check:"
  echo "$out" | tail -3
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/pip" install --disable-pip-version-check --progress-bar off)

say "installing torch==$TORCH_VERSION --no-deps, its linked nvidia-* runtime libraries (no triton/cusolver), numpy==$NUMPY_VERSION, safetensors==$SAFETENSORS_VERSION and torch's pure-Python deps (pip skips those already installed)"
"${PIP[@]}" --no-deps "torch==$TORCH_VERSION" "numpy==$NUMPY_VERSION" "safetensors==$SAFETENSORS_VERSION" \
  "${NVIDIA_WHEELS[@]}" "${PURE_DEPS[@]}"

if out=$(check_env); then
  say "minimal install works: $out"
else
  say "minimal install failed its check:"
  echo "$out" | tail -5
  say "falling back to: pip install torch==$TORCH_VERSION numpy==$NUMPY_VERSION safetensors==$SAFETENSORS_VERSION (with all dependencies)"
  "${PIP[@]}" "torch==$TORCH_VERSION" "numpy==$NUMPY_VERSION" "safetensors==$SAFETENSORS_VERSION"
  out=$(check_env) || { echo "$out"; say "FAILED: torch does not work in $VENV"; exit 1; }
  say "full install works: $out"
fi

say "size of $VENV: $(du -sh "$VENV" | cut -f1); took $(( $(date +%s) - START )) s"
say "run: $VENV/bin/python bench/pytorch/ddp_bench.py --workload sparse_lm --workers 2"
say "     $VENV/bin/python bench/pytorch/parity.py --workers 1 2"
