#!/usr/bin/env bash
# The projections of results/projection/ from the public cluster profiles of jobs/clusters/
# (issue 16): ResNet-50 weak scaling to 1,024 GPUs on H100 + NDR, and NVIDIA's DGX A100
# ResNet-50 figure (1 and 8 GPUs). Takes seconds and measures nothing.
#   scripts/project-published.sh
# The compute times: 78 ms for a 256-image H100 step (about 3,300 img/s with AMP, an assumed
# figure) and 103.6 ms for the DGX A100's published 2,470 img/s on one GPU (256 / 2,470).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
B="$HPC_TRAIN_BIN"
P=results/projection
mkdir -p "$P"
"$B" project --profile jobs/clusters/h100-ndr.toml --model resnet50 --compute-ms 78 --batch 256 --out "$P" > "$P/h100-ndr-resnet50.log"
"$B" project --profile jobs/clusters/dgx-a100-hdr.toml --model resnet50 --compute-ms 103.6 --batch 256 --ranks 1,8 --out "$P" > "$P/dgx-a100-hdr-resnet50.log"
grep -h "(projected) | \(8\|64\|512\|1024\) |" "$P/h100-ndr-resnet50.md" "$P/dgx-a100-hdr-resnet50.md"
