#!/usr/bin/env bash
# hpc-train's optimizers and learning-rate schedules (issue 35) against torch.optim and
# torch.optim.lr_scheduler: for each row, back to back from the same initial weights, hpc-train
# (float32, one rank), PyTorch in float64 (the reference) and PyTorch in float32
# (scripts/optim_reference.py); a row passes when hpc-train's final weights are at most twice as
# far from the float64 reference as PyTorch float32's (L2 over all parameters, and over the
# batch-norm running statistics apart). PyTorch float32's distance is the largest of K + 1
# float32 runs: from the shared initial weights, and from K copies of them nudged by at most one
# ulp per element (float32 rounding alone moves ResNet-18's weights over an order of magnitude
# of distances, by which side of a ReLU's kink values near 0 fall on). Writes
# DIR/pytorch-equality.md (the table, the machine, the commands) and DIR/pytorch-equality.jsonl
# (one JSON line per row) beside it.
#
#   scripts/compare-optim-pytorch.sh           the whole matrix (27 rows, about 8 minutes on 2 cores)
#   scripts/compare-optim-pytorch.sh --quick   5 rows (about a minute), table in a scratch folder
#   options: --out DIR (default results/large-batch; with --quick a scratch folder),
#            --rows 1,5,13 (rows of the whole matrix by number), --factor F (default 2),
#            --nudges K (default 3), --keep-scratch, -h
#   environment: HPC_TRAIN_BIN (default target/release/hpc-train of this repository),
#                PYTORCH_VENV (default .venv-pytorch, shared with compare-pytorch.sh),
#                FASHION_H5 (default datasets/fashion-mnist.h5)
#   exit status: 0 every row passed, 1 a row failed or could not run, 2 bad usage,
#                77 PyTorch could not be installed (nothing was compared)
#
# The rows: the tiny CNN (8 steps, batch 32) and ResNet-18 (4 steps, batch 16; CIFAR-style stem
# at 28x28), each with sgd, lars and adamw under constant, step, cosine and poly decay after a
# linear warm-up, some with --scale-lr linear, --label-smoothing 0.1 or a non-zero --end-lr; and
# vit-tiny (6 steps, batch 16) against torchvision's VisionTransformer of the same configuration
# (issue 38), with sgd and with adamw under cosine decay.
# Each model trains on the first B training images of Fashion-MNIST, B its batch: every step
# then reads the whole subset, so one epoch is one step (E = ceil(samples / batch) = 1) and
# --warmup-epochs and --lr-steps count steps. PyTorch reads the samples in hpc-train's order
# (its ChaCha8 shuffle, rebuilt in optim_reference.py), so that both sides sum in the same order.
#
# hpc-train runs as one process without mpirun (an MPI singleton); where that fails, under
# `mpirun -n 1` (hpc_train_mpirun of scripts/env.sh). Everything runs on one thread. PyTorch
# (torch 2.11.0 with its Python dependencies, h5py, numpy; about 4.6 GB from PyPI) goes into
# the venv on first use, as scripts/compare-pytorch.sh does: the libtorch in .venv has no
# Python dependencies and no CUDA libraries, so Python cannot import it.
set -euo pipefail

user_bin="${HPC_TRAIN_BIN:-}"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
ROOT="$HPC_TRAIN_ROOT"
BIN_SOURCE="${user_bin:-$HPC_TRAIN_BIN}"
export HPC_TRAIN_BIN="$BIN_SOURCE"   # hpc_train_mpirun picks the launcher of this binary's MPI
VENV="${PYTORCH_VENV:-$ROOT/.venv-pytorch}"
FASHION="${FASHION_H5:-$ROOT/datasets/fashion-mnist.h5}"
# shellcheck source=scripts/lib/pytorch-venv.sh
source "$ROOT/scripts/lib/pytorch-venv.sh"
TORCH_VERSION=$PYTORCH_VENV_TORCH
TORCHVISION_VERSION=$PYTORCH_VENV_TORCHVISION
REF="$ROOT/scripts/optim_reference.py"
SKIP=77

quick=0
out=""
rows_wanted=""
factor=2
nudges=3
keep_scratch=0
orig_args=("$@")
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        --out) out="${2:?--out needs a folder}"; shift ;;
        --rows) rows_wanted="${2:?--rows needs numbers}"; shift ;;
        --factor) factor="${2:?--factor needs a number}"; shift ;;
        --nudges) nudges="${2:?--nudges needs a count}"; shift ;;
        --keep-scratch) keep_scratch=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "compare-optim-pytorch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ "$factor" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "compare-optim-pytorch.sh: --factor $factor: expected a positive number" >&2; exit 2; }
