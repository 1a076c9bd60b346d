#!/usr/bin/env bash
# hpc-train's pipelines, --zero 3 and tensor parallelism against PyTorch's own versions
# (torch.distributed.pipelining, FSDP2's fully_shard, DTensor's parallelize_module), back to back
# on the same model, data, batch, threads and optimizer; optionally a second hpc-train build
# (--before) in the same rotation, to see whether a change moved the speed. Writes a Markdown
# table and the raw records and logs to a results folder.
#
#   scripts/compare-pytorch-layouts.sh                  3 repetitions (about 25 minutes on 2 cores)
#   scripts/compare-pytorch-layouts.sh --quick          a smoke test (2-3 minutes), written to a scratch folder
#   options: --reps N (default 3), --rows 1,2,3,4,5 (default all), --out DIR (default
#            results/pytorch-layouts), --before BIN (an earlier hpc-train build, run as the side
#            `before`), --wait-idle S (before each run, wait up to S seconds for the CPUs to be under
#            25% busy; default 20, 0 with --quick), -h
#   environment: HPC_TRAIN_BIN (default target/release/hpc-train of this repository),
#                PYTORCH_VENV (default .venv-pytorch), FASHION_H5 (default datasets/fashion-mnist.h5),
#                SYNTH_DIR (synthetic datasets, default datasets/)
#
# Rows (2 ranks, one thread each; PyTorch's side in scripts/pytorch_layouts.py):
#   1  ResNet-18 3x128x128, a 2-stage pipeline, batch 16 in 4 micro-batches, 1F1B, cut before
#        layer3: hpc-train --pipeline-stages 2 --schedule 1f1b --partition 5 against
#        torch.distributed.pipelining's Schedule1F1B on the same cut
#   2  the same with GPipe (ScheduleGPipe)
#   3  ResNet-18 3x128x128, 2 ranks x batch 16: hpc-train --zero 3 (its defaults: every block a
#        unit, --overlap auto) against FSDP2 (fully_shard on every residual block and the root)
#   4  the same with the whole model one unit: --zero 3 --fsdp-unit model against fully_shard on
#        the root alone (neither reshards inside the step, and hpc-train has nothing to recompute)
#   5  vit-tiny on Fashion-MNIST, one tensor-parallel group of 2, batch 64: hpc-train
#        --tensor-parallel 2 against DTensor's ColwiseParallel / RowwiseParallel plan
# Every configuration runs --reps times, the order of the sides rotated each repetition.
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

quick=0 reps="" rows_wanted="1,2,3,4,5" out="" before_source="" wait_idle=""
orig_args=("$@")
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        --reps) reps="$2"; shift ;;
        --rows) rows_wanted="$2"; shift ;;
        --out) out="$2"; shift ;;
        --before) before_source="$2"; shift ;;
        --wait-idle) wait_idle="$2"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "compare-pytorch-layouts.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$reps" ] || reps=$([ $quick -eq 1 ] && echo 1 || echo 3)
[[ "$reps" =~ ^[1-9][0-9]*$ ]] || { echo "compare-pytorch-layouts.sh: --reps $reps: expected a positive count" >&2; exit 2; }
[ -n "$wait_idle" ] || wait_idle=$([ $quick -eq 1 ] && echo 0 || echo 20)
[[ "$wait_idle" =~ ^[0-9]+$ ]] || { echo "compare-pytorch-layouts.sh: --wait-idle $wait_idle: expected seconds" >&2; exit 2; }

say() { printf '\n==> %s\n' "$*"; }
die() { echo "compare-pytorch-layouts.sh: $*" >&2; exit 1; }

scratch="$(mktemp -d "${TMPDIR:-/tmp}/compare-pytorch-layouts.XXXXXX")"
trap 'rm -rf "$scratch/bin"' EXIT
[ -n "$out" ] || out=$([ $quick -eq 1 ] && echo "$scratch/result" || echo "results/pytorch-layouts")
# The runs write into the scratch folder; the records, logs and table replace those in $out only
# once every row has run, so an interrupted or failed comparison leaves the last one standing
# (and its own partial records in the scratch folder).
work="$scratch/work"

# ---- The builds, copied so that a rebuild during the run cannot mix two builds. ----
mkdir -p "$scratch/bin"
declare -A BIN BIN_INFO
add_build() {  # add_build LABEL PATH
    [ -x "$2" ] || die "no hpc-train binary at $2 (side $1): build it (cargo build --release) or set HPC_TRAIN_BIN / --before"
    cp "$2" "$scratch/bin/$1"
    BIN[$1]="$scratch/bin/$1"
    BIN_INFO[$1]="$2 (built $(date -u -r "$2" +%Y-%m-%dT%H:%M:%SZ))"
}
add_build after "$BIN_SOURCE"
sides="after"
if [ -n "$before_source" ]; then add_build before "$before_source"; sides="after before"; fi
sides="$sides pytorch"

