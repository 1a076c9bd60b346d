# Shared by the job files in jobs/: settings from the environment, the launch of one point of a
# sweep, and the report at the end. Sourced, not run.
#
# Every setting is an environment variable with a default; set it at submission, e.g.
#   MODEL=resnet18 STRATEGIES="ring horovod" sbatch --nodes=8 jobs/weak_scaling.sbatch
#
# | variable          | default                                   | meaning |
# |-------------------|-------------------------------------------|---------|
# | HPC_TRAIN         | $SLURM_SUBMIT_DIR/target/release/hpc-train | the binary (or the packed one, scripts/pack.sh) |
# | RANKS_PER_NODE    | $SLURM_NTASKS_PER_NODE, else 1            | ranks (= GPUs) per node |
# | GPUS_PER_RANK     | 1                                         | 0 for CPU-only nodes |
# | NODE_COUNTS       | 1 2 4 ... up to the allocation            | the sweep, in nodes |
# | RANK_COUNTS       | (NODE_COUNTS x RANKS_PER_NODE)            | the sweep in ranks, instead of nodes |
# | STRATEGIES        | ring ps allreduce horovod                 | strategies at every point |
# | MODEL             | resnet50                                  | model |
# | DATA              | datasets/fashion-mnist.h5                 | dataset file (on a shared file system) |
# | BATCH             | 256                                       | per-rank batch (weak scaling) |
# | GLOBAL_BATCH      | 1024                                      | global batch (strong scaling) |
# | EPOCHS            | 1                                         | epochs per point (unless STEPS) |
# | STEPS             | (unset)                                   | steps per point, instead of EPOCHS |
# | RESULTS           | results                                   | runs.jsonl, bench.jsonl, reports |
# | LAUNCHER          | srun                                      | srun, or mpirun: the MPI library's own launcher |
# | SRUN_MPI          | by the binary's MPI (see below)           | srun --mpi= (pmix for Open MPI, pmi2 for the MPICH family) |
# | MPIEXEC           | by the binary's MPI (see below)           | the program LAUNCHER=mpirun runs (mpirun, mpiexec.mpich...) |
# | LAUNCH_EXTRA      | (unset)                                   | more launcher options (e.g. --overcommit) |
# | EXTRA_ARGS        | (unset)                                   | more hpc-train options for every run |
# | CHECKPOINT_DIR    | (unset)                                   | checkpoints, one folder per point: DIR/<strategy>-<ranks> |
# | RESUME            | (unset)                                   | 1: each point continues from its folder's newest checkpoint |
# | STUDY_ID          | <job name>-<job id>                       | tags the runs; the report selects them |

# A point that fails ends the script (set -e), and so does one a signal stopped: hpc-train
# exits 143 when it stopped before its last step (1 when nothing was saved), see jobs/README.md.
set -euo pipefail

# Site modules: edit for your cluster (these are typical names).
# module purge
# module load gcc/12 openmpi/4.1 cuda/12.4 hdf5/1.12

cd "${SLURM_SUBMIT_DIR:-.}"
HPC_TRAIN=${HPC_TRAIN:-$PWD/target/release/hpc-train}
RANKS_PER_NODE=${RANKS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}
GPUS_PER_RANK=${GPUS_PER_RANK:-1}
STRATEGIES=${STRATEGIES:-ring ps allreduce horovod}
MODEL=${MODEL:-resnet50}
DATA=${DATA:-datasets/fashion-mnist.h5}
BATCH=${BATCH:-256}
GLOBAL_BATCH=${GLOBAL_BATCH:-1024}
EPOCHS=${EPOCHS:-1}
RESULTS=${RESULTS:-results}
LAUNCHER=${LAUNCHER:-srun}
LAUNCH_EXTRA=${LAUNCH_EXTRA:-}
EXTRA_ARGS=${EXTRA_ARGS:-}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-}
RESUME=${RESUME:-}
STUDY_ID=${STUDY_ID:-${SLURM_JOB_NAME:-hpc-train}-${SLURM_JOB_ID:-local}}
ALLOC_NODES=${SLURM_JOB_NUM_NODES:-1}

[ -x "$HPC_TRAIN" ] || { echo "HPC_TRAIN=$HPC_TRAIN is not an executable (build it, or pack it with scripts/pack.sh)" >&2; exit 1; }
mkdir -p "$RESULTS"

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

