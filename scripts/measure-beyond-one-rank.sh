#!/usr/bin/env bash
# Issue 49's measurement: a model that no rank can hold under its memory limit, trained by the
# layouts that split it. ViT-L/16 (304 M parameters) with AdamW (about 4.9 GB of training state)
# on 4 ranks, each in a memory cgroup of its own (scripts/lib/in-memory-cgroup.sh: LIMIT bytes,
# no swap), as a batch system with per-task memory limits runs them:
#   - plain data parallelism is expected to be killed by the kernel;
#   - --zero 3, --tensor-parallel 4, --pipeline-stages 4 and a 2 x 2 layout (2 stages of
#     tensor-parallel pairs) each go through set-up, STEPS steps with evaluations, a checkpoint,
#     then a resume at another layout for MORE steps (with its own evaluation and checkpoint);
#   - each resumed run is compared with an uninterrupted run of STEPS + MORE steps at the first
#     layout (the consolidated checkpoints, tensor by tensor: the largest relative L2
#     difference, as the tests measure it, and the same with the key third of the attention
#     biases left out, whose true gradient is zero: AdamW moves them by about the learning rate
#     with a sign set by the order of the sums, so two layouts part there whatever the
#     checkpoint holds; tests/checkpoint.rs says more).
# Every rank's peak resident memory per phase comes from the run's record
# (extra.peak_rss_mb_by_phase, src/train/memory.rs); the cgroup's own figures (peak usage,
# page cache included, and OOM kills) are read beside it.
#   scripts/measure-beyond-one-rank.sh [--limit-mib N] [--steps N] [--more N] [--out DIR]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
out="results/beyond-one-rank/cgroup" limit_mib=2048 steps=20 more=4 model=vit-l16 bin=target/release/hpc-train
while [ $# -gt 0 ]; do
    case "$1" in
        --limit-mib) limit_mib=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --more) more=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --model) model=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
limit=$(( limit_mib * 1024 * 1024 ))

# The memory hierarchy this shell is in: cgroup v1's memory controller, else cgroup v2's.
if [ -d /sys/fs/cgroup/memory ]; then
    parent="/sys/fs/cgroup/memory$(awk -F: '$2 == "memory" {print $3}' /proc/self/cgroup)"
else
    parent="/sys/fs/cgroup$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)"
