#!/usr/bin/env bash
# hpc-train against PyTorch, back to back on the same model, data, batch, threads and optimizer;
# writes a Markdown table to results/pytorch_comparison.md and the raw records and logs to
# results/pytorch_comparison/.
#
#   scripts/compare-pytorch.sh            the full comparison (about 15 minutes on 2 cores)
#   scripts/compare-pytorch.sh --quick    a smoke test (a couple of minutes): few steps, one
#                                         repetition, table written to a scratch folder
#   options: --reps N (default 3), --rows 1,2,3,4,5 (default all), --out FILE.md (raw records
#            go to FILE/ beside it), --wait-idle S (before each run, wait up to S seconds for
#            the CPUs to be under 25% busy; default 20, 0 with --quick), --keep-scratch, -h
#   environment: HPC_TRAIN_BIN (default target/release/hpc-train of this repository),
#                PYTORCH_VENV (default .venv-pytorch), FASHION_H5 (default
#                datasets/fashion-mnist.h5), SYNTH_DIR (synthetic datasets, default datasets/)
#
# Rows (sides timed alike: the first 5 steps left out, images/s over the slowest rank):
#   1  tiny CNN, Fashion-MNIST 1x28x28, 1 rank x batch 64, 2 threads:
#        hpc-train allreduce overlap on / off, PyTorch eager
#   2  ResNet-18, synthetic 3x128x128, 1 rank x batch 16, 2 threads: the same three
#   3  tiny CNN, 2 ranks x batch 32, 1 thread each: hpc-train allreduce and ring, overlap on and
#        off, against PyTorch DDP (gloo on 127.0.0.1)
#   4  ResNet-18 3x128x128, 2 ranks x batch 16, 1 thread each: the same five
#   5  ResNet-50, synthetic 3x64x64, 2 ranks x batch 16, 1 thread each: hpc-train allreduce and ring,
#        overlap on / off, and DDP
# Every configuration runs --reps times, the order rotated each repetition (the machine is
# noisy); the table gives medians and the min-max spread.
#
# PyTorch (torch 2.11.0 with its Python dependencies, h5py, numpy; about 4.6 GB from PyPI, 90 s)
# goes into the venv on first use; later runs check its version and go on (seconds). The venv
# holds a `.gitignore` of `*`, so git ignores it wherever it is.
set -euo pipefail

user_bin="${HPC_TRAIN_BIN:-}"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
ROOT="$HPC_TRAIN_ROOT"
BIN_SOURCE="${user_bin:-$HPC_TRAIN_BIN}"
VENV="${PYTORCH_VENV:-$ROOT/.venv-pytorch}"
FASHION="${FASHION_H5:-$ROOT/datasets/fashion-mnist.h5}"
SYNTH_DIR="${SYNTH_DIR:-$ROOT/datasets}"
# shellcheck source=scripts/lib/pytorch-venv.sh
source "$ROOT/scripts/lib/pytorch-venv.sh"
# shellcheck source=scripts/lib/compare.sh
source "$ROOT/scripts/lib/compare.sh"
TORCH_VERSION=$PYTORCH_VENV_TORCH

quick=0
reps=""
rows_wanted="1,2,3,4,5"
out=""
keep_scratch=0
wait_idle=""
orig_args=("$@")
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        --reps) reps="$2"; shift ;;
        --rows) rows_wanted="$2"; shift ;;
        --out) out="$2"; shift ;;
        --keep-scratch) keep_scratch=1 ;;
        --wait-idle) wait_idle="$2"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "compare-pytorch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$reps" ] || reps=$([ $quick -eq 1 ] && echo 1 || echo 3)
[[ "$reps" =~ ^[1-9][0-9]*$ ]] || { echo "compare-pytorch.sh: --reps $reps: expected a positive count" >&2; exit 2; }
[ -n "$wait_idle" ] || wait_idle=$([ $quick -eq 1 ] && echo 0 || echo 20)
[[ "$wait_idle" =~ ^[0-9]+$ ]] || { echo "compare-pytorch.sh: --wait-idle $wait_idle: expected seconds" >&2; exit 2; }

say() { printf '\n==> %s\n' "$*"; }
die() { echo "compare-pytorch.sh: $*" >&2; exit 1; }

scratch="$(mktemp -d "${TMPDIR:-/tmp}/compare-pytorch.XXXXXX")"
cleanup() {
    if [ $keep_scratch -eq 1 ]; then rm -f "$scratch/hpc-train"; echo "scratch kept: $scratch"; else rm -rf "$scratch"; fi
}
trap cleanup EXIT

