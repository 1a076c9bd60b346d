# Shared by the job files in jobs/: settings from the environment, site settings (jobs/site.sh),
# the output folder, the launch of one point of a sweep, stop-and-requeue, the report at the end.
# Sourced, not run.
#
# Every setting is an environment variable with a default; set it at submission, e.g.
#   MODEL=resnet18 STRATEGIES="ring horovod" sbatch --nodes=8 jobs/weak_scaling.sbatch
#
# | variable          | default                                   | meaning |
# |-------------------|-------------------------------------------|---------|
# | HPC_TRAIN         | $SLURM_SUBMIT_DIR/target/release/hpc-train | the binary (or the packed one, scripts/pack.sh) |
# | SITE_SH           | jobs/site.sh (sourced when present)       | modules and MPI settings of your site (jobs/site.sh.example) |
# | OUTPUT_DIR        | $SCRATCH/hpc-train/<job id>, else $HOME/hpc-train/<job id> | the job's log, the points' logs, checkpoints |
# | RESULTS           | $OUTPUT_DIR                               | runs.jsonl, points.jsonl, bench.jsonl, reports |
# | JOB_LOG           | $OUTPUT_DIR/slurm-<job id>.out            | where the job's output goes; empty: stay in sbatch's --output |
# | RANKS_PER_NODE    | $SLURM_NTASKS_PER_NODE, else 1            | ranks (= GPUs) per node |
# | GPUS_PER_RANK     | 1                                         | 0 for CPU-only nodes (submit with --gpus-per-node=0: the job files ask for GPUs) |
# | GPU_BIND          | node                                      | node: every rank sees the node's GPUs (srun --gpus-per-node) and takes its node-local rank's; task: srun --gpus-per-task, each rank sees its own |
# | NODE_COUNTS       | 1 2 4 ... up to the allocation            | the sweep, in nodes |
# | RANK_COUNTS       | (NODE_COUNTS x RANKS_PER_NODE)            | the sweep in ranks, instead of nodes |
# | STRATEGIES        | ring ps allreduce horovod                 | strategies at every point |
# | CONFIG            | (none)                                    | a run file of the training options (hpc-train --config; jobs/configs/), instead of PRESET and the variables below; MODEL etc. still override it |
# | PRESET            | resnet50-throughput                       | hpc-train --preset (synthetic ImageNet-sized images, fixed steps); empty: none, MODEL etc. below |
# | MODEL             | (the preset's; resnet50 without one)      | model |
# | DATA              | (the preset's; datasets/fashion-mnist.h5) | dataset file (on a shared file system) |
# | BATCH             | (the preset's; 256)                       | per-rank batch (weak scaling) |
# | GLOBAL_BATCH      | 1024                                      | global batch (strong scaling) |
# | EPOCHS            | (the preset's; 1)                         | epochs per point (unless STEPS) |
# | STEPS             | (the preset's; unset)                     | steps per point, instead of EPOCHS |
# | LAUNCHER          | srun                                      | srun, or mpirun: the MPI library's own launcher |
# | SRUN_MPI          | by the binary's MPI (see below)           | srun --mpi= (pmix for Open MPI, pmi2 for the MPICH family) |
# | PMIX_FENCE        | ring                                      | under srun --mpi=pmix: the fence Slurm's PMIx plugin runs (exported as SLURM_PMIX_FENCE; see below); site: leave it to mpi.conf's PMIxCollFence |
# | MPIEXEC           | by the binary's MPI (see below)           | the program LAUNCHER=mpirun runs (mpirun, mpiexec.mpich...) |
# | LAUNCH_EXTRA      | (unset)                                   | more launcher options (e.g. --overcommit) |
# | EXTRA_ARGS        | (unset)                                   | more hpc-train options for every run |
# | CHECKPOINT_DIR    | $OUTPUT_DIR/checkpoints/<study>           | checkpoints, one folder per point: DIR/<point>; empty: none |
# | RESUME            | 1 in a requeued job, else unset           | 1: each point continues from its folder's newest checkpoint |
# | REQUEUE           | 1 in a batch job                          | a point stopped by a signal (exit 143) requeues the job (scontrol requeue) |
# | STUDY_ID          | <job name>-<job id>                       | tags the runs; the report selects them |
# | REPEATS           | 1                                         | runs of every point; repeat r starts each rank count's strategies at offset r; points are named <strategy>-<ranks>-r<r> when above 1 |
#
# The points of a sweep: each one's output goes to OUTPUT_DIR/logs/<study>/<point>.log and the job's
# log, and its exit status to RESULTS/points.jsonl. A point that fails (any non-zero status but
# 143) is recorded and the sweep goes on; the report lists it, and the job exits 1 at the end.
# A point stopped by a signal (143: hpc-train wrote a checkpoint; see jobs/README.md) ends the
# sweep there, and with REQUEUE=1 the job is requeued: the next run skips the points that ended,
# and continues the stopped one from its checkpoint.
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-.}"
JOBS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Site settings (modules, MPI variables): jobs/site.sh, made from jobs/site.sh.example.
SITE_SH=${SITE_SH:-$JOBS_DIR/site.sh}
if [ -f "$SITE_SH" ]; then
    echo "site settings: $SITE_SH"
    # shellcheck source=/dev/null
    source "$SITE_SH"