[[ "$nudges" =~ ^[0-9]+$ ]] || { echo "compare-optim-pytorch.sh: --nudges $nudges: expected a count" >&2; exit 2; }
[[ -z "$rows_wanted" || "$rows_wanted" =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "compare-optim-pytorch.sh: --rows $rows_wanted: expected numbers like 1,5,13" >&2; exit 2; }

say() { printf '\n==> %s\n' "$*"; }
die() { echo "compare-optim-pytorch.sh: $*" >&2; exit 1; }

scratch="$(mktemp -d "${TMPDIR:-/tmp}/compare-optim-pytorch.XXXXXX")"
cleanup() {
    if [ $keep_scratch -eq 1 ]; then rm -f "$scratch/hpc-train"; echo "scratch kept: $scratch"; else rm -rf "$scratch"; fi
}
trap cleanup EXIT

if [ -z "$out" ]; then
    if [ $quick -eq 1 ]; then out="$scratch/table"; keep_scratch=1; else out="$ROOT/results/large-batch"; fi
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
table="$out/pytorch-equality.md"
raw="$out/pytorch-equality.jsonl"

# ---- 1. The hpc-train binary, copied so that a rebuild during the run cannot mix two builds. ----
[ -x "$BIN_SOURCE" ] || die "no hpc-train binary at $BIN_SOURCE: build it (cargo build --release, or scripts/setup.sh --no-run) or set HPC_TRAIN_BIN"
BIN="$scratch/hpc-train"
cp "$BIN_SOURCE" "$BIN"
bin_info="$BIN_SOURCE (built $(date -u -r "$BIN_SOURCE" +%Y-%m-%dT%H:%M:%SZ))"
"$BIN" --help | grep -q -- '--init-weights' \
    || die "$BIN_SOURCE has no --init-weights (a build from before issue 35's optimizers): rebuild it"

# ---- 2. PyTorch: the venv compare-pytorch.sh makes (scripts/lib/pytorch-venv.sh), made here on first use. ----
PY="$VENV/bin/python"
if ! ensure_pytorch_venv "$VENV"; then
    echo "compare-optim-pytorch.sh: skipped: PyTorch $TORCH_VERSION with torchvision $TORCHVISION_VERSION, h5py and numpy could not be installed into $VENV" >&2
    exit $SKIP
fi
torch_version="$("$PY" -c 'import torch; print(torch.__version__)')"

# ---- 3. Data: one batch of Fashion-MNIST per model; initial weights once per model. ----
"$BIN" data info "$FASHION" >/dev/null 2>&1 || die "$FASHION is missing or unreadable: run scripts/setup.sh --no-run first (or set FASHION_H5)"

# The matrix: number|model|optimizer|schedule|flags[|note] (the same flags for hpc-train and
# for optim_reference.py; hpc-train refuses a flag its optimizer or schedule does not read).
TINY_LR_SGD="--lr 0.05"; TINY_LR_LARS="--lr 1.0"; TINY_LR_ADAMW="--lr 0.003"
R18_LR_SGD="--lr 0.01"; R18_LR_LARS="--lr 0.1"; R18_LR_ADAMW="--lr 0.0003"
MATRIX=(
    "1|tiny|sgd|constant|$TINY_LR_SGD --warmup-epochs 2"
    "2|tiny|sgd|step|$TINY_LR_SGD --warmup-epochs 2 --lr-steps 4,6 --label-smoothing 0.1"
    "3|tiny|sgd|cosine|--lr 0.4 --scale-lr linear --base-batch 256 --warmup-epochs 2"
    "4|tiny|sgd|poly|$TINY_LR_SGD --warmup-epochs 3 --poly-power 2"
    "5|tiny|lars|constant|$TINY_LR_LARS --warmup-epochs 2 --label-smoothing 0.1"
    "6|tiny|lars|step|$TINY_LR_LARS --warmup-epochs 2 --lr-steps 4,6 --lr-gamma 0.5"
    "7|tiny|lars|cosine|$TINY_LR_LARS --warmup-epochs 2 --end-lr 0.01"
    "8|tiny|lars|poly|--lr 2.0 --scale-lr linear --base-batch 64 --warmup-epochs 2 --label-smoothing 0.1"
    "9|tiny|adamw|constant|$TINY_LR_ADAMW --warmup-epochs 2"
    "10|tiny|adamw|step|$TINY_LR_ADAMW --warmup-epochs 2 --lr-steps 4,6 --label-smoothing 0.1"
    "11|tiny|adamw|cosine|--lr 0.024 --scale-lr linear --base-batch 256 --warmup-epochs 2 --end-lr 0.0001"
    "12|tiny|adamw|poly|$TINY_LR_ADAMW --warmup-epochs 2 --end-lr 0.0001 --poly-power 1"
    "13|resnet18|sgd|constant|$R18_LR_SGD --warmup-epochs 1 --label-smoothing 0.1"
    "14|resnet18|sgd|step|$R18_LR_SGD --warmup-epochs 1 --lr-steps 2,3"
    "15|resnet18|sgd|cosine|--lr 0.16 --scale-lr linear --base-batch 256 --warmup-epochs 2"
    "16|resnet18|sgd|poly|$R18_LR_SGD --warmup-epochs 1 --label-smoothing 0.1"
    "17|resnet18|lars|constant|$R18_LR_LARS --warmup-epochs 1"
    "18|resnet18|lars|step|$R18_LR_LARS --warmup-epochs 1 --lr-steps 2,3 --label-smoothing 0.1"
    "19|resnet18|lars|cosine|$R18_LR_LARS --warmup-epochs 2 --end-lr 0.001"
    "20|resnet18|lars|poly|--lr 1.6 --scale-lr linear --base-batch 256 --warmup-epochs 1"
    "21|resnet18|adamw|constant|$R18_LR_ADAMW --warmup-epochs 1 --label-smoothing 0.1"
    "22|resnet18|adamw|step|$R18_LR_ADAMW --warmup-epochs 1 --lr-steps 2,3"
    "23|resnet18|adamw|cosine|$R18_LR_ADAMW --warmup-epochs 2 --end-lr 0.00001"
    "24|resnet18|adamw|poly|--lr 0.0048 --scale-lr linear --base-batch 256 --warmup-epochs 1 --label-smoothing 0.1"
    "25|tiny|sgd|step|$TINY_LR_SGD --warmup-epochs 1.5 --lr-steps 2.25,5.5|fractional epochs: the spec's rule (k counts the milestones m with m E <= s) drops the rate after warm-up 2 (1.5 rounded) at steps 3 (2.25 epochs) and 6 (5.5), not at the nearest steps 2 and 6"
    "26|vit-tiny|sgd|constant|--lr 0.05 --warmup-epochs 1|torchvision's VisionTransformer (its patch convolution for 1 channel) from the same weights"
    "27|vit-tiny|adamw|cosine|--lr 0.001 --warmup-epochs 1 --end-lr 0.0001|torchvision's VisionTransformer (its patch convolution for 1 channel) from the same weights"
)
QUICK_ROWS="2,8,11,19,27"
[ -n "$rows_wanted" ] || rows_wanted=$([ $quick -eq 1 ] && echo "$QUICK_ROWS" || echo "")

selected=()
for row in "${MATRIX[@]}"; do
    n="${row%%|*}"
    if [ -z "$rows_wanted" ] || [[ ",$rows_wanted," == *",$n,"* ]]; then selected+=("$row"); fi
done
[ ${#selected[@]} -gt 0 ] || die "--rows $rows_wanted: no such rows (1 to ${#MATRIX[@]})"

steps_of() { case "$1" in tiny) echo 8 ;; vit-tiny) echo 6 ;; *) echo 4 ;; esac; }
batch_of() { [ "$1" = tiny ] && echo 32 || echo 16; }

