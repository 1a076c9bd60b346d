#!/usr/bin/env bash
# A cluster of N nodes on this one machine, made of Linux namespaces, for testing multi-node runs.
#   scripts/local-cluster.sh up DIR --nodes N [--link-mbit M] [--cpus-per-node C]
#       N nodes: each a network namespace and a UTS namespace (hostname nodeK) held by a `sleep`
#       process, with a link (veth pair) to a bridge in the root namespace and the address
#       10.213.X.K on a private /24 chosen from DIR (the bridge has .254). --link-mbit M limits
#       every node's link to M Mbit/s each way (tbf on both ends). --cpus-per-node C gives node K
#       cores (K-1)C..KC-1 of its own: everything started on it is pinned there (taskset) and it
#       has C slots; otherwise every node shares every core. Writes into DIR: nodes (name,
#       address, holder PID, namespace, cores or - per line), hostfile (Open MPI's) and hosts (Hydra's),
#       rsh-agent, env (the settings of both launchers). Fails when DIR is already up: run `down`
#       first.
#   scripts/local-cluster.sh run DIR -- COMMAND...
#       runs COMMAND on node1 with the settings of DIR/env, so that the launcher starts its ranks
#       over the nodes (every node with $(nproc) slots): Open MPI's `mpirun -n 4 --map-by
#       ppr:2:node hpc-train ...` or MPICH's Hydra, `mpiexec.mpich -n 4 -ppn 2 hpc-train ...`.
#       Prints only what COMMAND prints; exits with its status.
#   scripts/local-cluster.sh slurm DIR [--gpus-per-node G]
#       a Slurm cluster on the nodes: slurmctld on node1, one slurmd per node (NodeName=nodeK,
#       NodeAddr its address), one munged; prints the line to export SLURM_CONF. --gpus-per-node
#       declares G GPUs per node as a generic resource (gres/gpu over placeholder device files in
#       DIR/slurm/dev, no GPU needed), so that Slurm sets CUDA_VISIBLE_DEVICES in jobs as on a GPU
#       cluster; with TaskPlugin=task/none nothing hides the other GPUs from a task.
#   scripts/local-cluster.sh link DIR NODE down|up
#       takes NODE's link (node2 or 2) down or up, as a pulled cable would.
#   scripts/local-cluster.sh down DIR
#       stops everything by the PIDs recorded in DIR (Slurm daemons, munged, what still runs in the
#       nodes, the holders), deletes the namespaces, links and bridge. Safe after a partial `up`
#       and when run twice.
# Needs root. Installs iproute2 and util-linux (and slurm-wlm, munge for `slurm`) when missing.
# No traffic leaves the bridge: the nodes have no default route, and nothing is forwarded.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib/daemons.sh
source "$here/lib/daemons.sh"

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || usage
shift 2
[ "$(id -u)" -eq 0 ] || { echo "$0: needs root (network namespaces)" >&2; exit 1; }

# --- state -------------------------------------------------------------------------------------
# DIR/cluster.conf is written before anything is created, so that `down` after a partial `up`
# knows what to remove.

load_conf() {
    [ -f "$dir/cluster.conf" ] || return 1
    # shellcheck source=/dev/null
    source "$dir/cluster.conf"
}

ns_name()    { echo "${ID}n$1"; }          # network namespace of node K
veth_name()  { echo "${ID}v$1"; }          # root-side end of node K's link (on the bridge)
peer_name()  { echo "${ID}p$1"; }          # node-side end, renamed eth0 inside the node
holder_pid() { cat "$dir/holders/node$1.pid" 2>/dev/null; }

