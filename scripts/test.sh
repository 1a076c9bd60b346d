#!/usr/bin/env bash
# Runs the whole test suite against both MPI libraries: installs and builds what is missing
# (scripts/setup.sh --no-run, once per MPI: Open MPI into target/, MPICH into target/mpich/, the
# libtorch venv and the dataset shared), then
#   1. with Open MPI: the unit tests and every test that launches hpc-train;
#   2. with MPICH: every test whose subject depends on the MPI library (the unit tests, and the
#      tests of optimizer arithmetic, datasets, reports, projections and the source's layout,
#      run once; the few tests that cannot run under MPICH say so and why: README, "MPI
#      libraries"), by Open MPI's build of the test binaries run against MPICH's hpc-train
#      (they link no MPI; HPC_TRAIN_TEST_MPI_FAMILY tells them the launcher).
#   scripts/test.sh                       both, as CI runs it
#   scripts/test.sh --test horovod        cargo test's own selection, under both MPIs
#   HPC_TRAIN_TEST_MPI=mpich scripts/test.sh   one MPI only (openmpi or mpich)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"

which=${HPC_TRAIN_TEST_MPI:-both}
case "$which" in
    both) libraries=(openmpi mpich) ;;
    openmpi|mpich) libraries=("$which") ;;
    *) echo "HPC_TRAIN_TEST_MPI=$which: expected openmpi, mpich or both" >&2; exit 2 ;;
esac

# tests/optim_pytorch.rs compares with torch.optim in a PyTorch venv of its own (4.6 GB from
# PyPI). It downloads in the background while the builds compile instead of in the test's time
# (a minute or two of CI's). The test installs it itself if this fails.
venv_job=""
if [ $# -eq 0 ] && [[ " ${libraries[*]} " == *" openmpi "* ]]; then
    # shellcheck source=scripts/lib/pytorch-venv.sh
    source scripts/lib/pytorch-venv.sh
    mkdir -p target
    ensure_pytorch_venv "${PYTORCH_VENV:-$HPC_TRAIN_ROOT/.venv-pytorch}" > target/pytorch-venv.log 2>&1 &
    venv_job=$!
    # A failed set-up ends this script: pip goes with it rather than on in the background.
    trap '[ -z "$venv_job" ] || { pkill -TERM -P "$venv_job"; kill "$venv_job"; } 2>/dev/null || true' EXIT
fi

for mpi in "${libraries[@]}"; do
    scripts/setup.sh --no-run --mpi "$mpi"
done
if [ -n "$venv_job" ]; then
    wait "$venv_job" || { echo "test.sh: the PyTorch venv's installation failed (tests/optim_pytorch.rs tries again):" >&2; cat target/pytorch-venv.log >&2; }
    venv_job=""
fi
# setup.sh may have just installed libtorch into .venv: read the environment again so that cargo
# below finds it (LIBTORCH) the same way the build in setup.sh did.
source scripts/env.sh
[ -n "${LIBTORCH:-}" ] || { echo "test.sh: libtorch not found under $HPC_TRAIN_VENV after setup" >&2; exit 1; }

# The Slurm test (tests/slurm.rs) runs the job files on a single-node Slurm it starts itself.
# shellcheck source=scripts/lib/daemons.sh
source scripts/lib/daemons.sh
need_packages slurm-wlm munge lmod || echo "the Slurm test will be skipped" >&2

# The integration tests launch hpc-train and link no MPI: under the second MPI, Open MPI's build
# of them runs against MPICH's hpc-train (HPC_TRAIN_TEST_BINARY), told its family, instead of
# being compiled again (about 1.5 of CI's minutes).
# shellcheck source=scripts/lib/cargo.sh
source scripts/lib/cargo.sh

# Every test binary runs to its end under every MPI, and the failures are listed together at the
# end: one failing binary must not hide the state of the others (cargo test stops at the first
# failing binary unless told --no-fail-fast).
failures=()
for mpi in "${libraries[@]}"; do
    HPC_TRAIN_MPI=$mpi
    source scripts/env.sh
    if [ $# -gt 0 ]; then
        printf '\n==> %s: cargo test --release --no-fail-fast %s\n' "$mpi" "$*"
        cargo test --release --locked --no-fail-fast "$@" || failures+=("$mpi: cargo test $*")
    elif [ "$mpi" = openmpi ]; then
        printf '\n==> %s: cargo test --release --no-fail-fast (unit tests and every test that launches hpc-train)\n' "$mpi"
        cargo test --release --locked --no-fail-fast || failures+=("$mpi: cargo test (its summary above names the failing binaries)")
    else
        # Under the second MPI, every test whose subject depends on the MPI library. Left to
        # the first: the optimizers' arithmetic against torch.optim (optim_pytorch), dataset
        # import and conversion (datasets), reports and projections from records (report,
        # projection) and the source's layout (architecture), which no MPI call changes and
        # which took about 7 of the suite's minutes a second time.
        selection=()
        for t in tests/*.rs; do
            name=$(basename "$t" .rs)
            case "$name" in optim_pytorch|datasets|report|projection|architecture) ;; *) selection+=(--test "$name") ;; esac
        done
        mpich_binary=$HPC_TRAIN_BIN
        if [ "${libraries[0]}" = openmpi ]; then
            executables=$(HPC_TRAIN_MPI=openmpi; source scripts/env.sh; test_executables "${selection[@]}")
        else
            executables=$(test_executables "${selection[@]}")
        fi
        printf '\n==> %s: %d test binaries against %s (every test whose subject depends on the MPI library)\n' "$mpi" "$(wc -w <<< "$executables")" "$mpich_binary"
        for executable in $executables; do
            name=$(basename "$executable"); name=${name%-*}
            printf '\n     Running tests/%s.rs (%s)\n' "$name" "$executable"
            HPC_TRAIN_TEST_BINARY=$mpich_binary HPC_TRAIN_TEST_MPI_FAMILY=mpich "$executable" || failures+=("$mpi: tests/$name.rs")
        done
    fi
done
if [ ${#failures[@]} -gt 0 ]; then
    printf '\ntest.sh: failures:\n' >&2
    printf '  %s\n' "${failures[@]}" >&2
    exit 1
fi