declare -A prepared=()
prepare_model() {
    local model=$1 batch
    [ -n "${prepared[$model]:-}" ] && return 0
    batch=$(batch_of "$model")
    "$PY" "$REF" subset --data "$FASHION" --train "$batch" --test 16 --out "$scratch/$model.h5"
    "$BIN" data info "$scratch/$model.h5" >/dev/null || die "hpc-train cannot read the subset $scratch/$model.h5"
    "$PY" "$REF" init --model "$model" --data "$scratch/$model.h5" --seed 42 --out "$scratch/$model-init.safetensors"
    prepared[$model]=1
}

# hpc-train alone (an MPI singleton), or under mpirun -n 1 where that fails.
launch=""
run_hpc() {
    local log=$1; shift
    if [ "$launch" != mpirun ] && "$BIN" "$@" >"$log" 2>&1; then
        launch=direct; return 0
    fi
    if [ -z "$launch" ]; then
        echo "    hpc-train alone failed ($(tail -n 1 "$log")); trying mpirun -n 1" >&2
        if hpc_train_mpirun 1 "$BIN" "$@" >"$log" 2>&1; then launch=mpirun; return 0; fi
    elif [ "$launch" = mpirun ]; then
        hpc_train_mpirun 1 "$BIN" "$@" >"$log" 2>&1 && return 0
    fi
    return 1
}

