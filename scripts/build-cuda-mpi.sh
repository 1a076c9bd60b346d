#!/usr/bin/env bash
# Builds a CUDA-aware Open MPI 4.1.4 (the version of Debian's, which hpc-train links as libmpi.so.40,
# so that one can stand in for the other) for the bundle of scripts/pack.sh (README, "A CUDA-aware
# Open MPI"). No package registry ships one, but Open MPI 4.1 needs only the driver API header
# cuda.h at build time (from the PyPI wheel nvidia-cuda-runtime-cu12) and loads libcuda with dlopen
# at run time: the build needs neither a GPU nor a CUDA toolkit.
#   scripts/build-cuda-mpi.sh     downloads, builds and installs into $CACHE/openmpi-4.1.4-cuda
#                                 (CACHE=${HPC_TRAIN_CACHE:-$HOME/.cache/hpc-train}); 15-25 min on 2 cores
# Idempotent: once the install is complete it prints the prefix and exits (the last line of its
# output is always the prefix). Downloads are checked against the sha256 pinned below.
# Needs gcc, make, curl, pip (for `pip download`) and, as Debian's build does, external hwloc,
# libevent and PMIx (libhwloc-dev, libevent-dev, libpmix-dev); each falls back to Open MPI's own
# copy where the package is absent.
set -euo pipefail

version=4.1.4
cache=${HPC_TRAIN_CACHE:-$HOME/.cache/hpc-train}
prefix=$cache/openmpi-$version-cuda
tarball=openmpi_$version.orig.tar.xz
tarball_url=http://deb.debian.org/debian/pool/main/o/openmpi/$tarball
tarball_sha256=ddaee7dbdb01eb4fab1fda5b5e03e8bbff026711806c095c1f39bb410f99f263
wheel_spec=nvidia-cuda-runtime-cu12==12.9.79
wheel=nvidia_cuda_runtime_cu12-12.9.79-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
wheel_sha256=25bba2dfb01d48a9b59ca474a1ac43c6ebf7011f1b0b8cc44f54eb6ac48a96c3

if [ -f "$prefix/.complete" ] && [ -x "$prefix/bin/ompi_info" ]; then
    echo "$prefix"
    exit 0
fi

mkdir -p "$cache"
cd "$cache"
fetch() { # fetch FILE SHA256 COMMAND...: runs COMMAND unless FILE is there with that hash
    local file=$1 sum=$2; shift 2
    if ! echo "$sum  $file" | sha256sum --check --status 2>/dev/null; then
        rm -f "$file"
        "$@"
    fi
    echo "$sum  $file" | sha256sum --check --quiet || { echo "build-cuda-mpi.sh: $file: wrong sha256" >&2; exit 1; }
}
fetch "$tarball" "$tarball_sha256" curl -fsSL -o "$tarball" "$tarball_url"
fetch "$wheel" "$wheel_sha256" python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --python-version 3 --dest . "$wheel_spec"

# The headers only: cuda.h (driver API) is what Open MPI includes; nothing of the wheel is linked.
cuda_headers=$cache/cuda-headers-12.9.79
if [ ! -f "$cuda_headers/include/cuda.h" ]; then
    rm -rf "$cuda_headers" "$cuda_headers.tmp"
    mkdir -p "$cuda_headers.tmp"
    python3 - "$wheel" "$cuda_headers.tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith("nvidia/cuda_runtime/include/"):
            z.extract(name, sys.argv[2])
PY
    mv "$cuda_headers.tmp/nvidia/cuda_runtime" "$cuda_headers"
    rm -rf "$cuda_headers.tmp"
fi

# The options: CUDA, C only (hpc-train uses neither the Fortran nor the C++ bindings), shared
# libraries only, and no network stacks whose libraries the GPU machine lacks (UCX, verbs, OFI,
# PSM): ranks on one machine talk over shared memory (vader, or smcuda for device buffers) and
# TCP. hwloc, libevent and PMIx as Debian's build has them (external), so that the bundle's
# lib/ serves both trees.
options=(--prefix="$prefix" --with-cuda="$cuda_headers" --disable-mpi-fortran --disable-static
         --enable-shared --without-ucx --without-verbs --without-ofi --without-psm --without-psm2
         --without-portals4 --without-ugni --without-xpmem --without-knem --without-hcoll
         --without-fca --without-mxm --without-tm --disable-mpi-java
         "--with-package-string=hpc-train CUDA-aware Open MPI")
[ -f /usr/include/hwloc.h ] && options+=(--with-hwloc=external)
[ -f /usr/include/event2/event.h ] && options+=(--with-libevent=external)
pmix=/usr/lib/x86_64-linux-gnu/pmix2
[ -f "$pmix/include/pmix.h" ] && options+=(--with-pmix="$pmix")

build=$cache/build-openmpi-$version-cuda
rm -rf "$build" "$prefix"
mkdir -p "$build"
tar -C "$build" --strip-components=1 -xJf "$tarball"
cd "$build"
echo "configure ${options[*]}"
./configure "${options[@]}"
make -j"$(nproc)"
make install
"$prefix/bin/ompi_info" --parsable --all | grep -q ':mpi_built_with_cuda_support:value:true$' \
    || { echo "build-cuda-mpi.sh: $prefix was built without CUDA support" >&2; exit 1; }
cd "$cache"
rm -rf "$build"
printf '%s\n' "${options[@]}" > "$prefix/.complete"
echo "$prefix"
