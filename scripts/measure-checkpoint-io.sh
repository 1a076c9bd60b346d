#!/usr/bin/env bash
# Issue 49: the sharded checkpoint's write and read rates that training records (runs.jsonl:
# checkpoint_write_bytes / checkpoint_write_s after a checkpoint, resume_read_bytes /
# resume_read_s after a resume), at 1, 2 and 4 ranks, beside the disk's own rate measured in the
# same run (dd with O_DIRECT, 1 GiB, into the same folder). ViT-B/16 (86 M parameters) with AdamW:
# weights and two state slots, about 1 GB a checkpoint. Each layout trains 1 step and
# checkpoints, then resumes in a second run (the page cache dropped first, where the kernel lets
# us) and trains one more step.
#   scripts/measure-checkpoint-io.sh [--out DIR] [--model M]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
out="results/beyond-one-rank/checkpoint-io" model=vit-b16 bin=target/release/hpc-train
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=$2; shift 2 ;;
        --model) model=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$out/logs"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/hpc-ckpt-io.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
data="$scratch/vit224.h5"
"$bin" data synth --samples 16 --test-samples 0 --shape 3x224x224 --classes 10 --out "$data" >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo dropped || echo "not dropped"; }
# The disk: 1 GiB written and read back with O_DIRECT (no page cache), in the checkpoints' folder.
disk_write=$(dd if=/dev/zero of="$scratch/dd.bin" bs=16M count=64 oflag=direct 2>&1 | awk '/copied/ {print $(NF-1), $NF}')
disk_read=$(dd if="$scratch/dd.bin" of=/dev/null bs=16M iflag=direct 2>&1 | awk '/copied/ {print $(NF-1), $NF}')
rm -f "$scratch/dd.bin"
table="$out/table.md"
{
    printf '%s with AdamW, batch 2 per rank, 3x224x224, %s, %s; checkpoints in %s (%s)\n\n' "$model" "$(uname -n)" "$(date -u +%F)" "$(df -h "$scratch" | awk 'NR==2 {print $1}')" "$(nproc) cores"
    printf 'Disk, dd with O_DIRECT, 1 GiB in 16 MiB blocks: write %s, read %s.\n\n' "$disk_write" "$disk_read"
    printf '| layout | ranks | part files | checkpoint GB | write s | write GB/s | page cache before the resume | read GB (all ranks) | read s (slowest rank) | read GB/s |\n'
    printf '|---|---:|---:|---:|---:|---:|---|---:|---:|---:|\n'
} > "$table"
for point in "1 plain" "2 plain" "4 plain" "2 --zero 3" "4 --zero 3"; do
    ranks=${point%% *} layout=${point#* }
    [ "$layout" = plain ] && options=() || read -r -a options <<< "$layout"
    name="$ranks-${layout// /}"
    ckpt="$scratch/ckpt-$name" results="$scratch/runs-$name"
    common=(--model "$model" --data "$data" --batch-size 2 --no-eval --threads 1 --optimizer adamw --strategy ring
            --checkpoint-dir "$ckpt" --checkpoint-every 1 --results "$results" "${options[@]}")
    mpirun -n "$ranks" --oversubscribe "$bin" "${common[@]}" --steps 1 > "$out/logs/$name-save.txt" 2>&1
    dropped=$(drop_caches)
    mpirun -n "$ranks" --oversubscribe "$bin" "${common[@]}" --steps 2 --resume > "$out/logs/$name-resume.txt" 2>&1
    parts=$(find "$ckpt"/ckpt-000000000001 -name 'part-*' | wc -l)
    python3 - "$results/runs.jsonl" "$layout" "$ranks" "$parts" "$dropped" >> "$table" <<'ROW'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
save, resume = rows[0]["extra"], rows[-1]["extra"]
wb, ws = save["checkpoint_write_bytes"] / 1e9, save["checkpoint_write_s"]
rb, rs = resume["resume_read_bytes"] / 1e9, resume["resume_read_s"]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | {wb:.2f} | {ws:.2f} | {wb / ws:.2f} | {sys.argv[5]} | {rb:.2f} | {rs:.2f} | {rb / rs:.2f} |")
ROW
done
cat "$table"