# Commands as written in the table: paths relative to the scratch folder.
show() { local s="$*"; s="${s//$scratch\//}"; s="${s//$ROOT\//}"; echo "$s"; }

: > "$scratch/raw.jsonl"
failed=0
started=$(date +%s)
for row in "${selected[@]}"; do
    IFS='|' read -r n model opt sched flags note <<<"$row"
    steps=$(steps_of "$model"); batch=$(batch_of "$model")
    prepare_model "$model"
    data="$scratch/$model.h5"; init="$scratch/$model-init.safetensors"; dir="$scratch/row$n"
    mkdir -p "$dir/results"
    say "row $n: $model, $opt, $sched ($flags), $steps steps of $batch"
    # shellcheck disable=SC2206
    recipe=(--optimizer "$opt" --lr-schedule "$sched" $flags --seed 42)
    hpc_cmd=(--model "$model" --data "$data" --batch-size "$batch" --steps "$steps" --threads 1 --no-eval
             --init-weights "$init" --save-weights "$dir/hpc.safetensors" --results "$dir/results" "${recipe[@]}")
    ref_cmd=(train --model "$model" --data "$data" --batch-size "$batch" --steps "$steps" --init-weights "$init" "${recipe[@]}")
    # The float64 reference (the longest) beside hpc-train and the float32 run: 2 cores, 1 thread each.
    "$PY" "$REF" "${ref_cmd[@]}" --dtype float64 --out "$dir/f64.safetensors" --summary "$dir/f64.json" --verbose >"$dir/f64.log" 2>&1 &
    f64_pid=$!
    hpc_ok=1
    run_hpc "$dir/hpc.log" "${hpc_cmd[@]}" || hpc_ok=0
    f32_ok=1
    nudge_seeds=$(seq -s, 1 "$nudges"); nudged=""
    for k in $(seq 1 "$nudges"); do nudged="$nudged${nudged:+,}$dir/f32-nudge$k.safetensors"; done
    "$PY" "$REF" "${ref_cmd[@]}" --dtype float32 --out "$dir/f32.safetensors" --summary "$dir/f32.json" --verbose \
        ${nudge_seeds:+--nudge "$nudge_seeds"} >"$dir/f32.log" 2>&1 || f32_ok=0
    f64_ok=1
    wait "$f64_pid" || f64_ok=0
    hpc_line="$(show "$([ "$launch" = mpirun ] && echo "mpirun -n 1 ")hpc-train ${hpc_cmd[*]}")"
    commands=("$hpc_line" "$(show "python scripts/optim_reference.py ${ref_cmd[*]} --dtype float64 --out $dir/f64.safetensors")"
              "$(show "python scripts/optim_reference.py ${ref_cmd[*]} --dtype float32 --out $dir/f32.safetensors${nudge_seeds:+ --nudge $nudge_seeds}")"
              "$(show "python scripts/optim_reference.py compare --reference $dir/f64.safetensors --torch $dir/f32.safetensors${nudged:+ --nudged $nudged} --hpc $dir/hpc.safetensors --init $init")")
    tag="$("$PY" -c 'import json, sys; a = sys.argv; print(json.dumps({"row": int(a[1]), "model": a[2], "optimizer": a[3], "schedule": a[4], "extra": a[5], "steps": int(a[6]), "batch": int(a[7]), "note": a[8], "commands": a[9:]}))' \
        "$n" "$model" "$opt" "$sched" "$flags" "$steps" "$batch" "${note:-}" "${commands[@]}")"
    why=""
    [ $hpc_ok -eq 1 ] || why="hpc-train failed: $(tail -n 3 "$dir/hpc.log" | tr '\n' ' ')"
    [ $f64_ok -eq 1 ] || why="$why PyTorch float64 failed: $(tail -n 2 "$dir/f64.log" | tr '\n' ' ')"
    [ $f32_ok -eq 1 ] || why="$why PyTorch float32 failed: $(tail -n 2 "$dir/f32.log" | tr '\n' ' ')"
    if [ -z "$why" ] && "$PY" "$REF" compare --reference "$dir/f64.safetensors" --torch "$dir/f32.safetensors" \
            ${nudged:+--nudged "$nudged"} --hpc "$dir/hpc.safetensors" --init "$init" --factor "$factor" --tag "$tag" \
            --out "$scratch/raw.jsonl" >"$dir/compare.log" 2>&1; then
        "$PY" -c 'import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1]); p = r["parameters"]; b = r.get("buffers")
