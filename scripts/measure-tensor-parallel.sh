#!/usr/bin/env bash
# The figures of results/tensor-parallel/ (issue 38): vit-b16 (torchvision's ViT-B/16, 86.6 M
# parameters) on 4 ranks, 3x224x224 synthetic images, a global batch of 4, SGD:
#   1. data parallelism (D = 4, ring), tensor parallelism (T = 4) and both (D x T = 2 x 2):
#      parameter bytes per rank, peak resident memory, step time, the tensor-parallel
#      all-reduces' time and bytes; each run in a memory cgroup of its own (cgroup v1, no limit),
#      whose peak usage is the whole job's (4 ranks and mpirun);
#   2. a memory limit halfway between T = 4's job peak and D = 4's: both run under it, and the
#      record says which trained and which the kernel killed.
# About 10 minutes on 2 cores, as root (cgroups); run it on an otherwise idle machine.
#   scripts/measure-tensor-parallel.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
B="$HPC_TRAIN_BIN"
R=results/tensor-parallel
mkdir -p "$R/logs" runs
DATA=runs/vit-synth-3x224x224.h5
[ -f "$DATA" ] || "$B" data synth --samples 64 --test-samples 8 --shape 3x224x224 --classes 10 --out "$DATA"
CG=/sys/fs/cgroup/memory/hpc-train-tensor-parallel
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
  { stamp "$name (memory limit $limit): vit-b16, synthetic 3x224x224, 4 ranks, global batch 4, $*"
    ( echo $BASHPID > "$CG/cgroup.procs"
      exec mpirun -n 4 --oversubscribe --bind-to none "$B" --model vit-b16 --data "$DATA" \
          --steps 8 --skip-steps 3 --threads 1 --no-eval --log-every 1000 \
          --study "tp-$name" --results "$R" "$@" ) 2>&1 || rc=$?; } > "$log" 2>&1 || true
  local peak oom
  peak=$(cat "$CG/memory.max_usage_in_bytes")
  oom=$(awk '/oom_kill /{print $2}' "$CG/memory.oom_control" 2>/dev/null || echo "?")
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$limit" "$rc" "$peak" "${oom:-?}" | tee -a "$R/limits.tsv"
}

printf 'run\tlimit_bytes\texit\tjob_peak_bytes\toom_kills\n' > "$R/limits.tsv"
# --batch-size is per worker: a rank with data parallelism, a group with tensor parallelism.
run d4 -1 --strategy ring --batch-size 1
run t4 -1 --strategy ring --tensor-parallel 4 --batch-size 4
run d2-t2 -1 --strategy ring --tensor-parallel 2 --batch-size 2
limit=$(awk -F'\t' '$1 == "d4" {d = $4} $1 == "t4" {t = $4} END {printf "%.0f", (d + t) / 2}' "$R/limits.tsv")
run limited-d4 "$limit" --strategy ring --batch-size 1
run limited-t4 "$limit" --strategy ring --tensor-parallel 4 --batch-size 4

python3 - "$R" <<'PY' | tee "$R/table.md"
import json, sys, csv
R = sys.argv[1]
runs = {r["study"][len("tp-"):]: r for r in (json.loads(l) for l in open(f"{R}/runs.jsonl") if l.strip()) if (r.get("study") or "").startswith("tp-")}
limits = {row["run"]: row for row in csv.DictReader(open(f"{R}/limits.tsv"), delimiter="\t")}
mb = lambda b: b / 2**20
print("vit-b16 on 4 ranks, global batch 4, SGD (8 steps, the last 5 measured); memory per rank between steps (runs.jsonl, the largest over the ranks) and the job's peak (its cgroup: 4 ranks and mpirun):")
print()
print("| run | layout D x P x T | parameters MB / rank | optimizer state MB | gradients MB | peak RSS MB (largest rank) | job peak MB (cgroup) | step ms | TP all-reduce ms / step | TP MB sent / rank / step |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for name in ["d4", "t4", "d2-t2"]:
    r = runs.get(name)
    if not r:
        continue
    e = r["extra"]
    layout = e.get("layout", {"data": r["ranks"], "pipeline": 1, "tensor": 1})
    params = e.get("parameter_bytes_held", 4 * e["parameters"])
    tp_ms = f"{e['tp_allreduce_ms']:.0f}" if "tp_allreduce_ms" in e else "-"
    tp_mb = f"{mb(e['tp_bytes_sent']):.1f}" if "tp_bytes_sent" in e else "-"
    print(f"| {name} | {layout['data']} x {layout['pipeline']} x {layout['tensor']} | {mb(params):.1f} | {mb(e['optimizer_state_bytes']):.1f} | {mb(e['gradient_bytes']):.1f} | "
          f"{r['peak_rss_mb']:.0f} | {mb(int(limits[name]['job_peak_bytes'])):.0f} | {r['step_ms']:.0f} | {tp_ms} | {tp_mb} |")
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
PY
