# shellcheck shell=bash
# Helpers shared by the scripts that build test environments (scripts/local-slurm.sh,
# scripts/local-cluster.sh): install what is missing, start munged, stop a process by the PID
# recorded in a file. Sourced, not run.

# need_packages PKG...: installs the Debian packages that are not installed yet (apt-get; sudo
# when not root). Quick when all are there. apt's output goes to stderr: callers print on stdout.
need_packages() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "installing ${missing[*]}" >&2
    local sudo_cmd=(); [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
    { "${sudo_cmd[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" \
        apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >&2 \
        || { echo "could not install ${missing[*]}" >&2; return 1; }
}

# alive PID: the process exists and is no zombie (an orphan that its new parent, often PID 1,
# has not reaped yet has ended for our purposes).
alive() {
    local state
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

# stop_pid PID [COMM]: SIGTERM, up to 5 s for it to end, then SIGKILL. With COMM, a PID whose
# process has another name (the recorded one ended and its PID was reused) is left alone.
stop_pid() {
    local pid=$1 comm=${2:-}
    [ -n "$pid" ] || return 0
    if [ -n "$comm" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != "$comm" ]; then return 0; fi
    kill "$pid" 2>/dev/null || return 0
    local _
    for _ in $(seq 50); do alive "$pid" || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

# stop_pidfile FILE [COMM]: stop_pid of the PID in FILE, then removes FILE. Nothing when FILE
# does not exist, so that stopping twice, or after a partial start, is safe.
stop_pidfile() {
    local file=$1
    [ -f "$file" ] || return 0
    stop_pid "$(cat "$file")" "${2:-}"
    rm -f "$file"
}

# start_munged DIR: a munged of its own with state in DIR: a private key readable by root only
# (DIR/munge/munge.key, made once), a socket folder others can traverse, the socket
# DIR/munge/munge.socket, its PID in DIR/munged.pid and its log in DIR/log/munged.log.
# Prints nothing; the socket path is "$1/munge/munge.socket".
start_munged() {
    local dir=$1
    mkdir -p "$dir/log"
    install -d -m 711 "$dir/munge"
    if [ ! -f "$dir/munge/munge.key" ]; then
        dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 0400 "$dir/munge/munge.key"
    munged --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/munged.pid" \
        --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munge.seed" --force
}

# write_slurm_conf DIR NAME HOST ADDR: writes DIR/slurm.conf for a test cluster called NAME
# whose controller runs on HOST at ADDR, with the controller's state, log and PID file in DIR,
# the munged of `start_munged DIR`, and ports of its own derived from DIR (so that two test
# clusters never meet). The slurmd settings and node lines, which differ between one node and
# many, come on stdin; one partition of all nodes follows them. Prints nothing.
write_slurm_conf() {
    local dir=$1 name=$2 host=$3 addr=$4 port
    # Below the kernel's ephemeral range (32768 and up), where an outgoing connection could hold it.
    port=$(( 10000 + $(printf '%s' "$dir" | cksum | cut -d' ' -f1) % 20000 ))
    {
        cat <<CONF
ClusterName=$name
SlurmctldHost=$host($addr)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/log/slurmctld.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=30
InactiveLimit=0
MinJobAge=300
CONF
        cat
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
    } > "$dir/slurm.conf"
}