# The node number from "node2" or "2".
node_number() {
    local k=${1#node}
    [[ "$k" =~ ^[0-9]+$ ]] && [ "$k" -ge 1 ] && [ "$k" -le "$NODES" ] \
        || { echo "$0: no node $1 (nodes 1..$NODES)" >&2; exit 2; }
    echo "$k"
}

# --- link shaping ------------------------------------------------------------------------------

# shape DEV MBIT [NETNS]: a token bucket of MBIT Mbit/s on DEV's egress. Both ends of a node's
# link are shaped: the node's eth0 (its uplink) and the bridge side (its downlink, where traffic
# from several nodes meets, as at a switch port). Measured here (docs/local-cluster.md): the bucket needs about 0.2-0.5 ms of traffic, or the rate is not reached above
# 1 Gbit/s (64 KiB at 10 Gbit/s gave 370 MB/s); a larger one lets the first bytes of every message
# pass at memory speed (a 5 MB bucket gave 1.85 GB/s for 1 MiB on a 10 Gbit/s link). The queue
# holds 10 ms: 50 ms made TCP's round trips, and the 2 x 2 ranks' times, longer (bufferbloat).
shape() {
    local dev=$1 mbit=$2 ns=${3:-} burst
    burst=$(( mbit * 1000000 / 8 / 2000 ))        # 0.5 ms at the rate
    [ "$burst" -ge 65536 ] || burst=65536         # at least a 64 KiB GSO packet
    local tc=(tc); [ -n "$ns" ] && tc=(ip netns exec "$ns" tc)
    "${tc[@]}" qdisc replace dev "$dev" root tbf rate "${mbit}mbit" burst "$burst" latency 10ms
}

# --- down --------------------------------------------------------------------------------------

cmd_down() {
    load_conf || return 0
    local k ns pid
    # Slurm first (its daemons would otherwise restart steps), then what still runs in the nodes.
    for k in $(seq "$NODES"); do stop_pidfile "$dir/slurm/slurmd.node$k.pid" slurmd; done
    stop_pidfile "$dir/slurm/slurmctld.pid" slurmctld
    stop_pidfile "$dir/slurm/munged.pid" munged
    for k in $(seq "$NODES"); do
        ns=$(ns_name "$k")
        ip netns list 2>/dev/null | grep -qw "^$ns" || continue
        # Every process in our namespace was started by this script or through it (rsh-agent,
        # run, slurmd): stop them, then the holder.
        others() { ip netns pids "$ns" 2>/dev/null | grep -vx "$(holder_pid "$k")" || true; }
        for pid in $(others); do kill "$pid" 2>/dev/null || true; done
        for _ in $(seq 50); do [ -z "$(others)" ] && break; sleep 0.1; done
        for pid in $(others); do kill -9 "$pid" 2>/dev/null || true; done
    done
    for k in $(seq "$NODES"); do
        stop_pidfile "$dir/holders/node$k.pid" sleep
        tc qdisc del dev "$(veth_name "$k")" root 2>/dev/null || true
        ip link del "$(veth_name "$k")" 2>/dev/null || true
        ip link del "$(peer_name "$k")" 2>/dev/null || true
        ip netns del "$(ns_name "$k")" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -f "$dir/cluster.conf" "$dir/nodes" "$dir/hostfile" "$dir/hosts" "$dir/rsh-agent" "$dir/env"
}

# --- up ----------------------------------------------------------------------------------------

cmd_up() {
    local nodes="" mbit="" cpus_per_node=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --nodes) nodes=${2:-}; shift 2 ;;
            --cpus-per-node) cpus_per_node=${2:-}; shift 2 ;;
            --link-mbit) mbit=${2:-}; shift 2 ;;
            *) usage ;;
        esac
    done
    [[ "$nodes" =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 64 ] \
        || { echo "$0 up: --nodes 1..64 expected" >&2; exit 2; }
    if [ -n "$mbit" ]; then
        [[ "$mbit" =~ ^[0-9]+$ ]] && [ "$mbit" -ge 1 ] || { echo "$0 up: --link-mbit expects Mbit/s" >&2; exit 2; }
    fi
    if [ -n "$cpus_per_node" ]; then
        [[ "$cpus_per_node" =~ ^[0-9]+$ ]] && [ "$cpus_per_node" -ge 1 ] \
            || { echo "$0 up: --cpus-per-node expects a number of cores" >&2; exit 2; }
        [ $((nodes * cpus_per_node)) -le "$(nproc)" ] \
            || { echo "$0 up: $nodes nodes x $cpus_per_node cores need $((nodes * cpus_per_node)) cores; this machine has $(nproc)" >&2; exit 2; }
    fi
    if [ -f "$dir/cluster.conf" ]; then
        echo "$0 up: $dir is already up (or was not taken down): run '$0 down $dir' first" >&2
        exit 1
    fi
    # The commands, wherever they come from (a machine without a package mirror may have them
    # from the bundle of scripts/pack.sh); the packages where they are missing.
    command -v ip > /dev/null && command -v tc > /dev/null && command -v nsenter > /dev/null || need_packages iproute2 util-linux

    # Names and subnet from DIR, so that two clusters (two test runs) never meet. Interface names
    # have at most 15 characters: hpcc + 6 hex digits + v|p|n + node number.
    local sum id x
    sum=$(printf '%s' "$dir" | cksum | cut -d' ' -f1)
    id=hpcc$(printf '%06x' $(( sum % 16777216 )))
    ip link show "${id}br" >/dev/null 2>&1 && { echo "$0 up: ${id}br exists (another cluster in a folder of the same hash?)" >&2; exit 1; }
    # 10.213.X.0/24 with X from the hash, the next one when that subnet is in use here.
    x=$(( sum % 250 + 1 ))
    local tries=0
    while ip -4 -o addr show | grep -q " 10\.213\.$x\." || [ -n "$(ip -4 route show 10.213.$x.0/24)" ]; do
        x=$(( x % 250 + 1 )); tries=$((tries + 1))
        [ "$tries" -lt 250 ] || { echo "$0 up: no free subnet 10.213.X.0/24" >&2; exit 1; }
    done

    mkdir -p "$dir/holders" "$dir/log"
    cat > "$dir/cluster.conf" <<CONF
ID=$id
NODES=$nodes
NET=10.213.$x
BRIDGE=${id}br
LINK_MBIT=$mbit
CONF
    load_conf
    # Whatever fails from here on (set -e), what was made is removed again.
    up_ok=0
    trap '[ "$up_ok" = 1 ] || { echo "$0 up: failed; removing what was made" >&2; cmd_down; }' EXIT

    # The bridge: the nodes' switch. The root namespace's address on it (.254) lets clients here
    # (sbatch, ssh-less tools) reach the nodes; IPv6 off so that nothing is sent unasked.
    ip link add "$BRIDGE" type bridge
    sysctl -qw "net.ipv6.conf.$BRIDGE.disable_ipv6=1"
    ip addr add "$NET.254/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up

    local k ns veth pid
    : > "$dir/nodes.tmp"
    for k in $(seq "$nodes"); do
        ns=$(ns_name "$k"); veth=$(veth_name "$k")
        ip netns add "$ns"
        ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
        ip link add "$veth" type veth peer name "$(peer_name "$k")" netns "$ns"
        sysctl -qw "net.ipv6.conf.$veth.disable_ipv6=1"
        ip link set "$veth" master "$BRIDGE" up
        ip -n "$ns" link set "$(peer_name "$k")" name eth0
        ip -n "$ns" addr add "$NET.$k/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        if [ -n "$mbit" ]; then
            shape "$veth" "$mbit"
            shape eth0 "$mbit" "$ns"
        fi
        # The holder keeps the namespaces (and the node's hostname) alive; later commands enter
        # them with nsenter -t PID -n -u. ip netns exec and unshare exec, so $! is sleep's PID.
        ip netns exec "$ns" unshare --uts sh -c "hostname node$k; exec sleep infinity" \
            </dev/null >/dev/null 2>"$dir/log/holder.node$k.log" &
        pid=$!
        disown "$pid"
        echo "$pid" > "$dir/holders/node$k.pid"
        for _ in $(seq 100); do
            [ "$(nsenter -t "$pid" -u hostname 2>/dev/null)" = "node$k" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = sleep ] && break
            sleep 0.05
        done
        [ "$(nsenter -t "$pid" -u hostname 2>/dev/null)" = "node$k" ] || { echo "$0 up: node$k's holder did not start" >&2; false; }
        local cores=-
        [ -n "$cpus_per_node" ] && cores="$(( (k - 1) * cpus_per_node ))-$(( k * cpus_per_node - 1 ))"
        echo "node$k $NET.$k $pid $ns $cores" >> "$dir/nodes.tmp"
    done
    mv "$dir/nodes.tmp" "$dir/nodes"

    # node1 reaches every other node: a TCP connection to a closed port is refused (no ping here).
    for k in $(seq 2 "$nodes"); do
        local answer
        answer=$(nsenter -t "$(holder_pid 1)" -n timeout 5 bash -c "exec 3<>/dev/tcp/$NET.$k/9" 2>&1 || true)
        [[ "$answer" == *refused* ]] || { echo "$0 up: node1 cannot reach node$k: $answer" >&2; false; }
    done

    local slots; slots=${cpus_per_node:-$(nproc)}
    awk -v s="$slots" '{print $2, "slots=" s}' "$dir/nodes" > "$dir/hostfile"
    awk -v s="$slots" '{print $2 ":" s}' "$dir/nodes" > "$dir/hosts"

    # Open MPI and Hydra start their daemons on other nodes through this agent instead of ssh:
    # `rsh-agent [options] HOST COMMAND...` runs COMMAND in HOST's namespaces (HOST: address or name).
    cat > "$dir/rsh-agent" <<AGENT
#!/bin/sh
# rsh agent of the local cluster in $dir (made by scripts/local-cluster.sh).
while [ \$# -gt 0 ]; do case "\$1" in -*) shift ;; *) break ;; esac; done
host=\$1; shift
pid=\$(awk -v h="\$host" '\$1 == h || \$2 == h { print \$3 }' "$dir/nodes")
[ -n "\$pid" ] || { echo "rsh-agent: no node \$host in $dir/nodes" >&2; exit 255; }
cores=\$(awk -v h="\$host" '\$1 == h || \$2 == h { print \$5 }' "$dir/nodes")
if [ -n "\$cores" ] && [ "\$cores" != - ]; then
    exec taskset -c "\$cores" nsenter -t "\$pid" -n -u -- /bin/sh -c "\$*"
fi
exec nsenter -t "\$pid" -n -u -- /bin/sh -c "\$*"
AGENT
    chmod +x "$dir/rsh-agent"

    # The Open MPI settings a launch on these nodes needs (see docs/local-cluster.md):
    # routed direct (the agent is no ssh that tree-routing could use), TCP on this subnet only,
    # yield when idle (every node claims the machine's cores: polling ranks would starve the
    # network), the hostfile as default, oversubscription and no binding (all nodes share cores).
    # Session folders go into DIR/tmp: a node's daemon killed in a test would otherwise leave
    # /tmp/ompi.nodeK.*, and two clusters' nodeK would share one.
    # Hydra (MPICH's mpiexec) reads its settings from HYDRA_* variables: the agent as an rsh
    # launcher, the hosts file, and the address of eth0 for the proxies to call mpiexec back on
    # (by default it gives its host name, nodeK, which no node can resolve). It binds nothing and
    # has no slot limit unless asked; MPICH has no yield-when-idle setting that helps here.
    # MPICH (ch4:ucx) sends between nodes through UCX, which takes the nodes for one machine (they
    # share the boot id) and passes their messages through shared memory, around the links: a
    # 16 MB ring between 2 nodes put 3 KB on node2's link, 146 MB with UCX_TLS=tcp,self. That
    # setting is left to the user: with it MPICH 4.0.2 / UCX 1.13 hung in MPI_Finalize in 3 of 5
    # runs of 4 ranks on 2 nodes (a rank flushing its TCP endpoints while its peers wait in the
    # PMI barrier, no longer progressing them).
    mkdir -p "$dir/tmp"
    cat > "$dir/env" <<ENV
export OMPI_MCA_plm_rsh_agent=$dir/rsh-agent
export OMPI_MCA_routed=direct
export OMPI_MCA_oob_tcp_if_include=$NET.0/24
export OMPI_MCA_btl_tcp_if_include=$NET.0/24
export OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_orte_default_hostfile=$dir/hostfile
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_hwloc_base_binding_policy=none
export OMPI_MCA_orte_tmpdir_base=$dir/tmp
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export HYDRA_LAUNCHER=rsh
export HYDRA_LAUNCHER_EXEC=$dir/rsh-agent
export HYDRA_HOST_FILE=$dir/hosts
export HYDRA_IFACE=eth0
ENV
    up_ok=1
    echo "cluster of $nodes node(s) up on $NET.0/24${mbit:+, links $mbit Mbit/s}: $dir/nodes" >&2
}

# --- run ---------------------------------------------------------------------------------------

cmd_run() {
    [ "${1:-}" = -- ] && shift
    [ $# -gt 0 ] || usage
    load_conf && [ -f "$dir/env" ] || { echo "$0 run: $dir is not up" >&2; exit 1; }
    # shellcheck source=/dev/null
    source "$dir/env"
    local cores; cores=$(awk '$1 == "node1" { print $5 }' "$dir/nodes")
    if [ -n "$cores" ] && [ "$cores" != - ]; then
        exec taskset -c "$cores" nsenter -t "$(holder_pid 1)" -n -u -- "$@"
    fi
    exec nsenter -t "$(holder_pid 1)" -n -u -- "$@"
}

# --- link --------------------------------------------------------------------------------------

cmd_link() {
    load_conf || { echo "$0 link: $dir is not up" >&2; exit 1; }
    local k; k=$(node_number "${1:-}")
    case "${2:-}" in
        down|up) ip link set "$(veth_name "$k")" "$2" ;;
        *) usage ;;
    esac
}

