#!/usr/bin/env bash
# Install NVRTC (libnvrtc.so.13 and its builtins library) from PyPI's
# `nvidia-cuda-nvrtc` wheel into .nvrtc/ at the repository root (git-ignored), with
# `pip install --target`: no CUDA toolkit, no GPU, no driver and no root needed.
# NVRTC compiles CUDA C to CUBIN on a machine with no GPU, so CI compiles every
# generated kernel (../shared/PLATFORM.md).
#
# Idempotent: a second run finds the library and prints only where it is.
# The library folder is printed on the last line; point distc at it with
#   DISTC_CUDA_LIB_DIR=<that folder>
# (the runtime's cuda module loads libnvrtc from there by full path; the CUDA tests
# also look in this folder by themselves, so `cargo test` needs no variable).
#
# Usage: bash scripts/install-nvrtc.sh      (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$(pwd)"
TARGET="$ROOT/.nvrtc"
PYTHON="${PYTHON:-python3}"
# Matches CUDA 13.0 on the GPU machines (driver 580): a newer NVRTC's output can be
# refused by an older driver.
VERSION="13.0.88"
LIB_DIR="$TARGET/nvidia/cu13/lib"
STAMP="$TARGET/.installed-$VERSION"

say() { echo "[install-nvrtc] $*"; }

if [ -f "$STAMP" ] && [ -e "$LIB_DIR/libnvrtc.so.13" ]; then
  say "NVRTC $VERSION already installed: $LIB_DIR/libnvrtc.so.13"
  echo "$LIB_DIR"
  exit 0
fi

START=$(date +%s)
say "installing nvidia-cuda-nvrtc==$VERSION into $TARGET (about 58 MB download)"
rm -rf "$TARGET"
"$PYTHON" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
  --target "$TARGET" "nvidia-cuda-nvrtc==$VERSION"

if [ ! -e "$LIB_DIR/libnvrtc.so.13" ]; then
  say "FAILED: $LIB_DIR/libnvrtc.so.13 is not there after the install; the wheel holds:"
  find "$TARGET" -name 'libnvrtc*' >&2
  exit 1
fi
if ! compgen -G "$LIB_DIR/libnvrtc-builtins.so*" >/dev/null; then
  say "FAILED: no libnvrtc-builtins.so* beside libnvrtc.so.13 in $LIB_DIR"
  exit 1
fi
touch "$STAMP"
say "installed NVRTC $VERSION in $(( $(date +%s) - START )) s ($(du -sh "$TARGET" | cut -f1)): $LIB_DIR/libnvrtc.so.13"
echo "$LIB_DIR"
