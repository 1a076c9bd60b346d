#!/usr/bin/env bash
# Issue 51: overlap on CPU ranks, back to back in one script. Two builds (--before, the binary
# from before gradients became bucket views and auto measured; --after, this one), ResNet-18 and
# ResNet-50 on Fashion-MNIST, 2 ranks with the default threads (the cores divided by the ranks),
# batch 16 per rank, ring, the steps after the warm-up measured: each build with --overlap on
# and off, the new build with its default (auto) too, by turns, --reps times. Then one profiled
# run of each build and mode per model (--profile-dir, overlap off and on), summarised with
# scripts/trace_summary.py: AccumulateGrad, the zeroing and the copies per step, before against
# after, and the new build's off against on (its traces hold the backward thread's ops).
#
# Every run appends its record to $out/runs.jsonl (study tag ov-MODEL-BUILD-MODE-rREP) and its
# log to $out/logs/; $out/table.md is made from runs.jsonl by the Python at the end.
#   scripts/measure-overlap-auto.sh --before BIN [--after BIN] [--out results/overlap-auto] [--reps 5] [--steps 25] [--models "resnet18 resnet50"] [--ranks 2]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
out=results/overlap-auto reps=5 steps=25 models="resnet18 resnet50" ranks=2 before="" after="$HPC_TRAIN_BIN" profile=1
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --reps) reps="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --models) models="$2"; shift 2 ;;
        --ranks) ranks="$2"; shift 2 ;;
        --before) before="$2"; shift 2 ;;
        --after) after="$2"; shift 2 ;;
        --no-profile) profile=0; shift ;;
        *) echo "measure-overlap-auto.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[ -n "$before" ] || { echo "measure-overlap-auto.sh: --before BIN (the build to compare against) is required" >&2; exit 2; }
mkdir -p "$out/logs"
# Copies: a rebuild during the measurement must not change what runs.
work=$(mktemp -d "${TMPDIR:-/tmp}/hpc-train-ov.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp "$before" "$work/before"; cp "$after" "$work/after"
"$work/before" --version | head -n 1 > "$out/logs/versions.txt"
"$work/after" --version | head -n 1 >> "$out/logs/versions.txt"

run() {
    local name=$1 build=$2 model=$3 n=$4
    shift 4
    echo "==> $name: $*"
    hpc_train_mpirun "$ranks" "$work/$build" --strategy ring --model "$model" --data datasets/fashion-mnist.h5 --batch-size 16 \
        --steps "$n" --skip-steps 5 --no-eval --results "$out" --study "$name" "$@" \
        >"$out/logs/$name.txt" 2>&1 || { echo "    failed: see $out/logs/$name.txt" >&2; return 1; }
    grep -E "images/s|--overlap" "$out/logs/$name.txt" | sed 's/^/    /' || true
}

for model in $models; do
    for rep in $(seq 1 "$reps"); do
        run "ov-$model-before-on-r$rep" before "$model" "$steps" --overlap on
        run "ov-$model-before-off-r$rep" before "$model" "$steps" --overlap off
        run "ov-$model-after-on-r$rep" after "$model" "$steps" --overlap on
        run "ov-$model-after-off-r$rep" after "$model" "$steps" --overlap off
        run "ov-$model-after-auto-r$rep" after "$model" "$steps"
    done
    if [ "$profile" = 1 ]; then
        for build in before after; do
            for mode in off on; do
                rm -rf "$out/profile/$model-$build-$mode"
                run "ov-$model-$build-$mode-profiled" "$build" "$model" 9 --overlap "$mode" --profile-dir "$out/profile/$model-$build-$mode" --profile-steps 3
            done
        done
        for mode in off on; do
            python3 scripts/trace_summary.py "before=$out/profile/$model-before-$mode/rank-0.json" "after=$out/profile/$model-after-$mode/rank-0.json" \
                --top 25 > "$out/profile-$model-$mode.txt"
        done
        # Where a step's time goes with overlap against without (the new build, whose traces
        # hold backward's ops on its own thread too).
        python3 scripts/trace_summary.py "off=$out/profile/$model-after-off/rank-0.json" "on=$out/profile/$model-after-on/rank-0.json" \
            --top 25 > "$out/profile-$model-after-off-vs-on.txt"
        # The traces are large; their summaries are what results/ keeps.
        rm -rf "$out/profile/$model-"*
    fi
done
rmdir "$out/profile" 2>/dev/null || true

python3 - "$out" "$models" "$reps" "$ranks" "$(nproc)" "$(uname -n)" "$(date -u +%F)" <<'EOF'
import json, statistics, sys
out, models, reps, ranks, cores, host, day = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7]
runs = {}
for line in open(f"{out}/runs.jsonl"):
    if line.strip():
        r = json.loads(line)
        runs[r.get("study", "")] = r  # the newest record of each name
versions = open(f"{out}/logs/versions.txt").read().split("\n")
lines = [f"Overlap on CPU ranks: {ranks} ranks on {cores} cores ({host}), ring, Fashion-MNIST, batch 16 per rank, default threads, the steps after the warm-up; median of {reps} runs by turns; {day}.",
         f"before: `{versions[0]}`; after: `{versions[1]}`.", ""]
header = ["model", "build", "--overlap", "images/s", "step ms", "compute ms", "exchange ms not hidden", "overlap ran", "runs"]
lines.append("| " + " | ".join(header) + " |")
lines.append("|---|---|---|" + "---:|" * (len(header) - 3))
summary = []
for model in models:
    ips = {}
    for build, modes in (("before", ("on", "off")), ("after", ("on", "off", "auto"))):
        for mode in modes:
            rs = [runs[k] for k in (f"ov-{model}-{build}-{mode}-r{i}" for i in range(1, reps + 1)) if k in runs]
            if not rs:
                continue
            med = lambda key: statistics.median(r[key] for r in rs)
            ips[(build, mode)] = med("images_per_sec")
            ran = sum(1 for r in rs if r["extra"].get("overlap"))
            lines.append(f"| {model} | {build} | {mode} | {med('images_per_sec'):.2f} | {med('step_ms'):.0f} | {med('compute_ms'):.0f} | {med('comm_ms'):.1f} | {ran} of {len(rs)} | {len(rs)} |")
    if all(k in ips for k in (("before", "on"), ("before", "off"), ("after", "on"), ("after", "off"), ("after", "auto"))):
        best = max(ips[("after", "on")], ips[("after", "off")])
        summary.append(f"- {model}: on / off images/s {ips[('before', 'on')] / ips[('before', 'off')]:.3f} before, {ips[('after', 'on')] / ips[('after', 'off')]:.3f} after; "
                       f"after / before with off {ips[('after', 'off')] / ips[('before', 'off')]:.3f}, with on {ips[('after', 'on')] / ips[('before', 'on')]:.3f}; "
                       f"the default (auto) {ips[('after', 'auto')] / best:.3f} of the better of on and off")
lines += ["", *summary, "", "The trial of each auto run (its record's overlap_reason):", ""]
for model in models:
    for i in range(1, reps + 1):
        r = runs.get(f"ov-{model}-after-auto-r{i}")
        if r:
            lines.append(f"- {model} r{i}: overlap {'on' if r['extra'].get('overlap') else 'off'}: {r['extra'].get('overlap_reason', '')}")
open(f"{out}/table.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
