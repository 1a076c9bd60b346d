#!/usr/bin/env bash
# A single-node Slurm cluster on loopback, for testing the job files in jobs/.
#   scripts/local-slurm.sh start DIR   start munged, slurmctld and slurmd with state in DIR;
#                                      prints the line to export SLURM_CONF
#   scripts/local-slurm.sh stop DIR    stop them (by the PIDs recorded in DIR)
# Needs Debian's slurm-wlm and munge (scripts/test.sh installs them). No daemon of the
# machine's own is touched: everything lives in DIR, on its own ports.
set -euo pipefail

cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }

# shellcheck source=scripts/lib/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/daemons.sh"

stop() {
    for name in slurmd slurmctld munged; do
        stop_pidfile "$dir/$name.pid" "$name"
    done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || { echo "$tool not found: install slurm-wlm and munge" >&2; exit 3; }
done

dir=$(mkdir -p "$dir" && cd "$dir" && pwd)
mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/tmp"
start_munged "$dir"

host=$(hostname)
write_slurm_conf "$dir" hpctraintest "$host" 127.0.0.1 <<CONF
SlurmdSpoolDir=$dir/spool
TmpFS=$dir/tmp
SlurmdPidFile=$dir/slurmd.pid
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
CONF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF" -i
slurmd -f "$SLURM_CONF"
# Wait for the node to come up: at most 60 s, each query bounded (sinfo waits long for a
# controller that is not there).
SECONDS=0
while [ "$SECONDS" -lt 60 ]; do
    if timeout 5 sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.2
done
echo "slurm did not come up; logs in $dir/log" >&2
stop
exit 1
