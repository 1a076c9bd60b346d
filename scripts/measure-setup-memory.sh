#!/usr/bin/env bash
# Peak resident memory per rank of ViT-L/16 (304 M parameters, 1.2 GB in f32) on 4 ranks, one
# step, before and after issue 49's initialisation in parts: --pipeline-stages 4, --tensor-parallel
# 4, --zero 3. Each rank runs under GNU time (its maximum resident set, in KiB).
#   scripts/measure-setup-memory.sh --before OLD_BINARY [--after NEW_BINARY] [--model M] [--out DIR]
# (the binaries before 2026-11-27 have no vit-l16: compare them with --model vit-b16)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
before="" after="target/release/hpc-train" model=vit-l16 out="results/beyond-one-rank/setup-memory"
while [ $# -gt 0 ]; do
    case "$1" in
        --before) before=$2; shift 2 ;;
        --after) after=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --model) model=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
[ -n "$before" ] || { echo "--before OLD_BINARY is needed" >&2; exit 2; }
mkdir -p "$out/logs"
data="$out/vit224.h5"
[ -f "$data" ] || "$after" data synth --samples 16 --shape 3x224x224 --classes 10 --out "$data" >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
table="$out/table.md"
printf '%s, 4 ranks, 1 step, batch 4, 3x224x224, SGD, 2-core VM, %s\n\n' "$model" "$(date -u +%F)" > "$table"
printf '| binary | layout | peak RSS per rank (MiB) | max | wall s |\n|---|---|---|---:|---:|\n' >> "$table"
for which in before after; do
    bin=${!which}
    for layout in "--pipeline-stages 4 --micro-batches 4" "--tensor-parallel 4" "--zero 3"; do
        name=$(echo "$layout" | tr -d ' -' )
        log="$out/logs/$which-$name.txt"
        start=$(date +%s)
        # shellcheck disable=SC2086
        mpirun -n 4 --oversubscribe /usr/bin/time -f "maxrss_kib %M" "$bin" --model "$model" --data "$data" \
            --batch-size 4 --steps 1 --no-eval --threads 1 --optimizer sgd --strategy ring $layout \
            --results "$out/runs-$which" > "$log" 2>&1 || echo "$which $layout failed (see $log)" >&2
        wall=$(( $(date +%s) - start ))
        peaks=$(grep -o 'maxrss_kib [0-9]*' "$log" | awk '{printf "%d ", $2/1024}')
        max=$(echo "$peaks" | tr ' ' '\n' | sort -n | tail -1)
        printf '| %s | `%s` | %s| %s | %s |\n' "$which" "$layout" "$peaks" "$max" "$wall" >> "$table"
    done
done
cat "$table"