# Where the table and the raw records go. A smoke test does not replace the real table.
if [ -z "$out" ]; then
    out=$([ $quick -eq 1 ] && echo "$scratch/pytorch_comparison.md" || echo "results/pytorch_comparison.md")
    [ $quick -eq 1 ] && keep_scratch=1
fi
raw_dir="${out%.md}"

# ---- 1. The hpc-train binary, copied so that a rebuild during the run cannot mix two builds. ----
[ -x "$BIN_SOURCE" ] || die "no hpc-train binary at $BIN_SOURCE: build it (cargo build --release, or scripts/setup.sh --no-run) or set HPC_TRAIN_BIN"
BIN="$scratch/hpc-train"
cp "$BIN_SOURCE" "$BIN"
bin_info="$BIN_SOURCE (built $(date -u -r "$BIN_SOURCE" +%Y-%m-%dT%H:%M:%SZ))"

# ---- 2. The PyTorch venv (scripts/lib/pytorch-venv.sh): made on first use, checked quickly afterwards. ----
PY="$VENV/bin/python"
ensure_pytorch_venv "$VENV" || die "no PyTorch venv at $VENV"
say "PyTorch venv $VENV present"
REF="$ROOT/scripts/pytorch_reference.py"

# ---- 3. Data: Fashion-MNIST (imported like scripts/setup.sh when missing) and two synthetic sets. ----
if ! "$BIN" data info "$FASHION" >/dev/null 2>&1; then
    src=/usr/share/datasets/fashion-mnist
    [ -d "$src" ] || die "no $FASHION and no $src to import it from: run scripts/setup.sh --no-run, or set FASHION_H5"
    say "importing Fashion-MNIST into $FASHION"
    mkdir -p "$(dirname "$FASHION")"
    "$BIN" data import --format idx --force \
        --train-images $src/train-images-idx3-ubyte.gz --train-labels $src/train-labels-idx1-ubyte.gz \
        --test-images $src/t10k-images-idx3-ubyte.gz --test-labels $src/t10k-labels-idx1-ubyte.gz \
        --name fashion-mnist \
        --class-names "T-shirt/top,Trouser,Pullover,Dress,Coat,Sandal,Shirt,Sneaker,Bag,Ankle boot" \
        --out "$FASHION"
fi
R18_DATA="$(synth_dataset "$BIN" "$SYNTH_DIR" 3x128x128)"
R50_DATA="$(synth_dataset "$BIN" "$SYNTH_DIR" 3x64x64)"

# ---- 4. The rows. Steps stay inside one epoch of the data (no short last step). ----
# The full run's step counts keep it near 15 minutes on 2 cores: ResNet-18 takes about 0.5 s a
# step at 1 rank x 2 threads and 1 s at 2 ranks x 1 thread, ResNet-50 on 64x64 about 1 s.
if [ $quick -eq 1 ]; then
    tiny_steps=40; r18_1_steps=8; r18_2_steps=7; r50_steps=7
else
    tiny_steps=400; r18_1_steps=20; r18_2_steps=16; r50_steps=14
fi
WARMUP=5
# id | model | data | ranks | batch/rank | threads/rank | steps | configurations | overlap goal | description
row_defs=(
    "1|tiny|$FASHION|1|64|2|$tiny_steps|allreduce:on allreduce:off torch|0.97|tiny CNN, Fashion-MNIST 1x28x28"
    "2|resnet18|$R18_DATA|1|16|2|$r18_1_steps|allreduce:on allreduce:off torch|0.97|ResNet-18, synthetic 3x128x128"
    "3|tiny|$FASHION|2|32|1|$tiny_steps|allreduce:on allreduce:off ring:on ring:off torch|0.97|tiny CNN, Fashion-MNIST 1x28x28"
    "4|resnet18|$R18_DATA|2|16|1|$r18_2_steps|allreduce:on allreduce:off ring:on ring:off torch|0.97|ResNet-18, synthetic 3x128x128"
    "5|resnet50|$R50_DATA|2|16|1|$r50_steps|allreduce:on allreduce:off ring:on ring:off torch|faster|ResNet-50, synthetic 3x64x64"
)

