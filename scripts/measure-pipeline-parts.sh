#!/usr/bin/env bash
# Issue 49's two points as measured (results/pipeline/parts.md): peak resident memory per stage
# and evaluation time of one P = 2 ResNet-18 run on Fashion-MNIST with the evaluation at its end,
# by a binary from before (every stage reads and caches the whole batch; evaluation one stage at
# a time on 2 x the pipeline batch) and by this build (the first stage reads images, the last
# labels; evaluation pipelined in training's micro-batches).
#
# Each rank runs under GNU time, whose maximum resident set size is the rank's peak (the same
# for both binaries; the new record's per-rank peak_rss_mb agrees with it); the evaluation's time
# is the gap between the last step's progress line and the evaluation's line in the log (whole
# seconds; the new record's evaluation_s says it to the millisecond).
#   scripts/measure-pipeline-parts.sh --before PATH [--out results/pipeline/parts] [--steps 4]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
out=results/pipeline/parts steps=4 before=""
while [ $# -gt 0 ]; do
    case "$1" in
        --before) before="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        *) echo "measure-pipeline-parts.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[ -x "$before" ] || { echo "measure-pipeline-parts.sh: --before PATH: the binary to compare with" >&2; exit 2; }
mkdir -p "$out/logs"
after="$out/hpc-train-after.$$"
cp "$HPC_TRAIN_BIN" "$after" # a copy, so that a rebuild cannot change it midway
trap 'rm -f "$after"' EXIT

# run NAME BINARY: the P = 2 run, each rank's peak in the log as "rank R peak K KiB".
run() {
    local name=$1 bin=$2
    echo "==> $name ($(uptime | sed 's/.*load/load/'))" # other work on the machine shows in the times
    hpc_train_mpirun 2 sh -c '/usr/bin/time -f "rank $OMPI_COMM_WORLD_RANK peak %M KiB" "$@"' sh "$bin" \
        --model resnet18 --data datasets/fashion-mnist.h5 --batch-size 64 --steps "$steps" --skip-steps 1 \
        --threads 1 --pipeline-stages 2 --micro-batches 4 --schedule 1f1b --cache-data on \
        --results "$out" --study "parts-$name" >"$out/logs/$name.txt" 2>&1 \
        || { echo "    failed: see $out/logs/$name.txt" >&2; return 1; }
    grep -E "peak [0-9]+ KiB|test loss|training split" "$out/logs/$name.txt" | sed 's/^/    /'
    echo "    after: $(uptime | sed 's/.*load/load/')"
}
run before "$before"
run after "$after"

python3 - "$out" <<'EOF'
import json, re, sys
out = sys.argv[1]
runs = {}
for line in open(f"{out}/runs.jsonl"):
    if line.strip():
        r = json.loads(line)
        runs[r.get("study", "")] = r
def clock(t):
    h, m, s = map(int, t.split(":"))
    return 3600 * h + 60 * m + s
lines = ["| binary | stage 0 peak MiB | stage 1 peak MiB | evaluation s (log) | evaluation_s (record) | test loss | test accuracy |", "|---|---:|---:|---:|---:|---:|---:|"]
for name in ("before", "after"):
    text = open(f"{out}/logs/{name}.txt").read()
    peaks = {int(r): int(k) / 1024 for r, k in re.findall(r"rank (\d+) peak (\d+) KiB", text)}
    last_step = re.findall(r"\[(\d\d:\d\d:\d\d) rank 0 INFO\] epoch \d+ step", text)[-1]
    evaluated = re.findall(r"\[(\d\d:\d\d:\d\d) rank 0 INFO\] epoch \d+ done", text)[-1]
    r = runs[f"parts-{name}"]
    recorded = r.get("extra", {}).get("evaluation_s")
    lines.append(f"| {name} | {peaks[0]:.0f} | {peaks[1]:.0f} | {clock(evaluated) - clock(last_step)} | "
                 f"{'-' if recorded is None else f'{recorded:.1f}'} | {r['test_loss']:.6f} | {100 * r['test_accuracy']:.2f}% |")
print("\n".join(lines))
open(f"{out}/table.md", "w").write("\n".join(lines) + "\n")
EOF