fi

JOB_ID=${SLURM_JOB_ID:-local-$$}
STUDY_ID=${STUDY_ID:-${SLURM_JOB_NAME:-hpc-train}-${JOB_ID}}
# The output folder: never the checkout, unless asked. RESULTS given alone is the output folder.
if [ -z "${OUTPUT_DIR:-}" ]; then
    if [ -n "${RESULTS:-}" ]; then OUTPUT_DIR=$RESULTS
    elif [ -n "${SCRATCH:-}" ]; then OUTPUT_DIR=$SCRATCH/hpc-train/$JOB_ID
    else OUTPUT_DIR=$HOME/hpc-train/$JOB_ID
    fi
fi
RESULTS=${RESULTS:-$OUTPUT_DIR}
mkdir -p "$OUTPUT_DIR/logs/$STUDY_ID" "$RESULTS"
OUTPUT_DIR=$(cd "$OUTPUT_DIR" && pwd)
RESULTS=$(cd "$RESULTS" && pwd)
# The job's output from here on, appended (a requeued job continues it). What sbatch's --output
# holds is this line and Slurm's own messages.
JOB_LOG=${JOB_LOG-$OUTPUT_DIR/slurm-$JOB_ID.out}
if [ -n "$JOB_LOG" ]; then
    echo "job $JOB_ID: log in $JOB_LOG, results in $RESULTS"
    exec >> "$JOB_LOG" 2>&1
fi
echo "job $JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-$(hostname)}, $(date -u +%FT%TZ): output in $OUTPUT_DIR, results in $RESULTS"

HPC_TRAIN=${HPC_TRAIN:-$PWD/target/release/hpc-train}
RANKS_PER_NODE=${RANKS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}
GPUS_PER_RANK=${GPUS_PER_RANK:-1}
GPU_BIND=${GPU_BIND:-node}
STRATEGIES=${STRATEGIES:-ring ps allreduce horovod}
REPEATS=${REPEATS:-1}
[[ "$REPEATS" =~ ^[1-9][0-9]*$ ]] || { echo "error: REPEATS=$REPEATS: give the runs of every point, 1 or more" >&2; exit 2; }
PRESET=${PRESET-resnet50-throughput}
GLOBAL_BATCH=${GLOBAL_BATCH:-1024}
LAUNCHER=${LAUNCHER:-srun}
LAUNCH_EXTRA=${LAUNCH_EXTRA:-}
EXTRA_ARGS=${EXTRA_ARGS:-}
CHECKPOINT_DIR=${CHECKPOINT_DIR-$OUTPUT_DIR/checkpoints/$STUDY_ID}
# A requeued job continues every point from its checkpoint.
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then RESUME=${RESUME:-1}; fi
RESUME=${RESUME:-}
REQUEUE=${REQUEUE:-$([ -n "${SLURM_JOB_ID:-}" ] && echo 1 || echo 0)}
ALLOC_NODES=${SLURM_JOB_NUM_NODES:-1}
POINTS=$RESULTS/points.jsonl

