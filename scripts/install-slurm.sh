#!/usr/bin/env bash
# Install SLURM (Debian's slurm-wlm: slurmctld, slurmd, srun and sbatch), for
# compiler/tests/slurm.rs, which starts a cluster of its own (scripts/slurm-local.sh).
# Idempotent: does nothing when the daemons and the clients are already present.
set -euo pipefail

if command -v slurmctld >/dev/null 2>&1 \
    && command -v slurmd >/dev/null 2>&1 \
    && command -v srun >/dev/null 2>&1 \
    && command -v sbatch >/dev/null 2>&1; then
    echo "install-slurm: SLURM already installed ($(srun --version 2>/dev/null))"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
else
    SUDO=(sudo)
fi

"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    slurmctld slurmd slurm-client
# The packages enable their services; the tests start daemons with a configuration of
# their own, and nothing else should hold SLURM's ports.
for s in slurmctld slurmd; do
    "${SUDO[@]}" systemctl disable --now "$s" >/dev/null 2>&1 || true
done

echo "install-slurm: installed $(srun --version 2>/dev/null)"
