#!/usr/bin/env bash
# The figures of results/issue68-zero3-pipeline/ (--zero 3 in a pipeline: each stage one unit,
# sharded over its replicas, gathered once per step).
#  1. Equality: the tiny CNN, 3 steps on 4 ranks = 2 pipelines x 2 stages, every schedule at
#     --zero 3 against the same pipeline at --zero 0 (the largest relative difference of any
#     tensor, as tests/common's max_relative_difference).
#  2. Time and memory: ResNet-18 on Fashion-MNIST, the same 4 ranks, batch 16 per pipeline in 4
#     micro-batches (1F1B), --zero 0, 2 and 3 by turns, 5 measured steps after 3, 3 rounds;
#     medians of the step and exchange times, and what the largest rank holds between steps.
#     On a 2-core machine 4 ranks oversubscribe: times are relative, not absolute.
#   scripts/measure-zero3-pipeline.sh [rounds]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
R=results/issue68-zero3-pipeline
ROUNDS=${1:-3}
mkdir -p "$R/logs"
rm -rf "$R/runs.jsonl" "$R/resnet50"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
stamp() { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg), $(git rev-parse --short HEAD): $1"; }
pipeline=(--pipeline-stages 2 --partition params --threads 1 --no-eval --log-every 1000 --strategy ring)

"$HPC_TRAIN_BIN" data synth --samples 512 --test-samples 16 --shape 1x16x16 --classes 10 --out "$scratch/small.h5" > /dev/null
for schedule in gpipe 1f1b interleaved zb-h1 zb-v; do
  extra=(--schedule "$schedule" --micro-batches 4)
  [[ $schedule == interleaved ]] && extra+=(--virtual-stages 2)
  for zero in 0 3; do
    { stamp "$schedule zero $zero"
      mpirun -n 4 --oversubscribe --bind-to none "$HPC_TRAIN_BIN" --model tiny --data "$scratch/small.h5" --batch-size 16 --steps 3 --lr 0.01 \
        "${pipeline[@]}" "${extra[@]}" --zero "$zero" --results "$scratch/equal" --save-weights "$scratch/$schedule-$zero.safetensors"; } > "$R/logs/equal-$schedule-$zero.txt" 2>&1
  done
done
python3 - "$scratch" <<'PY' | tee "$R/equality.md"
import json, math, struct, sys, array
def load(path):
    b = open(path, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; header = json.loads(b[8:8 + n])
    return {k: array.array("f", b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]) for k, v in header.items() if k != "__metadata__"}
print("| schedule (tiny CNN, 3 steps, 2 pipelines x 2 stages, 4 micro-batches of 4) | largest relative difference, --zero 3 against --zero 0 |")
print("|---|---|")
for schedule in ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]:
    a, b = load(f"{sys.argv[1]}/{schedule}-0.safetensors"), load(f"{sys.argv[1]}/{schedule}-3.safetensors")
    assert a.keys() == b.keys()
    worst = max(math.sqrt(sum((x - y) ** 2 for x, y in zip(a[k], b[k]))) / max(math.sqrt(sum(x * x for x in a[k])), 1e-12) for k in a)
    print(f"| {schedule} | {worst:.3g} |")
PY

for round in $(seq 1 "$ROUNDS"); do
  for zero in 0 2 3; do
    name="zero$zero-$round"
    { stamp "$name"
      mpirun -n 4 --oversubscribe --bind-to none "$HPC_TRAIN_BIN" --model resnet18 --data datasets/fashion-mnist.h5 \
        --batch-size 16 --steps 8 --skip-steps 3 "${pipeline[@]}" --schedule 1f1b --micro-batches 4 --zero "$zero" --study "$name" --results "$R"; } > "$R/logs/$name.txt" 2>&1
  done
done
python3 - "$R" <<'PY' | tee "$R/table.md"
import sys, statistics
sys.path.insert(0, "scripts/lib")
import study_rounds
groups = study_rounds.by_study(sys.argv[1])
mib = lambda v: f"{v / 2**20:.1f}" if v is not None else "-"
print("| run (ResNet-18, 4 ranks: 2 pipelines x 2 stages, 1F1B, batch 16 per pipeline in 4 micro-batches) | rounds | step ms (median) | exchange ms, after the schedule and the gather before it (median) | parameters held between steps, MiB (largest rank) | gathered during a step, MiB | gradients held, MiB | optimizer state, MiB | peak RSS, MiB (largest rank, median) |")
print("|---|---|---|---|---|---|---|---|---|")
for name, rs in groups.items():
    med = lambda f: statistics.median(f(r) for r in rs)
    e = rs[0]["extra"]
    # Without ZeRO 3 a rank holds its stage whole: the record gives the stage's parameters over
    # both pipelines' worth of stages, so the largest stage is read from the sharded runs'.
    held = e.get("parameter_bytes_held")
    print(f"| {name} | {len(rs)} | {med(lambda r: r['step_ms']):.0f} | {med(lambda r: r['comm_ms']):.1f} | {mib(held) if held else 'whole stage'} | {mib(e.get('peak_gathered_parameter_bytes'))} | {mib(e['gradient_bytes'])} | {mib(e['optimizer_state_bytes'])} | {med(lambda r: r['peak_rss_mb']):.0f} |")
PY

# 3. What a rank's memory keeps after the run's last step: ResNet-50 (its stages above glibc's
#    32 MiB mmap threshold, so a freed buffer leaves the resident set), 2 stages, D = 2 (4 ranks)
#    and D = 4 (8 ranks), batch 8 per pipeline in 2 micro-batches, 3 steps, one run of each
#    stage; the record's byte counts and rss_end_mb. Between steps stage 3 holds (2 + K)/D of a
#    stage (K = 1: SGD's momentum) and stage 2 holds 1 + K/D: equal at D = 2, less from D = 3.
for ranks in 4 8; do
  for zero in 0 2 3; do
    name="resnet50-d$((ranks / 2))-zero$zero"
    { stamp "$name"
      mpirun -n "$ranks" --oversubscribe --bind-to none "$HPC_TRAIN_BIN" --model resnet50 --data datasets/fashion-mnist.h5 \
        --batch-size 8 --steps 3 --skip-steps 1 "${pipeline[@]}" --schedule 1f1b --micro-batches 2 --zero "$zero" --study "$name" --results "$R/resnet50"; } > "$R/logs/$name.txt" 2>&1
  done
done
python3 - "$R/resnet50" <<'PY' | tee "$R/resnet50.md"
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1] + "/runs.jsonl")]
mib = lambda v: f"{v / 2**20:.1f}"
print("| run (ResNet-50, 2 stages, D pipelines, 1F1B, batch 8 per pipeline in 2 micro-batches, 3 steps) | ranks | parameters held between steps, MiB (largest rank) | kept for the next gather, MiB | gradients held, MiB | optimizer state, MiB | resident after the last step, MiB (largest rank) | peak resident, MiB |")
print("|---|---|---|---|---|---|---|---|")
for r in runs:
    e = r["extra"]
    held = e.get("parameter_bytes_held")
    print(f"| {r['study']} | {r['ranks']} | {mib(held) if held else 'whole stage'} | {mib(e.get('fsdp_buffer_bytes', 0))} | {mib(e['gradient_bytes'])} | {mib(e['optimizer_state_bytes'])} | {r['rss_end_mb']:.0f} | {r['peak_rss_mb']:.0f} |")
PY
