#!/usr/bin/env bash
# scripts/setup.sh as a new cluster user would run it (tests/install.rs): a non-root account
# without sudo, on a machine whose own MPI and HDF5 are hidden, that finds Open MPI and HDF5 only
# through Lmod modules kept off the default paths. Run as root:
#   scripts/lib/install-test.sh run SCRATCH      set up, run, leave the findings in SCRATCH/out/
#   scripts/lib/install-test.sh cleanup SCRATCH  stop what is left (by PID), remove SCRATCH
# Exit 77: this machine cannot run the test (not root, no unshare/setpriv, no Lmod).
#
# Nothing system-wide changes: the account exists only inside a private mount namespace (copies
# of /etc/passwd and /etc/group bound over the real ones there), the system's MPI and HDF5
# packages are hidden there by an overlay on /usr whose whiteouts live in SCRATCH, and the mounts
# end with the namespace. The modules tree (SCRATCH/modules) holds copies of Debian's installed
# Open MPI 4.1.4 and HDF5 1.10.8 files under prefixes of their own, with Lua modulefiles that set
# what minimal site modules set (PATH, LD_LIBRARY_PATH, MPI_HOME, HDF5_DIR, OPAL_PREFIX). Not
# CPATH or PKG_CONFIG_PATH: cc-rs reruns every C crate's build script when CPATH changes, and
# the pkg-config crate bzip2-sys's when PKG_CONFIG_PATH does; bzip2 is a build dependency of
# torch-sys (through zip), so either turns the seeded build into a whole one (torch-sys's C++
# wrapper among them: more than 20 minutes on this busy 2-core VM). Modules that set them work
# the same; only the first build is longer (results/cluster-path/install.md). The Rust toolchain
# and cargo's registry are shared read-only (bind mounts), the checkout's target folder starts
# from the main build's (seed_target_folder: only the crates that read MPI or HDF5 rebuild),
# libtorch is the shared one through LIBTORCH (1.3 GB saved per run),
# and Fashion-MNIST comes from a local HTTP mirror through FASHION_MNIST_URL (the download path,
# without the network). Environment: ROOT (the checkout to copy; default this one), LIBTORCH.
set -euo pipefail
action=${1:-}; S=${2:-}
[ -n "$S" ] && [ "${S#/}" != "$S" ] || { echo "usage: $0 run|cleanup /ABSOLUTE/SCRATCH" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=${ROOT:-$(cd "$here/../.." && pwd)}

cleanup() {
    # The test account's processes (it is used by nothing else), then the mirror, then the files.
    local uid pid
    uid=$(cat "$S/uid" 2>/dev/null || true)
    if [ -n "$uid" ]; then
        for pid in $(ps -e -o pid=,uid= | awk -v u="$uid" '$2 == u {print $1}'); do kill -9 "$pid" 2>/dev/null || true; done
    fi
    pid=$(cat "$S/mirror.pid" 2>/dev/null || true)
    [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
    # Mounts live in the namespace only; one left by a namespace that still runs is lazily detached.
    grep -F " $S/" /proc/self/mountinfo 2>/dev/null | awk '{print $5}' | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf "$S"
}
if [ "$action" = cleanup ]; then cleanup; exit 0; fi
[ "$action" = run ] || { echo "usage: $0 run|cleanup SCRATCH" >&2; exit 2; }

skip() { echo "skipped: $*" >&2; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "the install test needs root (to make a namespace and switch to a test account)"
for tool in unshare setpriv dpkg-query; do command -v "$tool" >/dev/null || skip "no $tool here"; done
lmod_init=/usr/share/lmod/lmod/init/bash
[ -f "$lmod_init" ] || skip "Lmod is not installed (Debian: lmod; scripts/test.sh installs it)"
[ -n "${LIBTORCH:-}" ] && [ -f "$LIBTORCH/lib/libtorch_cpu.so" ] || { echo "LIBTORCH=${LIBTORCH:-} holds no libtorch" >&2; exit 1; }
sysroot=$(rustc --print sysroot)
cargo_home=${CARGO_HOME:-$HOME/.cargo}
[ -d "$cargo_home/registry" ] || { echo "no cargo registry at $cargo_home/registry" >&2; exit 1; }
for p in openmpi-bin libopenmpi3 libopenmpi-dev libhdf5-dev dataset-fashion-mnist; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
        || skip "$p is not installed here (the modules are copies of the installed files)"
done

mkdir -p "$S"/{out,modules/modulefiles/openmpi,modules/modulefiles/hdf5,upper,work,etc,trap-bin,mirror,rust,registry,home,cargo-home/registry}
chmod 755 "$S" "$S/modules" "$S/trap-bin" "$S/rust"
echo "$(date +%s)" > "$S/out/started"

# The account: a free uid, an entry only in the namespace's /etc/passwd and /etc/group.
uid=61000
while getent passwd "$uid" >/dev/null || getent group "$uid" >/dev/null; do uid=$((uid + 1)); done
echo "$uid" > "$S/uid"
user=hpcuser
home=$S/home/$user
cp /etc/passwd "$S/etc/passwd"; cp /etc/group "$S/etc/group"
echo "$user:x:$uid:$uid:install test:$home:/bin/bash" >> "$S/etc/passwd"
echo "$user:x:$uid:" >> "$S/etc/group"
mkdir -p "$home"/{tmp,hpc-train}

# The checkout as a clone would have it (what git tracks plus what it does not ignore), its target
# folder seeded from the main build.
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) \
    | tar -C "$home/hpc-train" -xf -
# shellcheck source=scripts/lib/cargo.sh
source "$here/cargo.sh"
seed_target_folder "$ROOT/target" "$home/hpc-train/target"
chown -R "$uid:$uid" "$home" "$S/cargo-home"
chmod 755 "$S/home"

# The shared Rust toolchain and cargo registry, read-only, at the paths the main build used:
# cargo counts a crate as changed when the path of its source changes, and would rebuild them
# all from another CARGO_HOME. CARGO_HOME itself is the account's (cargo takes its lock there);
# a parent folder the account cannot enter (/root) is covered, in the namespace only, by one
# holding just those mount points.
cover=""
parent=$(dirname "$cargo_home")
if [ "$(( $(stat -c '%a' "$parent" | tail -c 2) & 1 ))" -eq 0 ]; then
    cover=$parent
    mkdir -p "$S/cover/$(basename "$cargo_home")"
    case "$sysroot" in "$parent"/*) mkdir -p "$S/cover/${sysroot#"$parent"/}" ;; esac
    chmod -R 755 "$S/cover"
fi
bind_sysroot=""
case "$sysroot" in "${cover:-/nowhere}"/*) bind_sysroot="mount --bind $S/rust $sysroot" ;; esac

# The modules tree: Debian's installed files under prefixes of their own, as a site installs them.
ompi=$S/modules/sw/openmpi/4.1.4
dpkg -L openmpi-bin libopenmpi3 libopenmpi-dev openmpi-common | while IFS= read -r f; do
    { [ -L "$f" ] || [ -f "$f" ]; } && echo "${f#/}"
done | tar -C / -cf - -T - | { mkdir -p "$ompi"; tar -C "$ompi" -xf -; }
for tool in mpicc mpicxx mpirun mpiexec; do ln -sf "$tool.openmpi" "$ompi/usr/bin/$tool"; done
hdf5=$S/modules/sw/hdf5/1.10.8
mkdir -p "$hdf5/include" "$hdf5/lib"
cp -a /usr/include/hdf5/serial/. "$hdf5/include/"
cp -a /usr/lib/x86_64-linux-gnu/libhdf5_serial.so* /usr/lib/x86_64-linux-gnu/libhdf5_serial_hl.so* "$hdf5/lib/"
ln -s libhdf5_serial.so "$hdf5/lib/libhdf5.so"
ln -s libhdf5_serial_hl.so "$hdf5/lib/libhdf5_hl.so"
mkdir -p "$hdf5/lib/pkgconfig"
cat > "$hdf5/lib/pkgconfig/hdf5.pc" <<PC
prefix=$hdf5
includedir=\${prefix}/include
libdir=\${prefix}/lib
Name: hdf5
Description: HDF5 (serial)
Version: 1.10.8
Cflags: -I\${includedir}
Libs: -L\${libdir} -lhdf5
PC
cat > "$S/modules/modulefiles/openmpi/4.1.4.lua" <<LUA
whatis("Open MPI 4.1.4")
local root = "$ompi/usr"
setenv("OPAL_PREFIX", root)
setenv("MPI_HOME", root)
prepend_path("PATH", pathJoin(root, "bin"))
prepend_path("LD_LIBRARY_PATH", pathJoin(root, "lib/x86_64-linux-gnu"))
prepend_path("LD_LIBRARY_PATH", pathJoin(root, "lib/x86_64-linux-gnu/openmpi/lib"))
LUA
cat > "$S/modules/modulefiles/hdf5/1.10.8.lua" <<LUA
whatis("HDF5 1.10.8 (serial)")
local root = "$hdf5"
setenv("HDF5_DIR", root)
setenv("HDF5_ROOT", root)
prepend_path("LD_LIBRARY_PATH", pathJoin(root, "lib"))
LUA

# What the namespace hides: every file of the system's MPI and HDF5 packages and of the dataset
# package, and every link under /usr that leads to one (Debian's alternatives: mpicc, hdf5.pc).
dpkg-query -W -f='${Package}\n' | grep -E '^(libhdf5|hdf5-|libopenmpi|openmpi-|mpich|libmpich|dataset-fashion-mnist)' \
    | xargs dpkg -L 2>/dev/null | python3 -c '
import os, sys
upper = sys.argv[1]
listed = (p.rstrip("\n") for p in sys.stdin)
hidden = {p for p in listed if p.startswith("/usr/") and (os.path.islink(p) or os.path.isfile(p))}
targets = {os.path.realpath(p) for p in hidden}
for top in ("/usr/bin", "/usr/lib", "/usr/include", "/usr/share"):
    for d, dirs, files in os.walk(top):
        for name in files + dirs:
            p = os.path.join(d, name)
            if os.path.islink(p) and os.path.realpath(p) in targets:
                hidden.add(p)
for p in sorted(hidden):
    w = os.path.join(upper, p[len("/usr/"):])
    os.makedirs(os.path.dirname(w), exist_ok=True)
    if not os.path.lexists(w):
        os.mknod(w, 0o600 | 0o020000, os.makedev(0, 0))
print(len(hidden))' "$S/upper" > "$S/out/hidden-count"

# Recorders in place of sudo and apt-get: set-up must call neither.
for tool in sudo apt-get apt dpkg; do
    printf '#!/bin/sh\necho "%s $*" >> %s/out/system-calls\nexit 1\n' "$tool" "$S" > "$S/trap-bin/$tool"
    chmod 755 "$S/trap-bin/$tool"
done
touch "$S/out/system-calls"; chmod 666 "$S/out/system-calls"
chmod 777 "$S/out"

# The Fashion-MNIST mirror on loopback.
cp /usr/share/datasets/fashion-mnist/*.gz "$S/mirror/"
python3 -c '
import functools, http.server, sys
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1])
class Quiet(handler.func):
    def log_message(self, *a): pass
server = http.server.HTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=sys.argv[1]))
open(sys.argv[2], "w").write(str(server.server_address[1]))
server.serve_forever()' "$S/mirror" "$S/mirror.port" > "$S/mirror.log" 2>&1 < /dev/null &
# Its own output, not this script's: the test reads this script's output to its end, which a
# server still holding it would never give. It ends with this script, whatever ends that.
echo $! > "$S/mirror.pid"
trap 'kill "$(cat "$S/mirror.pid")" 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ -s "$S/mirror.port" ] && break; sleep 0.1; done
port=$(cat "$S/mirror.port")

# What the system looked like before: compared afterwards by tests/install.rs.
sums() { sha256sum /etc/passwd /etc/group /var/lib/dpkg/status 2>/dev/null; }
sums > "$S/out/system-before"

# The user's session, inside the namespace. $1: what to run after the modules (if any) load.
cat > "$S/session.sh" <<'SESSION'
# Not -u: Lmod's own shell functions read variables that may be unset.
set -o pipefail
source /usr/share/lmod/lmod/init/bash
cd "$HOME/hpc-train"
if [ "${LOAD_MODULES:-0}" = 1 ]; then
    module use "$MODULES"
    module load openmpi/4.1.4 hdf5/1.10.8
fi
eval "$1"
SESSION
cat > "$S/inside.sh" <<INSIDE
set -euo pipefail
mount -t overlay overlay -o lowerdir=/usr,upperdir=$S/upper,workdir=$S/work /usr
mount --bind $S/etc/passwd /etc/passwd
mount --bind $S/etc/group /etc/group
mount --bind $sysroot $S/rust
mount -o remount,bind,ro $S/rust
mount --bind $cargo_home/registry $S/registry
mount -o remount,bind,ro $S/registry
[ -z "$cover" ] || mount --bind $S/cover $cover
mount --bind $S/cargo-home $cargo_home
mount --bind $S/registry $cargo_home/registry
$bind_sysroot
{
    for c in mpicc mpicc.openmpi mpicc.mpich mpirun mpiexec h5cc; do command -v \$c && echo "visible: \$c"; done
    for m in hdf5 ompi mpich; do pkg-config --exists \$m && echo "visible: pkg-config \$m"; done
    for f in /usr/include/hdf5/serial/hdf5.h /usr/lib/x86_64-linux-gnu/libmpi.so.40 /usr/lib/x86_64-linux-gnu/libhdf5_serial.so.103 /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz; do
        [ -e \$f ] && echo "visible: \$f"
    done
    true
} > $S/out/hidden-check 2>&1
as_user() {  # as_user NAME LOAD_MODULES COMMAND: runs COMMAND in the user's login-like session
    local start=\$(date +%s.%N) rc=0
    timeout 1200 setpriv --reuid=$uid --regid=$uid --clear-groups env -i HOME=$home USER=$user LOGNAME=$user \
        SHELL=/bin/bash TMPDIR=$home/tmp CARGO_HOME=$cargo_home CARGO_NET_OFFLINE=true \
        PATH=$S/trap-bin:$sysroot/bin:/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
        LIBTORCH=$LIBTORCH FASHION_MNIST_URL=http://127.0.0.1:$port MODULES=$S/modules/modulefiles \
        LOAD_MODULES=\$2 bash $S/session.sh "\$3" > $S/out/\$1.log 2>&1 || rc=\$?
    echo \$rc > $S/out/\$1.rc
    awk -v a="\$start" -v b="\$(date +%s.%N)" 'BEGIN { printf "%.1f\\n", b - a }' > $S/out/\$1.seconds
}
as_user check 0 'scripts/setup.sh --check'
as_user check-modules 1 'scripts/setup.sh --check'
as_user setup 1 'scripts/setup.sh --steps 20'
as_user ldd 1 'ldd target/release/hpc-train'
as_user again 1 'scripts/setup.sh --no-run'
INSIDE
unshare -m --propagation private bash "$S/inside.sh" > "$S/out/inside.log" 2>&1 || { echo "the namespace's set-up failed:" >&2; cat "$S/out/inside.log" >&2; exit 1; }
sums > "$S/out/system-after"
# Files the account left outside its home and the scratch folder.
find /tmp /var/tmp /dev/shm /etc /opt /usr /var/lib -xdev -uid "$uid" -not -path "$S/*" 2>/dev/null > "$S/out/stray-files" || true
echo "$(date +%s)" > "$S/out/ended"