rm -rf "$raw_dir"
mkdir -p "$raw_dir"
RUNS="$raw_dir/runs.jsonl"
: > "$RUNS"
: > "$raw_dir/commands.txt"
HPC_RESULTS="$scratch/hpc-results"
mkdir -p "$HPC_RESULTS"
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
started_at="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
failures=0

tag_json() {  # row label rep busy -> the JSON the records are tagged with
    printf '{"row": %s, "label": "%s", "rep": %s, "busy_before": %s, "load1_before": %s}' \
        "$1" "$2" "$3" "$4" "$(cut -d' ' -f1 /proc/loadavg)"
}

# run_config ROW_DEF CONFIG REP: one measurement, its log appended to rowN.log.
run_config() {
    local id model data ranks batch threads steps configs goal desc
    IFS='|' read -r id model data ranks batch threads steps configs goal desc <<< "$1"
    local config="$2" rep="$3" log="$raw_dir/row$id.log" busy label rc=0
    busy="$(wait_idle "$wait_idle")"
    local cmd=()
    if [ "$config" = torch ]; then
        label=pytorch
        cmd=("$PY" "$REF" train --model "$model" --data "$data" --batch-size "$batch" --ranks "$ranks"
             --threads "$threads" --steps "$steps" --warmup-steps $WARMUP --out "$RUNS"
             --tag "$(tag_json "$id" "$label" "$rep" "$busy" | sed 's/^{/{"side": "pytorch", /')")
    else
        local strategy="${config%%:*}" overlap="${config##*:}"
        label="$strategy, overlap $overlap"
        # --bind-to none: bound, a rank sees one core (and its threads share it); the PyTorch
        # processes are not bound either.
        cmd=(mpirun -n "$ranks" --oversubscribe --bind-to none "$BIN" --strategy "$strategy"
             --overlap "$overlap" --model "$model" --data "$data" --batch-size "$batch"
             --threads "$threads" --steps "$steps" --skip-steps $WARMUP --no-eval
             --results "$HPC_RESULTS" --study "compare-$id-$strategy-$overlap-$rep")
    fi
    printf '\n=== row %s, %s, repetition %s (CPU %s%% busy before) at %s\n$ %s\n' "$id" "$label" "$rep" "$busy" \
        "$(date -u +%H:%M:%S)" "${cmd[*]}" >> "$log"
    printf 'row %s | %s | rep %s | %s\n' "$id" "$label" "$rep" "${cmd[*]}" >> "$raw_dir/commands.txt"
    timeout 900 "${cmd[@]}" >> "$log" 2>&1 || rc=$?
    if [ $rc -ne 0 ]; then
        echo "   row $id, $label, rep $rep: FAILED (exit $rc; see $log)"
        failures=$((failures + 1))
        return 0
    fi
    if [ "$config" != torch ]; then
        tagged_record "$PY" "$HPC_RESULTS/runs.jsonl" "$(tag_json "$id" "$label" "$rep" "$busy")" \
            "compare-$id-${config%%:*}-${config##*:}-$rep" >> "$RUNS"
    fi
    "$PY" - "$RUNS" <<'EOF'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
extra = r.get("extra", {}).get("exchange_hidden_share")
hidden = f", hidden {extra * 100:.0f}%" if extra is not None else ""
side = r["label"] if r["side"] == "hpc-train" else ("PyTorch DDP" if r["ranks"] > 1 else "PyTorch eager")
print(f"   row {r['row']} | {side:<22} | rep {r['rep']}: {r['images_per_sec']:9,.1f} img/s, step {r['step_ms']:7.1f} ms{hidden} (CPU busy before: {r['busy_before']}%)")
EOF
}