fi
groups="$parent/hpc-train-measure-$$"
mkdir "$groups"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/hpc-beyond.XXXXXX")
cleanup() {
    for g in "$groups"/*/; do [ -d "$g" ] && rmdir "$g"/rank-* "$g" 2>/dev/null; done
    rmdir "$groups" 2>/dev/null || echo "left $groups (a process still in it?)" >&2
    rm -rf "$scratch"
}
trap cleanup EXIT
mkdir -p "$out/logs"
# PyTorch for the comparison of weights: the venv tests/optim_pytorch.rs installs.
python="$HPC_TRAIN_ROOT/.venv-pytorch/bin/python"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# Small images keep the compute of 2 cores for 4 ranks short (32x32: 4 patches and the class
# token); the parameters and the optimizer state, what the limit is about, are ViT-L/16's.
data="$scratch/images.h5"
"$bin" data synth --samples 64 --test-samples 32 --shape 3x32x32 --classes 10 --out "$data" >/dev/null
common=(--model "$model" --data "$data" --scaling strong --global-batch 8 --threads 1 --optimizer adamw --lr 1e-4)

declare -A layout=(
    [plain]="--strategy ring"
    [zero3]="--zero 3 --strategy ring"
    [tp4]="--tensor-parallel 4"
    [pp4]="--pipeline-stages 4 --micro-batches 4"
    [pp2xtp2]="--pipeline-stages 2 --tensor-parallel 2 --micro-batches 4"
)
declare -A resume_as=([zero3]=tp4 [tp4]=pp4 [pp4]=pp2xtp2 [pp2xtp2]=zero3)

# run NAME LAYOUT_KEY STEPS EXTRA...: 4 ranks, each in NAME's cgroups; prints the exit status.
run() {
    local name=$1 key=$2 n=$3
    shift 3
    local options
    read -r -a options <<< "${layout[$key]}"
    mkdir "$groups/$name"
    local status=0
    mpirun -n 4 --oversubscribe --bind-to none scripts/lib/in-memory-cgroup.sh "$groups/$name" "$limit" -- \
        "$bin" "${common[@]}" "${options[@]}" --steps "$n" --results "$scratch/runs-$name" "$@" \
        > "$out/logs/$name.txt" 2>&1 || status=$?
    # The kernel's view per rank: peak usage (page cache included) and OOM kills.
    for r in 0 1 2 3; do
        local g="$groups/$name/rank-$r"
        [ -d "$g" ] || continue
        local peak kills
        peak=$(cat "$g/memory.max_usage_in_bytes" 2>/dev/null || cat "$g/memory.peak" 2>/dev/null || echo 0)
        kills=$(awk '$1 == "oom_kill" {print $2}' "$g/memory.oom_control" "$g/memory.events" 2>/dev/null | head -1)
        echo "$name rank $r: cgroup peak $(( peak / 1048576 )) MiB, OOM kills ${kills:-0}" >> "$out/logs/cgroups.txt"
        rmdir "$g"
    done
    rmdir "$groups/$name"
    echo "$status"
}

: > "$out/logs/cgroups.txt"
{
    printf '%s with AdamW, 4 ranks, each in a memory cgroup of %d MiB without swap; global batch 8 of 3x32x32, %s steps then %s more at another layout; %s, %s cores, %s, %s\n\n' \
        "$model" "$limit_mib" "$steps" "$more" "$(uname -n)" "$(nproc)" "$(mpirun --version 2>&1 | head -1)" "$(date -u +%F)"
} > "$out/summary.md"

plain_status=$(run plain plain "$steps" --no-eval)
echo "plain data parallelism: exit status $plain_status ($(grep -c 'plain.*OOM kills [1-9]' "$out/logs/cgroups.txt") rank(s) killed by the kernel; log: logs/plain.txt)" >> "$out/summary.md"

for key in zero3 tp4 pp4 pp2xtp2; do
    next=${resume_as[$key]}
    ckpt="$scratch/ckpt-$key"
    first=$(run "$key" "$key" "$steps" --checkpoint-dir "$ckpt" --checkpoint-every "$steps")
    second=$(run "$key-then-$next" "$next" $(( steps + more )) --checkpoint-dir "$ckpt" --checkpoint-every "$steps" --resume)
    whole=$(run "$key-uninterrupted" "$key" $(( steps + more )) --checkpoint-dir "$scratch/ckpt-$key-whole" --checkpoint-every $(( steps + more )))
    diff="not compared"
    if "$bin" checkpoint consolidate "$ckpt" "$scratch/resumed.safetensors" > /dev/null \
        && "$bin" checkpoint consolidate "$scratch/ckpt-$key-whole" "$scratch/uninterrupted.safetensors" > /dev/null \
        && [ -x "$python" ]; then
        diff=$("$python" - "$scratch/resumed.safetensors" "$scratch/uninterrupted.safetensors" <<'COMPARE'
import json, struct, sys
import torch

def tensors(path):
    """Each tensor of a safetensors file, by name (F32 only, as hpc-train writes them)."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        yield name, torch.frombuffer(bytearray(data[8 + n + begin:8 + n + end]), dtype=torch.float32).double()

def without_key_biases(name, t):
    if name.endswith("self_attention.in_proj_bias"):
        third = t.numel() // 3
        return torch.cat([t[:third], t[2 * third:]])
    return t

a, b = dict(tensors(sys.argv[1])), dict(tensors(sys.argv[2]))
assert a.keys() == b.keys(), "different tensors"
relative = lambda x, y: ((x - y).norm() / x.norm().clamp_min(1e-12)).item()
every = max(relative(a[k], b[k]) for k in a)
but_keys = max(relative(without_key_biases(k, a[k]), without_key_biases(k, b[k])) for k in a)
print(f"{every:.1e} ({but_keys:.1e} without the key biases)")
COMPARE
)
    fi
    rm -rf "$scratch/ckpt-$key-whole" "$scratch"/*.safetensors "$ckpt"
    echo "- $key, then $next: exit statuses $first (first $steps steps), $second (resumed as $next to step $(( steps + more ))), $whole (uninterrupted $key); resumed against uninterrupted, largest relative L2 difference of a tensor: $diff" >> "$out/summary.md"
done

# The table: every rank's peak per phase from the records, and the limit.
python3 - "$scratch" "$limit_mib" >> "$out/summary.md" <<'TABLE'
import glob, json, os, sys
scratch, limit = sys.argv[1], float(sys.argv[2])
print(f"\n| run | phase | peak RSS per rank (MiB) | max | under {limit:.0f} MiB |\n|---|---|---|---:|---|")
for path in sorted(glob.glob(os.path.join(scratch, "runs-*", "runs.jsonl"))):
    name = os.path.basename(os.path.dirname(path))[len("runs-"):]
    for record in map(json.loads, open(path)):
        phases = record["extra"].get("peak_rss_mb_by_phase", {})
        for phase in ["set-up", "training", "evaluation", "checkpoint", "end"]:
            if phase not in phases:
                continue
            ranks = phases[phase]
            top = max(r for r in ranks if r is not None)
            shown = " / ".join("-" if r is None else f"{r:.0f}" for r in ranks)
            print(f"| {name} | {phase} | {shown} | {top:.0f} | {'yes' if top < limit else '**no**'} |")
TABLE
printf '\nThe kernel'"'"'s view per rank (cgroup peak usage, page cache included; OOM kills):\n\n```\n' >> "$out/summary.md"
cat "$out/logs/cgroups.txt" >> "$out/summary.md"
printf '```\n' >> "$out/summary.md"
cat "$out/summary.md"
