# Sourced by the other scripts: where things are, and the environment the build and MPI need.
# Safe to source from any directory.

HPC_TRAIN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HPC_TRAIN_ROOT

# libtorch 2.11.0 for tch 0.24, from the torch wheel in the repository's venv.
HPC_TRAIN_VENV="${HPC_TRAIN_VENV:-$HPC_TRAIN_ROOT/.venv}"
HPC_TRAIN_TORCH_VERSION="2.11.0"
hpc_train_torch_dir() {
    local d
    for d in "$HPC_TRAIN_VENV"/lib/python3*/site-packages/torch; do
        [ -f "$d/lib/libtorch_cpu.so" ] && { echo "$d"; return 0; }
    done
    return 1
}
if torch_dir="$(hpc_train_torch_dir)"; then
    export LIBTORCH="$torch_dir"
fi
unset torch_dir

export HPC_TRAIN_BIN="$HPC_TRAIN_ROOT/target/release/hpc-train"

# Open MPI refuses to run as root without these, and needs --oversubscribe for more ranks than
# cores; harmless for other users.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