# --- slurm -------------------------------------------------------------------------------------

cmd_slurm() {
    local gpus=0
    while [ $# -gt 0 ]; do
        case "$1" in
            --gpus-per-node) gpus=${2:-}; shift 2 ;;
            *) usage ;;
        esac
    done
    [[ "$gpus" =~ ^[0-9]+$ ]] && [ "$gpus" -le 16 ] || { echo "$0 slurm: --gpus-per-node expects 0..16" >&2; exit 2; }
    load_conf && [ -f "$dir/nodes" ] || { echo "$0 slurm: $dir is not up" >&2; exit 1; }
    need_packages slurm-wlm munge
    local s="$dir/slurm"
    if [ -f "$s/slurmctld.pid" ]; then echo "$0 slurm: already started in $s" >&2; exit 1; fi
    # A fresh Slurm each time: no jobs or node states of an earlier start.
    rm -rf "$s/state" "$s/spool" "$s/tmp" "$s/dev" "$s/gres.conf"
    mkdir -p "$s/state" "$s/log"
    start_munged "$s"
    local cpus k gres=""
    cpus=$(nproc)
    [ "$gpus" -gt 0 ] && gres=" Gres=gpu:$gpus"
    # Tasks of jobs get the Open MPI settings that `run` gives mpirun (TCP on this subnet only,
    # yield when idle, session folders in DIR/tmp), and Hydra the address to be called back on:
    # a task prolog's "export NAME=value" lines go into every task's environment.
    {
        echo '#!/bin/sh'
        sed -n 's/^export \(\(OMPI_MCA_\(btl_tcp_if_include\|oob_tcp_if_include\|mpi_yield_when_idle\|orte_tmpdir_base\)\|HYDRA_IFACE\)=.*\)/echo "export \1"/p' "$dir/env"
    } > "$s/task-prolog"
    chmod +x "$s/task-prolog"
    {
        echo "TaskProlog=$s/task-prolog"
        echo "SlurmdSpoolDir=$s/spool/%n"
        echo "TmpFS=$s/tmp/%n"
        echo "SlurmdPidFile=$s/slurmd.%n.pid"
        echo "SlurmdLogFile=$s/log/slurmd.%n.log"
        if [ "$gpus" -gt 0 ]; then echo "GresTypes=gpu"; fi
        for k in $(seq "$NODES"); do
            echo "NodeName=node$k NodeAddr=$NET.$k NodeHostname=node$k CPUs=$cpus${gres} State=UNKNOWN"
        done
    } | write_slurm_conf "$s" hpctraincluster node1 "$NET.1"
    if [ "$gpus" -gt 0 ]; then
        # Placeholder device files, one set per node; slurmd reads only their names (the index in
        # CUDA_VISIBLE_DEVICES is their order), since no cgroup constrains devices here.
        {
            echo "AutoDetect=off"
            for k in $(seq "$NODES"); do
                mkdir -p "$s/dev/node$k"
                for g in $(seq 0 $((gpus - 1))); do mknod "$s/dev/node$k/nvidia$g" c 195 "$g"; done
                echo "NodeName=node$k Name=gpu File=$s/dev/node$k/nvidia[0-$((gpus - 1))]"
            done
        } > "$s/gres.conf"
    fi
    export SLURM_CONF="$s/slurm.conf"
    nsenter -t "$(holder_pid 1)" -n -u -- slurmctld -f "$SLURM_CONF" -i
    for k in $(seq "$NODES"); do
        mkdir -p "$s/spool/node$k" "$s/tmp/node$k"
        nsenter -t "$(holder_pid "$k")" -n -u -- slurmd -f "$SLURM_CONF" -N "node$k"
    done
    SECONDS=0
    while [ "$SECONDS" -lt 60 ]; do
        if [ "$(timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated)$')" -eq "$NODES" ]; then
            echo "export SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.2
    done
    echo "$0 slurm: the nodes did not come up; logs in $s/log" >&2
    sinfo -N >&2 || true
    exit 1
}

case "$cmd" in
    up) dir=$(mkdir -p "$dir" && cd "$dir" && pwd); cmd_up "$@" ;;
    down) [ -d "$dir" ] || exit 0; dir=$(cd "$dir" && pwd); cmd_down ;;
    run) dir=$(cd "$dir" && pwd); cmd_run "$@" ;;
    link) dir=$(cd "$dir" && pwd); cmd_link "$@" ;;
    slurm) dir=$(cd "$dir" && pwd); cmd_slurm "$@" ;;
    *) usage ;;
esac
