#!/usr/bin/env bash
# The cost figures of results/issue68-channels-last/: ResNet-18 on 2 ranks at --zero 3 with and
# without --channels-last (prefetch off and on), and at --zero 0 with and without it, each twice,
# interleaved. What --channels-last costs stage 3 is its gathers' reorder (inside
# fsdp_gather_ms_per_step), the strided packing of the gradients (inside the step), and the
# reorder's scratch tensor (inside fsdp_buffer_bytes); what it costs or saves in the
# convolutions themselves is the --zero 0 pair's difference. About 3 minutes on 2 cores.
#   scripts/measure-zero3-channels-last.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
R=results/issue68-channels-last
mkdir -p "$R/logs"
rm -f "$R/runs.jsonl"
run() {
  local name=$1; shift
  { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg), $(git rev-parse --short HEAD): $name"
    mpirun -n 2 --oversubscribe --bind-to none "$HPC_TRAIN_BIN" --model resnet18 --data datasets/fashion-mnist.h5 \
      --batch-size 8 --steps 13 --skip-steps 3 --threads 1 --no-eval --log-every 1000 --strategy ring \
      --study "$name" --results "$R" "$@"; } > "$R/logs/$name.txt" 2>&1
}
for round in 1 2; do
  for cl in "" "--channels-last"; do
    tag=${cl:+-cl}
    run "zero3$tag-prefetch-off-$round" --zero 3 --overlap off $cl
    run "zero3$tag-prefetch-on-$round" --zero 3 --overlap on $cl
    run "zero0$tag-$round" --zero 0 --overlap on $cl
  done
done
python3 - "$R" <<'PY' | tee "$R/table.md"
import sys
sys.path.insert(0, "scripts/lib")
import study_rounds
groups = study_rounds.by_study(sys.argv[1])
print("| run (2 ranks x batch 8, ResNet-18, 1x28x28) | step ms | gather ms per step | scratch + gather/pack buffers MB | peak RSS MB (largest rank) |")
print("|---|---|---|---|---|")
for name, rs in groups.items():
    mean = lambda f: sum(f(r) for r in rs) / len(rs)
    e = lambda k: (lambda r: r["extra"].get(k, 0) or 0)
    gather = f"{mean(e('fsdp_gather_ms_per_step')):.1f}" if name.startswith("zero3") else "-"
    buffers = f"{mean(e('fsdp_buffer_bytes')) / 1e6:.1f}" if name.startswith("zero3") else "-"
    print(f"| {name} | {mean(lambda r: r['step_ms']):.0f} | {gather} | {buffers} | {mean(lambda r: r['peak_rss_mb']):.0f} |")
PY
