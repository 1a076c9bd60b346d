#!/usr/bin/env bash
# Packs hpc-train for a machine without Rust or MPI (a GPU test machine, a cluster node image):
#   scripts/pack.sh [--tests NAME,...] [OUT]   (default dist/hpc-train; also writes OUT.tar.gz)
# The bundle holds the binary, Open MPI (launcher, libraries, plugins, help files) and the HDF5
# runtime with their dependencies, laid out as Debian installs them, so that Open MPI finds its
# plugins through OPAL_PREFIX. libtorch is not packed: the packed binary's run path covers the
# torch of the GPU machines (/opt/torch/.venv/.../torch/lib, given to the build through
# HPC_TRAIN_EXTRA_RPATH, so cargo relinks hpc-train when the last build lacked it; PACK_TORCH_LIB
# names another folder) and a `lib/` folder beside it, where another libtorch 2.11.0 can be put.
# On the target:
#   source OUT/env.sh && mpirun -n 2 hpc-train --device cuda --allow-gpu-sharing ...
# Where scripts/build-cuda-mpi.sh has built a CUDA-aware Open MPI 4.1.4 (in
# ${HPC_TRAIN_CACHE:-$HOME/.cache/hpc-train}/openmpi-4.1.4-cuda, or the install that
# --cuda-mpi DIR names), it travels too, as OUT/openmpi-cuda, with OUT/env-cuda.sh to select it:
#   source OUT/env-cuda.sh && mpirun --mca pml ob1 --mca btl smcuda,vader,self -n 2 hpc-train ...
# --tests NAME,...: also the test binaries of tests/NAME.rs, as OUT/tests/NAME; run them with
# HPC_TRAIN_TEST_BINARY=OUT/bin/hpc-train and HPC_TRAIN_TEST_ROOT=<a checkout> (tests/common).
# The binaries lose their debug information (124 MB -> 9 MB), so that the bundle travels light.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# shellcheck source=scripts/lib/cargo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/cargo.sh"
cd "$HPC_TRAIN_ROOT"
tests=""
cuda_mpi=""
while [ $# -gt 0 ]; do
    case "$1" in
        --tests) tests=$2; shift 2 ;;
        --cuda-mpi) cuda_mpi=$2; shift 2
            [ -x "$cuda_mpi/bin/ompi_info" ] || { echo "pack.sh: --cuda-mpi $cuda_mpi: no Open MPI installed there" >&2; exit 1; } ;;
        *) break ;;
    esac
done
out=${1:-dist/hpc-train}
# The install of scripts/build-cuda-mpi.sh, once complete.
default_cuda_mpi=${HPC_TRAIN_CACHE:-$HOME/.cache/hpc-train}/openmpi-4.1.4-cuda
if [ -z "$cuda_mpi" ] && [ -f "$default_cuda_mpi/.complete" ]; then cuda_mpi=$default_cuda_mpi; fi
[ -x "$HPC_TRAIN_BIN" ] || { echo "build first: scripts/setup.sh --no-run" >&2; exit 1; }

# The torch of the GPU machines, in the packed binary's run path. build.rs compiles in no
# machine's path of its own: this one comes through HPC_TRAIN_EXTRA_RPATH (added to any the
# caller set), and cargo rebuilds hpc-train when its last build had another run path.
torch_lib=${PACK_TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
case ":${HPC_TRAIN_EXTRA_RPATH:-}:" in
    *":$torch_lib:"*) ;;
    *) export HPC_TRAIN_EXTRA_RPATH="${HPC_TRAIN_EXTRA_RPATH:+$HPC_TRAIN_EXTRA_RPATH:}$torch_lib" ;;