print("    from float64: hpc-train %.3e, torch float32 %.3e (largest with nudged starts %.3e): ratio %.2f%s -> %s" % (
      p["hpc_train"]["l2"], p["torch_f32"]["l2"], p["yardstick"], p["ratio"],
      ", buffers %.2f" % b["ratio"] if b else "", "pass" if r["pass"] else "FAIL"))
sys.exit(0 if r["pass"] else 1)' "$dir/compare.log" || failed=$((failed + 1))
    else
        [ -n "$why" ] || why="compare failed: $(tail -n 2 "$dir/compare.log" | tr '\n' ' ')"
        echo "    $why" >&2
        "$PY" -c 'import json, sys; r = json.loads(sys.argv[1]); r.update({"pass": False, "error": sys.argv[2]}); print(json.dumps(r))' \
            "$tag" "$why" >>"$scratch/raw.jsonl"
        failed=$((failed + 1))
    fi
done
elapsed=$(( $(date +%s) - started ))

# ---- 4. The table. ----
cp "$scratch/raw.jsonl" "$raw"
M_FACTOR="$factor" M_NUDGES="$nudges" M_DATE="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
M_COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src 2>/dev/null || echo ' with uncommitted changes in src/')" \
M_UNAME="$(uname -srmo)" M_NPROC="$(nproc)" M_CPU="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)" \
M_TORCH="$torch_version (PyTorch side, in $VENV); hpc-train's libtorch: ${LIBTORCH:-unknown}" \
M_BIN="$bin_info, launched $([ "$launch" = mpirun ] && echo 'under mpirun -n 1' || echo 'alone (an MPI singleton)')" \
M_RAW="$(basename "$raw")" M_COMMAND="scripts/compare-optim-pytorch.sh ${orig_args[*]}" M_ELAPSED="$elapsed" M_DATA="$(basename "$FASHION")" \
"$PY" - "$scratch/meta.json" <<'EOF'
import json, os, sys
e = os.environ
meta = {
    "factor": float(e["M_FACTOR"]), "nudges": int(e["M_NUDGES"]), "date": e["M_DATE"], "commit": e["M_COMMIT"], "uname": e["M_UNAME"],
    "nproc": e["M_NPROC"], "cpu": e["M_CPU"], "torch": e["M_TORCH"], "hpc_train": e["M_BIN"], "raw": e["M_RAW"],
    "command": e["M_COMMAND"].strip(),
    "setup": [
        f"data: the first B training images of {e['M_DATA']} (B = the batch: 32 for the tiny CNN, 16 for ResNet-18), "
        "so that every step reads the whole subset and one epoch is one step (E = 1); PyTorch reads them in "
        "hpc-train's order (its ChaCha8 shuffle, seed 42, rebuilt in optim_reference.py)",
        "initial weights: optim_reference.py init (torch.manual_seed(42), torchvision names, float32), loaded by "
        "both sides (hpc-train --init-weights)",
        f"the rows' files: MODEL.h5 = `optim_reference.py subset --data {e['M_DATA']} --train B --test 16 --out MODEL.h5`, "
        "MODEL-init.safetensors = `optim_reference.py init --model MODEL --data MODEL.h5 --seed 42 --out MODEL-init.safetensors`",
        "hpc-train: one rank, --threads 1, --no-eval, float32. PyTorch: torch.set_num_threads(1), deterministic "
        "algorithms, torch.optim.SGD and AdamW (foreach=False), LARS written from the spec's formula, "
        "torch.optim.lr_scheduler as the spec says (LinearLR then SequentialLR; MultiStepLR, CosineAnnealingLR, "
        "PolynomialLR, or LambdaLR for poly with a non-zero --end-lr)",
        "every PyTorch run checks that its scheduler's rate at each step equals the spec's formula within 1e-12 (relative)",
        f"nudged float32 starts: {e['M_NUDGES']} (seeds 1 to {e['M_NUDGES']}: each parameter element moved -1, 0 or +1 ulp)",
        f"the rows took {e['M_ELAPSED']} s in all",
    ],
}
json.dump(meta, open(sys.argv[1], "w"), indent=1)
EOF
"$PY" "$REF" table --rows "$raw" --meta "$scratch/meta.json" --output "$table" >/dev/null
say "table: $table ($(grep -c . "$raw") rows, $failed failed or could not run; ${elapsed} s)"
[ $failed -eq 0 ]
