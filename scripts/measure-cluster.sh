#!/usr/bin/env bash
# The multi-node figures of results/cluster/ (issues 15 and 16), on namespaced nodes of this one
# machine (scripts/local-cluster.sh), on an otherwise idle machine (about 15 minutes):
#   1. hpc-train bench across 2 nodes x 1 and x 2 ranks (and 4 x 1), links at 1,000 and 10,000
#      Mbit/s, 1-64 MiB, ring, rhd, MPI_Allreduce, horovod and ps, rows tagged with --link-mbit
#      (more iterations at 10,000 Mbit/s, where a step is short and the shared cores are noisy);
#      and Horovod-style hierarchical at 2 nodes x 2 (the one layout where it differs);
#   2. a weak-scaling ResNet-18 study over 1, 2 and 4 nodes (1 rank each) at 1,000 Mbit/s, and
#      its report;
#   3. the cost model fitted per link rate (scripts/fit-cluster.sh), then `auto` benched on the
#      same layouts with that rate's fitted model, the one it would run with;
#   4. the fit again, with every row checked against its prediction (scripts/fit-cluster.sh,
#      which can also be run alone on the recorded rows).
#   scripts/measure-cluster.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
B="$HPC_TRAIN_BIN"
R=results/cluster
C=$(mktemp -d /tmp/hpc-measure-cluster.XXXX)
mkdir -p "$R/logs"
stamp() { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, $(git rev-parse --short HEAD): $*"; }
cleanup() { scripts/local-cluster.sh down "$C/cluster" >/dev/null 2>&1 || true; rm -rf "$C"; }
trap cleanup EXIT

# bench_all NAME STRATEGIES [bench options...]: every layout (or those of BENCH_LAYOUTS, e.g.
# "2x2") at both rates; NAME tags the logs, and a {mbit} in an option becomes the link rate.
bench_all() {
    local name=$1 strategies=$2; shift 2
    for mbit in 1000 10000; do
        local iters=5 warmup=2
        [ "$mbit" -eq 10000 ] && { iters=40; warmup=5; }
        for nodes in 2 4; do
            scripts/local-cluster.sh up "$C/cluster" --nodes "$nodes" --link-mbit "$mbit"
            layouts="1"; [ "$nodes" -eq 2 ] && layouts="1 2"
            for per_node in $layouts; do
                [[ " ${BENCH_LAYOUTS:-2x1 2x2 4x1} " == *" ${nodes}x${per_node} "* ]] || continue
                ranks=$((nodes * per_node))
                { stamp "bench ($name), $nodes nodes x $per_node rank(s), links $mbit Mbit/s"
                  scripts/local-cluster.sh run "$C/cluster" -- mpirun -n "$ranks" --map-by "ppr:$per_node:node" "$B" bench \
                      --strategies "$strategies" --min-bytes 1M --max-bytes 64M --factor 4 --iters "$iters" --warmup "$warmup" \
                      --link-mbit "$mbit" --results "$R" "${@//\{mbit\}/$mbit}"; } 2>&1 | tee "$R/logs/$name-${nodes}x${per_node}-${mbit}mbit.txt"
            done
            scripts/local-cluster.sh down "$C/cluster"
        done
    done
}
bench_all bench ring,rhd,allreduce,horovod,ps
BENCH_LAYOUTS=2x2 bench_all bench-hierarchical horovod --hierarchical

# Weak scaling over nodes at 1 Gbit/s: ResNet-18 on 3x32x32, batch 16 per rank.
data="$C/synth-3x32.h5"
"$B" data synth --samples 2048 --test-samples 64 --shape 3x32x32 --classes 10 --out "$data" >/dev/null
for nodes in 1 2 4; do
    scripts/local-cluster.sh up "$C/cluster" --nodes "$nodes" --link-mbit 1000
    { stamp "weak scaling, ResNet-18 3x32x32, $nodes node(s) x 1 rank, links 1000 Mbit/s"
      scripts/local-cluster.sh run "$C/cluster" -- mpirun -n "$nodes" --map-by ppr:1:node "$B" --strategy ring \
          --model resnet18 --data "$data" --batch-size 16 --steps 23 --skip-steps 3 --threads 1 --no-eval \
          --study cluster-weak-1gbit --results "$R"; } 2>&1 | tee "$R/logs/weak-${nodes}-nodes.txt"
    scripts/local-cluster.sh down "$C/cluster"
done
"$B" report --input "$R/runs.jsonl" --study cluster-weak-1gbit --out "$R/report"

# auto's choice is only as good as its model: bench it with the model fitted to the rows above.
scripts/fit-cluster.sh
bench_all bench-auto auto --cost-model "$R/cost-model-{mbit}mbit.json"

# The cost model per link rate, and every row against its prediction (rows within one node,
# results/speed on the same machine, give the node's own links).
scripts/fit-cluster.sh