esac
echo "pack.sh: building hpc-train with run path $torch_lib (HPC_TRAIN_EXTRA_RPATH)"
cargo build --release --locked 2>&1 | { grep -vE '^\s+(Compiling|Downloaded|Downloading)' || true; }
readelf -d "$HPC_TRAIN_BIN" | grep -E 'R(UN)?PATH' | grep -qF "$torch_lib" \
    || { echo "pack.sh: $HPC_TRAIN_BIN has no run path $torch_lib after the build" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
strip -o "$out/bin/hpc-train" "$HPC_TRAIN_BIN"
if [ -n "$tests" ]; then
    mkdir -p "$out/tests"
    for name in ${tests//,/ }; do
        executable=$(test_executables --test "$name" | tail -n 1)
        [ -x "$executable" ] || { echo "pack.sh: no test binary for tests/$name.rs" >&2; exit 1; }
        strip -o "$out/tests/$name" "$executable"
    done
fi

ompi=/usr/lib/x86_64-linux-gnu/openmpi
# Open MPI: its tree under usr/ (OPAL_PREFIX=OUT/usr relocates every path it has built in).
mkdir -p "$out/usr/lib/x86_64-linux-gnu" "$out/usr/bin" "$out/usr/share"
cp -a "$ompi" "$out/usr/lib/x86_64-linux-gnu/"
cp -a /usr/share/openmpi "$out/usr/share/"
cp -a /etc/openmpi "$out/usr/etc-openmpi" 2>/dev/null || true
# copy_launcher FROM TO: Open MPI's launcher (orterun as mpirun and mpiexec, the daemon orted)
# and ompi_info, from one bin/ folder into another.
copy_launcher() {
    local tool
    for tool in orterun orted ompi_info; do
        cp -L "$1/$tool" "$2/"
    done
    ln -sf orterun "$2/mpirun"
    ln -sf orterun "$2/mpiexec"
}
copy_launcher /usr/bin "$out/usr/bin"

# Shared libraries the binary, the Open MPI tools and the plugins need, except the C and C++
# runtimes (the target's are newer), the GPU driver and libtorch with its CUDA libraries (the
# target's torch provides them).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libutil\.so|libresolv\.so|libstdc\+\+|libgcc_s|libtorch|libc10|libgomp|libcuda|libcudart|libcupti|libnv|libcublas|libcudnn|libnccl)'
objects=("$out/bin/hpc-train" "$out/usr/bin/orterun" "$out/usr/bin/orted")
while IFS= read -r plugin; do objects+=("$plugin"); done < <(find "$out/usr/lib/x86_64-linux-gnu/openmpi" -name '*.so*' -type f)
for object in "${objects[@]}"; do
    ldd "$object" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [ -e "$out/lib/$name" ] || cp -L "$path" "$out/lib/$name"
done

# iproute2's ip and tc for scripts/local-cluster.sh on a machine without them and without a
# package mirror (the GPU machine): in net-tools/, each a wrapper that finds the libraries packed
# beside it (not in lib/, whose LD_LIBRARY_PATH reaches every program: libelf and libbpf of this
# machine must not shadow the target's own). scripts/device-check.sh puts net-tools/ on PATH
# only where the machine has no ip or tc.
mkdir -p "$out/net-tools/bin" "$out/net-tools/lib"
for tool in ip tc; do
    path=$(command -v "$tool" || true)
    [ -n "$path" ] || { echo "pack.sh: no $tool here to pack (apt-get install iproute2)" >&2; exit 1; }
    cp -L "$path" "$out/net-tools/bin/$tool"
    ldd "$path" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name lib; do
        [[ "$name" =~ $skip ]] || cp -L "$lib" "$out/net-tools/lib/$name"
    done
    cat > "$out/net-tools/$tool" <<WRAPPER
#!/bin/sh
# iproute2's $tool from the machine that packed this bundle, with its own libraries.
here=\$(cd "\$(dirname "\$0")" && pwd)
LD_LIBRARY_PATH="\$here/lib" exec "\$here/bin/$tool" "\$@"
WRAPPER
    chmod +x "$out/net-tools/$tool"
done

# What was packed: the commit (and whether the tree had changes), for the figures made with it.
git describe --always --dirty --abbrev=12 > "$out/COMMIT" 2>/dev/null || echo unknown > "$out/COMMIT"

cat > "$out/env.sh" <<'ENV'
# Source this file to use the bundle: hpc-train and mpirun on PATH, its libraries found.
HPC_TRAIN_BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export OPAL_PREFIX="$HPC_TRAIN_BUNDLE/usr"
export PATH="$HPC_TRAIN_BUNDLE/bin:$HPC_TRAIN_BUNDLE/usr/bin:$PATH"
export LD_LIBRARY_PATH="$HPC_TRAIN_BUNDLE/lib:$HPC_TRAIN_BUNDLE/usr/lib/x86_64-linux-gnu/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Root on a test machine; harmless otherwise.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ENV

# The CUDA-aware Open MPI, a tree of its own beside usr/ (it has the same libmpi.so.40, so the
# two cannot share lib/): launcher, libraries and plugins stripped, help files and MCA defaults;
# no headers, wrapper compilers or static archives. env-cuda.sh puts it before everything else.
if [ -n "$cuda_mpi" ]; then
    cuda_out=$out/openmpi-cuda
    mkdir -p "$cuda_out/bin" "$cuda_out/lib" "$cuda_out/share"
    copy_launcher "$cuda_mpi/bin" "$cuda_out/bin"
    (cd "$cuda_mpi/lib" && find . \( -name '*.so' -o -name '*.so.*' \) \( -type f -o -type l \) -print0 \
        | tar --null -T - -cf -) | tar -C "$cuda_out/lib" -xf -
    cp -a "$cuda_mpi/share/openmpi" "$cuda_out/share/"
    cp -a "$cuda_mpi/etc" "$cuda_out/etc"
    find "$cuda_out/bin" "$cuda_out/lib" -type f -exec strip --strip-unneeded {} +
    # Its dependencies that lib/ lacks (hwloc, libevent and PMIx are the same as Debian's).
    while IFS= read -r object; do
        LD_LIBRARY_PATH="$cuda_out/lib" ldd "$object" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
    done < <(find "$cuda_out/bin" "$cuda_out/lib" -type f) | sort -u | while read -r name path; do
        [[ "$name" =~ $skip ]] && continue
        [ -e "$cuda_out/lib/$name" ] || [ -e "$out/lib/$name" ] || cp -L "$path" "$out/lib/$name"
    done
    cat > "$out/env-cuda.sh" <<'ENV'
# Source this file instead of env.sh to use the bundle with its CUDA-aware Open MPI (built by
# scripts/build-cuda-mpi.sh; it loads libcuda at run time): its mpirun first on PATH and its
# libmpi.so.40 first on LD_LIBRARY_PATH, ahead of the plain Open MPI in lib/.
HPC_TRAIN_BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export OPAL_PREFIX="$HPC_TRAIN_BUNDLE/openmpi-cuda"
export PATH="$HPC_TRAIN_BUNDLE/bin:$HPC_TRAIN_BUNDLE/openmpi-cuda/bin:$PATH"
export LD_LIBRARY_PATH="$HPC_TRAIN_BUNDLE/openmpi-cuda/lib:$HPC_TRAIN_BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Root on a test machine; harmless otherwise.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ENV
else
    echo "pack.sh: the bundle has no CUDA-aware MPI (run scripts/build-cuda-mpi.sh)"
fi

tar -C "$(dirname "$out")" -czf "$out.tar.gz" "$(basename "$out")"
echo "packed $(du -sh "$out" | cut -f1) into $out (and $out.tar.gz)"
