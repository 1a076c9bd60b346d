#!/usr/bin/env bash
# The speed figures of results/speed/ (issue 14), on an otherwise idle machine (about 10 min on
# 2 cores): the exchange against the memory bound, Horovod-style against MPI_Allreduce on
# ResNet-50's tensors, the parameter server before and after (set HPC_TRAIN_BEFORE to the
# binary of the earlier commit), and the response cache with overlap. The comparison with
# PyTorch (and overlap on against off) is scripts/compare-pytorch.sh.
#   scripts/measure-speed.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
B="$HPC_TRAIN_BIN"
R=results/speed
mkdir -p "$R"
stamp() { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, $(git rev-parse --short HEAD): $*"; }
# One rank per core when they fit (Open MPI binds them), unbound when oversubscribed.
mpi() { local n=$1 bin=$2; shift 2; mpirun -n "$n" --oversubscribe "$bin" "$@"; }

# Rounds: every strategy measured in turn, the first one changing from round to round, each row
# pooled over the rounds (this VM's speed drifts by tens of percent within minutes).
{ stamp "bench, 2 ranks, one tensor, ring and rhd against MPI_Allreduce and the memory bound"
  mpi 2 "$B" bench --strategies ring,rhd,auto,allreduce --min-bytes 1M --max-bytes 64M --factor 4 --iters 10 --warmup 2 --rounds 5 --results "$R"; } 2>&1 | tee "$R/bench-2-ranks.txt"
# The same ring over MPI messages (on one node it reads node-shared memory by default), for
# comparison: its rows say ring_transport "mpi".
{ stamp "bench, 2 ranks, one tensor, the ring over MPI point-to-point (--ring-transport mpi)"
  mpi 2 "$B" bench --strategies ring --ring-transport mpi --min-bytes 1M --max-bytes 64M --factor 4 --iters 10 --warmup 2 --rounds 5 --results "$R"; } 2>&1 | tee "$R/bench-2-ranks-ring-mpi.txt"
# auto chooses with the model fitted to this layout's own ring and rhd rows, as a user would run
# it (`hpc-train model fit`, then --cost-model): MPI's link costs from the ring over MPI and rhd,
# the shared-memory ring's own from its rows.
rm -rf "$R/fit-4-ranks" && mkdir -p "$R/fit-4-ranks"
{ stamp "bench, 4 ranks (oversubscribed), ring (over MPI, then through shared memory) and rhd for the cost model; the fit"
  mpi 4 "$B" bench --strategies ring,rhd --ring-transport mpi --min-bytes 4K --max-bytes 16M --factor 4 --iters 20 --warmup 3 --rounds 3 --results "$R/fit-4-ranks"
  mpi 4 "$B" bench --strategies ring --min-bytes 4K --max-bytes 16M --factor 4 --iters 20 --warmup 3 --rounds 3 --results "$R/fit-4-ranks"
  "$B" model fit --bench "$R/fit-4-ranks/bench.jsonl" --out "$R/cost-model-4-ranks.json"; } 2>&1 | tee "$R/fit-4-ranks.txt"
{ stamp "bench, 4 ranks (oversubscribed), auto (fitted model) against MPI_Allreduce"
  mpi 4 "$B" bench --strategies auto,rhd,ring,allreduce --min-bytes 4K --max-bytes 16M --factor 4 --iters 20 --warmup 3 --rounds 5 --cost-model "$R/cost-model-4-ranks.json" --results "$R"; } 2>&1 | tee "$R/bench-4-ranks.txt"
# 20 rounds here (a round takes about 2 s): two runs of 5 rounds each, minutes apart, gave
# horovod / allreduce 0.94 and 1.19 at 16 MiB on the same binary.
{ stamp "bench, 2 ranks, ResNet-50's 161 tensors: Horovod-style against MPI_Allreduce"
  mpi 2 "$B" bench --strategies horovod,allreduce --layout resnet50 --min-bytes 1M --max-bytes 128M --factor 4 --iters 10 --warmup 3 --rounds 20 --results "$R"; } 2>&1 | tee "$R/bench-2-ranks-resnet50-horovod.txt"
for bin in ${HPC_TRAIN_BEFORE:-} "$B"; do
  { stamp "bench, parameter server, 2 servers and 3 workers, ResNet-50's tensors, binary $bin"
    mpi 5 "$bin" bench --strategies ps --servers 2 --layout resnet50 --min-bytes 1M --max-bytes 64M --factor 4 --iters 10 --warmup 2 --results "$R/ps-$(basename "$bin")"; } 2>&1 | tee "$R/bench-ps-$(basename "$bin").txt"
done
{ stamp "Horovod-style with overlap: response cache over 60 steps, 2 ranks, tiny CNN"
  # 5 KB buckets: the tiny CNN's 20 KB of gradients in several, or there is nothing to overlap.
  mpi 2 "$B" --strategy horovod --overlap on --model tiny --data datasets/fashion-mnist.h5 --batch-size 32 --steps 60 --no-eval --threads 1 --bucket-mb 0.005 --results "$R"; } 2>&1 | tee "$R/horovod-cache.txt"
