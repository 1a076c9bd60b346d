# shellcheck shell=bash
# What scripts/setup.sh checks before it builds, found the way the build finds it: the system parts
# (MPI compiler wrapper, HDF5, libclang, C and C++ compilers, Rust, Python), libtorch's version, and
# where Fashion-MNIST comes from. Sourced after scripts/env.sh; changes nothing.

# libtorch_version DIR: the version of the libtorch in DIR (a Python torch package, or the
# libtorch zip's layout), empty when DIR holds none.
libtorch_version() {
    local dir=${1:-}
    [ -n "$dir" ] && [ -f "$dir/lib/libtorch_cpu.so" ] || return 0
    if [ -f "$dir/version.py" ]; then
        sed -n "s/^__version__ = '\([^']*\)'.*/\1/p" "$dir/version.py"
    elif [ -f "$dir/build-version" ]; then
        head -n 1 "$dir/build-version"
    fi
}

# version_at_least HAVE WANT: whether dotted version HAVE >= WANT.
version_at_least() {
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" = "$2" ]
}

# Each check_* prints what it found (one line) and returns 0, or returns 1 printing nothing.
check_mpi() {
    local mpi=$1 wrapper
    if [ -n "${MPICC:-}" ] && [ "$mpi" != openmpi ] && [ "$mpi" != mpich ]; then
        wrapper=$MPICC
    elif [ -n "${MPI_PKG_CONFIG:-}" ]; then
        pkg-config --exists "$MPI_PKG_CONFIG" 2>/dev/null && { echo "pkg-config $MPI_PKG_CONFIG (MPI_PKG_CONFIG)"; return 0; }
        return 1
    elif [ -n "${CRAY_MPICH_DIR:-}" ]; then
        [ -f "$CRAY_MPICH_DIR/include/mpi.h" ] && { echo "CRAY_MPICH_DIR=$CRAY_MPICH_DIR"; return 0; }
        return 1
    else
        # env.sh set MPICC for --mpi openmpi|mpich to the first wrapper found (or its bare name).
        wrapper=${MPICC:-mpicc}
    fi
    local path
    path=$(command -v "$wrapper" 2>/dev/null) || return 1
    "$path" -show >/dev/null 2>&1 || return 1
    echo "$path"
}

check_hdf5() {
    if [ -n "${HDF5_DIR:-}" ]; then
        [ -f "$HDF5_DIR/include/hdf5.h" ] && { echo "HDF5_DIR=$HDF5_DIR"; return 0; }
        return 1
    fi
    if command -v pkg-config >/dev/null 2>&1 && pkg-config --exists hdf5 2>/dev/null; then
        echo "pkg-config hdf5 ($(pkg-config --modversion hdf5))"; return 0
    fi
    # hdf5-sys's default place on Debian.
    [ -f /usr/include/hdf5/serial/hdf5.h ] && { echo "/usr/include/hdf5/serial"; return 0; }
    return 1
}

# bindgen (the mpi crate's bindings) loads libclang where clang-sys looks: LIBCLANG_PATH,
# llvm-config's library folder, then the usual system folders.
check_libclang() {
    local dirs=() d f
    [ -n "${LIBCLANG_PATH:-}" ] && dirs+=("$LIBCLANG_PATH")
    command -v llvm-config >/dev/null 2>&1 && dirs+=("$(llvm-config --libdir 2>/dev/null)")
    dirs+=(/usr/lib/llvm-*/lib /usr/lib64/llvm*/lib /usr/lib64 /usr/lib/x86_64-linux-gnu /usr/lib /usr/local/lib)
    for d in "${dirs[@]}"; do
        for f in "$d"/libclang.so "$d"/libclang-*.so "$d"/libclang.so.*; do
            [ -f "$f" ] && { echo "$f"; return 0; }
        done
    done
    return 1
}

check_compilers() {
    local cc cxx
    cc=$(command -v "${CC:-cc}" 2>/dev/null) || return 1
    cxx=$(command -v "${CXX:-c++}" 2>/dev/null) || cxx=$(command -v g++ 2>/dev/null) || return 1
    echo "$cc, $cxx"
}

check_rust() {
    local want have
    want=$(sed -n 's/^rust-version *= *"\([^"]*\)".*/\1/p' "$HPC_TRAIN_ROOT/Cargo.toml")
    command -v cargo >/dev/null 2>&1 && command -v rustc >/dev/null 2>&1 || return 1
    have=$(rustc --version 2>/dev/null | awk '{print $2}')
    [ -n "$have" ] && version_at_least "${have%%-*}" "$want" || { RUST_FOUND=$have; return 1; }
    echo "rustc $have"
}

check_python() {
    local python
    python=$(command -v python3 2>/dev/null) || return 1
    # Debian's python3 makes venvs only with python3-venv (ensurepip).
    "$python" -c 'import venv, ensurepip' 2>/dev/null || return 1
    echo "$python ($("$python" -c 'import platform; print(platform.python_version())'))"
}

