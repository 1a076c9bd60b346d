#!/usr/bin/env bash
# The weak-scaling accuracy study of results/large-batch/ (issue 35): ResNet-18 on a part of
# Fashion-MNIST, 16 samples per rank, 1, 2, 4 and 8 ranks (oversubscribed on small machines),
# a fixed number of epochs. Per rank count: SGD at the 1-rank learning rate (constant), and
# Goyal et al.'s recipe (the rate scaled linearly with the global batch, a linear warm-up);
# at 8 ranks also LARS. Each run records its test accuracy after every epoch (runs.jsonl), and
# `hpc-train report` makes the table and the plot of accuracy against ranks.
#
# The part of Fashion-MNIST: the first --train-samples training and --test-samples test images
# of the Debian package (Fashion-MNIST's files are shuffled), cut from the IDX files with
# Python's standard library and imported as usual. On 2 cores ResNet-18 trains about 40
# images/s, so the default (5,120 x 3 epochs, 10 runs) takes about 80 minutes; the runs go
# from the most telling (8 ranks) to the least, so a cut-short study still compares.
#
# --decay cosine adds a cosine decay of the rate to 0 over the run to every recipe (study id
# large-batch-resnet18-cosine, logs *-cosine.txt); --runs picks runs by name (constant-N,
# recipe-N, lars-8); --target-accuracy A records the time to accuracy A.
#   scripts/measure-large-batch.sh [--epochs 3] [--train-samples 5120] [--test-samples 2000] [--out results/large-batch]
#                                  [--decay constant|cosine] [--runs "constant-1 recipe-8"] [--target-accuracy 0.8]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
epochs=3 train=5120 test=2000 out=results/large-batch decay=constant target=0.8
runs="constant-8 recipe-8 lars-8 constant-1 recipe-4 constant-4 recipe-2 constant-2"
while [ $# -gt 0 ]; do
    case "$1" in
        --decay) decay="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        --target-accuracy) target="$2"; shift 2 ;;
        --epochs) epochs="$2"; shift 2 ;;
        --train-samples) train="$2"; shift 2 ;;
        --test-samples) test="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        *) echo "measure-large-batch.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
B="$HPC_TRAIN_BIN"
mkdir -p "$out/logs"
data="$out/fashion-mnist-$train.h5"
if ! "$B" data info "$data" >/dev/null 2>&1; then
    cut=$(mktemp -d)
    trap 'rm -rf "$cut"' EXIT
    python3 - "$cut" "$train" "$test" <<'EOF'
import gzip, struct, sys
src = "/usr/share/datasets/fashion-mnist/"
out, train, test = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def cut(name, n, dest):
    data = gzip.open(src + name).read()
    magic = struct.unpack(">I", data[:4])[0]
    dims = list(struct.unpack(">" + "I" * (magic & 0xFF), data[4:4 + 4 * (magic & 0xFF)]))
    if n > dims[0]:
        sys.exit(f"{name} holds {dims[0]} items, fewer than {n}")
    per = 1
    for d in dims[1:]:
        per *= d
    start = 4 + 4 * len(dims)
    body = data[start:start + n * per]
    dims[0] = n
    with gzip.open(f"{out}/{dest}", "wb") as f:
        f.write(struct.pack(">I", magic) + struct.pack(">" + "I" * len(dims), *dims) + body)
cut("train-images-idx3-ubyte.gz", train, "train-images.gz")
cut("train-labels-idx1-ubyte.gz", train, "train-labels.gz")
cut("t10k-images-idx3-ubyte.gz", test, "test-images.gz")
cut("t10k-labels-idx1-ubyte.gz", test, "test-labels.gz")
EOF
    "$B" data import --format idx --force --name "fashion-mnist-$train" \
        --train-images "$cut/train-images.gz" --train-labels "$cut/train-labels.gz" \
        --test-images "$cut/test-images.gz" --test-labels "$cut/test-labels.gz" --out "$data"
fi

stamp() { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, $(git rev-parse --short HEAD): $*"; }
tag=large-batch-resnet18 suffix=""
[ "$decay" = constant ] || { tag="$tag-$decay"; suffix="-$decay"; }
common=(--model resnet18 --data "$data" --batch-size 16 --epochs "$epochs" --strategy ring --log-every 1000
        --study "$tag" --results "$out" --lr-schedule "$decay" --target-accuracy "$target")
constant=(--optimizer sgd --lr 0.05)
recipe=(--optimizer sgd --lr 0.05 --scale-lr linear --base-batch 16 --warmup-epochs 1)
lars=(--optimizer lars --lr 2 --warmup-epochs 1)
run() {
    local name="$1" ranks="${1##*-}" recipe_args
    case "$name" in
        constant-*) recipe_args=("${constant[@]}") ;;
        recipe-*) recipe_args=("${recipe[@]}") ;;
        lars-*) recipe_args=("${lars[@]}") ;;
        *) echo "measure-large-batch.sh: unknown run $name" >&2; exit 2 ;;
    esac
    { stamp "$name$suffix: ResNet-18, $train training images, $ranks rank(s) x 16, $epochs epochs, decay $decay: ${recipe_args[*]}"
      mpirun -n "$ranks" --oversubscribe --bind-to none "$B" "${common[@]}" "${recipe_args[@]}"; } \
        2>&1 | tee "$out/logs/$name$suffix.txt"
}
for name in $runs; do
    run "$name"
done
"$B" report --input "$out/runs.jsonl" --study "$tag" --out "$out/report$suffix" || echo "report failed (see above)"
