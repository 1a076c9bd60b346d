#!/usr/bin/env bash
# Installs what hpc-train needs, builds it, prepares the default dataset, then (unless --no-run)
# trains on Fashion-MNIST with 2 MPI ranks as a first run.
#
# Idempotent: a second run checks each step and skips what is already done (seconds).
#   scripts/setup.sh            install, build, import the dataset, run the quick-start job
#   scripts/setup.sh --no-run   everything but the job (what the test script uses)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"

run_job=1
for arg in "$@"; do
    case "$arg" in
        --no-run) run_job=0 ;;
        -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
    esac
done

say() { printf '\n==> %s\n' "$*"; }

# 1. Debian packages: MPI, libclang (bindgen for the mpi crate), HDF5, pkg-config, the dataset, and
#    the font `hpc-train report` draws PNG plot text with.
packages=(openmpi-bin libopenmpi-dev libclang-dev libhdf5-dev pkg-config dataset-fashion-mnist python3-venv fonts-dejavu-core)
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

# 4. Build (cargo does nothing when the binary is up to date).
say "building hpc-train (release)"
cargo build --release --locked 2>&1 | grep -vE '^\s+(Compiling|Downloaded|Downloading)' || true
[ -x "$HPC_TRAIN_BIN" ] || { echo "the build failed" >&2; exit 1; }

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
say "training: mpirun -n 2 hpc-train --strategy ring --model tiny --epochs 2 --results runs"
mpirun -n 2 --oversubscribe "$HPC_TRAIN_BIN" --strategy ring --model tiny --epochs 2 \
    --batch-size 32 --lr 0.1 --data "$dataset" --results runs
