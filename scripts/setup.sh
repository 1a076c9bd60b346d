#!/usr/bin/env bash
# Installs what hpc-train needs, builds it, prepares the default dataset, then (unless --no-run)
# trains on Fashion-MNIST with 2 MPI ranks as a first run.
#
# Idempotent: a second run checks each step and skips what is already done (seconds).
#   scripts/setup.sh              install, build, import the dataset, run the quick-start job
#   scripts/setup.sh --no-run     everything but the job (what the test script uses)
#   scripts/setup.sh --mpi mpich  the same against Debian's MPICH (packages mpich, libmpich-dev),
#                                 built into target/mpich/; `--mpi openmpi` (Open MPI, target/) is
#                                 the default. Without --mpi, a user's own MPICC, MPI_PKG_CONFIG or
#                                 CRAY_MPICH_DIR (Cray MPICH, Intel MPI, MVAPICH2) is used instead.
set -euo pipefail

run_job=1
mpi=${HPC_TRAIN_MPI:-}
while [ $# -gt 0 ]; do
    case "$1" in
        --no-run) run_job=0 ;;
        --mpi) mpi=${2:-}; shift ;;
        --mpi=*) mpi=${1#--mpi=} ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
case "$mpi" in
    openmpi|mpich) ;;
    "") [ -n "${MPICC:-}${MPI_PKG_CONFIG:-}${CRAY_MPICH_DIR:-}" ] || mpi=openmpi ;;
    *) echo "setup.sh: --mpi $mpi: expected openmpi or mpich" >&2; exit 2 ;;
esac
# env.sh maps HPC_TRAIN_MPI to the compiler wrapper, the target folder and the launcher.
export HPC_TRAIN_MPI=$mpi
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"

say() { printf '\n==> %s\n' "$*"; }

# 1. Debian packages: MPI, libclang (bindgen for the mpi crate), HDF5, pkg-config, the dataset, and
#    the font `hpc-train report` draws PNG plot text with.
packages=(libclang-dev libhdf5-dev pkg-config dataset-fashion-mnist python3-venv fonts-dejavu-core)
case "$mpi" in
    openmpi) packages+=(openmpi-bin libopenmpi-dev) ;;
    mpich) packages+=(mpich libmpich-dev) ;;
    *) say "MPI: the one MPICC=${MPICC:-} MPI_PKG_CONFIG=${MPI_PKG_CONFIG:-} CRAY_MPICH_DIR=${CRAY_MPICH_DIR:-} finds (no MPI package installed)" ;;
esac
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian packages: ${missing[*]}"
    sudo_cmd=(); [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    say "Debian packages present"
fi
# env.sh chose the compiler wrapper and launcher among the MPI commands present when it was
# read: read it again now that the MPI asked for is installed (on a new machine `--mpi mpich`
# found only Open MPI's mpicc before, and built target/mpich against Open MPI).
source scripts/env.sh

# 2. Rust.
if ! command -v cargo >/dev/null; then
    echo "cargo not found: install Rust (https://rustup.rs), then run this again" >&2
    exit 1
fi

# 3. libtorch 2.11.0 (the version tch 0.24 is built for) from the PyPI wheel, into .venv. The
#    lightest working set: torch without its Python dependencies, plus the two CUDA libraries
#    the CPU library links against.
installed_torch=""
if [ -n "${LIBTORCH:-}" ] && [ -f "$LIBTORCH/version.py" ]; then
    installed_torch="$(sed -n "s/^__version__ = '\([^']*\)'.*/\1/p" "$LIBTORCH/version.py")"
fi
if [ "${installed_torch%%+*}" != "$HPC_TRAIN_TORCH_VERSION" ]; then
    say "installing libtorch $HPC_TRAIN_TORCH_VERSION into $HPC_TRAIN_VENV (about 1.3 GB)"
    [ -x "$HPC_TRAIN_VENV/bin/python" ] || python3 -m venv "$HPC_TRAIN_VENV"
    "$HPC_TRAIN_VENV/bin/pip" install -q --no-deps "torch==$HPC_TRAIN_TORCH_VERSION" \
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
    source scripts/env.sh
else
    say "libtorch $installed_torch present in $LIBTORCH"
fi

# 4. Build (cargo does nothing when the binary is up to date), into this MPI's target folder; a
#    second MPI's first build starts from the first's compiled dependencies.
# shellcheck source=scripts/lib/cargo.sh
source scripts/lib/cargo.sh
if [ -n "${CARGO_TARGET_DIR:-}" ] && [ "$CARGO_TARGET_DIR" != "$HPC_TRAIN_ROOT/target" ]; then
    seed_target_folder "$HPC_TRAIN_ROOT/target" "$CARGO_TARGET_DIR"
fi
say "building hpc-train (release) into ${CARGO_TARGET_DIR:-target}"
if ! cargo build --release --locked 2>&1 | { grep -vE '^\s+(Compiling|Downloaded|Downloading)' || true; } \
    || [ ! -x "$HPC_TRAIN_BIN" ]; then
    echo "the build failed" >&2; exit 1
fi
"$HPC_TRAIN_BIN" --version | sed -n 's/^MPI built against: /MPI: /p'

# 5. The default dataset: Fashion-MNIST from the Debian package, in the project's HDF5 layout.
dataset=datasets/fashion-mnist.h5
if "$HPC_TRAIN_BIN" data info "$dataset" >/dev/null 2>&1; then
    say "$dataset present"
else
    say "converting Fashion-MNIST to $dataset"
    src=/usr/share/datasets/fashion-mnist
    "$HPC_TRAIN_BIN" data import --format idx --force \
        --train-images $src/train-images-idx3-ubyte.gz --train-labels $src/train-labels-idx1-ubyte.gz \
        --test-images $src/t10k-images-idx3-ubyte.gz --test-labels $src/t10k-labels-idx1-ubyte.gz \
        --name fashion-mnist \
        --class-names "T-shirt/top,Trouser,Pullover,Dress,Coat,Sandal,Shirt,Sneaker,Bag,Ankle boot" \
        --out "$dataset"
fi

[ "$run_job" -eq 1 ] || exit 0

# 6. The quick-start job: 2 ranks, the ring all-reduce, the small CNN for 2 epochs (about a
#    minute on 2 cores). Cluster runs use the program's defaults (ResNet-50); see README.md.
#    Its record goes to runs/ (ignored by git): results/ holds the committed measurements only,
#    so a new checkout stays clean after set-up.
say "training: 2 ranks of hpc-train --strategy ring --model tiny --epochs 2 --results runs"
hpc_train_mpirun 2 "$HPC_TRAIN_BIN" --strategy ring --model tiny --epochs 2 \
    --batch-size 32 --lr 0.1 --data "$dataset" --results runs
