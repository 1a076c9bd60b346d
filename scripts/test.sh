#!/usr/bin/env bash
# Runs the whole test suite against both MPI libraries: installs and builds what is missing
# (scripts/setup.sh --no-run, once per MPI: Open MPI into target/, MPICH into target/mpich/, the
# libtorch venv and the dataset shared), then
#   1. with Open MPI: the unit tests and every test that launches hpc-train;
#   2. with MPICH: the tests whose outcome can depend on the MPI library (its launcher, aborts
#      and signals, progress and threads, shared memory, its collectives as the reference, and
#      every layout pair of the conformance matrix), as scripts/lib/mpich-tests.sh lists them,
#      by Open MPI's build of the test binaries run against MPICH's hpc-train (they link no
#      MPI; HPC_TRAIN_TEST_MPI_FAMILY tells them the launcher).
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
fi
# A failed set-up ends this script: what runs in the background (pip, the second MPI's build)
# goes with it rather than on.
second_setup=""
beside_jobs=()
stop_background() {
    local job
    for job in "$venv_job" "$second_setup" "${beside_jobs[@]}"; do
        [ -z "$job" ] || { pkill -TERM -P "$job"; kill "$job"; } 2>/dev/null || true
    done
}
trap stop_background EXIT

# The first MPI's set-up (it installs libtorch, the dataset and the Debian packages), and the
# packages of the Slurm test (tests/slurm.rs runs the job files on a single-node Slurm it starts
# itself) and of the install test (Lmod), before anything runs beside apt.
scripts/setup.sh --no-run --mpi "${libraries[0]}"
# shellcheck source=scripts/lib/daemons.sh
source scripts/lib/daemons.sh
need_packages slurm-wlm munge lmod || echo "the Slurm test will be skipped" >&2
# setup.sh may have just installed libtorch into .venv: read the environment again so that cargo
# below finds it (LIBTORCH) the same way the build in setup.sh did.
source scripts/env.sh
[ -n "${LIBTORCH:-}" ] || { echo "test.sh: libtorch not found under $HPC_TRAIN_VENV after setup" >&2; exit 1; }
# shellcheck source=scripts/lib/cargo.sh
source scripts/lib/cargo.sh

