#!/usr/bin/env bash
# The pipeline-parallelism figures of results/pipeline/ (issue 36): the measured bubble of each
# schedule against theory, the activations each schedule holds, and throughput of pipeline,
# data-parallel and hybrid layouts. ResNet-18 on Fashion-MNIST, a batch of 64 per pipeline,
# one intra-op thread per rank, the cut balanced by profiled time (--partition time).
#
# Every run appends its record to $out/runs.jsonl (the pipeline object holds the per-stage
# compute, measured bubble and peaks) and its log to $out/logs/; the tables of $out/README.md
# are made from runs.jsonl by the Python at the end. Runs of more ranks than cores share the
# cores (Open MPI's --oversubscribe): their bubble mixes idle time with time-sharing, and the
# tables mark them so.
# --bin runs another binary than the build's (a copy, so that a rebuild cannot change it midway).
#   scripts/measure-pipeline.sh [--out results/pipeline] [--steps 14] [--model resnet18] [--sets "bubble memory throughput"] [--bin PATH]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
out=results/pipeline steps=14 model=resnet18 sets="bubble memory throughput" bin="$HPC_TRAIN_BIN"
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --model) model="$2"; shift 2 ;;
        --sets) sets="$2"; shift 2 ;;
        --bin) bin="$2"; shift 2 ;;
        *) echo "measure-pipeline.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$out/logs"
cores=$(nproc)

# run NAME RANKS ARGS...: one training run, its record tagged with the study id and NAME.
run() {
    local name=$1 ranks=$2
    shift 2
    echo "==> $name ($ranks ranks): $*"
    hpc_train_mpirun "$ranks" "$bin" --model "$model" --data datasets/fashion-mnist.h5 --batch-size 64 \
        --steps "$steps" --skip-steps 4 --threads 1 --no-eval --results "$out" --study "pipeline-$name" "$@" \
        >"$out/logs/$name.txt" 2>&1 || { echo "    failed: see $out/logs/$name.txt" >&2; return 1; }
    grep -E "images/s|bubble" "$out/logs/$name.txt" | sed 's/^/    /' || true
}

for set in $sets; do
    case "$set" in
        bubble)
            for p in 2 4; do
                for m in 4 8 16; do
                    run "bubble-p$p-gpipe-m$m" "$p" --pipeline-stages "$p" --micro-batches "$m" --schedule gpipe
                    run "bubble-p$p-1f1b-m$m" "$p" --pipeline-stages "$p" --micro-batches "$m" --schedule 1f1b
                    if [ $((m % p)) -eq 0 ]; then
                        run "bubble-p$p-interleaved-m$m" "$p" --pipeline-stages "$p" --micro-batches "$m" --schedule interleaved --virtual-stages 2
                    fi
                done
            done ;;
        memory)
            run memory-p2-gpipe-m8 2 --pipeline-stages 2 --micro-batches 8 --schedule gpipe
            run memory-p2-1f1b-m8 2 --pipeline-stages 2 --micro-batches 8 --schedule 1f1b
            run memory-p2-gpipe-m8-recompute 2 --pipeline-stages 2 --micro-batches 8 --schedule gpipe --recompute
            run memory-p2-1f1b-m8-recompute 2 --pipeline-stages 2 --micro-batches 8 --schedule 1f1b --recompute ;;
        throughput)
            run throughput-1rank 1
            run throughput-d2 2 --strategy ring
            run throughput-p2-m8 2 --pipeline-stages 2 --micro-batches 8
            run throughput-d4 4 --strategy ring
            run throughput-p2d2-m8 4 --pipeline-stages 2 --micro-batches 8 --strategy ring
            run throughput-p4-m8 4 --pipeline-stages 4 --micro-batches 8 ;;
        *) echo "measure-pipeline.sh: unknown set $set" >&2; exit 2 ;;
    esac
done

python3 - "$out" "$cores" <<'EOF'
import json, sys
out, cores = sys.argv[1], int(sys.argv[2])
runs = {}
for line in open(f"{out}/runs.jsonl"):
    line = line.strip()
    if line:
        r = json.loads(line)
        runs[r.get("study", "")] = r  # the newest record of each name
def get(name):
    return runs.get("pipeline-" + name)
lines = []
def table(header, rows):
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|")
    lines.extend("| " + " | ".join(str(c) for c in row) + " |" for row in rows)
    lines.append("")
pct = lambda x: f"{100 * x:.1f}%"
rows = []
for p in (2, 4):
    for m in (4, 8, 16):
        for s in ("gpipe", "1f1b", "interleaved"):
            r = get(f"bubble-p{p}-{s}-m{m}")
            if not r:
                continue
            pl = r["pipeline"]
            bubbles = pl["bubble"]
            mean = sum(bubbles) / len(bubbles)
            shared = " (shared cores)" if r["ranks"] > cores else ""
            rows.append([f"{p}{shared}", m, s + (f" V={pl['virtual_stages']}" if pl["virtual_stages"] > 1 else ""),
                         ", ".join(pct(b) for b in bubbles), pct(mean), pct(pl["theoretical_bubble"]),
                         f"{100 * (mean - pl['theoretical_bubble']):+.1f}", ", ".join(f"{c:.0f}" for c in pl["stage_compute_ms"]), f"{r['images_per_sec']:.1f}"])
lines.append("### Bubble: measured idle share of each stage against theory\n")
table(["P", "M", "schedule", "bubble per stage", "mean", "theory", "points off", "compute ms per stage", "images/s"], rows)
rows = []
for name in ("memory-p2-gpipe-m8", "memory-p2-1f1b-m8", "memory-p2-gpipe-m8-recompute", "memory-p2-1f1b-m8-recompute"):
    r = get(name)
    if r:
        pl = r["pipeline"]
        rows.append([name.removeprefix("memory-"), ", ".join(map(str, pl["peak_alive_micro_batches"])),
                     ", ".join(f"{b / 2**20:.1f}" for b in pl["peak_boundary_activation_bytes"]), f"{r['peak_rss_mb']:.0f}", f"{r['images_per_sec']:.1f}"])
lines.append("### Memory: activations held per stage (P = 2, M = 8)\n")
table(["run", "micro-batches held per stage", "boundary activations MiB per stage", "peak RSS MiB (largest rank)", "images/s"], rows)
rows = []
for name in ("throughput-1rank", "throughput-d2", "throughput-p2-m8", "throughput-d4", "throughput-p2d2-m8", "throughput-p4-m8"):
    r = get(name)
    if r:
        pl = r.get("pipeline") or {}
        layout = f"D={r['workers']} x P={pl.get('pipeline_stages', 1)}" + (f", M={pl['micro_batches']} {pl['schedule']}" if pl else "")
        shared = " (shared cores)" if r["ranks"] > cores else ""
        rows.append([f"{r['ranks']}{shared}", layout, r["global_batch"], f"{r['images_per_sec']:.1f}", f"{r['step_ms']:.0f}", f"{r['compute_ms']:.0f}", f"{r['comm_ms']:.0f}", f"{r['peak_rss_mb']:.0f}"])
lines.append("### Throughput: pipeline, data-parallel and hybrid layouts\n")
table(["ranks", "layout", "global batch", "images/s", "step ms", "compute ms", "exchange ms", "peak RSS MiB"], rows)
open(f"{out}/tables.md", "w").write("\n".join(lines))
print("\n".join(lines))
EOF
