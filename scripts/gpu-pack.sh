#!/usr/bin/env bash
# Packs what a GPU machine needs into gpu-bin/ (git-ignored): the GPU machines have no
# Rust toolchain, so distc and the GPU test binaries are built here, stripped (a device
# run carries at most 64 MiB of ignored files), and run there by scripts/gpu-suite.sh.
#
#   here:   bash scripts/gpu-pack.sh
#   there:  bash scripts/gpu-suite.sh        (carry gpu-bin; see the script)
set -euo pipefail
cd "$(dirname "$0")/.."

# Test binaries that touch a GPU: "package test".
tests=(
  "distc-tests cuda_ops"
  "distc-tests cuda_backend"
  "distc-tests cuda_mesh"
  "distc-tests backend"
  "distc-runtime cuda_device"
  "distc-runtime cuda"
  "distc-runtime nccl"
)

cargo build --release -p distc
rm -rf gpu-bin && mkdir -p gpu-bin
cp target/release/distc gpu-bin/distc
for t in "${tests[@]}"; do
  read -r pkg name <<<"$t"
  exe=$(cargo test --release -p "$pkg" --test "$name" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])
' "$name" | tail -1)
  [ -n "$exe" ] || { echo "gpu-pack: no test binary for $pkg --test $name" >&2; exit 1; }
  cp "$exe" "gpu-bin/$pkg-$name"
done
strip gpu-bin/*
total=$(du -cb gpu-bin/* | tail -1 | cut -f1)
ls -l gpu-bin
echo "gpu-bin: $((total / 1024 / 1024)) MiB"
if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
  echo "gpu-pack: gpu-bin is over 60 MiB; a device run carries 64 MiB in all" >&2
  exit 1
fi