# The second MPI's build beside the compilation of the first's test binaries: each is mostly one
# rustc compiling the hpc-train crate, whose front end runs on one core, so the two together
# keep both of CI's cores busy where one after the other left one idle for minutes. The second's
# target folder is seeded here, before the test binaries' compilation writes into the first's.
if [ $# -eq 0 ] && [ ${#libraries[@]} -gt 1 ]; then
    second=${libraries[1]}
    seed_target_folder "$HPC_TRAIN_ROOT/target" "$(HPC_TRAIN_MPI=$second; source scripts/env.sh; echo "$CARGO_TARGET_DIR")"
    scripts/setup.sh --no-run --mpi "$second" > "target/setup-$second.log" 2>&1 &
    second_setup=$!
    printf '\n==> %s: compiling the test binaries (while %s builds beside, target/setup-%s.log)\n' "${libraries[0]}" "$second" "$second"
    (HPC_TRAIN_MPI=${libraries[0]}; source scripts/env.sh; cargo test --release --locked --no-run 2>&1 | { grep -vE '^\s+(Compiling|Executable)' || true; })
    wait "$second_setup" || { second_setup=""; cat "target/setup-$second.log" >&2; echo "test.sh: $second's set-up failed" >&2; exit 1; }
    second_setup=""
    cat "target/setup-$second.log"
else
    for mpi in "${libraries[@]:1}"; do
        scripts/setup.sh --no-run --mpi "$mpi"
    done
fi
if [ -n "$venv_job" ]; then
    wait "$venv_job" || { echo "test.sh: the PyTorch venv's installation failed (tests/optim_pytorch.rs tries again):" >&2; cat target/pytorch-venv.log >&2; }
    venv_job=""
fi

# The integration tests launch hpc-train and link no MPI: under the second MPI, Open MPI's build
# of them runs against MPICH's hpc-train (HPC_TRAIN_TEST_BINARY), told its family, instead of
# being compiled again (about 1.5 of CI's minutes).

# Every test binary runs to its end under every MPI, and the failures are listed together at the
# end: one failing binary must not hide the state of the others (cargo test stops at the first
# failing binary unless told --no-fail-fast).
failures=()

# Binaries that run in the background beside the others, their output kept in
# target/beside-NAME-MPI.log and shown when they end:
# - tests/reliability.rs mostly waits (for timeouts, watchdogs, stalls and signals): under CI it
#   kept about a quarter of the two cores busy over its two and a half minutes. It runs beside
#   each pass's other binaries. Its tests bound how long a job may take after a fault with
#   margins of several times what they take, which the extra load leaves standing.
# - tests/install.rs (Open MPI only) is mostly a build of hpc-train in a test account's
#   checkout: it runs beside LATE_BINARIES, the second half of Open MPI's pass, whose checks are
#   of weights, files and records, not of how long something took (the cut link, the watchdogs,
#   Horovod's cycle and the parameter servers' staleness run before it starts).
BESIDE=reliability
LATE_BINARIES=(optim_pytorch overlap pipeline precision preset projection recipe report run_file slurm tensor training zero)
beside_jobs=()
beside_names=()
# start_beside NAME MPI EXECUTABLE ARGS...: starts tests/NAME.rs's binary in the background.
start_beside() {
    local name=$1 mpi=$2 executable=$3; shift 3
    printf '\n     Running tests/%s.rs beside the others (%s, output in target/beside-%s-%s.log)\n' "$name" "$executable" "$name" "$mpi"
    "$executable" "$@" > "target/beside-$name-$mpi.log" 2>&1 &
    beside_jobs+=($!)
    beside_names+=("$name")
}
# wait_beside MPI: waits for every binary started beside, shows their output, notes failures.
wait_beside() {
    local mpi=$1 i rc
    for i in "${!beside_jobs[@]}"; do
        rc=0
        wait "${beside_jobs[$i]}" || rc=$?
        printf '\n     tests/%s.rs (run beside the others):\n' "${beside_names[$i]}"
        cat "target/beside-${beside_names[$i]}-$mpi.log"
        [ "$rc" -eq 0 ] || failures+=("$mpi: tests/${beside_names[$i]}.rs")
    done
    beside_jobs=()
    beside_names=()
}

for mpi in "${libraries[@]}"; do
    HPC_TRAIN_MPI=$mpi
    source scripts/env.sh
    if [ $# -gt 0 ]; then
        printf '\n==> %s: cargo test --release --no-fail-fast %s\n' "$mpi" "$*"
        cargo test --release --locked --no-fail-fast "$@" || failures+=("$mpi: cargo test $*")
    elif [ "$mpi" = openmpi ]; then
        printf '\n==> %s: cargo test --release --no-fail-fast (unit tests and every test that launches hpc-train)\n' "$mpi"
        early=(--bins)
        late=()
        for t in tests/*.rs; do
            name=$(basename "$t" .rs)
            case " $BESIDE install ${LATE_BINARIES[*]} " in
                *" $name "*) [ "$name" = "$BESIDE" ] || [ "$name" = install ] || late+=(--test "$name") ;;
                *) early+=(--test "$name") ;;
            esac
        done
        start_beside "$BESIDE" "$mpi" "$(test_executables --test "$BESIDE")"
        cargo test --release --locked --no-fail-fast "${early[@]}" || failures+=("$mpi: cargo test (its summary above names the failing binaries)")
        if [ -f tests/install.rs ]; then
            start_beside install "$mpi" "$(test_executables --test install)"
        fi
        if [ ${#late[@]} -gt 0 ]; then
            cargo test --release --locked --no-fail-fast "${late[@]}" || failures+=("$mpi: cargo test (its summary above names the failing binaries)")
        fi
        wait_beside "$mpi"
    else
        # Under the second MPI, the tests whose outcome can depend on the MPI library, as
        # scripts/lib/mpich-tests.sh lists them per binary (and says why).
        # shellcheck source=scripts/lib/mpich-tests.sh
        source scripts/lib/mpich-tests.sh
        selection=()
        for t in tests/*.rs; do
            name=$(basename "$t" .rs)
            rc=0; mpich_test_args "$name" > /dev/null || rc=$?
            case $rc in
                0) selection+=(--test "$name") ;;
                1) ;;
                *) echo "test.sh: scripts/lib/mpich-tests.sh does not say what MPICH's pass runs of tests/$name.rs" >&2
                   failures+=("$mpi: tests/$name.rs (not in scripts/lib/mpich-tests.sh)") ;;
            esac
        done
        mpich_binary=$HPC_TRAIN_BIN
        if [ "${libraries[0]}" = openmpi ]; then
            executables=$(HPC_TRAIN_MPI=openmpi; source scripts/env.sh; test_executables "${selection[@]}")
        else
            executables=$(test_executables "${selection[@]}")
        fi
        # The binary that runs beside the others first, so that it overlaps them all.
        executables=$(printf '%s\n' $executables | awk -v b="/$BESIDE-" 'index($0, b) { print; next } { rest = rest $0 "\n" } END { printf "%s", rest }')
        printf '\n==> %s: %d test binaries against %s (the tests whose outcome can depend on the MPI library)\n' "$mpi" "$(wc -w <<< "$executables")" "$mpich_binary"
        for executable in $executables; do
            name=$(basename "$executable"); name=${name%-*}
            read -r -a args <<< "$(mpich_test_args "$name")"
            # A name in the table that the binary does not have would silently run or skip
            # nothing: each --exact name must be one of the binary's tests, each --skip filter
            # part of one.
            listed=$("$executable" --list --format terse 2>/dev/null | sed 's/: test$//')
            missing=""
            for word in "${args[@]}"; do
                case "$word" in --*) continue ;; esac
                if [[ " ${args[*]} " == *" --exact "* ]]; then
                    grep -qxF -- "$word" <<< "$listed" || missing+=" $word"
                else
                    grep -qF -- "$word" <<< "$listed" || missing+=" $word"
                fi
            done
            if [ -n "$missing" ]; then
                echo "test.sh: scripts/lib/mpich-tests.sh names tests of tests/$name.rs that it does not have: $missing" >&2
                failures+=("$mpi: tests/$name.rs (scripts/lib/mpich-tests.sh names tests it does not have)")
                continue
            fi
            if [ "$name" = "$BESIDE" ]; then
                HPC_TRAIN_TEST_BINARY=$mpich_binary HPC_TRAIN_TEST_MPI_FAMILY=mpich start_beside "$BESIDE" "$mpi" "$executable" "${args[@]}"
                continue
            fi
            printf '\n     Running tests/%s.rs %s(%s)\n' "$name" "${args[*]:+${args[*]} }" "$executable"
            HPC_TRAIN_TEST_BINARY=$mpich_binary HPC_TRAIN_TEST_MPI_FAMILY=mpich "$executable" "${args[@]}" || failures+=("$mpi: tests/$name.rs")
        done
        wait_beside "$mpi"
    fi
done
if [ ${#failures[@]} -gt 0 ]; then
    printf '\ntest.sh: failures:\n' >&2
    printf '  %s\n' "${failures[@]}" >&2
    exit 1
fi
