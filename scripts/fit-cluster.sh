#!/usr/bin/env bash
# The cost model fitted to the namespaced cluster's recorded bench rows, per link rate, and its
# predictions checked against the recorded rows of that same rate (and, at 1 Gbit/s, against the
# weak-scaling training runs). Needs no cluster and takes seconds: it reads rows that
# scripts/measure-cluster.sh recorded. Writes results/cluster/cost-model-<rate>mbit.json,
# results/cluster/logs/fit-<rate>mbit.txt, results/projection/local-<rate>mbit/ and both rates'
# validation in results/projection/validation.csv.
#   scripts/fit-cluster.sh [ONE_NODE_ROWS]
# ONE_NODE_ROWS: bench rows within one node of the same machine, for the node's own links
# (default results/speed/bench.jsonl).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
B="$HPC_TRAIN_BIN"
R=results/cluster
one_node="${1:-results/speed/bench.jsonl}"
[ -f "$one_node" ] || { echo "fit-cluster.sh: no file $one_node (bench rows within one node)" >&2; exit 2; }
T=$(mktemp -d /tmp/hpc-fit-cluster.XXXX)
trap 'rm -rf "$T"' EXIT
mkdir -p "$R/logs"

cat "$one_node" "$R/bench.jsonl" > "$T/all-bench.jsonl"
for mbit in 1000 10000; do
    # Each namespaced node has one veth link: its ranks crossing at once share it.
    { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD): model fit of $R/bench.jsonl at $mbit Mbit/s, one-node rows from $one_node"
      "$B" model fit --bench "$T/all-bench.jsonl" --link-mbit "$mbit" --servers 1 --nics-per-node 1 --out "$R/cost-model-${mbit}mbit.json"; } | tee "$R/logs/fit-${mbit}mbit.txt"
    # Validation against the rows measured at this rate only, and the training runs (1 Gbit/s).
    grep "\"link_mbit\":${mbit}.0[,}]" "$R/bench.jsonl" > "$T/bench-${mbit}.jsonl"
    runs=(); [ "$mbit" -eq 1000 ] && runs=(--validate-runs "$R/runs.jsonl")
    printf 'name = "local namespaced cluster, %s Mbit/s (fitted)"\nranks_per_node = 1\nfitted = "%s"\n' \
        "$mbit" "$PWD/$R/cost-model-${mbit}mbit.json" > "$T/local-cluster.toml"
    out="results/projection/local-${mbit}mbit"
    rm -rf "$out"
    "$B" project --profile "$T/local-cluster.toml" --model resnet18 --from-runs "$R/runs.jsonl" --batch 16 --ranks 1,2,4 \
        --validate-bench "$T/bench-${mbit}.jsonl" "${runs[@]}" --out "$out" > "$T/project-${mbit}.log"
    echo "# validation: $out/validation.csv"
done
# Both rates in one table (the columns carry link_mbit): results/projection/validation.csv.
all=results/projection/validation.csv
head -n 1 results/projection/local-1000mbit/validation.csv > "$all"
for mbit in 1000 10000; do tail -n +2 "results/projection/local-${mbit}mbit/validation.csv" >> "$all"; done
echo "# validation, both rates: $all ($(($(wc -l < "$all") - 1)) rows)"
