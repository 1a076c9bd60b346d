#!/usr/bin/env bash
# results/tensor-parallel/plan/ (issue 38): `hpc-train project --plan` for the ten GPT
# configurations of Narayanan et al. (SC 2021), table 1, on the DGX A100 HDR profile
# (jobs/clusters/dgx-a100-hdr.toml; Selene, where they ran, has the same nodes and network with
# 80 GB GPUs), at their GPU counts and batch sizes, and the comparison of the plan's fastest
# layout with the one they used; then ViT-H/14 and GPT-3 175B examples. Seconds.
#   scripts/project-plan.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
B="$HPC_TRAIN_BIN"
OUT=results/tensor-parallel/plan
PROFILE=jobs/clusters/dgx-a100-hdr.toml
mkdir -p "$OUT"
# The paper's table 1: parameters (billion), heads, width, layers, T, P, GPUs, batch, achieved
# teraFLOP/s per GPU (of 312 peak; sequence 2048, vocabulary 51,200, interleaved 1F1B).
TABLE1="1.7 24 2304 24 1 1 32 512 137
3.6 32 3072 30 2 1 64 512 138
7.5 32 4096 36 4 1 128 512 142
18.4 48 6144 40 8 1 256 1024 135
39.1 64 8192 48 8 2 512 1536 138
76.1 80 10240 60 8 4 1024 1792 140
145.6 96 12288 80 8 8 1536 2304 148
310.1 128 16384 96 8 16 1920 2160 155
529.6 128 20480 105 8 35 2520 2520 163
1008 160 25600 128 8 64 3072 3072 163"
: > "$OUT/table1.tsv"
while read -r params heads hidden layers t p gpus batch tflops; do
  "$B" project --plan --profile "$PROFILE" --transformer gpt3-175b --layers "$layers" --hidden "$hidden" --heads "$heads" \
      --tokens 2048 --vocab 51200 --gpus "$gpus" --global-batch "$batch" --gpu-memory-gb 80 --gpu-tflops 156 --show 6 --out "$OUT" > /dev/null
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$params" "$heads" "$hidden" "$layers" "$t" "$p" "$gpus" "$batch" "$tflops" \
      "$OUT/dgx-a100-hdr-gpt3-l$layers-h$hidden-${gpus}gpus-plan.jsonl" >> "$OUT/table1.tsv"
done <<< "$TABLE1"
"$B" project --plan --profile "$PROFILE" --transformer gpt3-175b --gpus 1024 --global-batch 1536 --out "$OUT" > /dev/null
"$B" project --plan --profile jobs/clusters/h100-ndr.toml --transformer vit-h14 --gpus 64 --global-batch 4096 --gpu-tflops 400 --out "$OUT" > /dev/null

python3 - "$OUT" <<'PY' | tee "$OUT/README.md"
import json, sys
out = sys.argv[1]
print("# `project --plan` against Megatron-LM's published layouts\n")
print("Narayanan et al. (SC 2021), table 1: GPT models of 1.7 to 1,008 billion parameters trained on Selene (DGX A100 80 GB, 8 HDR InfiniBand adapters per node) with the tensor-parallel size T and pipeline size P in the first columns. `hpc-train project --plan` was given the same shapes, GPU counts and batch sizes, the profile `jobs/clusters/dgx-a100-hdr.toml`, 80 GB per GPU and 156 TFLOP/s sustained per GPU on the layers (half the A100's 312 peak); the plan's fastest layout and where the paper's (T, P) ranks among the plan's layouts (its best micro-batch size) are below. `scripts/project-plan.sh` made this file.\n")
print("| params (B) | GPUs | batch | paper T x P | paper TFLOP/s/GPU | plan's fastest D x P x T (micro-batch) | its projected TFLOP/s/GPU | paper's layout in the plan: rank, TFLOP/s/GPU | layouts that fit |")
print("|---|---|---|---|---|---|---|---|---|")
for line in open(f"{out}/table1.tsv"):
    params, heads, hidden, layers, t, p, gpus, batch, tflops, path = line.split("\t")
    rows = [json.loads(l) for l in open(path.strip())]
    if not rows:
        print(f"| {params} | {gpus} | {batch} | {t} x {p} | {tflops} | none fits | - | - | 0 |")
        continue
    best = rows[0]["layout"]
    paper = next((r for r in rows if r["layout"]["tensor"] == int(t) and r["layout"]["pipeline"] == int(p)), None)
    where = f"{paper['rank']}, {paper['layout']['achieved_flops_per_gpu'] / 1e12:.0f}" if paper else "does not fit or divide"
    print(f"| {params} | {gpus} | {batch} | {t} x {p} | {tflops} | {best['data']} x {best['pipeline']} x {best['tensor']} ({best['micro_batch']}) | {best['achieved_flops_per_gpu'] / 1e12:.0f} | {where} | {len(rows)} |")
PY
