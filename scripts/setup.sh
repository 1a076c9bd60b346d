#!/usr/bin/env bash
# Checks what hpc-train needs, installs what it may, builds it, prepares the default dataset, then
# (unless --no-run) trains on Fashion-MNIST with 2 MPI ranks as a first run.
#
# Idempotent: a second run checks each step and skips what is already done (seconds).
#   scripts/setup.sh              check, install, build, import the dataset, run the quick-start job
#   scripts/setup.sh --check      only report which system parts are present and which are missing
#                                 (exit 1 when one is missing); installs and builds nothing
#   scripts/setup.sh --no-run     everything but the job (what the test script uses)
#   scripts/setup.sh --steps N    the job stops after N steps instead of 2 epochs
#   scripts/setup.sh --cuda       libtorch with its CUDA libraries (torch 2.11.0 and its dependencies
#                                 from PyPI, about 4.6 GB), so that the build drives GPUs
#   scripts/setup.sh --mpi mpich  against MPICH's wrapper (mpicc.mpich, else mpicc), built into
#                                 target/mpich/; `--mpi openmpi` (target/) is the default. Without
#                                 --mpi, a user's own MPICC, MPI_PKG_CONFIG or CRAY_MPICH_DIR
#                                 (Cray MPICH, Intel MPI, MVAPICH2) is used instead.
#   scripts/setup.sh --sudo       as a user with sudo on Debian: install missing packages with sudo
# As root on Debian, missing Debian packages are installed with apt-get. As any other user nothing
# system-wide is touched: a missing system part (MPI, HDF5, libclang, compilers, Rust, Python) is
# named with its Debian and RHEL package and its usual module name, and set-up stops (exit 1).
# libtorch goes into the checkout's .venv (HPC_TRAIN_VENV), unless LIBTORCH names one already.
set -euo pipefail

run_job=1 check_only=0 cuda=0 use_sudo=0 steps=""
mpi=${HPC_TRAIN_MPI:-}
while [ $# -gt 0 ]; do
    case "$1" in
        --no-run) run_job=0 ;;
        --check) check_only=1 ;;
        --cuda) cuda=1 ;;
        --sudo) use_sudo=1 ;;
        --steps) steps=${2:-}; shift ;;
        --steps=*) steps=${1#--steps=} ;;
        --mpi) mpi=${2:-}; shift ;;
        --mpi=*) mpi=${1#--mpi=} ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
case "$steps" in
    "") ;;
    *[!0-9]*|0*) echo "setup.sh: --steps $steps: expected a positive whole number" >&2; exit 2 ;;
esac
case "$mpi" in
    openmpi|mpich) ;;
    "") [ -n "${MPICC:-}${MPI_PKG_CONFIG:-}${CRAY_MPICH_DIR:-}" ] || mpi=openmpi ;;
    *) echo "setup.sh: --mpi $mpi: expected openmpi or mpich" >&2; exit 2 ;;
esac
# env.sh maps HPC_TRAIN_MPI to the compiler wrapper, the target folder and the launcher.
export HPC_TRAIN_MPI=$mpi
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
# shellcheck source=scripts/lib/setup-checks.sh
source scripts/lib/setup-checks.sh

say() { printf '\n==> %s\n' "$*"; }

# 1. System parts. Root on Debian installs the Debian packages that are missing (MPI, libclang,
#    HDF5, pkg-config, the dataset, Python's venv, and the font `hpc-train report` draws PNG plot
#    text with); so does a user with --sudo. Everyone else only checks.
is_root=0; [ "$(id -u)" -eq 0 ] && is_root=1
if [ "$check_only" -eq 0 ] && { [ "$is_root" -eq 1 ] || [ "$use_sudo" -eq 1 ]; } && command -v apt-get >/dev/null \
    && command -v dpkg-query >/dev/null; then
    packages=(libclang-dev libhdf5-dev pkg-config g++ dataset-fashion-mnist python3-venv fonts-dejavu-core)
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
        sudo_cmd=(); [ "$is_root" -eq 1 ] || sudo_cmd=(sudo)
        "${sudo_cmd[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
    else
        say "Debian packages present"
    fi
    # env.sh chose the compiler wrapper and launcher among the MPI commands present when it was
    # read: read it again now that the MPI asked for is installed (on a new machine `--mpi mpich`
    # found only Open MPI's mpicc before, and built target/mpich against Open MPI).
    source scripts/env.sh
elif [ "$use_sudo" -eq 1 ] && [ "$check_only" -eq 0 ]; then
    echo "setup.sh: --sudo installs Debian packages, and this machine has no apt-get" >&2
    exit 2
fi

# Python builds the venv that holds libtorch; not needed when LIBTORCH names a libtorch 2.11.0
# already (and --cuda, which installs into the venv, is not asked for).
need_python=1
if [ "$cuda" -eq 0 ] && [ -n "$(libtorch_version "${LIBTORCH:-}")" ]; then need_python=0; fi
if check_system_parts "$mpi" "$need_python"; then parts_ok=1; else parts_ok=0; fi
if [ "$check_only" -eq 1 ] || [ "$parts_ok" -eq 0 ]; then
    [ "$parts_ok" -eq 1 ] && exit 0
    if [ "$check_only" -eq 0 ]; then
        if [ "$is_root" -eq 1 ]; then
            echo "setup.sh: the parts above are missing; install them and run this again" >&2
        else
            echo "setup.sh: the parts above are missing. Without root, set-up installs nothing system-wide: load" \
                "their modules (module load ...), or ask the administrators for the packages, then run this again" \
                "(on Debian with sudo: scripts/setup.sh --sudo)" >&2
        fi
    fi
    exit 1
