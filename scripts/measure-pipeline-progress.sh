#!/usr/bin/env bash
# Pipelines' progress thread (src/progress.rs), back to back against a build without it: two
# stages of ResNet-18 (1F1B, 8 micro-batches, batch 64, one thread per rank) on Fashion-MNIST
# (messages of 0.4 MiB) and on synthetic 3x32x32 images (1 MiB), with Open MPI's single-copy
# path between the ranks (CMA, where the kernel allows it) and without it
# (btl_vader_single_copy_mechanism=none, as on the 16-core GPU machine, whose kernel has no CMA).
# Each pair of runs by turns, --reps times. Writes $out/runs.jsonl, $out/logs/ and $out/table.md
# (images/s, the measured bubble against the replay of the run's own compute, what set-up's
# probe measured and whether the thread ran).
#   scripts/measure-pipeline-progress.sh --before BIN [--after BIN] [--out DIR] [--reps 2]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
source scripts/env.sh
out=results/pipeline/progress before="" after="$HPC_TRAIN_BIN" reps=2
while [ $# -gt 0 ]; do
    case "$1" in
        --before) before=$2; shift 2 ;;
        --after) after=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --reps) reps=$2; shift 2 ;;
        *) echo "measure-pipeline-progress.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[ -x "$before" ] || { echo "measure-pipeline-progress.sh: --before BIN (a build without the progress thread)" >&2; exit 2; }
mkdir -p "$out/logs"
rm -f "$out/runs.jsonl"
synthetic="$out/synthetic-3x32x32.h5"
[ -f "$synthetic" ] || "$after" data synth --samples 2048 --test-samples 0 --shape 3x32x32 --classes 10 --out "$synthetic" > /dev/null
for rep in $(seq 1 "$reps"); do
    for data in fashion synthetic; do
        file=datasets/fashion-mnist.h5; [ "$data" = synthetic ] && file=$synthetic
        for copy in cma none; do
            for build in before after; do
                bin=$before; [ "$build" = after ] && bin=$after
                name="$data-$copy-$build-r$rep"
                OMPI_MCA_btl_vader_single_copy_mechanism=$copy hpc_train_mpirun 2 "$bin" --model resnet18 --data "$file" \
                    --batch-size 64 --steps 12 --skip-steps 4 --threads 1 --no-eval --pipeline-stages 2 --micro-batches 8 \
                    --schedule 1f1b --results "$out" --study "$data-$copy-$build" > "$out/logs/$name.log" 2>&1
            done
        done
    done
done
python3 - "$out" "$(nproc)" "$(uname -n)" "$(date -u +%F)" "$reps" <<'EOF'
import json, statistics, sys
out, cores, host, day, reps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
runs = {}
for line in open(f"{out}/runs.jsonl"):
    r = json.loads(line)
    runs.setdefault(r["study"], []).append(r)
mean = lambda v: sum(v) / len(v)
lines = [f"Two ResNet-18 stages, 1F1B, M = 8, batch 64, one thread per rank, Open MPI 4.1.4; {host} ({cores} cores), {day}; median of {reps} runs each, by turns.", "",
         "| data (message) | single copy | build | images/s | bubble (mean of stages) | replay | probe: ms to arrive while the sender computes 20 ms | progress thread |",
         "|---|---|---|---:|---:|---:|---:|---|"]
for data in ("fashion", "synthetic"):
    for copy in ("cma", "none"):
        for build in ("before", "after"):
            rs = runs.get(f"{data}-{copy}-{build}", [])
            if not rs:
                continue
            p = [r["pipeline"] for r in rs]
            probe = f"{statistics.median(x['stall_probe_ms'] for x in p):.1f} ({p[0]['stall_probe_bytes'] / 2**20:.2f} MiB)" if "stall_probe_ms" in p[0] else "-"
            thread = ("yes" if p[0]["progress_thread"] else "no") if "progress_thread" in p[0] else "(none built)"
            lines.append(f"| {data} | {'CMA' if copy == 'cma' else 'none'} | {build} | {statistics.median(r['images_per_sec'] for r in rs):.1f} | "
                         f"{100 * statistics.median(mean(x['bubble']) for x in p):.1f}% | {100 * statistics.median(mean(x['replay_bubble']) for x in p):.1f}% | {probe} | {thread} |")
open(f"{out}/table.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
