#!/usr/bin/env bash
# The figures of results/zero3/ (issue 37): ResNet-50 on 4 ranks with --zero 0, 1, 2 and 3.
#   1. memory: each run in a memory cgroup of its own (cgroup v1, no limit), whose peak usage is
#      the whole job's (4 ranks and mpirun); runs.jsonl adds what each rank held between steps;
#   2. a memory limit between stage 3's peak and the lowest peak of stages 0-2: every stage
#      runs under it, and the record says which trained and which the kernel killed;
#   3. speed: stage 2 with overlap off and on, stage 3 with prefetch off and on (block units),
#      and stage 3 in stage units; the share of the gathers hidden behind compute.
# About 20 minutes on 2 cores, as root (cgroups); run it on an otherwise idle machine.
#   scripts/measure-zero3.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
B="$HPC_TRAIN_BIN"
R=results/zero3
mkdir -p "$R/logs"
CG=/sys/fs/cgroup/memory/hpc-train-zero3
[ -d /sys/fs/cgroup/memory ] || { echo "needs the cgroup v1 memory controller at /sys/fs/cgroup/memory" >&2; exit 1; }
cleanup() {
  if [ -d "$CG" ]; then
    for p in $(cat "$CG/cgroup.procs" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    sleep 1
    rmdir "$CG" 2>/dev/null || true
  fi
}
trap cleanup EXIT
stamp() { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, $(git rev-parse --short HEAD): $*"; }

# run NAME LIMIT_BYTES(-1: none) ARGS...: one launch in the cgroup; appends a line to limits.tsv.
run() {
  local name=$1 limit=$2; shift 2
  cleanup; mkdir "$CG"
  echo "$limit" > "$CG/memory.limit_in_bytes"
  local log="$R/logs/$name.txt" rc=0
  { stamp "$name (memory limit $limit): ResNet-50, fashion-mnist 1x28x28, 4 ranks x batch 4, $*"
    ( echo $BASHPID > "$CG/cgroup.procs"
      exec mpirun -n 4 --oversubscribe --bind-to none "$B" --model resnet50 --data datasets/fashion-mnist.h5 \
          --batch-size 4 --steps 13 --skip-steps 3 --threads 1 --no-eval --log-every 1000 \
          --study "zero3-$name" --results "$R" "$@" ) 2>&1 || rc=$?; } > "$log" 2>&1 || true
  local peak oom
  peak=$(cat "$CG/memory.max_usage_in_bytes")
  oom=$(awk '/oom_kill /{print $2}' "$CG/memory.oom_control" 2>/dev/null || echo "?")
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$limit" "$rc" "$peak" "${oom:-?}" | tee -a "$R/limits.tsv"
}

printf 'run\tlimit_bytes\texit\tjob_peak_bytes\toom_kills\n' > "$R/limits.tsv"
# 1 and 3: no limit.
for zero in 0 1 2; do run "zero$zero-overlap-on" -1 --strategy ring --zero "$zero" --overlap on; done
run zero3-prefetch-on -1 --strategy ring --zero 3 --overlap on
run zero2-overlap-off -1 --strategy ring --zero 2 --overlap off
run zero3-prefetch-off -1 --strategy ring --zero 3 --overlap off
run zero3-stage-units -1 --strategy ring --zero 3 --overlap on --fsdp-unit stage

# 2: a limit halfway between stage 3's peak and the lowest of stages 0-2.
limit=$(awk -F'\t' '$1 ~ /^zero[012]-overlap-on$/ {if (min == "" || $4 < min) min = $4} $1 == "zero3-prefetch-on" {z3 = $4} END {printf "%.0f", (min + z3) / 2}' "$R/limits.tsv")
for zero in 0 1 2 3; do
  run "limited-zero$zero" "$limit" --strategy ring --zero "$zero" --overlap on
done

python3 - "$R" <<'EOF' | tee "$R/table.md"
import json, sys, csv
R = sys.argv[1]
runs = {r["study"][len("zero3-"):]: r for r in (json.loads(l) for l in open(f"{R}/runs.jsonl") if l.strip()) if (r.get("study") or "").startswith("zero3-")}
limits = {row["run"]: row for row in csv.DictReader(open(f"{R}/limits.tsv"), delimiter="\t")}
mb = lambda b: b / 2**20
print("Memory per rank between steps (runs.jsonl, the largest over the 4 ranks) and the job's peak (its cgroup: 4 ranks and mpirun):")
print()
print("| run | zero | parameters MB held | optimizer state MB | gradients MB | peak gathered parameters MB | peak RSS MB (largest rank) | job peak MB (cgroup) | step ms |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for name in ["zero0-overlap-on", "zero1-overlap-on", "zero2-overlap-on", "zero3-prefetch-on", "zero3-stage-units"]:
    r = runs.get(name)
    if not r:
        continue
    e = r["extra"]
    params = e.get("parameter_bytes_held", 4 * e["parameters"])
    gathered = e.get("peak_gathered_parameter_bytes")
    print(f"| {name} | {e['zero']} | {mb(params):.1f} | {mb(e['optimizer_state_bytes']):.1f} | {mb(e['gradient_bytes']):.1f} | "
          f"{'-' if gathered is None else f'{mb(gathered):.1f}'} | {r['peak_rss_mb']:.0f} | {mb(int(limits[name]['job_peak_bytes'])):.0f} | {r['step_ms']:.0f} |")
print()
print("ResNet-50 has", runs["zero0-overlap-on"]["extra"]["parameters"], "parameters:", f"{mb(4 * runs['zero0-overlap-on']['extra']['parameters']):.1f} MB in f32; a quarter is {mb(runs['zero0-overlap-on']['extra']['parameters']):.1f} MB.")
print()
print("Under a memory limit (the cgroup's memory.limit_in_bytes, no swap):")
print()
print("| run | limit MB | exit status | job peak MB | OOM kills | trained |")
print("|---|---:|---:|---:|---:|---|")
for name, row in limits.items():
    if not name.startswith("limited-"):
        continue
    trained = name in runs
    print(f"| {name} | {mb(int(row['limit_bytes'])):.0f} | {row['exit']} | {mb(int(row['job_peak_bytes'])):.0f} | {row['oom_kills']} | {'yes: ' + str(runs[name]['steps']) + ' steps' if trained else 'no'} |")
print()
print("Speed (13 steps, the last 10 measured; 4 ranks on 2 cores, so compute and communication share the cores):")
print()
print("| run | zero | overlap / prefetch | step ms | x of zero 2 (same overlap) | gather ms/step | exposed | hidden | reduce-scatter ms/step | exposed | hidden |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
base = {True: runs.get("zero2-overlap-on"), False: runs.get("zero2-overlap-off")}
for name in ["zero2-overlap-off", "zero2-overlap-on", "zero3-prefetch-off", "zero3-prefetch-on", "zero3-stage-units"]:
    r = runs.get(name)
    if not r:
        continue
    e = r["extra"]
    on = e["overlap"]
    x = r["step_ms"] / base[on]["step_ms"] if base[on] else float("nan")
    if e["zero"] == 3:
        f = lambda k: f"{e[k]:.0f}"
        p = lambda k: f"{100 * e[k]:.0f}%"
        cells = f"{f('fsdp_gather_ms_per_step')} | {f('fsdp_exposed_gather_ms_per_step')} | {p('fsdp_gather_hidden')} | {f('fsdp_reduce_scatter_ms_per_step')} | {f('fsdp_exposed_reduce_scatter_ms_per_step')} | {p('fsdp_reduce_scatter_hidden')}"
    else:
        cells = "- | - | - | - | - | -"
    print(f"| {name} | {e['zero']} | {'on' if on else 'off'} | {r['step_ms']:.0f} | {x:.2f} | {cells} |")
EOF