PY="$VENV/bin/python"
ensure_pytorch_venv "$VENV" || die "no PyTorch venv at $VENV"
REF="$ROOT/scripts/pytorch_layouts.py"

# ---- Data: Fashion-MNIST (scripts/setup.sh imports it) and a synthetic set, made once. ----
"${BIN[after]}" data info "$FASHION" >/dev/null 2>&1 || die "no dataset at $FASHION: run scripts/setup.sh --no-run, or set FASHION_H5"
R18_DATA="$(synth_dataset "${BIN[after]}" "$SYNTH_DIR" 3x128x128)"

# ---- The rows. ----
if [ $quick -eq 1 ]; then pipe_steps=6; fsdp_steps=5; tp_steps=15; skip=2; tp_skip=5
else pipe_steps=16; fsdp_steps=12; tp_steps=60; skip=4; tp_skip=10; fi
# id | layout | data | global batch | steps | skipped | hpc-train options | pytorch_layouts.py options | description
row_defs=(
    "1|pipeline|$R18_DATA|16|$pipe_steps|$skip|--model resnet18 --batch-size 16 --pipeline-stages 2 --micro-batches 4 --schedule 1f1b --partition 5|--layout pipeline --schedule 1f1b --model resnet18 --batch-size 16 --micro-batches 4 --cut layer3|pipeline 1F1B, ResNet-18 3x128x128"
    "2|pipeline|$R18_DATA|16|$pipe_steps|$skip|--model resnet18 --batch-size 16 --pipeline-stages 2 --micro-batches 4 --schedule gpipe --partition 5|--layout pipeline --schedule gpipe --model resnet18 --batch-size 16 --micro-batches 4 --cut layer3|pipeline GPipe, ResNet-18 3x128x128"
    "3|fsdp|$R18_DATA|32|$fsdp_steps|$skip|--model resnet18 --batch-size 16 --zero 3|--layout fsdp2 --model resnet18 --batch-size 16|ZeRO 3 / FSDP2, ResNet-18 3x128x128"
    "4|fsdp|$R18_DATA|32|$fsdp_steps|$skip|--model resnet18 --batch-size 16 --zero 3 --fsdp-unit model|--layout fsdp2 --units model --model resnet18 --batch-size 16|ZeRO 3 / FSDP2 with the model one unit, ResNet-18 3x128x128"
    "5|tp|$FASHION|64|$tp_steps|$tp_skip|--model vit-tiny --batch-size 64 --tensor-parallel 2|--layout tp --model vit-tiny --batch-size 64|tensor parallel, vit-tiny 1x28x28"
)

mkdir -p "$work/logs"
RUNS="$work/runs.jsonl"
: > "$RUNS"
: > "$work/commands.txt"
HPC_RESULTS="$scratch/hpc-results"
mkdir -p "$HPC_RESULTS"
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
started_at="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
failures=0

run_side() {  # run_side ROW_DEF SIDE REP
    local id layout data batch steps skipped hpc_opts torch_opts desc
    IFS='|' read -r id layout data batch steps skipped hpc_opts torch_opts desc <<< "$1"
    local side="$2" rep="$3" log busy rc=0 study tag
    log="$work/logs/row$id.log"
    busy="$(wait_idle "$wait_idle")"
    tag="{\"row\": $id, \"label\": \"$side\", \"rep\": $rep, \"busy_before\": $busy}"
    local cmd=()
    if [ "$side" = pytorch ]; then
        # shellcheck disable=SC2206  # the options are words
        cmd=("$PY" "$REF" train $torch_opts --data "$data" --ranks 2 --threads 1 --steps "$steps"
             --warmup-steps "$skipped" --out "$RUNS" --tag "$tag")
    else
        study="layouts-$id-$side-$rep"
        # shellcheck disable=SC2206
        cmd=(mpirun -n 2 --oversubscribe --bind-to none "${BIN[$side]}" $hpc_opts --data "$data" --threads 1
             --steps "$steps" --skip-steps "$skipped" --no-eval --results "$HPC_RESULTS" --study "$study")
    fi
    printf '\n=== row %s, %s, repetition %s (CPU %s%% busy before) at %s\n$ %s\n' "$id" "$side" "$rep" "$busy" \
        "$(date -u +%H:%M:%S)" "${cmd[*]}" >> "$log"
    printf 'row %s | %s | rep %s | %s\n' "$id" "$side" "$rep" "${cmd[*]}" >> "$work/commands.txt"
    timeout 900 "${cmd[@]}" >> "$log" 2>&1 || rc=$?
    if [ $rc -ne 0 ]; then
        echo "   row $id, $side, rep $rep: FAILED (exit $rc; see $log)"
        failures=$((failures + 1))
        return 0
    fi
    if [ "$side" != pytorch ]; then
        tagged_record "$PY" "$HPC_RESULTS/runs.jsonl" "$tag" "$study" >> "$RUNS"
    fi
    "$PY" - "$RUNS" <<'EOF'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
print(f"   row {r['row']} | {r['label']:<8} | rep {r['rep']}: {r['images_per_sec']:8.1f} img/s, step {r['step_ms']:7.1f} ms (CPU busy before: {r['busy_before']}%)")
EOF
}

