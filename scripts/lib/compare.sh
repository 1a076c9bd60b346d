# Sourced by the PyTorch comparison scripts (compare-pytorch.sh, compare-pytorch-layouts.sh): how
# busy the machine is just before a measurement and a wait for it to be quiet, the synthetic
# datasets they train on, and hpc-train's record of a run tagged for their runs.jsonl.

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

# synth_dataset BIN DIR SHAPE: the path of a 2048-sample synthetic set of SHAPE (CxHxW, 10
# classes) in DIR, made by hpc-train BIN's `data synth` when DIR has no readable one.
synth_dataset() {
    local bin=$1 dir=$2 shape=$3
    local f="$dir/synth-$shape-n2048.h5"
    if ! "$bin" data info "$f" >/dev/null 2>&1; then
        mkdir -p "$dir"
        "$bin" data synth --samples 2048 --test-samples 16 --shape "$shape" --classes 10 --out "$f" --force >&2
    fi
    echo "$f"
}

# tagged_record PYTHON RUNS_JSONL TAG_JSON STUDY: prints the last record of hpc-train's
# RUNS_JSONL as a line of a comparison's runs.jsonl: marked `"side": "hpc-train"`, with TAG_JSON's
# fields (row, label, repetition, ...). Fails when that record is not STUDY's run, so that a run
# that wrote no record cannot be counted with another's figures.
tagged_record() {
    "$1" - "$(tail -n 1 "$2")" "$3" "$4" <<'EOF'
import json, sys
r = json.loads(sys.argv[1])
if r.get("study") != sys.argv[3]:
    sys.exit(f"the last record of runs.jsonl is not this run's ({r.get('study')} != {sys.argv[3]})")
print(json.dumps({"side": "hpc-train", **json.loads(sys.argv[2]), **r}))
EOF
}
