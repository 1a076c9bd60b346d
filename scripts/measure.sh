#!/usr/bin/env bash
# The measurements recorded in results/strategies/ (CPU, this machine): exchange benchmarks, the CPU
# training reference, the weak and strong studies, overlap, parameter-server variants, and the
# report built from them. Takes about 45 minutes on 2 cores; run on an otherwise idle machine.
#   scripts/measure.sh [bench|reference|studies|overlap|ps|data|report|all]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
what=${1:-all}
B="$HPC_TRAIN_BIN"
R=results/strategies
DATA=datasets/fashion-mnist.h5
mkdir -p "$R/logs"
# Default binding: a rank per core up to the core count (unbound when oversubscribed).
mpi() { local n=$1; shift; mpirun -n "$n" --oversubscribe "$B" "$@"; }
stamp() { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores: $*"; }

if [[ $what == bench || $what == all ]]; then
    # Rounds: every strategy measured in turn, the first one changing from round to round, each
    # row the median of all rounds' iterations (this VM's speed drifts within minutes).
    for n in 2 4; do
        { stamp "bench, $n ranks, one tensor"; mpi "$n" bench --strategies ring,allreduce --min-bytes 4K --max-bytes 256M --iters 10 --warmup 3 --rounds 3 --results $R; } 2>&1 | tee "$R/logs/bench-$n-ranks.txt"
        { stamp "bench, $n ranks, one tensor"; mpi "$n" bench --strategies ps,horovod --min-bytes 4K --max-bytes 64M --iters 5 --warmup 2 --rounds 3 --results $R; } 2>&1 | tee "$R/logs/bench-$n-ranks-ps-horovod.txt"
    done
    { stamp "bench, 2 ranks, ResNet-50's 161 tensors"; mpi 2 bench --strategies ring,allreduce,horovod --layout resnet50 --min-bytes 64K --max-bytes 128M --factor 4 --iters 7 --warmup 2 --rounds 3 --results $R; } 2>&1 | tee "$R/logs/bench-2-ranks-resnet50-layout.txt"
    for seg in 64 256 1024 4096 65536; do
        { stamp "ring segment $seg KiB, 2 ranks"; mpi 2 bench --strategies ring,allreduce --min-bytes 1M --max-bytes 64M --factor 4 --iters 30 --warmup 3 --segment-kb "$seg" --results "$R/segments"; } 2>&1 | tee "$R/logs/segment-$seg-kib.txt"
    done
fi

train_common=(--data "$DATA" --threads 1 --skip-steps 3 --no-eval --results "$R")
if [[ $what == reference || $what == all ]]; then
    for model in resnet18 resnet50; do
        for n in 1 2 4; do
            { stamp "reference $model $n ranks"; mpi "$n" --strategy allreduce --model "$model" --batch-size 32 --steps 13 --study cpu-reference "${train_common[@]}"; } 2>&1 | tee -a "$R/logs/reference.txt"
        done
    done
fi

if [[ $what == studies || $what == all ]]; then
    { stamp "weak study"; mpi 4 study --scaling weak --ranks 1,2,4 --strategies ring,ps,allreduce,horovod --study-id cpu-weak-resnet18 --model resnet18 --batch-size 16 --steps 11 "${train_common[@]}"; } 2>&1 | tee "$R/logs/study-weak.txt"
    { stamp "strong study"; mpi 4 study --scaling strong --ranks 1,2,4 --strategies ring,ps,allreduce,horovod --study-id cpu-strong-resnet18 --model resnet18 --global-batch 48 --steps 11 "${train_common[@]}"; } 2>&1 | tee "$R/logs/study-strong.txt"
fi

if [[ $what == overlap || $what == all ]]; then
    for model in resnet18 resnet50; do
        for n in 2 4; do
            for o in off on; do
                { stamp "overlap $o $model $n ranks"; mpi "$n" --strategy ring --model "$model" --batch-size 16 --steps 11 --overlap "$o" --study "cpu-overlap" "${train_common[@]}"; } 2>&1 | tee -a "$R/logs/overlap.txt"
            done
        done
    done
fi

if [[ $what == ps || $what == all ]]; then
    for spec in "2|--servers 1|--ps-mode sync" "2|--ps-colocate|--ps-mode sync" "4|--servers 1|--ps-mode sync" "4|--servers 2|--ps-mode sync" \
                "4|--servers 1|--ps-mode async --max-staleness 4" "4|--servers 2|--ps-mode async --max-staleness 4" "4|--ps-colocate|--ps-mode sync"; do
        IFS='|' read -r n layout mode <<< "$spec"
        # shellcheck disable=SC2086
        { stamp "ps $n ranks $layout $mode"; mpi "$n" --strategy ps $layout $mode --model resnet18 --batch-size 16 --steps 11 --study cpu-ps "${train_common[@]}"; } 2>&1 | tee -a "$R/logs/ps.txt"
    done
    for n in 2 4; do
        for s in ring allreduce; do
            { stamp "$s $n ranks (ps comparison)"; mpi "$n" --strategy "$s" --model resnet18 --batch-size 16 --steps 11 --study cpu-ps "${train_common[@]}"; } 2>&1 | tee -a "$R/logs/ps.txt"
        done
    done
    { stamp "bench ps, 4 ranks, 1 and 2 servers, ResNet-50 layout"; mpi 4 bench --strategies ps,ring,allreduce --layout resnet50 --min-bytes 1M --max-bytes 64M --factor 4 --iters 10 --warmup 2 --servers 2 --results $R; } 2>&1 | tee "$R/logs/bench-ps-4-ranks.txt"
fi

if [[ $what == data || $what == all ]]; then
    # ResNet-50 where images are large (224x224), to compare with `data bench` and check that
    # training does not wait for data (data_wait_ms).
    synth=/tmp/hpc-train-synth-3x224x224.h5
    [ -f "$synth" ] || "$B" data synth --samples 2000 --test-samples 0 --shape 3x224x224 --classes 1000 --out "$synth"
    for n in 1 2 4; do
        { stamp "resnet50 on 3x224x224, $n ranks"; mpi "$n" --strategy ring --model resnet50 --data "$synth" --batch-size 4 --steps 8 --threads 1 --skip-steps 2 --no-eval --study cpu-data --results "$R"; } 2>&1 | tee -a "$R/logs/data.txt"
    done
    for n in 1 2 4; do
        { stamp "data bench 3x224x224, $n ranks"; mpi "$n" data bench "$synth" --batch-size 4 --epochs 2 --results "$R"; } 2>&1 | tee -a "$R/logs/data.txt"
    done
fi

if [[ $what == report || $what == all ]]; then
    # The two studies on their own, then every record and the exchange benchmark together.
    rm -rf "$R/report"
    "$B" report --input "$R/runs.jsonl" --study cpu-weak-resnet18 --bench "$R/bench.jsonl" --out "$R/report/weak"
    "$B" report --input "$R/runs.jsonl" --study cpu-strong-resnet18 --bench "$R/bench.jsonl" --out "$R/report/strong"
    "$B" report --input "$R/runs.jsonl" --bench "$R/bench.jsonl" --out "$R/report/all"
fi
