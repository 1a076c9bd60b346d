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

stop() {
    for name in slurmd slurmctld munged; do
        local pidfile="$dir/$name.pid"
        if [ -f "$pidfile" ]; then
            local pid; pid=$(cat "$pidfile")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
            rm -f "$pidfile"
        fi
    done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || { echo "$tool not found: install slurm-wlm and munge" >&2; exit 3; }
done

dir=$(mkdir -p "$dir" && cd "$dir" && pwd)
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
# munge: a private key readable by root only, and a socket folder others can traverse.
install -d -m 711 "$dir/munge"
if [ ! -f "$dir/munge/munge.key" ]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
fi
chmod 0400 "$dir/munge/munge.key"
socket="$dir/munge/munge.socket"
munged --socket="$socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munge.seed" --force

host=$(hostname)
cpus=$(nproc)
# Ports of its own (derived from the folder) so that two test runs never meet.
port=$(( 20000 + $(printf '%s' "$dir" | cksum | cut -d' ' -f1) % 20000 ))
cat > "$dir/slurm.conf" <<CONF
ClusterName=hpctraintest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=30
InactiveLimit=0
MinJobAge=300
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF" -i
slurmd -f "$SLURM_CONF"
# Wait for the node to come up.
for _ in $(seq 100); do
    if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.2
done
echo "slurm did not come up; logs in $dir/log" >&2
stop
exit 1