[ -x "$HPC_TRAIN" ] || { echo "HPC_TRAIN=$HPC_TRAIN is not an executable (build it, or pack it with scripts/pack.sh)" >&2; exit 1; }
case "$GPU_BIND" in node|task) ;; *) echo "GPU_BIND=$GPU_BIND: expected node or task" >&2; exit 2 ;; esac

# Slurm 22.05 and later: srun in a batch job does not inherit sbatch's --cpus-per-task; without it
# each rank gets one core (and libtorch one thread's worth).
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi

# The launchers follow the MPI library the binary was built against (`hpc-train --version`, which
# needs no launcher): a launcher of another MPI would start every rank as a job of its own.
#   Open MPI:           srun --mpi=pmix, or its mpirun (mpirun.openmpi where Debian has both)
#   the MPICH family:   srun --mpi=pmi2, or Hydra's mpiexec (mpiexec.mpich where Debian has both)
#                       (Cray MPICH, Intel MPI and MVAPICH2 share MPICH's ABI and PMI)
# SRUN_MPI and MPIEXEC override the choice (e.g. SRUN_MPI=pmix for an MPICH built with PMIx).
first_command() { local c; for c in "$@"; do command -v "$c" >/dev/null && { echo "$c"; return; }; done; echo "$1"; }
MPI_FAMILY=$("$HPC_TRAIN" --version | sed -n 's/^MPI built against: .*; \([a-z]*\) family;.*/\1/p')
case "$MPI_FAMILY" in
    mpich) SRUN_MPI=${SRUN_MPI:-pmi2}; MPIEXEC=${MPIEXEC:-$(first_command mpiexec.mpich mpiexec.hydra mpiexec)} ;;
    *)     SRUN_MPI=${SRUN_MPI:-pmix}; MPIEXEC=${MPIEXEC:-$(first_command mpirun.openmpi mpirun)} ;;
esac
echo "$HPC_TRAIN: built against ${MPI_FAMILY:-an unknown} MPI family; launching with srun --mpi=$SRUN_MPI (LAUNCHER=srun) or $MPIEXEC (LAUNCHER=mpirun)"

# srun --mpi=pmix: Slurm's PMIx plugin runs a fence that collects no data (Open MPI's barrier at the
# end of MPI_Init) as a tree over the step's nodes, and in Slurm 22.05 that tree gives every node
# no parent and no children when the step has fewer nodes than TreeWidth (50 by default). Each
# node then ends the fence on its own: a rank of a fast node returns from MPI_Init and sends to a
# rank of a slow node that is still inside it, and Open MPI 4.1 segfaults there (in the TCP BTL,
# before its PML has registered its handlers). The ring is a barrier across the nodes.
# results/cluster-path/pmix-fence.md has the measurement. SLURM_PMIX_FENCE set by the site (or
# jobs/site.sh) wins; PMIX_FENCE=site leaves the choice to mpi.conf's PMIxCollFence.
PMIX_FENCE=${PMIX_FENCE:-ring}
case "$PMIX_FENCE" in ring|tree|mixed|site) ;; *) echo "PMIX_FENCE=$PMIX_FENCE: expected ring, tree, mixed or site" >&2; exit 2 ;; esac
if [[ "$SRUN_MPI" == pmix* ]]; then
    if [ "$PMIX_FENCE" != site ] && [ -z "${SLURM_PMIX_FENCE:-}" ]; then export SLURM_PMIX_FENCE=$PMIX_FENCE; fi
    echo "srun --mpi=$SRUN_MPI: the PMIx fence is SLURM_PMIX_FENCE=${SLURM_PMIX_FENCE:-(unset: mpi.conf PMIxCollFence, else mixed)}"
