#!/usr/bin/env bash
# The figures of results/issue68-overlap-pipeline/: ResNet-18 on Fashion-MNIST, 4 ranks = 2
# pipelines x 2 stages, batch 16 per pipeline in 4 micro-batches, 1F1B and interleaved (2 chunks
# per stage), 5 measured steps after 3, --overlap off and on by turns, 3 rounds; the step time, the exchange's exposed
# part (the record's comm_ms) and with overlap its whole time (exchange_total_ms), medians over
# the rounds. On a 2-core machine 4 ranks oversubscribe: the exchange's thread and backward share
# the cores with the other stage's ranks.
#   scripts/measure-overlap-pipeline.sh [rounds]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
R=results/issue68-overlap-pipeline
ROUNDS=${1:-3}
mkdir -p "$R/logs"
rm -f "$R/runs.jsonl"
run() {
  local name=$1; shift
  { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg), $(git rev-parse --short HEAD): $name"
    mpirun -n 4 --oversubscribe --bind-to none "$HPC_TRAIN_BIN" --model resnet18 --data datasets/fashion-mnist.h5 \
      --batch-size 16 --steps 8 --skip-steps 3 --threads 1 --no-eval --log-every 1000 --strategy ring \
      --pipeline-stages 2 --micro-batches 4 --partition params --study "$name" --results "$R" "$@"; } > "$R/logs/$name.txt" 2>&1
}
for round in $(seq 1 "$ROUNDS"); do
  for schedule in 1f1b interleaved; do
    extra=(--schedule "$schedule")
    [[ $schedule == interleaved ]] && extra+=(--virtual-stages 2)
    for mode in off on; do
      run "$schedule-$mode-$round" "${extra[@]}" --overlap "$mode"
    done
  done
done
python3 - "$R" <<'PY' | tee "$R/table.md"
import sys, statistics
sys.path.insert(0, "scripts/lib")
import study_rounds
groups = study_rounds.by_study(sys.argv[1])
print("| run (4 ranks: 2 pipelines x 2 stages, batch 16 per pipeline, 4 micro-batches, ResNet-18, 1x28x28) | rounds | step ms (median) | exposed exchange ms (comm_ms, median) | exchange ms in all (median) | hidden share (median) | overlap buckets (rank 0) |")
print("|---|---|---|---|---|---|---|")
for name, rs in groups.items():
    med = lambda f: statistics.median(f(r) for r in rs)
    on = rs[0]["extra"]["overlap"]
    total = med(lambda r: r["extra"]["exchange_total_ms"]) if on else med(lambda r: r["comm_ms"])
    hidden = f'{med(lambda r: r["extra"]["exchange_hidden_share"]):.2f}' if on else "0 (after the schedule)"
    buckets = rs[0]["extra"].get("overlap_buckets", "-")
    print(f"| {name} | {len(rs)} | {med(lambda r: r['step_ms']):.0f} | {med(lambda r: r['comm_ms']):.1f} | {total:.1f} | {hidden} | {buckets} |")
PY
