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
missing=()
for p in slurm-wlm munge; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    printf '\n==> installing %s for the Slurm test\n' "${missing[*]}"
    sudo_cmd=(); [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
    if ! { "${sudo_cmd[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"; }; then
        echo "could not install ${missing[*]}: the Slurm test will be skipped" >&2
    fi
fi
printf '\n==> cargo test --release\n'
cargo test --release --locked "$@"
