#!/usr/bin/env bash
# Two builds of hpc-train side by side, for a change meant to keep behaviour (a refactor): the
# same short training runs with each, every strategy and ZeRO stage, compared byte for byte by
# their saved weights, then the same bench with each, alternating. Writes OUT/README.md (the
# verdicts and busbw side by side, machine, date, commits), OUT/logs/ and OUT/weights/ (removed
# after the comparison). Run it on an otherwise idle machine; exits 1 if any weights differ.
#   scripts/compare-builds.sh BEFORE_BINARY AFTER_BINARY OUT_DIR
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
[ $# -eq 3 ] || { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
BEFORE=$1 AFTER=$2 OUT=$3
mkdir -p "$OUT/logs" "$OUT/weights"
DATA=datasets/fashion-mnist.h5
mpi() { mpirun -n 2 --oversubscribe "$@"; }
version() { "$1" --version | head -n 1; }
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
configs=("ring" "rhd" "auto" "allreduce" "horovod" "ps" "ring --zero 1" "ring --zero 2" "ring --overlap on --bucket-mb 1" "allreduce --overlap on --bucket-mb 1" "ring --overlap on --bucket-mb 0.001" "horovod --overlap on --bucket-mb 0.001" "ring --zero 2 --overlap on --bucket-mb 0.001")
rows=()
differ=0
for i in "${!configs[@]}"; do
    cfg=${configs[$i]}
    for side in before after; do
        bin=$BEFORE; [ $side = after ] && bin=$AFTER
        # shellcheck disable=SC2086
        mpi "$bin" --strategy $cfg --model tiny --data "$DATA" --batch-size 32 --steps 20 --threads 1 --no-eval \
            --results "$OUT/weights/$side-runs" --save-weights "$OUT/weights/$i-$side.safetensors" > "$OUT/logs/train-$i-$side.txt" 2>&1
    done
    if cmp -s "$OUT/weights/$i-before.safetensors" "$OUT/weights/$i-after.safetensors"; then verdict="identical"; else verdict="**differ**"; differ=1; fi
    rows+=("| \`--strategy $cfg\` | $verdict |")
done
B_ARGS=(bench --strategies ring,allreduce,horovod --min-bytes 1M --max-bytes 64M --factor 4 --iters 10 --warmup 3 --rounds 3)
for round in 1 2; do
    mpi "$BEFORE" "${B_ARGS[@]}" --results "$OUT/weights/before-bench" > "$OUT/logs/bench-before-$round.txt" 2>&1
    mpi "$AFTER" "${B_ARGS[@]}" --results "$OUT/weights/after-bench" > "$OUT/logs/bench-after-$round.txt" 2>&1
done
rm -rf "$OUT/weights"
busbw() { cat "$OUT"/logs/bench-"$1"-*.txt | awk -v s="$2" -v b="$3" '$1 !~ /^#/ && NF == 9 && $4 == s && $1 == b { print $8 }' | sort -g |
    awk '{ v[NR] = $1 } END { if (NR == 0) print "-"; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
{
    echo "# Two builds side by side"
    echo
    echo "Made by \`scripts/compare-builds.sh\`, started $started on $(hostname) ($(nproc) cores, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)), $(mpirun --version 2>&1 | head -n 1), 2 ranks."
    echo
    echo "- before: \`$(version "$BEFORE")\`"
    echo "- after: \`$(version "$AFTER")\`"
    echo
    echo "Training: the tiny CNN on Fashion-MNIST, 2 ranks, batch 32 per rank, 20 steps, 1 thread per rank; the saved weights compared byte for byte (logs: \`logs/train-*\`)."
    echo
    echo "| run | weights |"
    echo "|---|---|"
    printf '%s\n' "${rows[@]}"
    echo
    echo "Bench: \`${B_ARGS[*]}\`, each build twice, alternating; busbw GB/s, the median of the two runs (logs: \`logs/bench-*\`)."
    echo
    echo "| size | ring before | ring after | allreduce before | allreduce after | horovod before | horovod after |"
    echo "|---:|---:|---:|---:|---:|---:|---:|"
    for b in 1048576 4194304 16777216 67108864; do
        echo "| $((b >> 20)) MiB | $(busbw before ring $b) | $(busbw after ring $b) | $(busbw before allreduce $b) | $(busbw after allreduce $b) | $(busbw before horovod $b) | $(busbw after horovod $b) |"
    done
} > "$OUT/README.md"
cat "$OUT/README.md"
exit $differ