say "hpc-train $bin_info; PyTorch in $VENV; $reps repetition(s); load average $load_before"
for def in "${row_defs[@]}"; do
    id="${def%%|*}"
    [[ ",$rows_wanted," == *",$id,"* ]] || continue
    IFS='|' read -r _ model _ ranks batch threads steps configs _ desc <<< "$def"
    read -r -a cfgs <<< "$configs"
    say "row $id: $desc, $model, $ranks rank(s) x batch $batch, $threads thread(s)/rank, $steps steps"
    for ((rep = 1; rep <= reps; rep++)); do
        # Rotate the order each repetition, so that no side always runs first (or last).
        n=${#cfgs[@]}
        for ((k = 0; k < n; k++)); do
            run_config "$def" "${cfgs[$(((k + rep - 1) % n))]}" "$rep"
        done
    done
done
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"

# ---- 5. The table. ----
say "writing $out"
mem_gib="$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
cpu_model="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
libtorch="$(ldd "$BIN" | awk '/libtorch_cpu/ {print $3}')"
cmdline="scripts/compare-pytorch.sh${orig_args[*]:+ ${orig_args[*]}}"
[ -n "$user_bin" ] && cmdline="HPC_TRAIN_BIN=$user_bin $cmdline"
rel_raw="$(realpath "$raw_dir")"
[[ "$rel_raw" == "$ROOT"/* ]] && rel_raw="${rel_raw#"$ROOT"/}"
export M_ROWS_WANTED="$rows_wanted" M_WARMUP="$WARMUP" M_STARTED="$started_at" M_QUICK="$quick" \
    M_ARGS="${orig_args[*]}" M_REPS="$reps" M_HOST="$(hostname)" M_CPU="$cpu_model" M_NPROC="$(nproc)" \
    M_MEM="$mem_gib" M_LOAD_BEFORE="$load_before" M_LOAD_AFTER="$load_after" M_BINARY="$bin_info" \
    M_MPI="$(mpirun --version 2>/dev/null | head -1)" M_LIBTORCH="$libtorch" M_VENV="$VENV" \
    M_COMMAND="$cmdline" M_RAW_DIR="$rel_raw" M_WAIT_IDLE="$wait_idle"
"$PY" - "$raw_dir/meta.json" "${row_defs[@]}" <<'EOF'
import json, os, platform, sys
e = os.environ
rows = []
wanted = e["M_ROWS_WANTED"].split(",")
for d in sys.argv[2:]:
    id_, model, data, ranks, batch, threads, steps, configs, goal, desc = d.split("|")
    if id_ not in wanted:
        continue
    cfgs = []
    for c in configs.split():
        if c == "torch":
            cfgs.append({"label": "pytorch", "side": "pytorch",
                         "desc": "DDP, gloo on 127.0.0.1, default buckets, broadcast_buffers off" if int(ranks) > 1 else "eager"})
        else:
            s, o = c.split(":")
            cfgs.append({"label": f"{s}, overlap {o}", "side": "hpc-train", "overlap": o})
    notes = (f"{desc} (`{os.path.basename(data)}`), model `{model}`, {ranks} rank(s) x batch {batch} "
             f"= {int(ranks) * int(batch)} global, {threads} thread(s) per rank "
             f"(`--threads {threads}` / `torch.set_num_threads({threads})`), {steps} steps of which {e['M_WARMUP']} warm-up; "
             f"hpc-train `mpirun -n {ranks} --bind-to none ... --no-eval`, strategies and overlap as listed; "
             f"PyTorch " + ("DDP over gloo on 127.0.0.1 (2 processes, torch.multiprocessing.spawn), default buckets "
                            "(25 MiB, first 1 MiB), broadcast_buffers=False" if int(ranks) > 1 else "eager, one process, no DDP"))
    rows.append({"id": int(id_), "model_desc": desc, "ranks": int(ranks), "batch": int(batch), "threads": int(threads),
                 "steps": int(steps), "configs": cfgs, "notes": notes,
                 "overlap_goal": goal if goal == "faster" else float(goal)})
meta = {
    "date": e["M_STARTED"], "quick": e["M_QUICK"] == "1", "args": e["M_ARGS"], "reps": int(e["M_REPS"]),
    "wait_idle": int(e["M_WAIT_IDLE"]),
    "host": e["M_HOST"], "cpu": e["M_CPU"], "nproc": e["M_NPROC"], "mem": e["M_MEM"],
    "load_before": e["M_LOAD_BEFORE"], "load_after": e["M_LOAD_AFTER"],
    "binary": e["M_BINARY"], "mpi": e["M_MPI"], "libtorch": e["M_LIBTORCH"],
    "venv": e["M_VENV"], "python": platform.python_version(),
    "command": e["M_COMMAND"], "raw_dir": e["M_RAW_DIR"], "rows": rows,
}
json.dump(meta, open(sys.argv[1], "w"), indent=1)
EOF
"$PY" "$REF" table --runs "$RUNS" --meta "$raw_dir/meta.json" --output "$out" > /dev/null
say "table: $out (raw records and logs: $raw_dir/); load average before $load_before, after $load_after"
[ $failures -eq 0 ] || { echo "compare-pytorch.sh: $failures run(s) failed; see the logs in $raw_dir/" >&2; exit 1; }
