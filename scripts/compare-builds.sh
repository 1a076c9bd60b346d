#!/usr/bin/env bash
# Two builds of hpc-train side by side, for a change meant to keep behaviour (a refactor): the
# same short training runs with each (every strategy and ZeRO stage, every pipeline schedule, a
# tensor-parallel layout), compared byte for byte by their saved weights; the cost model's fit
# and projections, compared by what they print and write; then the step's speed and the same
# bench with each, alternating. Writes OUT/README.md (the verdicts and busbw side by side, machine, date,
# commits), OUT/logs/ and OUT/weights/ (removed after the comparison). Run it on an otherwise
# idle machine; exits 1 if any weights or outputs differ. NO_BENCH=1 leaves the speed and the bench out (a
# check of the weights alone, on a machine too busy for its figures to mean anything).
#   scripts/compare-builds.sh BEFORE_BINARY AFTER_BINARY OUT_DIR
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
[ $# -eq 3 ] || { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
BEFORE=$1 AFTER=$2 OUT=$3
mkdir -p "$OUT/logs" "$OUT/weights"
DATA=datasets/fashion-mnist.h5
mpi() { mpirun -n 2 --oversubscribe "$@"; }
version() { "$1" --version | head -n 1; }
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
# Each row's options; rows that name no --model train the tiny CNN (TINY). The Horovod-style rows
# negotiate every cycle (no cache) or evict from a cache of 2, with the timeline's bookkeeping
# on (its file is timed, so not compared). fp16 rows with a loss scale of 2^30 overflow and skip
# their first steps, then train: the loss scaler's both paths. The pipeline rows are
# one pipeline of 2 stages cut by parameters (--partition time would cut by measured times, which
# differ from run to run); the tensor-parallel rows split vit-tiny's heads and MLP over both ranks.
TINY=(--model tiny --batch-size 32 --steps 20)
configs=("--strategy ring" "--strategy rhd" "--strategy auto" "--strategy allreduce" "--strategy horovod" "--strategy ps"
    "--strategy ring --zero 1" "--strategy ring --zero 2" "--strategy ring --zero 3"
    "--strategy ring --overlap on --bucket-mb 1" "--strategy allreduce --overlap on --bucket-mb 1"
    "--strategy ring --overlap on --bucket-mb 0.001" "--strategy horovod --overlap on --bucket-mb 0.001"
    "--strategy ring --zero 2 --overlap on --bucket-mb 0.001" "--strategy ring --zero 3 --overlap on --bucket-mb 0.001"
    "--strategy horovod --cache-capacity 0 --fusion-threshold-mib 0"
    "--strategy horovod --cache-capacity 2 --overlap on --bucket-mb 0.001 --timeline /dev/null"
    "--pipeline-stages 2 --micro-batches 4 --schedule gpipe --partition params"
    "--pipeline-stages 2 --micro-batches 4 --schedule 1f1b --partition params"
    "--pipeline-stages 2 --micro-batches 4 --schedule interleaved --virtual-stages 2 --partition params"
    "--pipeline-stages 2 --micro-batches 4 --schedule zb-h1 --partition params"
    "--pipeline-stages 2 --micro-batches 4 --schedule zb-v --partition params"
    "--pipeline-stages 2 --micro-batches 2 --schedule 1f1b --partition 1"
    "--model vit-tiny --batch-size 16 --steps 6 --tensor-parallel 2"
    "--model vit-tiny --batch-size 16 --steps 6 --tensor-parallel 2 --tp-allreduce ring"
    "--strategy ring --zero 3 --optimizer lars" "--strategy ring --zero 1 --overlap on --bucket-mb 0.001 --optimizer adamw"
    "--precision fp16" "--precision fp16 --loss-scale 1073741824" "--precision fp16 --overlap on --bucket-mb 0.001" "--precision bf16 --strategy ring --zero 2"
    "--precision fp16 --loss-scale 1073741824 --pipeline-stages 2 --micro-batches 4 --schedule 1f1b --partition params"
    "--model vit-tiny --batch-size 16 --steps 6 --tensor-parallel 2 --precision fp16")
rows=()
differ=0
for i in "${!configs[@]}"; do
    cfg=${configs[$i]} failed=()
    for side in before after; do
        bin=$BEFORE; [ $side = after ] && bin=$AFTER
        model=("${TINY[@]}"); [[ " $cfg " == *" --model "* ]] && model=()
        # shellcheck disable=SC2086
        mpi "$bin" "${model[@]}" $cfg --data "$DATA" --threads 1 --no-eval \
            --results "$OUT/weights/$side-runs" --save-weights "$OUT/weights/$i-$side.safetensors" > "$OUT/logs/train-$i-$side.txt" 2>&1 ||
            failed+=("$side")
    done
    # A run that fails is its own verdict (its log says why), not a difference in the weights.
    if [ ${#failed[@]} -gt 0 ]; then verdict="**${failed[*]} failed**"; differ=1
    elif cmp -s "$OUT/weights/$i-before.safetensors" "$OUT/weights/$i-after.safetensors"; then verdict="identical"; else verdict="**differ**"; differ=1; fi
    rows+=("| \`$cfg\` | $verdict |")
done
# The cost model's fit and the projection (no MPI): what each prints, with the side's own
# output path and the log's clock masked, and the model file that fit writes, byte for byte.
# The projection's run records are not compared: they carry the date and the build's commit.
BENCH_ROWS=results/strategies/bench.jsonl
cost_configs=("model fit --bench $BENCH_ROWS"
    "project --cluster jobs/clusters/local-cluster.toml --compute-ms 50 --ranks 2,8 --validate-bench $BENCH_ROWS"
    "project --cluster jobs/clusters/dgx-a100-hdr.toml --compute-ms 50 --ranks 8,64,512 --pipeline-stages 2,4"
    "project --cluster jobs/clusters/h100-ndr.toml --plan --transformer gpt3-175b --gpus 1024")
cost_rows=()
for i in "${!cost_configs[@]}"; do
    cfg=${cost_configs[$i]} failed=()
    for side in before after; do
        bin=$BEFORE; [ $side = after ] && bin=$AFTER
        out=$OUT/weights/cost-$i-$side
        # shellcheck disable=SC2086
        "$bin" $cfg --out "$out" > "$OUT/logs/cost-$i-$side.txt" 2>&1 || failed+=("$side")
        sed -e "s|$out|OUT|g" -e 's/^\[[0-9:]* rank/[rank/' "$OUT/logs/cost-$i-$side.txt" > "$OUT/weights/cost-$i-$side.printed"
    done
    if [ ${#failed[@]} -gt 0 ]; then verdict="**${failed[*]} failed**"; differ=1
    elif cmp -s "$OUT/weights/cost-$i-before.printed" "$OUT/weights/cost-$i-after.printed" &&
        { [ ! -f "$OUT/weights/cost-$i-before" ] || cmp -s "$OUT/weights/cost-$i-before" "$OUT/weights/cost-$i-after"; }; then verdict="identical"
    else verdict="**differ**"; differ=1; fi
    cost_rows+=("| \`$cfg\` | $verdict |")
done
B_ARGS=(bench --strategies ring,allreduce,horovod --min-bytes 1M --max-bytes 64M --factor 4 --iters 10 --warmup 3 --rounds 3)
rounds=(1 2); [ "${NO_BENCH:-0}" = 1 ] && rounds=()
for round in "${rounds[@]}"; do
    mpi "$BEFORE" "${B_ARGS[@]}" --results "$OUT/weights/before-bench" > "$OUT/logs/bench-before-$round.txt" 2>&1
    mpi "$AFTER" "${B_ARGS[@]}" --results "$OUT/weights/after-bench" > "$OUT/logs/bench-after-$round.txt" 2>&1
done
# The step's speed: the same short training runs with each build, alternating, three rounds;
# images/s from each run's record (the steps after the skipped ones), the median per side.
SPEED_CONFIGS=("--strategy ring" "--strategy ring --overlap on --bucket-mib 0.001" "--strategy ring --zero 3"
    "--pipeline-stages 2 --micro-batches 4 --schedule 1f1b --partition params" "--precision fp16")
speed_rows=()
[ "${NO_BENCH:-0}" = 1 ] && SPEED_CONFIGS=()
for i in "${!SPEED_CONFIGS[@]}"; do
    cfg=${SPEED_CONFIGS[$i]}
    for round in 1 2 3; do
        for side in before after; do
            bin=$BEFORE; [ $side = after ] && bin=$AFTER
            # shellcheck disable=SC2086
            mpi "$bin" --model tiny --batch-size 32 --steps 60 --skip-steps 10 $cfg --data "$DATA" --threads 1 --no-eval \
                --results "$OUT/weights/speed-$i-$side" > "$OUT/logs/speed-$i-$side-$round.txt" 2>&1
        done
    done
    medians=$(python3 - "$OUT/weights/speed-$i-before/runs.jsonl" "$OUT/weights/speed-$i-after/runs.jsonl" <<'PY'
import json, statistics, sys
m = [statistics.median(json.loads(line)["images_per_sec"] for line in open(path) if line.strip()) for path in sys.argv[1:]]
print(f"{m[0]:.0f} | {m[1]:.0f} | {m[1] / m[0]:.3f}")
PY
)
    speed_rows+=("| \`$cfg\` | $medians |")
done
rm -rf "$OUT/weights"
busbw() { cat "$OUT"/logs/bench-"$1"-*.txt 2>/dev/null | awk -v s="$2" -v b="$3" '$1 !~ /^#/ && NF == 9 && $4 == s && $1 == b { print $8 }' | sort -g |
    awk '{ v[NR] = $1 } END { if (NR == 0) print "-"; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
{
    echo "# Two builds side by side"
    echo
    echo "Made by \`scripts/compare-builds.sh\`, started $started on $(hostname) ($(nproc) cores, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)), $(mpirun --version 2>&1 | head -n 1), 2 ranks."
    echo
    echo "- before: \`$(version "$BEFORE")\`"
    echo "- after: \`$(version "$AFTER")\`"
    echo
    echo "Training on Fashion-MNIST, 2 ranks, 1 thread per rank: the tiny CNN (\`${TINY[*]}\`) unless the row names vit-tiny; the saved weights compared byte for byte (logs: \`logs/train-*\`)."
    echo
    echo "| run | weights |"
    echo "|---|---|"
    printf '%s\n' "${rows[@]}"
    echo
    echo "The cost model's fit and the projection: what each prints (its output path and the log's clock masked) and the model file fit writes, compared byte for byte (logs: \`logs/cost-*\`)."
    echo
    echo "| run | output |"
    echo "|---|---|"
    printf '%s\n' "${cost_rows[@]}"
    echo
    echo "Step speed: the tiny CNN, 2 ranks x batch 32, 1 thread each, 60 steps of which the first 10 are skipped, each build three times, alternating; images/s, the median of the three (logs: \`logs/speed-*\`)."
    echo
    echo "| run | before | after | after / before |"
    echo "|---|---:|---:|---:|"
    printf '%s\n' "${speed_rows[@]}"
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