fi

# The sweep in ranks: RANK_COUNTS as given, else powers of two of nodes up to the allocation.
if [ -z "${RANK_COUNTS:-}" ]; then
    if [ -z "${NODE_COUNTS:-}" ]; then
        NODE_COUNTS=""; n=1
        while [ "$n" -le "$ALLOC_NODES" ]; do NODE_COUNTS="$NODE_COUNTS $n"; n=$((n * 2)); done
    fi
    RANK_COUNTS=""
    for n in $NODE_COUNTS; do RANK_COUNTS="$RANK_COUNTS $((n * RANKS_PER_NODE))"; done
fi

# LAUNCH_CMD=(launcher ... "$@"): runs "$@" on RANKS ranks of this allocation, filling nodes
# RANKS_PER_NODE at a time.
launch_command() {
    local ranks=$1; shift
    local nodes=$(( (ranks + RANKS_PER_NODE - 1) / RANKS_PER_NODE ))
    local per_node=$(( ranks < RANKS_PER_NODE ? ranks : RANKS_PER_NODE ))
    local extra=()
    # shellcheck disable=SC2206
    [ -n "$LAUNCH_EXTRA" ] && extra=($LAUNCH_EXTRA)
    case "$LAUNCHER" in
        srun)
            local gpus=() cpus=()
            if [ "$GPUS_PER_RANK" -gt 0 ]; then
                # node: every rank of a node sees all the step's GPUs there (Slurm sets the same
                # CUDA_VISIBLE_DEVICES for each), so that CUDA IPC between them works, and hpc-train
                # gives each its node-local rank's. No --gpu-bind=none: with it Slurm 22.05 sets no
                # CUDA_VISIBLE_DEVICES at all, and where no cgroup hides the other jobs' GPUs a
                # rank would see them too. task: one GPU per rank.
                if [ "$GPU_BIND" = node ]; then gpus=(--gpus-per-node="$((per_node * GPUS_PER_RANK))")
                else gpus=(--gpus-per-task="$GPUS_PER_RANK"); fi
            fi
            [ -n "${SLURM_CPUS_PER_TASK:-}" ] && cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
            LAUNCH_CMD=(srun --mpi="$SRUN_MPI" --nodes="$nodes" --ntasks="$ranks" --ntasks-per-node="$per_node"
                "${cpus[@]}" "${gpus[@]}" --kill-on-bad-exit=1 "${extra[@]}" "$@") ;;
        mpirun)
            local hosts
            hosts=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" | head -n "$nodes" | sed "s/\$/:$per_node/" | paste -sd, -)
            if [ "$MPI_FAMILY" = mpich ]; then
                # Hydra: the first NODES hosts of the allocation, PER_NODE ranks on each; it binds
                # no rank to a core unless asked.
                LAUNCH_CMD=("$MPIEXEC" -n "$ranks" -hosts "$hosts" -ppn "$per_node" "${extra[@]}" "$@")
            else
                # Open MPI binds each rank to a core by default: a GPU rank's kernel-launching
                # thread, loader and autograd thread would share it.
                local bind=()
                [ "$GPUS_PER_RANK" -gt 0 ] && bind=(--bind-to none)
                LAUNCH_CMD=("$MPIEXEC" -n "$ranks" --host "$hosts" --map-by "ppr:$per_node:node" "${bind[@]}" "${extra[@]}" "$@")
            fi ;;
        *) echo "LAUNCHER=$LAUNCHER: expected srun or mpirun" >&2; exit 2 ;;
    esac
}

# Runs "$@" on RANKS ranks in the foreground (for scripts of your own).
launch() {
    launch_command "$@"
    "${LAUNCH_CMD[@]}"
}

