#!/usr/bin/env bash
# Issue 49: the sharded checkpoint (this tree: every rank writes its part file) against the whole
# checkpoint of hpc-train before training wrote sharded ones (format 3: rank 0 writes weights and
# state as two files; under --zero 3 every unit and state slot gathered first), in the same run:
# ViT-B/16 with AdamW (1.03 GB a checkpoint), 1 step, at 1, 2 and 4 ranks and --zero 3 at 2 and 4.
#
# The old binary records no checkpoint time, so both are timed alike: the wall time of a run
# that checkpoints after its one step, less that of the same run without --checkpoint-dir, the
# median of --reps runs each (the difference also holds rank 0's dataset fingerprint, the same
# for both). This tree's own record (checkpoint_write_s, the write alone) is printed beside it.
#
# The whole-checkpoint binary, built once from the commit before 355705e into the same target
# folder (only hpc-train itself recompiles), then this tree's rebuilt:
#   git worktree add /tmp/hpc-train-format3 355705e^
#   (source scripts/env.sh && cd /tmp/hpc-train-format3 && cargo build --release --target-dir "$HPC_TRAIN_ROOT/target")
#   cp target/release/hpc-train /tmp/hpc-train-format3.bin && cargo build --release
#
#   scripts/measure-checkpoint-whole.sh --whole-binary /tmp/hpc-train-format3.bin [--sharded-binary B] [--out DIR] [--reps N]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
out="results/beyond-one-rank/checkpoint-whole" model=vit-b16 reps=3 whole="" sharded=target/release/hpc-train
while [ $# -gt 0 ]; do
    case "$1" in
        --whole-binary) whole=$2; shift 2 ;;
        --sharded-binary) sharded=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --reps) reps=$2; shift 2 ;;
        --model) model=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
[ -x "$whole" ] || { echo "--whole-binary: an hpc-train built before sharded checkpoints (see the header)" >&2; exit 2; }
mkdir -p "$out/logs"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/hpc-ckpt-whole.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
data="$scratch/vit224.h5"
"$sharded" data synth --samples 16 --test-samples 0 --shape 3x224x224 --classes 10 --out "$data" >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
disk_write=$(dd if=/dev/zero of="$scratch/dd.bin" bs=16M count=64 oflag=direct 2>&1 | awk '/copied/ {print $(NF-1), $NF}')
rm -f "$scratch/dd.bin"

# Seconds of one run (wall), its log kept.
timed_run() {
    local log=$1; shift
    local start end
    start=$(date +%s.%N)
    "$@" > "$log" 2>&1 || { echo "failed: $* (see $log)" >&2; exit 1; }
    end=$(date +%s.%N)
    python3 -c "print(f'{$end - $start:.3f}')"
}
median() { python3 -c 'import statistics, sys; print(f"{statistics.median(float(x) for x in sys.argv[1:]):.2f}")' "$@"; }

table="$out/table.md"
{
    printf '%s with AdamW, batch 2 per rank, 3x224x224, 1 step; %s, %s, %s cores; checkpoints in %s (dd O_DIRECT write %s); median of %s runs\n\n' \
        "$model" "$(uname -n)" "$(date -u +%F)" "$(nproc)" "$(df -h "$scratch" | awk 'NR==2 {print $1}')" "$disk_write" "$reps"
    printf '| layout | ranks | whole (format 3): run with - without checkpoint, s | sharded: run with - without, s | sharded: recorded write s | whole / sharded |\n'
    printf '|---|---:|---:|---:|---:|---:|\n'
} > "$table"
for point in "1 plain" "2 plain" "4 plain" "2 --zero 3" "4 --zero 3"; do
    ranks=${point%% *} layout=${point#* }
    [ "$layout" = plain ] && options=() || read -r -a options <<< "$layout"
    name="$ranks-${layout// /}"
    declare -A cost=()
    recorded=()
    for kind in whole sharded; do
        bin=$sharded; [ "$kind" = whole ] && bin=$whole
        with=() without=()
        for rep in $(seq "$reps"); do
            common=(--model "$model" --data "$data" --batch-size 2 --no-eval --threads 1 --optimizer adamw --strategy ring --steps 1 "${options[@]}")
            ckpt="$scratch/ckpt-$kind-$name-$rep" results="$scratch/runs-$kind-$name-$rep"
            with+=("$(timed_run "$out/logs/$kind-$name-$rep-with.txt" mpirun -n "$ranks" --oversubscribe "$bin" "${common[@]}" --results "$results" --checkpoint-dir "$ckpt")")
            without+=("$(timed_run "$out/logs/$kind-$name-$rep-without.txt" mpirun -n "$ranks" --oversubscribe "$bin" "${common[@]}" --results "$results-none")")
            [ "$kind" = sharded ] && recorded+=("$(python3 -c 'import json, sys; print(json.loads(open(sys.argv[1]).readlines()[-1])["extra"]["checkpoint_write_s"])' "$results/runs.jsonl")")
            rm -rf "$ckpt"
        done
        cost[$kind]=$(python3 -c 'import sys; print(f"{float(sys.argv[1]) - float(sys.argv[2]):.2f}")' "$(median "${with[@]}")" "$(median "${without[@]}")")
        echo "$kind $name: with ${with[*]}; without ${without[*]}" >> "$out/runs.txt"
    done
    ratio=$(python3 -c 'import sys; a, b = map(float, sys.argv[1:]); print(f"{a / b:.2f}" if b > 0 else "-")' "${cost[whole]}" "${cost[sharded]}")
    printf '| %s | %s | %s | %s | %s | %s |\n' "$layout" "$ranks" "${cost[whole]}" "${cost[sharded]}" "$(median "${recorded[@]}")" "$ratio" >> "$table"
    unset cost
done
cat "$table"
