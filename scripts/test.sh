#!/usr/bin/env bash
# Runs the whole test suite: installs and builds what is missing (scripts/setup.sh --no-run),
# then the unit tests and the tests that launch hpc-train under mpirun.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
scripts/setup.sh --no-run
printf '\n==> cargo test --release\n'
cargo test --release --locked "$@"