# The model, data, batch and length of a training point: the preset's, with what the user set
# on top; without a preset, the defaults of the table above.
training_args() {
    local scaling=$1
    if [ -n "${CONFIG:-}" ] || [ -n "$PRESET" ]; then
        # A run file holds every option it needs (and may name a preset itself).
        if [ -n "${CONFIG:-}" ]; then TRAIN_ARGS=(--config "$CONFIG"); else TRAIN_ARGS=(--preset "$PRESET"); fi
        [ -n "${MODEL:-}" ] && TRAIN_ARGS+=(--model "$MODEL")
        [ -n "${DATA:-}" ] && TRAIN_ARGS+=(--data "$DATA")
        [ -n "${EPOCHS:-}" ] && TRAIN_ARGS+=(--epochs "$EPOCHS")
        [ -n "${STEPS:-}" ] && TRAIN_ARGS+=(--steps "$STEPS")
        [ "$scaling" != strong ] && [ -n "${BATCH:-}" ] && TRAIN_ARGS+=(--batch-size "$BATCH")
    else
        TRAIN_ARGS=(--model "${MODEL:-resnet50}" --data "${DATA:-datasets/fashion-mnist.h5}")
        if [ -n "${STEPS:-}" ]; then TRAIN_ARGS+=(--steps "$STEPS"); else TRAIN_ARGS+=(--epochs "${EPOCHS:-1}"); fi
        [ "$scaling" != strong ] && TRAIN_ARGS+=(--batch-size "${BATCH:-256}")
    fi
    case "$scaling" in
        weak) TRAIN_ARGS+=(--scaling weak) ;;
        strong) TRAIN_ARGS+=(--scaling strong --global-batch "$GLOBAL_BATCH") ;;
        *) ;;   # a layout of its own (pipeline.sbatch): no scaling options
    esac
    return 0
}

# Checkpoint options of one point: a folder of its own under CHECKPOINT_DIR (hpc-train refuses
# a run from step 0 into a folder that holds another run's checkpoints, and a shared folder
# would let one point prune another's), and --resume with RESUME=1.
checkpoint_args() {
    CKPT_ARGS=()
    [ -n "$CHECKPOINT_DIR" ] || return 0
    CKPT_ARGS=(--checkpoint-dir "$CHECKPOINT_DIR/$1")
    if [ "$RESUME" = 1 ]; then CKPT_ARGS+=(--resume); fi
    return 0
}

# --- points, signals, requeue ------------------------------------------------------------------

