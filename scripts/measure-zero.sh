#!/usr/bin/env bash
# The ZeRO figures of results/zero/ (issue 18): ResNet-50 on 4 ranks with --zero 0, 1 and 2,
# overlap off and on, twice each in turns (the machine drifts): the optimizer state and
# gradients each rank holds (runs.jsonl), its resident memory after warm-up and at the end, and
# the step time against the plain ring (--zero 0). About 15 minutes on 2 cores; run it on an
# otherwise idle machine.
#   scripts/measure-zero.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
B="$HPC_TRAIN_BIN"
R=results/zero
mkdir -p "$R/logs"
stamp() { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, $(git rev-parse --short HEAD): $*"; }

for round in 1 2; do
  for overlap in off on; do
    for zero in 0 1 2; do
      { stamp "round $round: ResNet-50, fashion-mnist 1x28x28, 4 ranks x batch 4, ring --zero $zero --overlap $overlap"
        mpirun -n 4 --oversubscribe --bind-to none "$B" --strategy ring --zero "$zero" --overlap "$overlap" \
            --model resnet50 --data datasets/fashion-mnist.h5 --batch-size 4 --steps 13 --skip-steps 3 \
            --threads 1 --no-eval --log-every 1000 --study zero-resnet50 --results "$R"; } \
        2>&1 | tee "$R/logs/round-$round-zero-$zero-overlap-$overlap.txt"
    done
  done
done

# One table from the records: every run, then the mean of the two rounds against --zero 0.
python3 - "$R/runs.jsonl" <<'EOF' | tee "$R/table.md"
import json, sys, statistics
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
runs = [r for r in runs if r.get("study") == "zero-resnet50"]
mb = lambda b: b / 2**20
print("| overlap | zero | optimizer state MB/rank | gradients MB/rank | RSS after warm-up MB | RSS at end MB | peak RSS MB | step ms | commit |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
for r in runs:
    e = r["extra"]
    print(f"| {'on' if e['overlap'] else 'off'} | {e['zero']} | {mb(e['optimizer_state_bytes']):.1f} | {mb(e['gradient_bytes']):.1f} | "
          f"{r['rss_warmup_mb']:.0f} | {r['rss_end_mb']:.0f} | {r['peak_rss_mb']:.0f} | {r['step_ms']:.0f} | {r['git_commit']} |")
print()
print("Means of the rounds, against --zero 0 with the same overlap setting:")
print()
print("| overlap | zero | optimizer state MB/rank | x of zero 0 | RSS after warm-up MB | saved MB | RSS at end MB | saved MB | step ms | x of zero 0 |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for overlap in (False, True):
    def mean(zero, f):
        xs = [f(r) for r in runs if r["extra"]["overlap"] == overlap and r["extra"]["zero"] == zero]
        return statistics.mean(xs) if xs else float("nan")
    base = {k: mean(0, f) for k, f in [("state", lambda r: r["extra"]["optimizer_state_bytes"]), ("warm", lambda r: r["rss_warmup_mb"]), ("end", lambda r: r["rss_end_mb"]), ("step", lambda r: r["step_ms"])]}
    for zero in (0, 1, 2):
        state, warm, end, step = (mean(zero, f) for f in [lambda r: r["extra"]["optimizer_state_bytes"], lambda r: r["rss_warmup_mb"], lambda r: r["rss_end_mb"], lambda r: r["step_ms"]])
        print(f"| {'on' if overlap else 'off'} | {zero} | {mb(state):.1f} | {state / base['state']:.3f} | {warm:.0f} | {base['warm'] - warm:.0f} | {end:.0f} | {base['end'] - end:.0f} | {step:.0f} | {step / base['step']:.2f} |")
EOF
