#!/usr/bin/env bash
# Issue 50: two builds of hpc-train under ZB-V, back to back in one script: --before and --after
# take turns (the order alternating from one repetition to the next) at P stages (default 2, one
# rank per core of the 2-core VM) for M = 4, 8, 16 micro-batches, ResNet-18 and vit-tiny on
# Fashion-MNIST, a batch of 64 per pipeline, one intra-op thread per rank, --partition time (the
# default). Per run: the cut (the record's chunk_blocks), each stage's compute per step, the
# measured bubble beside the replay's, images/s. Used for ZB-V's cut (v-cut/, via
# scripts/measure-zb-v-cut.sh) and for the turn of the V without a message (v-turn/).
#
# Every run appends its record to $out/runs.jsonl and its log to $out/logs/; $out/table.md is
# made from runs.jsonl by the Python at the end; --title is its first line's subject.
#   scripts/measure-zb-v-builds.sh --before PATH --after PATH --out DIR --title TEXT [--stages 2] [--steps 14] [--reps 2] [--models "resnet18 vit-tiny"]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
out="" title="" steps=14 stages=2 reps=2 models="resnet18 vit-tiny" before="" after=""
while [ $# -gt 0 ]; do
    case "$1" in
        --before) before="$2"; shift 2 ;;
        --after) after="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --title) title="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --stages) stages="$2"; shift 2 ;;
        --reps) reps="$2"; shift 2 ;;
        --models) models="$2"; shift 2 ;;
        *) echo "measure-zb-v-builds.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[ -x "$before" ] && [ -x "$after" ] && [ -n "$out" ] && [ -n "$title" ] || { echo "measure-zb-v-builds.sh: --before PATH --after PATH --out DIR --title TEXT are needed" >&2; exit 2; }
mkdir -p "$out/logs"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/hpc-train-zbv.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
cp "$before" "$scratch/before"
cp "$after" "$scratch/after"
run() {
    local build=$1 model=$2 m=$3 rep=$4
    local name="$model-p$stages-zb-v-m$m-$build-r$rep"
    echo "==> $name"
    hpc_train_mpirun "$stages" "$scratch/$build" --model "$model" --data datasets/fashion-mnist.h5 --batch-size 64 \
        --steps "$steps" --skip-steps 4 --threads 1 --no-eval --pipeline-stages "$stages" --schedule zb-v \
        --micro-batches "$m" --results "$out" --study "vcut-$name" >"$out/logs/$name.txt" 2>&1 \
        || { echo "    failed: see $out/logs/$name.txt" >&2; return 1; }
    grep -E "chunk [0-9]+ on stage|images/s" "$out/logs/$name.txt" | sed 's/^.*INFO\] *//; s/^/    /' || true
}
for rep in $(seq "$reps"); do
    for model in $models; do
        for m in 4 8 16; do
            if [ $((rep % 2)) -eq 1 ]; then order="before after"; else order="after before"; fi
            for build in $order; do
                run "$build" "$model" "$m" "$rep"
            done
        done
    done
done
python3 - "$out" "$stages" "$models" "$reps" "$(nproc)" "$(uname -n)" "$(date -u +%F)" "$title" <<'EOF'
import json, re, statistics, sys
out, stages, models, reps, cores, host, day, title = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7], sys.argv[8]
runs = {}
for line in open(f"{out}/runs.jsonl"):
    if line.strip():
        r = json.loads(line)
        runs[r.get("study", "")] = r
def cut(record):
    return " / ".join(c.split(" ")[0] for c in record["pipeline"]["chunk_blocks"])
mean = lambda v: sum(v) / len(v)
lines = [f"{title}, P = {stages} ({stages} ranks, {cores} cores), "
         f"Fashion-MNIST, batch 64 per step, one thread per rank, --partition time, {reps} run(s) per row in turns; {host}, {day}.", "",
         "| model | M | build | blocks per chunk (0..2P-1) | compute ms per step, per stage | bubble per stage | mean bubble | replay | images/s (median) |",
         "|---|---:|---|---|---:|---:|---:|---:|---:|"]
for model in models:
    for m in (4, 8, 16):
        for build in ("before", "after"):
            names = [f"{model}-p{stages}-zb-v-m{m}-{build}-r{rep}" for rep in range(1, reps + 1)]
            got = [(n, runs.get(f"vcut-{n}")) for n in names]
            got = [(n, r) for n, r in got if r]
            if not got:
                continue
            pl = [r["pipeline"] for _, r in got]
            compute = [mean([p["stage_compute_ms"][s] for p in pl]) for s in range(stages)]
            bubble = [mean([p["bubble"][s] for p in pl]) for s in range(stages)]
            replay = mean([mean(p.get("replay_bubble", [float("nan")])) for p in pl])
            ips = statistics.median(r["images_per_sec"] for _, r in got)
            lines.append("| " + " | ".join([model, str(m), build, cut(got[0][1]), ", ".join(f"{c:.1f}" for c in compute),
                ", ".join(f"{100 * b:.1f}%" for b in bubble), f"{100 * mean(bubble):.1f}%", f"{100 * replay:.1f}%", f"{ips:.1f}"]) + " |")
lines.append("")
lines.append("blocks per chunk: first..last block of each chunk in model order (stage s holds chunks s and 2P-1-s); compute: each stage's forwards and backwards per measured step (the record's stage_compute_ms, mean over the runs); bubble: each stage's idle share of the pipelined part of the step; replay: the schedule replayed with the run's own measured F, B and W (messages free).")
open(f"{out}/table.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
