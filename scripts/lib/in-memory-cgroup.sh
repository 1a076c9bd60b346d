#!/usr/bin/env bash
# Runs a command (one MPI rank) in a memory cgroup of its own, limited to LIMIT bytes, with no
# swap: a rank that holds more than LIMIT is killed by the kernel, as on a node whose batch
# system enforces a memory limit per task (Slurm's cgroup plugin). cgroup v1's memory controller
# (this VM's kernel mounts it at /sys/fs/cgroup/memory) or cgroup v2's (memory.max).
#   mpirun ... scripts/lib/in-memory-cgroup.sh PARENT LIMIT -- COMMAND...
# PARENT is a folder the caller made inside the memory hierarchy (it reads each rank's figures
# from PARENT/rank-R afterwards and removes them); R is the launcher's rank variable.
set -euo pipefail
parent=$1 limit=$2
shift 2
[ "${1:-}" = "--" ] && shift
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-0}}}
group="$parent/rank-$rank"
mkdir -p "$group"
if [ -e "$group/memory.limit_in_bytes" ]; then
    echo "$limit" > "$group/memory.limit_in_bytes"
    # Swap too, where the kernel accounts it (this limit must not be below the one above).
    [ -e "$group/memory.memsw.limit_in_bytes" ] && echo "$limit" > "$group/memory.memsw.limit_in_bytes"
else
    echo "$limit" > "$group/memory.max"
    [ -e "$group/memory.swap.max" ] && echo 0 > "$group/memory.swap.max"
fi
echo $$ > "$group/cgroup.procs"
exec "$@"