# The sweep in ranks: RANK_COUNTS as given, else powers of two of nodes up to the allocation.
if [ -z "${RANK_COUNTS:-}" ]; then
    if [ -z "${NODE_COUNTS:-}" ]; then
        NODE_COUNTS=""; n=1
        while [ "$n" -le "$ALLOC_NODES" ]; do NODE_COUNTS="$NODE_COUNTS $n"; n=$((n * 2)); done
    fi
    RANK_COUNTS=""
    for n in $NODE_COUNTS; do RANK_COUNTS="$RANK_COUNTS $((n * RANKS_PER_NODE))"; done
fi

# Runs "$@" on RANKS ranks of this allocation, filling nodes RANKS_PER_NODE at a time.
launch() {
    local ranks=$1; shift
    local nodes=$(( (ranks + RANKS_PER_NODE - 1) / RANKS_PER_NODE ))
    local per_node=$(( ranks < RANKS_PER_NODE ? ranks : RANKS_PER_NODE ))
    case "$LAUNCHER" in
        srun)
            local gpus=()
            [ "$GPUS_PER_RANK" -gt 0 ] && gpus=(--gpus-per-task="$GPUS_PER_RANK")
            # shellcheck disable=SC2086
            srun --mpi="$SRUN_MPI" --nodes="$nodes" --ntasks="$ranks" --ntasks-per-node="$per_node" \
                "${gpus[@]}" --kill-on-bad-exit=1 $LAUNCH_EXTRA "$@" ;;
        mpirun)
            local hosts
            hosts=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" | head -n "$nodes" | sed "s/\$/:$per_node/" | paste -sd, -)
            if [ "$MPI_FAMILY" = mpich ]; then
                # Hydra: the first NODES hosts of the allocation, PER_NODE ranks on each.
                # shellcheck disable=SC2086
                "$MPIEXEC" -n "$ranks" -hosts "$hosts" -ppn "$per_node" $LAUNCH_EXTRA "$@"
            else
                # shellcheck disable=SC2086
                "$MPIEXEC" -n "$ranks" --host "$hosts" --map-by "ppr:$per_node:node" $LAUNCH_EXTRA "$@"
            fi ;;
        *) echo "LAUNCHER=$LAUNCHER: expected srun or mpirun" >&2; exit 2 ;;
    esac
}

length_args() {
    if [ -n "${STEPS:-}" ]; then echo "--steps $STEPS"; else echo "--epochs $EPOCHS"; fi
}

# Checkpoint options of one point: a folder of its own under CHECKPOINT_DIR (hpc-train refuses
# a run from step 0 into a folder that holds another run's checkpoints, and a shared folder
# would let one point prune another's), and --resume with RESUME=1.
checkpoint_args() {
    local point=$1
    [ -n "$CHECKPOINT_DIR" ] || return 0
    echo "--checkpoint-dir $CHECKPOINT_DIR/$point"
    if [ "$RESUME" = 1 ]; then echo "--resume"; fi
}

# A training sweep: every rank count x every strategy, each a job step of its own.
run_sweep() {
    local scaling=$1
    local batch_args
    if [ "$scaling" = weak ]; then batch_args="--batch-size $BATCH"; else batch_args="--global-batch $GLOBAL_BATCH"; fi
    echo "study $STUDY_ID: $scaling scaling of $MODEL, ranks:$RANK_COUNTS, strategies: $STRATEGIES"
    for ranks in $RANK_COUNTS; do
        for strategy in $STRATEGIES; do
            if [ "$strategy" = ps ] && [ "$ranks" -lt 2 ] && [[ "$EXTRA_ARGS" != *--ps-colocate* ]]; then
                echo "skipping ps at 1 rank: a dedicated server leaves no worker"; continue
            fi
            echo "== $strategy on $ranks rank(s)"
            # shellcheck disable=SC2046,SC2086
            launch "$ranks" "$HPC_TRAIN" --strategy "$strategy" --model "$MODEL" --data "$DATA" \
                --scaling "$scaling" $batch_args $(length_args) --results "$RESULTS" \
                --study-tag "$STUDY_ID" $(checkpoint_args "$strategy-$ranks") $EXTRA_ARGS
        done
    done
    make_report
}

# Tables and plots of this study's runs (serial, on the batch host).
make_report() {
    "$HPC_TRAIN" report --input "$RESULTS/runs.jsonl" --study "$STUDY_ID" --out "$RESULTS/report-$STUDY_ID"
}
