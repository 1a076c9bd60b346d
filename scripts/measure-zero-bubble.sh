#!/usr/bin/env bash
# Issue 50: the zero-bubble schedules (ZB-H1, ZB-V) against 1F1B and interleaved 1F1B, back to
# back in one script: at P stages (default 2: one rank per core of the 2-core VM) for M = 4, 8,
# 16 micro-batches, the measured bubble of each stage beside the bubble the schedule's replay
# gives with the run's own measured forward, B and W times (runs.jsonl's replay_bubble), the
# balanced theory, images/s, each stage's peak resident memory and the most boundary bytes it
# held (chunk inputs and outputs, and what a split backward's B keeps for its W). Two models: ResNet-18
# (convolutions: W cheap against B) and vit-tiny (linear layers: W about B), Fashion-MNIST, a
# batch of 64 per pipeline, one intra-op thread per rank, the cut balanced by profiled time.
#
# Every run appends its record to $out/runs.jsonl and its log to $out/logs/; $out/table.md is
# made from runs.jsonl by the Python at the end. --bin runs a copy of another binary.
#   scripts/measure-zero-bubble.sh [--out results/pipeline/zero-bubble] [--stages 2] [--steps 14] [--models "resnet18 vit-tiny"] [--bin PATH]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
out=results/pipeline/zero-bubble steps=14 stages=2 models="resnet18 vit-tiny" bin="$HPC_TRAIN_BIN"
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --stages) stages="$2"; shift 2 ;;
        --models) models="$2"; shift 2 ;;
        --bin) bin="$2"; shift 2 ;;
        *) echo "measure-zero-bubble.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$out/logs"
copy=$(mktemp "${TMPDIR:-/tmp}/hpc-train-zb.XXXXXX")
trap 'rm -f "$copy"' EXIT
cp "$bin" "$copy"
chmod +x "$copy"

run() {
    local name=$1 model=$2
    shift 2
    echo "==> $name: $*"
    hpc_train_mpirun "$stages" "$copy" --model "$model" --data datasets/fashion-mnist.h5 --batch-size 64 \
        --steps "$steps" --skip-steps 4 --threads 1 --no-eval --pipeline-stages "$stages" --results "$out" --study "zb-$name" "$@" \
        >"$out/logs/$name.txt" 2>&1 || { echo "    failed: see $out/logs/$name.txt" >&2; return 1; }
    grep -E "images/s" "$out/logs/$name.txt" | sed 's/^/    /' || true
}

for model in $models; do
    for m in 4 8 16; do
        run "$model-p$stages-1f1b-m$m" "$model" --micro-batches "$m" --schedule 1f1b
        if [ $((m % stages)) -eq 0 ]; then
            run "$model-p$stages-interleaved-m$m" "$model" --micro-batches "$m" --schedule interleaved --virtual-stages 2
        fi
        run "$model-p$stages-zb-h1-m$m" "$model" --micro-batches "$m" --schedule zb-h1
        run "$model-p$stages-zb-v-m$m" "$model" --micro-batches "$m" --schedule zb-v
    done
done

python3 - "$out" "$stages" "$models" "$(nproc)" "$(uname -n)" "$(date -u +%F)" <<'EOF'
import json, sys
out, stages, models, cores, host, day = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), int(sys.argv[4]), sys.argv[5], sys.argv[6]
runs = {}
for line in open(f"{out}/runs.jsonl"):
    if line.strip():
        r = json.loads(line)
        runs[r.get("study", "")] = r  # the newest record of each name
pct = lambda x: f"{100 * x:.1f}%"
mean = lambda v: sum(v) / len(v) if v else float("nan")
lines = [f"Zero-bubble schedules, P = {stages} ({stages} ranks, {cores} cores), Fashion-MNIST, batch 64 per step, one thread per rank; {host}, {day}.", ""]
header = ["model", "M", "schedule", "bubble per stage", "mean", "replay (measured F, B, W)", "points off", "replay with messages", "points off", "message ms per step and stage", "theory", "F / B / W ms per micro-batch and stage", "images/s", "peak RSS MiB per stage", "held MiB per stage (micro-batches)"]
lines.append("| " + " | ".join(header) + " |")
lines.append("|" + "|".join("---:" if i > 2 else "---" for i in range(len(header))) + "|")
for model in models:
    for m in (4, 8, 16):
        for s in ("1f1b", "interleaved", "zb-h1", "zb-v"):
            r = runs.get(f"zb-{model}-p{stages}-{s}-m{m}")
            if not r:
                continue
            pl = r["pipeline"]
            measured, replay = mean(pl["bubble"]), mean(pl.get("replay_bubble", []))
            with_messages = mean(pl.get("replay_bubble_with_messages", []))
            steps = max(1, r["steps"] - 4)
            compute = pl["stage_compute_ms"]
            b, w = pl.get("stage_input_grad_ms", []), pl.get("stage_weight_grad_ms", [])
            if b:
                fbw = ", ".join(f"{(c - bi - wi) / m:.1f} / {bi / m:.1f} / {wi / m:.1f}" for c, bi, wi in zip(compute, b, w))
            else:
                fbw = ", ".join(f"{c / m:.1f} (F+B+W)" for c in compute)
            held = ", ".join(f"{b / 2**20:.1f} ({a})" for b, a in zip(pl["peak_boundary_activation_bytes"], pl["peak_alive_micro_batches"]))
            rss = {}
            for rank in pl.get("ranks", []):
                rss[rank["stage"]] = max(rss.get(rank["stage"], 0), rank["peak_rss_mb"])
            lines.append("| " + " | ".join([model, str(m), s + (" V=2" if pl["virtual_stages"] > 1 and s == "interleaved" else ""),
                ", ".join(pct(x) for x in pl["bubble"]), pct(measured), pct(replay), f"{100 * (measured - replay):+.1f}",
                pct(with_messages), f"{100 * (measured - with_messages):+.1f}", ", ".join(f"{x:.1f}" for x in pl.get("stage_message_ms", [])), pct(pl["theoretical_bubble"]),
                fbw, f"{r['images_per_sec']:.1f}", ", ".join(f"{rss[k]:.0f}" for k in sorted(rss)), held]) + " |")
lines.append("")
lines.append("bubble: each stage's idle share of the pipelined part of the step, measured; replay: the schedule replayed (src/plan/pipeline/) with the run's own measured forward, B and W times of each chunk (an unsplit backward counted as B), messages free; replay with messages: the same with each message to another stage costing its stage an equal share of the stage's message time; message ms: each stage's host time per step outside computing and outside waiting for messages (making their buffers, posting and testing them); theory: the balanced replay with F = B = W; held: the most bytes of chunk inputs and outputs a stage held at once, with what a split backward's B keeps for its W (the first chunk's output and its gradient, the gradients B captured), and the most micro-batches whose graph it held.")
open(f"{out}/table.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
