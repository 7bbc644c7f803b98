#!/usr/bin/env bash
# Install OpenMPI and libclang (needed by the `mpi` crate's bindgen step), and iproute2
# (`ip`, `tc`: compiler/tests/netns.rs runs MPI jobs across network namespaces).
# Idempotent: does nothing when mpirun, mpicc, libclang, ip and tc are already present.
set -euo pipefail

have_libclang() {
    compgen -G '/usr/lib/llvm-*/lib/libclang*.so*' >/dev/null 2>&1 \
        || compgen -G '/usr/lib/x86_64-linux-gnu/libclang*.so*' >/dev/null 2>&1 \
        || compgen -G '/usr/lib/aarch64-linux-gnu/libclang*.so*' >/dev/null 2>&1
}

if command -v mpirun >/dev/null 2>&1 \
    && command -v mpicc >/dev/null 2>&1 \
    && command -v ip >/dev/null 2>&1 \
    && command -v tc >/dev/null 2>&1 \
    && have_libclang; then
    echo "install-mpi: OpenMPI and libclang already installed ($(mpirun --version 2>/dev/null | head -n1))"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
else
    SUDO=(sudo)
fi

# `env` so DEBIAN_FRONTEND survives sudo's environment reset.
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    libopenmpi-dev openmpi-bin libclang-dev clang pkg-config iproute2

echo "install-mpi: installed $(mpirun --version 2>/dev/null | head -n1)"
