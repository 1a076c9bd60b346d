# Sourced by the other scripts: where things are, and the environment the build and MPI need.
# Safe to source from any directory.

HPC_TRAIN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HPC_TRAIN_ROOT

# libtorch 2.11.0 for tch 0.24: the one LIBTORCH names where it holds one (a site's or a shared
# install), else the torch wheel in the repository's venv, where scripts/setup.sh puts it.
HPC_TRAIN_VENV="${HPC_TRAIN_VENV:-$HPC_TRAIN_ROOT/.venv}"
HPC_TRAIN_TORCH_VERSION="2.11.0"
hpc_train_torch_dir() {
    local d
    for d in "$HPC_TRAIN_VENV"/lib/python3*/site-packages/torch; do
        [ -f "$d/lib/libtorch_cpu.so" ] && { echo "$d"; return 0; }
    done
    return 1
}
if [ -n "${LIBTORCH:-}" ] && [ -f "$LIBTORCH/lib/libtorch_cpu.so" ]; then
    export LIBTORCH
elif torch_dir="$(hpc_train_torch_dir)"; then
    export LIBTORCH="$torch_dir"
fi
unset torch_dir

# The MPI library to build against and launch with where several are installed (docs/mpi.md):
# HPC_TRAIN_MPI=openmpi (Debian's default) or mpich. Each gets its own target folder,
# target/ and target/mpich/, since the mpi crate's bindings are never rebuilt when the MPI
# changes; the launcher goes to HPC_TRAIN_MPIEXEC, which the tests and hpc_train_mpirun use.
# Unset: what the build finds (a user's own MPICC, MPI_PKG_CONFIG or CRAY_MPICH_DIR, else
# `mpicc`), into target/ (or CARGO_TARGET_DIR).
hpc_train_first_command() {
    local c
    for c in "$@"; do command -v "$c" >/dev/null 2>&1 && { echo "$c"; return 0; }; done
    echo "$1"
}
case "${HPC_TRAIN_MPI:-}" in
    "") ;;
    openmpi|mpich)
        # The named library wins over any other way of finding one.
        unset MPI_PKG_CONFIG CRAY_MPICH_DIR
        if [ "$HPC_TRAIN_MPI" = mpich ]; then
            export MPICC="$(hpc_train_first_command mpicc.mpich mpicc)"
            export HPC_TRAIN_MPIEXEC="$(hpc_train_first_command mpiexec.mpich mpiexec.hydra mpiexec)"
            export CARGO_TARGET_DIR="$HPC_TRAIN_ROOT/target/mpich"
        else
            export MPICC="$(hpc_train_first_command mpicc.openmpi mpicc)"
            export HPC_TRAIN_MPIEXEC="$(hpc_train_first_command mpirun.openmpi mpirun)"
            export CARGO_TARGET_DIR="$HPC_TRAIN_ROOT/target"
        fi ;;
    *) echo "HPC_TRAIN_MPI=$HPC_TRAIN_MPI: expected openmpi or mpich" >&2; return 2 ;;
esac
export HPC_TRAIN_BIN="${CARGO_TARGET_DIR:-$HPC_TRAIN_ROOT/target}/release/hpc-train"

# The MPI family the binary was built against (openmpi or mpich), from `hpc-train --version`
# (no launcher needed); empty before the first build.
hpc_train_mpi_family() {
    [ -x "$HPC_TRAIN_BIN" ] || return 0
    "$HPC_TRAIN_BIN" --version | sed -n 's/^MPI built against: .*; \([a-z]*\) family;.*/\1/p'
}

# hpc_train_mpirun N COMMAND...: N ranks of COMMAND on this machine with the launcher of the
# binary's MPI: Open MPI's mpirun with --oversubscribe (it refuses more ranks than cores
# otherwise), or Hydra's mpiexec (no slot limit; it refuses --oversubscribe). Neither is told how
# to bind: Open MPI binds a rank to a core when they fit, Hydra binds nothing.
hpc_train_mpirun() {
    local n=$1; shift
    if [ "$(hpc_train_mpi_family)" = mpich ]; then
        "${HPC_TRAIN_MPIEXEC:-$(hpc_train_first_command mpiexec.mpich mpiexec.hydra mpiexec)}" -n "$n" "$@"
    else
        "${HPC_TRAIN_MPIEXEC:-mpirun}" -n "$n" --oversubscribe "$@"
    fi
}

# Open MPI refuses to run as root without these, and needs --oversubscribe for more ranks than
# cores; harmless for other users (and for MPICH, which ignores them).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