# check_system_parts MPI NEED_PYTHON: one line per part, present or missing with the Debian and
# RHEL packages and the module that provide it; returns 1 when one is missing.
check_system_parts() {
    local mpi=$1 need_python=$2 missing=0 found want
    want=$(sed -n 's/^rust-version *= *"\([^"]*\)".*/\1/p' "$HPC_TRAIN_ROOT/Cargo.toml")
    local mpi_fix
    case "$mpi" in
        mpich) mpi_fix="Debian: mpich libmpich-dev; RHEL: mpich-devel; module: mpich (or cray-mpich)" ;;
        openmpi) mpi_fix="Debian: openmpi-bin libopenmpi-dev; RHEL: openmpi-devel; module: openmpi (RHEL's: mpi/openmpi-x86_64)" ;;
        *) mpi_fix="MPICC=${MPICC:-} MPI_PKG_CONFIG=${MPI_PKG_CONFIG:-} CRAY_MPICH_DIR=${CRAY_MPICH_DIR:-} finds none; module: your MPI's (openmpi, mpich, cray-mpich, intel-mpi)" ;;
    esac
    local RUST_FOUND=""
    printf '\nhpc-train set-up: system parts (user %s%s)\n' "$(id -un 2>/dev/null || id -u)" \
        "$([ "$(id -u)" -eq 0 ] || echo ', not root: nothing is installed system-wide')"
    part() {  # part NAME FIX CHECK ARGS...
        local name=$1 fix=$2; shift 2
        if found=$("$@"); then
            printf '  present  %-28s %s\n' "$name" "$found"
        else
            printf '  MISSING  %-28s %s\n' "$name" "$fix"
            missing=1
        fi
    }
    part "MPI compiler wrapper" "$mpi_fix" check_mpi "$mpi"
    part "HDF5 (library, headers)" "Debian: libhdf5-dev; RHEL: hdf5-devel; module: hdf5 (cray-hdf5), which sets HDF5_DIR" check_hdf5
    part "libclang (bindgen)" "Debian: libclang-dev; RHEL: clang-devel; module: llvm or clang (or set LIBCLANG_PATH)" check_libclang
    part "C and C++ compilers" "Debian: gcc g++; RHEL: gcc gcc-c++; module: gcc" check_compilers
    check_rust >/dev/null || true  # sets RUST_FOUND when an older one is there
    part "Rust >= $want" "$([ -n "$RUST_FOUND" ] && echo "rustc $RUST_FOUND is too old; ")Debian: rustc cargo, RHEL: rust cargo (where they are $want or newer); module: rust; or rustup (https://rustup.rs, into ~/.cargo, no root)" check_rust
    if [ "$need_python" -eq 1 ]; then
        part "Python 3 with venv" "Debian: python3 python3-venv; RHEL: python3; module: python" check_python
    else
        printf '  present  %-28s %s\n' "Python 3 with venv" "not needed: LIBTORCH=$LIBTORCH holds libtorch $(libtorch_version "$LIBTORCH")"
    fi
    unset -f part
    return "$missing"
}

# The upstream mirror of Fashion-MNIST's four IDX files (FASHION_MNIST_URL overrides it).
FASHION_MNIST_FILES=(train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte)
FASHION_MNIST_DEFAULT_URL=http://fashion-mnist.s3-website.eu-central-1.amazonaws.com

# has_fashion_mnist DIR: DIR holds the four IDX files (gzipped or not).
has_fashion_mnist() {
    local f
    for f in "${FASHION_MNIST_FILES[@]}"; do
        [ -f "$1/$f.gz" ] || [ -f "$1/$f" ] || return 1
    done
}

# fashion_mnist_source DOWNLOAD_DIR: prints the folder to import Fashion-MNIST from: Debian's
# dataset-fashion-mnist (/usr/share/datasets), else FASHION_MNIST_DIR, else the four files
# downloaded into DOWNLOAD_DIR (curl, else Python's urllib). Exits with one error naming the ways
# out when none works (offline, no package, no folder).
fashion_mnist_source() {
    local debian=/usr/share/datasets/fashion-mnist dir=$1 url=${FASHION_MNIST_URL:-$FASHION_MNIST_DEFAULT_URL} f
    if [ -n "${FASHION_MNIST_DIR:-}" ]; then
        has_fashion_mnist "$FASHION_MNIST_DIR" && { echo "$FASHION_MNIST_DIR"; return 0; }
        echo "setup.sh: FASHION_MNIST_DIR=$FASHION_MNIST_DIR lacks one of ${FASHION_MNIST_FILES[*]} (.gz or not)" >&2
        exit 1
    fi
    has_fashion_mnist "$debian" && { echo "$debian"; return 0; }
    echo "==> downloading Fashion-MNIST (4 files, 30 MB) from $url" >&2
    for f in "${FASHION_MNIST_FILES[@]}"; do
        if command -v curl >/dev/null 2>&1; then
            curl -fsSL --retry 2 --connect-timeout 20 -o "$dir/$f.gz" "$url/$f.gz"
        else
            python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$url/$f.gz" "$dir/$f.gz"
        fi 2>/dev/null || {
            echo "setup.sh: could not download $url/$f.gz (offline?). Fashion-MNIST comes from Debian's" \
                "dataset-fashion-mnist ($debian), else from a folder holding ${FASHION_MNIST_FILES[*]}" \
                "(.gz or not) that FASHION_MNIST_DIR names, else from $url" >&2
            exit 1
        }
    done
    echo "$dir"
}