fi

# 2. libtorch 2.11.0 (the version tch 0.24 is built for) from the PyPI wheel, into .venv. The
#    lightest working set: torch without its Python dependencies, plus the two CUDA libraries
#    the CPU library links against. --cuda: torch with all its dependencies (cuDNN, cuBLAS, NCCL
#    and the rest), which the same libtorch_cuda.so loads to drive GPUs.
if [ "$cuda" -eq 1 ]; then
    venv_torch=""
    for d in "$HPC_TRAIN_VENV"/lib/python3*/site-packages/torch; do [ -d "$d" ] && venv_torch=$d; done
    if [ -x "$HPC_TRAIN_VENV/bin/python" ] && "$HPC_TRAIN_VENV/bin/python" -c "import sys, torch
sys.exit(not (torch.__version__.split('+')[0] == '$HPC_TRAIN_TORCH_VERSION' and torch.version.cuda))" 2>/dev/null; then
        say "torch $HPC_TRAIN_TORCH_VERSION with CUDA present in $HPC_TRAIN_VENV"
    else
        say "installing torch $HPC_TRAIN_TORCH_VERSION with its CUDA libraries into $HPC_TRAIN_VENV (about 4.6 GB)"
        [ -x "$HPC_TRAIN_VENV/bin/python" ] || python3 -m venv "$HPC_TRAIN_VENV"
        "$HPC_TRAIN_VENV/bin/pip" install -q --no-cache-dir "torch==$HPC_TRAIN_TORCH_VERSION"
    fi
    if [ -n "${LIBTORCH:-}" ] && [ "${LIBTORCH%/}" != "${venv_torch:-none}" ] && [[ "$LIBTORCH" != "$HPC_TRAIN_VENV"/* ]]; then
        say "--cuda: building against the venv's torch, not LIBTORCH=$LIBTORCH"
    fi
    unset LIBTORCH
    source scripts/env.sh
else
    installed_torch=$(libtorch_version "${LIBTORCH:-}")
    if [ "${installed_torch%%+*}" != "$HPC_TRAIN_TORCH_VERSION" ]; then
        [ -z "${LIBTORCH:-}" ] || [[ "$LIBTORCH" == "$HPC_TRAIN_VENV"/* ]] \
            || say "LIBTORCH=$LIBTORCH holds no libtorch $HPC_TRAIN_TORCH_VERSION (${installed_torch:-none found}): installing one into $HPC_TRAIN_VENV"
        say "installing libtorch $HPC_TRAIN_TORCH_VERSION into $HPC_TRAIN_VENV (about 1.3 GB)"
        [ -x "$HPC_TRAIN_VENV/bin/python" ] || python3 -m venv "$HPC_TRAIN_VENV"
        "$HPC_TRAIN_VENV/bin/pip" install -q --no-cache-dir --no-deps "torch==$HPC_TRAIN_TORCH_VERSION" \
            nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
        unset LIBTORCH
        source scripts/env.sh
    else
        say "libtorch $installed_torch present in $LIBTORCH"
    fi
fi
[ -n "$(libtorch_version "${LIBTORCH:-}")" ] || { echo "setup.sh: no libtorch found in $HPC_TRAIN_VENV after installing it" >&2; exit 1; }

# 3. Build (cargo does nothing when the binary is up to date), into this MPI's target folder; a
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

# 4. The default dataset: Fashion-MNIST in the project's HDF5 layout, from the Debian package's
#    files, else the folder FASHION_MNIST_DIR names, else downloaded (fashion_mnist_source).
dataset=datasets/fashion-mnist.h5
if "$HPC_TRAIN_BIN" data info "$dataset" >/dev/null 2>&1; then
    say "$dataset present"
else
    download_dir=$(mktemp -d "$HPC_TRAIN_ROOT/datasets/.download.XXXXXX")
    trap 'rm -rf "$download_dir"' EXIT
    src=$(fashion_mnist_source "$download_dir")
    say "converting Fashion-MNIST from $src to $dataset"
    idx() { local f; for f in "$src/$1.gz" "$src/$1"; do [ -f "$f" ] && { echo "$f"; return; }; done; }
    "$HPC_TRAIN_BIN" data import --format idx --force \
        --train-images "$(idx train-images-idx3-ubyte)" --train-labels "$(idx train-labels-idx1-ubyte)" \
        --test-images "$(idx t10k-images-idx3-ubyte)" --test-labels "$(idx t10k-labels-idx1-ubyte)" \
        --name fashion-mnist \
        --class-names "T-shirt/top,Trouser,Pullover,Dress,Coat,Sandal,Shirt,Sneaker,Bag,Ankle boot" \
        --out "$dataset"
    rm -rf "$download_dir"
fi

[ "$run_job" -eq 1 ] || exit 0

# 5. The quick-start job: 2 ranks, the ring all-reduce, the small CNN for 2 epochs (about a
#    minute on 2 cores). Cluster runs use the program's defaults (ResNet-50); see README.md.
#    Its record goes to runs/ (ignored by git): results/ holds the committed measurements only,
#    so a new checkout stays clean after set-up.
length=(--epochs 2); [ -z "$steps" ] || length=(--steps "$steps")
say "training: 2 ranks of hpc-train --strategy ring --model tiny ${length[*]} --results runs"
hpc_train_mpirun 2 "$HPC_TRAIN_BIN" --strategy ring --model tiny "${length[@]}" \
    --batch-size 32 --lr 0.1 --data "$dataset" --results runs