STEP_PID=""
SIGNALS=0
STOPPED=""
# Slurm's --signal=B:USR1@300 (and SIGTERM at the time limit, or scancel) reach this shell only:
# pass the signal to the running step (srun and mpirun forward it to every rank), whose ranks
# write a checkpoint and exit 143. The shell runs a trap only once its foreground command ends,
# hence the steps run in the background and the shell waits for them.
on_signal() {
    SIGNALS=$((SIGNALS + 1))
    echo "$(date -u +%T) job received SIG$1: passing it to the running step${STEP_PID:+ (PID $STEP_PID)}"
    if [ -n "$STEP_PID" ]; then kill -s "$1" "$STEP_PID" 2>/dev/null || true; fi
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

# How the last try of POINT in this study ended, if it ran: "stopped" (by a signal, with a
# checkpoint), else its exit status (points.jsonl, one JSON object a line, from record_point).
last_status() {
    [ -f "$POINTS" ] || return 0
    grep -F "\"study\":\"$STUDY_ID\"," "$POINTS" | grep -F "\"point\":\"$1\"," | tail -n 1 \
        | sed -n 's/.*"exit_code":\([0-9]*\),.*"stopped":\(true\|false\).*/\1 \2/p' \
        | awk '{ print ($2 == "true" ? "stopped" : $1) }'
}

json_string() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g'; }

# run_records: the number of records in runs.jsonl and bench.jsonl (training runs append to the
# first, benchmarks to the second).
run_records() {
    cat "$RESULTS/runs.jsonl" "$RESULTS/bench.jsonl" 2>/dev/null | wc -l
}

record_point() {
    local point=$1 strategy=$2 ranks=$3 code=$4 stopped=$5 start=$6 end=$7 log=$8
    printf '{"study":"%s","point":"%s","strategy":"%s","ranks":%d,"exit_code":%d,"stopped":%s,"start":"%s","end":"%s","log":"%s","job":"%s","restart":%d}\n' \
        "$(json_string "$STUDY_ID")" "$(json_string "$point")" "$(json_string "$strategy")" "$ranks" "$code" "$stopped" "$start" "$end" \
        "$(json_string "$log")" "$JOB_ID" "${SLURM_RESTART_COUNT:-0}" >> "$POINTS"
}

# run_point POINT STRATEGY RANKS COMMAND...: one point of the sweep, COMMAND on RANKS ranks. A
# point that ended in an earlier run of this job (requeued) is skipped, unless a signal stopped it.
# Returns 143 when a signal stopped it (the caller ends the sweep), else 0.
run_point() {
    local point=$1 strategy=$2 ranks=$3; shift 3
    local before
    before=$(last_status "$point")
    if [ -n "$before" ] && [ "$before" != stopped ]; then
        echo "== $point: ended (exit $before) in an earlier run of this job; skipped"
        return 0
    fi
    if [ "$SIGNALS" -gt 0 ]; then
        # The signal came between two points: stop before this one.
        echo "== $point: not started (the job was signalled)"; STOPPED=$point; return 143
    fi
    local log=$OUTPUT_DIR/logs/$STUDY_ID/$point.log start end rc="" r signals
    launch_command "$ranks" "$@"
    echo "== $point: $strategy on $ranks rank(s), log $log"
    echo "   ${LAUNCH_CMD[*]}"
    start=$(date -u +%FT%TZ)
    local records_before
    records_before=$(run_records)
    "${LAUNCH_CMD[@]}" > >(tee -a "$log") 2>&1 &
    STEP_PID=$!
    # Wait for the step; a trap cuts a wait short, so wait again for its real status (a wait for
    # a step already collected answers 127: the status from before stands).
    while :; do
        signals=$SIGNALS; r=0
        wait "$STEP_PID" 2>/dev/null || r=$?
        if [ "$r" -eq 127 ] && [ -n "$rc" ]; then break; fi
        rc=$r
        [ "$SIGNALS" != "$signals" ] || break
    done
    STEP_PID=""
    end=$(date -u +%FT%TZ)
    # srun can exit 0 for a step that never started ("task 0 launch failed", seen with a PMIx
    # plugin that could not make its directory): a run that ends well appends its record (a
    # benchmark its rows) or says its checkpoint already covers the steps, so a 0 without
    # either is a failed launch.
    if [ "$rc" = 0 ] && [ "$(run_records)" = "$records_before" ] && ! grep -q "already covers the" "$log" 2>/dev/null; then
        echo "== $point: the launcher exited 0 but the run wrote no record: its step did not start ($(tail -n 1 "$log" 2>/dev/null))"
        rc=1
    fi
    # 143 is a stop only after a signal to the job: srun also exits 143 when it terminated the
    # other ranks of a step one of which failed (--kill-on-bad-exit).
    local stopped=false
    [ "$rc" = 143 ] && [ "$SIGNALS" -gt 0 ] && stopped=true
    record_point "$point" "$strategy" "$ranks" "$rc" "$stopped" "$start" "$end" "$log"
    if [ "$stopped" = true ]; then
        echo "== $point: stopped by a signal after writing a checkpoint (exit 143)"; STOPPED=$point; return 143
    elif [ "$rc" != 0 ]; then
        echo "== $point: FAILED (exit $rc); recorded in $POINTS, going on with the sweep"
    fi
    return 0
}

# After a point stopped by a signal: requeue the job (REQUEUE=1), so that its next run continues
# the stopped point from its checkpoint; exits 143 either way.
stopped_exit() {
    if [ "$REQUEUE" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
        echo "requeueing job $SLURM_JOB_ID: its next run resumes $STOPPED from $CHECKPOINT_DIR/$STOPPED and skips the points that ended"
        scontrol requeue "$SLURM_JOB_ID" || echo "scontrol requeue failed: submit again with RESUME=1 STUDY_ID=$STUDY_ID OUTPUT_DIR=$OUTPUT_DIR"
    fi
    exit 143
}

# The points of this study whose last try failed, one "point (exit N)" a line.
failed_points() {
    [ -f "$POINTS" ] || return 0
    grep -F "\"study\":\"$STUDY_ID\"," "$POINTS" \
        | sed -n 's/.*"point":"\([^"]*\)".*"exit_code":\([0-9]*\).*/\1 \2/p' \
        | awk '{ last[$1] = $2; if (!($1 in seen)) { order[++n] = $1; seen[$1] = 1 } }
               END { for (i = 1; i <= n; i++) if (last[order[i]] != 0) print order[i] " (exit " last[order[i]] ")" }'
}

# The end of a sweep: the report, then exit 1 where a point failed.
finish_sweep() {
    make_report || echo "the report failed (above); the records are in $RESULTS"
    local failed
    failed=$(failed_points)
    if [ -n "$failed" ]; then
        echo "study $STUDY_ID: $(echo "$failed" | wc -l) point(s) failed: $(echo "$failed" | paste -sd, - | sed 's/,/, /g')"
        exit 1
    fi
    echo "study $STUDY_ID: every point ran; results in $RESULTS"
}

# A training sweep: every rank count x every strategy, each a job step of its own.
run_sweep() {
    local scaling=$1
    training_args "$scaling"
    echo "study $STUDY_ID: $scaling scaling, ${PRESET:+preset $PRESET, }ranks:$RANK_COUNTS, strategies: $STRATEGIES"
    local ranks strategy extra=()
    # shellcheck disable=SC2206
    [ -n "$EXTRA_ARGS" ] && extra=($EXTRA_ARGS)
    # shellcheck disable=SC2206
    local strategies=($STRATEGIES) repeat rotated point repeat_args=()
    for ((repeat = 0; repeat < REPEATS; repeat++)); do
        # Repeat r starts at strategy r (mod their count): drift over the job (a warming node,
        # a neighbour's traffic) does not always favour the same strategy.
        rotated=("${strategies[@]:repeat % ${#strategies[@]}}" "${strategies[@]:0:repeat % ${#strategies[@]}}")
        [ "$REPEATS" -gt 1 ] && repeat_args=(--repeat-index "$repeat")
        for ranks in $RANK_COUNTS; do
            for strategy in "${rotated[@]}"; do
                if [ "$strategy" = ps ] && [ "$ranks" -lt 2 ] && [[ "$EXTRA_ARGS" != *--ps-colocate* ]]; then
                    echo "skipping ps at 1 rank: a dedicated server leaves no worker"; continue
                fi
                point=$strategy-$ranks
                [ "$REPEATS" -gt 1 ] && point=$point-r$repeat
                checkpoint_args "$point"
                run_point "$point" "$strategy" "$ranks" "$HPC_TRAIN" --strategy "$strategy" "${TRAIN_ARGS[@]}" \
                    --results "$RESULTS" --study "$STUDY_ID" "${repeat_args[@]}" "${CKPT_ARGS[@]}" "${extra[@]}" || stopped_exit
            done
        done
    done
    finish_sweep
}

# Tables and plots of this study's runs and failed points (serial, on the batch host).
make_report() {
    "$HPC_TRAIN" report --input "$RESULTS/runs.jsonl" --study "$STUDY_ID" --out "$RESULTS/report-$STUDY_ID"
}