say "hpc-train ${BIN_INFO[after]}${before_source:+, before: ${BIN_INFO[before]}}; PyTorch in $VENV; $reps repetition(s)"
read -r -a side_list <<< "$sides"
for def in "${row_defs[@]}"; do
    id="${def%%|*}"
    [[ ",$rows_wanted," == *",$id,"* ]] || continue
    say "row $id: $(echo "$def" | awk -F'|' '{print $NF}')"
    for ((rep = 1; rep <= reps; rep++)); do
        n=${#side_list[@]}
        for ((k = 0; k < n; k++)); do run_side "$def" "${side_list[$(((k + rep - 1) % n))]}" "$rep"; done
    done
done
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"

# ---- The table. ----
cmdline="scripts/compare-pytorch-layouts.sh${orig_args[*]:+ ${orig_args[*]}}"
[ -n "$user_bin" ] && cmdline="HPC_TRAIN_BIN=$user_bin $cmdline"
rel_out="$(realpath -m "$out")"
[[ "$rel_out" == "$ROOT"/* ]] && rel_out="${rel_out#"$ROOT"/}"
export M_ROWS_WANTED="$rows_wanted" M_STARTED="$started_at" M_QUICK="$quick" M_REPS="$reps" M_HOST="$(hostname)" \
    M_CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')" M_NPROC="$(nproc)" \
    M_MEM="$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)" M_LOAD_BEFORE="$load_before" \
    M_LOAD_AFTER="$load_after" M_AFTER="${BIN_INFO[after]}" M_BEFORE="${BIN_INFO[before]:-}" M_SIDES="$sides" \
    M_MPI="$(mpirun --version 2>/dev/null | head -1)" M_COMMAND="$cmdline" M_RAW_DIR="$rel_out"
"$PY" - "$work/meta.json" "${row_defs[@]}" <<'EOF'
import json, os, platform, sys
e = os.environ
sides = e["M_SIDES"].split()
names = {"after": "hpc-train", "before": "hpc-train before", "pytorch": None}
torch_names = {"pipeline": "PyTorch pipelining", "fsdp": "PyTorch FSDP2", "tp": "PyTorch DTensor TP"}
rows = []
for d in sys.argv[2:]:
    id_, layout, data, batch, steps, skipped, hpc_opts, torch_opts, desc = d.split("|")
    if id_ not in e["M_ROWS_WANTED"].split(","):
        continue
    notes = (f"{desc} (`{os.path.basename(data)}`), 2 ranks with one thread each, global batch {batch}, "
             f"{steps} steps of which the first {skipped} are left out. hpc-train: `mpirun -n 2 --bind-to none hpc-train "
             f"{hpc_opts} --threads 1 --no-eval`; PyTorch: `pytorch_layouts.py train {torch_opts} --ranks 2 --threads 1`.")
    rows.append({"id": int(id_), "desc": desc, "ranks": 2, "global_batch": int(batch),
                 "steps": f"{int(steps) - int(skipped)} + {skipped}", "labels": sides, "notes": notes,
                 "sides": {s: names[s] or torch_names[layout] for s in sides}})
binaries = {"after": e["M_AFTER"]}
if e["M_BEFORE"]:
    binaries["before"] = e["M_BEFORE"]
meta = {"date": e["M_STARTED"], "quick": e["M_QUICK"] == "1", "reps": int(e["M_REPS"]), "host": e["M_HOST"],
        "cpu": e["M_CPU"], "nproc": e["M_NPROC"], "mem": e["M_MEM"], "load_before": e["M_LOAD_BEFORE"],
        "load_after": e["M_LOAD_AFTER"], "binaries": binaries, "mpi": e["M_MPI"], "python": platform.python_version(),
        "command": e["M_COMMAND"], "raw_dir": e["M_RAW_DIR"], "rows": rows}
json.dump(meta, open(sys.argv[1], "w"), indent=1)
EOF
"$PY" "$REF" table --runs "$RUNS" --meta "$work/meta.json" --output "$work/table.md" > /dev/null
if [ $failures -ne 0 ]; then
    echo "compare-pytorch-layouts.sh: $failures run(s) failed; their logs, the records and the table are in $work ($out is left as it was)" >&2
    exit 1
fi
# Every row ran: this comparison replaces the last one's records, logs and table in $out (a
# README or summary.toml there stays).
mkdir -p "$out"
rm -rf "$out/logs"
cp -r "$work"/. "$out"/
rm -rf "$work" "$HPC_RESULTS" "$scratch/bin"
rmdir "$scratch" 2>/dev/null || true  # kept where --quick's table is
say "table: $out/table.md (raw records, commands and logs beside it)"
