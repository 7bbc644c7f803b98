#!/usr/bin/env bash
# Install the `tensorboard` package into .venv-bench/ (made by
# scripts/install-pytorch.sh, run first) for bench/pytorch/tensorboard_read.py, which
# reads distc's --tensorboard event files back with TensorBoard's own reader.
# Idempotent: an environment where `tensorboard` imports is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$PWD/.venv-bench"
TENSORBOARD_VERSION="2.21.0"
[ -x "$VENV/bin/python" ] || { echo "[install-tensorboard] no $VENV: run scripts/install-pytorch.sh first" >&2; exit 1; }
if "$VENV/bin/python" -c "import tensorboard" 2>/dev/null; then
  echo "[install-tensorboard] tensorboard $("$VENV/bin/python" -c 'import tensorboard; print(tensorboard.__version__)') already in $VENV"
  exit 0
fi
"$VENV/bin/pip" install --disable-pip-version-check --progress-bar off "tensorboard==$TENSORBOARD_VERSION"
"$VENV/bin/python" -c "from tensorboard.backend.event_processing import event_accumulator; import tensorboard; print('[install-tensorboard] tensorboard', tensorboard.__version__)"
