#!/usr/bin/env bash
# Whether the PMIx fences of `srun --mpi=pmix` are barriers across nodes, for each fence algorithm
# of Slurm's PMIx plugin (SLURM_PMIX_FENCE=mixed, its default, tree and ring), on a 2-node Slurm
# cluster of namespaces (scripts/local-cluster.sh), and how often Open MPI's MPI_Init then crashes.
#   scripts/measure-pmix-fence.sh [--traced N] [--crash N] [--load L] [--out FILE]
# --traced N (20): steps per algorithm of a program that runs MPI_Init and one all-reduce, with
#   scripts/pmix-fence/fence_trace.c preloaded: every rank logs when it enters and leaves each
#   fence. A fence released a rank early when a rank left it before the last rank entered it.
#   Open MPI 4.1's MPI_Init makes two fences: 1 collects the connection data, 2 is a barrier.
# --crash N (300): steps per algorithm (mixed, ring) of the same program, untraced, under L (4)
#   busy loops, counting the steps that failed and those that segfaulted.
# Prints a markdown table; --out FILE writes it there too. Needs root, Open MPI (mpicc),
# libpmix-dev and Slurm (installed when missing).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib/daemons.sh
source "$here/lib/daemons.sh"

traced=20 crash=300 load=4 out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --traced) traced=$2; shift 2 ;;
        --crash) crash=$2; shift 2 ;;
        --load) load=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        *) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
    esac
done
need_packages libpmix-dev libopenmpi-dev openmpi-bin slurm-wlm munge

work=$(mktemp -d /tmp/pmix-fence.XXXXXX)
busy=()
cleanup() {
    local p
    for p in "${busy[@]}"; do kill "$p" 2>/dev/null || true; done
    "$here/local-cluster.sh" down "$work/cluster" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

mpicc -O2 -o "$work/init_allreduce" "$here/pmix-fence/init_allreduce.c"
# shellcheck disable=SC2046
gcc -shared -fPIC -O2 $(pkg-config --cflags pmix) -o "$work/fence_trace.so" "$here/pmix-fence/fence_trace.c" -ldl
printf '#!/bin/sh\nLD_PRELOAD=%s exec %s\n' "$work/fence_trace.so" "$work/init_allreduce" > "$work/traced"
chmod +x "$work/traced"

mkdir -p "$work/cluster"
"$here/local-cluster.sh" up "$work/cluster" --nodes 2 >/dev/null
eval "$("$here/local-cluster.sh" slurm "$work/cluster")"
export SLURM_CONF OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# TCP between the nodes on their own subnet, as in the cluster's env (the task prolog sets it too).
eval "$(grep '^export OMPI_MCA_btl_tcp_if_include=' "$work/cluster/env")"
slurm_version=$(sinfo --version | awk '{print $2}')

# steps PROGRAM N: N steps of PROGRAM, 2 ranks on each node, in one allocation; prints
# "failed segfaulted".
steps() {
    salloc --quiet --nodes=2 --ntasks-per-node=2 --overcommit bash -c '
        failed=0 segv=0
        for i in $(seq '"$2"'); do
            if ! timeout 60 srun --mpi=pmix --nodes=2 --ntasks=4 --ntasks-per-node=2 --kill-on-bad-exit=1 --overcommit '"$1"' > "'"$work"'/step.log" 2>&1; then
                failed=$((failed + 1))
                grep -q "Segmentation fault" "'"$work"'/step.log" && segv=$((segv + 1))
            fi
        done
        echo "$failed $segv"'
}

table="| SLURM_PMIX_FENCE | traced steps | fence 1 released a rank early | fence 2 (MPI_Init's barrier) released a rank early | steps under $load busy loops | failed | of them segfaults |"$'\n'"|---|---:|---:|---:|---:|---:|---:|"
for fence in mixed tree ring; do
    export SLURM_PMIX_FENCE=$fence FENCE_TRACE_DIR="$work/trace-$fence"
    mkdir -p "$FENCE_TRACE_DIR"
    steps "$work/traced" "$traced" > /dev/null
    read -r early1 early2 < <(python3 - "$FENCE_TRACE_DIR" <<'PY'
import collections, glob, os, sys
early = collections.Counter()
for path in glob.glob(os.path.join(sys.argv[1], '*')):
    enter, left = collections.defaultdict(list), collections.defaultdict(list)
    for line in open(path):
        t, _rank, what, fence = line.split()
        (enter if what == 'enter' else left)[fence].append(float(t))
    for fence in ('1', '2'):
        if len(enter[fence]) == 4 and left[fence] and min(left[fence]) < max(enter[fence]):
            early[fence] += 1
print(early['1'], early['2'])
PY
)
    failed=- segv=- crashed=-
    if [ "$fence" != tree ] && [ "$crash" -gt 0 ]; then
        for _ in $(seq "$load"); do (while :; do :; done) & busy+=($!); done
        read -r failed segv < <(steps "$work/init_allreduce" "$crash")
        for p in "${busy[@]}"; do kill "$p" 2>/dev/null || true; done
        busy=()
        crashed=$crash
    fi
    table+=$'\n'"| $fence | $traced | $early1 | $early2 | $crashed | $failed | $segv |"
done
unset SLURM_PMIX_FENCE

header="Slurm $slurm_version (mpi/pmix), $(ompi_info --version 2>/dev/null | head -1), PMIx $(dpkg-query -W -f='${Version}' libpmix2 2>/dev/null), 2 namespaced nodes x 2 ranks, $(nproc) cores, $(date -u +%F)"
report="$header"$'\n\n'"$table"
echo "$report"
[ -z "$out" ] || echo "$report" > "$out"
