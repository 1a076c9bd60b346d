# Sourced by the comparison scripts (compare-pytorch.sh, compare-pytorch-layouts.sh): how busy
# the machine is just before a measurement, and a wait for it to be quiet.

# cpu_busy: the percentage of the machine's CPU time that was busy over the last half second
# (/proc/stat), which is what others (a build, tests) take just before a measurement.
cpu_busy() {
    local a b idle total=0 i
    read -r -a a < /proc/stat
    sleep 0.5
    read -r -a b < /proc/stat
    idle=$(( (b[4] + b[5]) - (a[4] + a[5]) ))
    for i in 1 2 3 4 5 6 7 8; do total=$(( total + b[i] - a[i] )); done
    echo $(( total > 0 ? 100 * (total - idle) / total : 0 ))
}

# wait_idle MAX_SECONDS: waits at most MAX_SECONDS for the machine to be under 25% busy, and
# prints how busy it was when the measurement started.
wait_idle() {
    local limit=$1 waited=0 busy
    busy=$(cpu_busy)
    while [ "$busy" -ge 25 ] && [ "$waited" -lt "$limit" ]; do
        sleep 2; waited=$((waited + 3))
        busy=$(cpu_busy)
    done
    echo "$busy"
}
