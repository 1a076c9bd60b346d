#!/usr/bin/env bash
# Runs the whole test suite: installs and builds what is missing (scripts/setup.sh --no-run),
# then the unit tests and the tests that launch hpc-train under mpirun.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
scripts/setup.sh --no-run
# setup.sh may have just installed libtorch into .venv: read the environment again so that cargo
# below finds it (LIBTORCH) the same way the build in setup.sh did.
source scripts/env.sh
[ -n "${LIBTORCH:-}" ] || { echo "test.sh: libtorch not found under $HPC_TRAIN_VENV after setup" >&2; exit 1; }

# The Slurm test (tests/slurm.rs) runs the job files on a single-node Slurm it starts itself.
# shellcheck source=scripts/lib/daemons.sh
source scripts/lib/daemons.sh
need_packages slurm-wlm munge || echo "the Slurm test will be skipped" >&2
printf '\n==> cargo test --release\n'
cargo test --release --locked "$@"
