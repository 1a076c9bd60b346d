#!/usr/bin/env bash
# The measurements of issue 39 on the GPU machine (one GPU, 16 cores, 128 GiB; no Rust, no
# network), from the bundle of scripts/pack.sh, in two calls of at most 10 minutes each:
#
#   scripts/device-check.sh --part gpu --out DIR [--budget S] [--archive FILE.tar.gz] [--bundle B]
#   scripts/device-check.sh --part cpu --out DIR [...]
#
# --part gpu (issue 52's plan, within 7 minutes: --budget defaults to 420 s): the machine (GPU,
#   driver, CUDA, libtorch, its MPI and whether it is CUDA-aware); a smoke run on the GPU; then,
#   most important first: single-GPU ResNet-50 (3x224x224 synthetic) bf16 channels-last at batch
#   256, hpc-train then PyTorch (scripts/gpu_reference.py with the machine's torch, as its users
#   run it: a prefetching pinned DataLoader, SGD(fused=True)), both profiled alike and set side by
#   side (scripts/trace_summary.py: GPU busy and idle per step, synchronising calls, the largest
#   idle gaps); the same bf16 run under Open MPI's default binding of one core (every other
#   hpc-train run takes --bind-to none); tests/gpu.rs (every strategy, ZeRO 1-3, pipelines,
#   tensor parallelism, against the CPU); 2 ranks sharing the GPU: each strategy's exchange
#   (bench) staged and, where the bundle has a CUDA-aware Open MPI (env-cuda.sh), direct over
#   CUDA IPC; ResNet-50 with the ring, overlap on, off and auto, staged and CUDA-aware, PyTorch DDP
#   (gloo) beside them, ZeRO 3; then fp32 and tf32, batch 128, the other strategies.
# --part cpu: `mpirun -n 16 hpc-train bench` (every strategy, 1 KiB-256 MiB, against
#   MPI_Allreduce and the memory bound measured in the same run); ResNet-50 on 2 ranks with 4
#   cores each, overlap on against off and auto; weak and strong ResNet-18 studies over 1-16 ranks and
#   every strategy; 4 namespaced nodes x 4 cores (scripts/local-cluster.sh --cpus-per-node 4) at
#   10, 1 and 25 Gbit/s: the cost model fitted on half the sizes and checked on the other half.
#
# Every step runs under the time left (--budget, default 420 s for gpu and 540 s for cpu, minus
# a reserve for the summary) and is capped at twice its expected time: a step that no longer fits
# is skipped and says so; a failed or stopped step is recorded and the next one runs. DIR gets environment.txt, steps.tsv (step, status, seconds), logs/, the runs.jsonl and
# bench.jsonl rows, and summary.md (scripts/device_summary.py); --archive packs DIR into one file
# (the device tool returns at most 8 files). --skip REGEX: skip the steps whose names match
# (measured by an earlier call); GPU_TESTS: names of tests/gpu.rs's tests to run (default all).
# --quick: the same steps, tiny, on the CPU, to check
# the script where there is no GPU (its figures mean nothing).
#
# Environment: PYTHON (default /opt/torch/.venv/bin/python3, else .venv-pytorch/bin/python, else
# python3), for scripts/gpu_reference.py and the summary.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
start=$(date +%s)

part="" out="" budget="" archive="" bundle="$root/dist/hpc-train" quick=0 skip=""
while [ $# -gt 0 ]; do
    case "$1" in
        --part) part=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --budget) budget=$2; shift 2 ;;
        --archive) archive=$2; shift 2 ;;
        --bundle) bundle=$2; shift 2 ;;
        --quick) quick=1; shift ;;
        --skip) skip=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "device-check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$part" in gpu|cpu) ;; *) echo "device-check.sh: --part gpu or --part cpu" >&2; exit 2 ;; esac
[ -n "$out" ] || { echo "device-check.sh: --out DIR" >&2; exit 2; }
[ -n "$budget" ] || { [ "$part" = gpu ] && budget=420 || budget=540; }
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "device-check.sh: --budget takes seconds" >&2; exit 2; }
deadline=$((start + budget))
reserve=15
mkdir -p "$out/logs" || exit 1
out=$(cd "$out" && pwd)
steps_file="$out/steps.tsv"
printf 'step\tstatus\tseconds\n' > "$steps_file"

# The summary and the archive, however the script ends.
finish() {
    [ "$part" = cpu ] && "$root/scripts/local-cluster.sh" down /tmp/hpc-device-cluster > /dev/null 2>&1
    "$PYTHON" "$root/scripts/device_summary.py" --part "$part" --dir "$out" > "$out/summary.md" 2> "$out/logs/summary.log" \
        || echo "(the summary failed: logs/summary.log)" >> "$out/summary.md"
    if [ -n "$archive" ]; then
        tar -C "$(dirname "$out")" --exclude="$(basename "$out")/data" -czf "$archive" "$(basename "$out")"
        cp "$out/summary.md" "$(dirname "$archive")/summary-$part.md"
    fi
    echo "device-check.sh --part $part: $(( $(date +%s) - start )) s; summary in $out/summary.md"
}
trap finish EXIT

left() { echo $(( deadline - $(date +%s) )); }

# step NAME SECONDS COMMAND...: runs COMMAND (its output in logs/NAME.log) when SECONDS, its
# expected time, still fit; stops it when the budget ends.
step() {
    local name=$1 need=$2; shift 2
    if [ -n "$skip" ] && [[ "$name" =~ $skip ]]; then
        printf '%s\tskipped: --skip\t0\n' "$name" >> "$steps_file"
        return 1
    fi
    local remaining=$(( $(left) - reserve ))
    if [ "$remaining" -lt "$need" ]; then
        printf '%s\tskipped: %s s left, about %s s needed\t0\n' "$name" "$remaining" "$need" >> "$steps_file"
        echo "== $name: skipped ($remaining s left, about $need s needed)"
        return 1
    fi
    # Each step is capped at about twice its expected time, so that one that hangs or crawls
    # does not eat the lease.
    local cap=$(( 2 * need < remaining ? 2 * need : remaining ))
    echo "== $name ($remaining s left, cap $cap s)"
    local t0=$SECONDS status
    timeout --kill-after=5 "$cap" "$@" > "$out/logs/$name.log" 2>&1
    status=$?
    local took=$((SECONDS - t0)) word=ok
    [ "$status" -eq 124 ] || [ "$status" -eq 137 ] && word="stopped at its cap ($cap s)"
    [ "$status" -ne 0 ] && [ "$word" = ok ] && word="failed ($status)"
    printf '%s\t%s\t%s\n' "$name" "$word" "$took" >> "$steps_file"
    echo "   $word in $took s"
    [ "$status" -eq 0 ]
}

# --- the machine, before the bundle's PATH hides its own MPI ----------------------------------
PYTHON=${PYTHON:-}
for candidate in /opt/torch/.venv/bin/python3 "$root/.venv-pytorch/bin/python" python3; do
    [ -n "$PYTHON" ] && break
    command -v "$candidate" >/dev/null 2>&1 && PYTHON=$candidate
done

describe_machine() {
    local t="timeout 20"
    echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ), host $(hostname), hpc-train commit $(cat "$bundle/COMMIT" 2>/dev/null || echo unknown)"
    echo "## system"; uname -srm; grep -E '^(PRETTY_NAME)=' /etc/os-release
    echo "cores: $(nproc)"; lscpu | grep -E '^(Model name|Socket|Core|Thread|NUMA node)' ; free -g | head -2
    grep -iE '^(HugePages_Total|HugePages_Free|Hugepagesize)' /proc/meminfo
    cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null | sed 's/^/transparent hugepages: /'
    echo "## GPU"
    $t nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1
    $t nvidia-smi 2>&1 | grep -E 'CUDA Version' || true
    $t nvidia-smi topo -m 2>&1 | head -5
    echo "## torch ($PYTHON)"
    $t "$PYTHON" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version(), "GPU", torch.cuda.get_device_name() if torch.cuda.is_available() else None, "NCCL", torch.cuda.nccl.version() if torch.cuda.is_available() else None)' 2>&1
    echo "## the machine's own MPI"
    for tool in mpirun mpiexec ompi_info ucx_info fi_info; do
        type -a "$tool" 2>/dev/null || echo "$tool: not on PATH"
    done
    command -v mpirun >/dev/null && $t mpirun --version 2>&1 | head -3
    command -v ompi_info >/dev/null && $t ompi_info --parsable --all 2>/dev/null | grep -iE 'cuda_support|built_with_cuda|mpi_built_with' | head
    command -v ucx_info >/dev/null && $t ucx_info -v 2>&1 | head -3
    $t "$PYTHON" -c 'import mpi4py; print("mpi4py", mpi4py.__version__, mpi4py.get_config()); from mpi4py import MPI; print(MPI.Get_library_version().strip())' 2>&1 | head -5
    ls -d /dev/infiniband 2>/dev/null || echo "no /dev/infiniband"
    ls /usr/lib/x86_64-linux-gnu 2>/dev/null | grep -iE '^lib(mpi|mpich|ucp|fabric)\.' | head
    echo "## network namespaces (scripts/local-cluster.sh)"
    for tool in ip tc nsenter unshare taskset; do command -v "$tool" >/dev/null && echo "$tool: $(command -v "$tool")" || echo "$tool: missing"; done
    if command -v ip >/dev/null; then
        ip netns add hpcprobe 2>&1 && echo "ip netns: works" && ip netns del hpcprobe
        ip link add hpcprobe0 type veth peer name hpcprobe1 2>&1 && echo "veth: works" && ip link del hpcprobe0
        ip link add hpcprobebr type bridge 2>&1 && echo "bridge: works" && ip link del hpcprobebr
    fi
}

# --- the bundle --------------------------------------------------------------------------------
if [ ! -x "$bundle/bin/hpc-train" ] && [ -f "$bundle.tar.gz" ]; then
    unpacked=/tmp/hpc-train-bundle
    rm -rf "$unpacked" && mkdir -p "$unpacked" && tar -C "$unpacked" -xzf "$bundle.tar.gz"
    bundle="$unpacked/$(basename "$bundle")"
fi
[ -x "$bundle/bin/hpc-train" ] || { echo "device-check.sh: no bundle at $bundle (scripts/pack.sh --tests gpu)" >&2; exit 1; }
describe_machine > "$out/environment.txt" 2>&1
# shellcheck source=/dev/null
source "$bundle/env.sh"
# iproute2 from the bundle where the machine has none (the namespaced cluster needs ip and tc).
if ! command -v ip > /dev/null || ! command -v tc > /dev/null; then
    export PATH="$PATH:$bundle/net-tools"
    { echo "## iproute2 from the bundle ($bundle/net-tools)"; ip -V
      ip netns add hpcprobe && echo "ip netns: works" && ip netns del hpcprobe
      ip link add hpcprobe0 type veth peer name hpcprobe1 && echo "veth: works" \
          && tc qdisc add dev hpcprobe0 root tbf rate 10gbit burst 1mb latency 10ms && echo "tc tbf: works"
      ip link del hpcprobe0
      ip link add hpcprobebr type bridge && echo "bridge: works" && ip link del hpcprobebr; } >> "$out/environment.txt" 2>&1
fi
B="$bundle/bin/hpc-train"
# Whether Open MPI's shared-memory transport can copy between ranks in one pass (CMA, the
# kernel's process_vm_readv, which ptrace rules and containers may refuse): without it a large
# message moves only while its sender calls MPI (see src/progress.rs).
{ echo "## single-copy between ranks"; echo "yama ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo absent)"
  grep -E '^Cap(Eff|Bnd)' /proc/self/status
  ompi_info --parsable --param btl vader --level 9 2>/dev/null | grep -E 'single_copy_mechanism:(value|enumerator)'; } >> "$out/environment.txt" 2>&1
{ echo "## hpc-train"; "$B" --version 2>&1; echo "bundled Open MPI: $(ompi_info --parsable --all 2>/dev/null | grep -E 'ompi:version:full|built_with_cuda_support:value' | tr '\n' ' ')"; } >> "$out/environment.txt" 2>&1
[ -f "$bundle/env-cuda.sh" ] && echo "bundled CUDA-aware Open MPI (env-cuda.sh): $(bash -c 'source "$0" && ompi_info --parsable --all 2>/dev/null' "$bundle/env-cuda.sh" | grep -E 'ompi:version:full|built_with_cuda_support:value' | tr '\n' ' ')" >> "$out/environment.txt" 2>&1
cat "$out/environment.txt"
data="$out/data"
mkdir -p "$data"
synth() { [ -f "$data/$1.h5" ] || "$B" data synth --samples "$2" --test-samples 0 --shape "$3" --classes "$4" --out "$data/$1.h5" > /dev/null; }

if [ "$quick" = 1 ]; then
    device=cpu; big=3x32x32; batches="4"; train_steps=4; warmup=2; images=16; classes=10; py_device=cpu
    share_batch=2; cpu_ranks="1,2"; min_bytes=1K; max_bytes=64K; cpu_shape=3x16x16; shared_precision=fp32
else
    device=cuda; big=3x224x224; batches="128 256"; train_steps=25; warmup=8; images=512; classes=1000; py_device=cuda
    share_batch=64; cpu_ranks="1,2,4,8,16"; min_bytes=1M; max_bytes=256M; cpu_shape=3x128x128; shared_precision=bf16
fi
# `step` runs programs (under timeout), so launches are spelled out: "${mpi[@]}" RANKS ...
mpi=(mpirun --oversubscribe -n)

# --- GPU ---------------------------------------------------------------------------------------
# The order is the issue's: what matters most first, so that a short lease still returns it.
# hpc-train's GPU runs take `--bind-to none`: with 1 or 2 ranks Open MPI binds each to one core,
# which the training thread, the loader thread and libtorch's autograd thread then share (the
# 2026-11-26 lease measured hpc-train so: `"threads": 1`), while PyTorch ran on every core. One
# bf16 run keeps the old binding to show what it cost.
gpu_part() {
    synth small 96 3x32x32 5 && synth big "$images" "$big" "$classes" || { echo "device-check.sh: data synth failed" >&2; return 1; }
    local free=(--bind-to none)
    if ! step smoke 40 "${mpi[@]}" 1 "${free[@]}" "$B" --model tiny --data "$data/small.h5" --batch-size 8 --steps 3 --no-eval --device "$device" --results "$out/smoke"; then
        printf 'gpu\tnot run: the smoke run on the GPU failed (logs/smoke.log)\t0\n' >> "$steps_file"
        return 1
    fi
    local largest=${batches##* } bf16=bf16
    [ "$quick" = 1 ] && bf16=fp32
    # single RUN-NAME SETTING BATCH [MPIRUN-OPTION...]: hpc-train's ResNet-50 on one GPU.
    single() {
        local name=$1 setting=$2 batch=$3; shift 3
        local precision=${setting%-cl} layout=()
        [[ "$setting" == *-cl ]] && layout=(--channels-last)
        [ "$quick" = 1 ] && precision=fp32  # 16 bits and TF32 are for CUDA only
        step "$name" 45 "${mpi[@]}" 1 "$@" "$B" --model resnet50 --data "$data/big.h5" --batch-size "$batch" \
            --steps "$train_steps" --skip-steps "$warmup" --no-eval --device "$device" --precision "$precision" "${layout[@]}" \
            --results "$out/single" --study "single-$setting-$batch${study_suffix:-}"
    }
    pytorch_single() {  # pytorch_single SETTINGS BATCH: gpu_reference.py, one config per setting
        local configs="" setting
        for setting in $1; do configs+="${configs:+,}$setting:$2"; done
        step "single-pytorch-${1// /-}-$2" $((35 * $(wc -w <<< "$1"))) "$PYTHON" "$root/scripts/gpu_reference.py" --device "$py_device" \
            --model resnet50 --shape "$big" --classes "$classes" --images "$images" --configs "$configs" --steps "$train_steps" \
            --warmup-steps "$warmup" --out "$out/single/pytorch.jsonl"
    }
    # 1. The key pair: bf16 channels-last at the largest batch, hpc-train then PyTorch.
    single "single-hpc-train-$bf16-cl-$largest" "$bf16-cl" "$largest" "${free[@]}"
    pytorch_single "$bf16-cl" "$largest"
    # 2. Their profiles, over the same measured steps, each profiler warmed up one step.
    local profiled=(--steps $((warmup + 4)) --skip-steps "$warmup" --profile-dir "$out/profile" --profile-steps 3)
    step "profile-hpc-train-$bf16-cl-$largest" 40 "${mpi[@]}" 1 "${free[@]}" "$B" --model resnet50 --data "$data/big.h5" --batch-size "$largest" \
        "${profiled[@]}" --no-eval --device "$device" --precision "$bf16" --channels-last --results "$out/profile" \
        --study "profile-$bf16-cl-$largest"
    step "profile-pytorch-$bf16-cl-$largest" 45 "$PYTHON" "$root/scripts/gpu_reference.py" --device "$py_device" --model resnet50 \
        --shape "$big" --classes "$classes" --images "$images" --configs "$bf16-cl:$largest" "${profiled[@]}" --out "$out/profile/pytorch.jsonl"
    local theirs="$out/profile/pytorch-$bf16-cl-$largest.json"
    if [ -f "$out/profile/rank-0.json" ] && [ -f "$theirs" ]; then
        step profile-summary 20 "$PYTHON" "$root/scripts/trace_summary.py" hpc-train="$out/profile/rank-0.json" pytorch="$theirs" --top 25 \
            --out "$out/profile/summary.md"
    fi
    # 3. The same bf16 run with Open MPI's default binding (one core), to show its cost.
    study_suffix=-bind-core single "single-hpc-train-$bf16-cl-$largest-bind-core" "$bf16-cl" "$largest" --bind-to core
    # 4. tests/gpu.rs against the CPU, its tests side by side (they share the GPU); the pipeline's
    #    device receives under the bundle's CUDA-aware Open MPI where it has one (env-cuda.sh).
    # shellcheck disable=SC2086 # GPU_TESTS: test names (filters) for the test binary, or none
    step gpu-tests 190 env HPC_TRAIN_TEST_BINARY="$B" HPC_TRAIN_TEST_ROOT="$root" HPC_TRAIN_CUDA_MPI_ENV="$bundle/env-cuda.sh" \
        "$bundle/tests/gpu" --test-threads 8 ${GPU_TESTS:-}
    # 5. Two ranks sharing the GPU, the exchange alone: staged, then CUDA-aware where the bundle
    #    has that MPI (CUDA IPC between the two ranks through the smcuda transport).
    local cuda_mpi=() direct=()
    if [ -f "$bundle/env-cuda.sh" ]; then
        cuda_mpi=(bash -c 'source "$0" && exec "$@"' "$bundle/env-cuda.sh")
        direct=(--mca pml ob1 --mca btl smcuda,vader,self)
    else
        printf 'cuda-aware\tnot run: the bundle has no CUDA-aware Open MPI (scripts/build-cuda-mpi.sh, then pack.sh)\t0\n' >> "$steps_file"
    fi
    step shared-bench-staged 60 "${mpi[@]}" 2 "${free[@]}" "$B" bench --device "$device" --cuda-aware no --strategies ring,rhd,auto,allreduce,horovod,ps \
        --min-bytes "$min_bytes" --max-bytes "$max_bytes" --factor 4 --iters 5 --warmup 2 --results "$out/shared"
    if [ ${#cuda_mpi[@]} -gt 0 ]; then
        step shared-bench-cuda-aware 60 "${cuda_mpi[@]}" "${mpi[@]}" 2 "${free[@]}" "${direct[@]}" "$B" bench --device "$device" --cuda-aware yes \
            --strategies ring,rhd,auto,allreduce,horovod,ps --min-bytes "$min_bytes" --max-bytes "$max_bytes" --factor 4 --iters 5 --warmup 2 \
            --results "$out/shared"
    fi
    # 6. Two ranks sharing the GPU, ResNet-50 steps: the ring with overlap on and off, staged and
    #    CUDA-aware, PyTorch DDP (gloo) beside them; then ZeRO 3 and the other strategies.
    # Channels-last everywhere but ZeRO 3, which refuses it (its flat unit buffers).
    shared() {  # shared NAME [LAUNCHER...] -- [HPC-TRAIN-OPTION...]
        local name=$1; shift
        local launcher=()
        while [ "$1" != -- ]; do launcher+=("$1"); shift; done
        shift
        step "shared-$name" 35 "${launcher[@]}" "${mpi[@]}" 2 "${free[@]}" "$B" --model resnet50 --data "$data/big.h5" --batch-size "$share_batch" \
            --steps 12 --skip-steps 4 --no-eval --device "$device" --precision "$shared_precision" --allow-gpu-sharing \
            --results "$out/shared" --study "shared-$name" "$@"
    }
    local overlap
    # Auto is on for GPU ranks without a trial (issue 51): it must keep overlap's 1.2-1.3x.
    for overlap in on off auto; do
        shared "ring-overlap-$overlap-staged" -- --strategy ring --overlap "$overlap" --cuda-aware no --channels-last
        [ ${#cuda_mpi[@]} -gt 0 ] && shared "ring-overlap-$overlap-cuda-aware" "${cuda_mpi[@]}" -- --strategy ring --overlap "$overlap" --cuda-aware yes --channels-last
    done
    local ddp_precision=$shared_precision; [ "$quick" = 1 ] && ddp_precision=fp32
    step shared-pytorch-ddp-gloo 50 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 "$root/scripts/gpu_reference.py" --ddp gloo \
        --device "$py_device" --model resnet50 --shape "$big" --classes "$classes" --images "$images" --configs "$ddp_precision-cl:$share_batch" \
        --steps 12 --warmup-steps 4 --out "$out/shared/pytorch-ddp.jsonl"
    shared zero3-staged -- --zero 3 --cuda-aware no
    [ ${#cuda_mpi[@]} -gt 0 ] && shared zero3-cuda-aware "${cuda_mpi[@]}" -- --zero 3 --cuda-aware yes
    # Issue 52's item 2: ZeRO 3 without prefetch beside the rows above (its collectives on a
    # stream of their own: fsdp_gather_hidden), and a pipeline of 2 stages (F, B and W timed by
    # device events, no device-wide synchronisation per micro-batch, pinned staging).
    shared zero3-staged-no-prefetch -- --zero 3 --cuda-aware no --overlap off
    shared pipeline-1f1b-staged -- --pipeline-stages 2 --micro-batches 8 --schedule 1f1b --cuda-aware no --channels-last
    [ ${#cuda_mpi[@]} -gt 0 ] && shared pipeline-1f1b-cuda-aware "${cuda_mpi[@]}" -- --pipeline-stages 2 --micro-batches 8 --schedule 1f1b --cuda-aware yes --channels-last
    # 7. The other single-GPU settings, hpc-train then PyTorch, then the smaller batch.
    local setting smaller=${batches%% *}
    for setting in fp32 tf32; do single "single-hpc-train-$setting-$largest" "$setting" "$largest" "${free[@]}"; done
    pytorch_single "fp32 tf32" "$largest"
    if [ "$smaller" != "$largest" ]; then
        for setting in bf16-cl fp32 tf32; do single "single-hpc-train-$setting-$smaller" "$setting" "$smaller" "${free[@]}"; done
        pytorch_single "bf16-cl fp32 tf32" "$smaller"
    fi
    # 8. The other strategies with two ranks on the GPU (the ring's figures are above).
    local strategy
    for strategy in allreduce rhd auto horovod ps; do
        shared "$strategy-staged" -- --strategy "$strategy" --overlap off --cuda-aware no --channels-last
        [ ${#cuda_mpi[@]} -gt 0 ] && shared "$strategy-cuda-aware" "${cuda_mpi[@]}" -- --strategy "$strategy" --overlap off --cuda-aware yes --channels-last
    done
}

# --- CPU ---------------------------------------------------------------------------------------
cpu_part() {
    synth resnet 256 "$cpu_shape" 10 && synth cifar 2048 3x32x32 10 || { echo "device-check.sh: data synth failed" >&2; return 1; }
    local ranks=16; [ "$quick" = 1 ] && ranks=2
    local bind=(--bind-to core); [ "$quick" = 1 ] && bind=(--bind-to none)
    step bench-16 100 "${mpi[@]}" "$ranks" "${bind[@]}" "$B" bench --strategies ring,rhd,auto,allreduce,horovod --min-bytes 1K \
        --max-bytes "$max_bytes" --factor 4 --iters 5 --warmup 2 --results "$out/bench"
    # Overlap needs a core beside each rank's compute threads: 4 cores per rank, 3 threads.
    local pe=(--map-by slot:PE=4 --bind-to core) threads=3
    [ "$quick" = 1 ] && { pe=(--bind-to none); threads=1; }
    # Auto (the default) beside them: on CPU ranks it measures both over its first steps and
    # keeps the faster (issue 51), so it must come out at least the better of the two.
    # Each round takes the three in another order (round 1: off, on, auto; 2: on, auto, off;
    # 3: auto, off, on), so that no mode always runs first or after the same one.
    overlap_pair() {
        local overlap modes=(off on auto) order=()
        local k; for k in 0 1 2; do order+=("${modes[$(( (k + $1 - 1) % 3 ))]}"); done
        for overlap in "${order[@]}"; do
            step "overlap-$overlap-$1" 40 "${mpi[@]}" 2 "${pe[@]}" "$B" --device cpu --model resnet50 --data "$data/resnet.h5" --batch-size 16 --steps 24 \
                --skip-steps 4 --threads "$threads" --no-eval --strategy ring --overlap "$overlap" --results "$out/overlap" \
                --study "overlap-$overlap"
        done
    }
    overlap_pair 1
    # The cost model on 4 namespaced nodes of 4 cores each, 10 Gbit/s first (the goal's rate).
    # Where the kernel has no tbf qdisc, the links cannot be shaped: the nodes run once at the
    # veth pairs' own rate instead, so that the fit and its check still run.
    local nodes=4 per=4 rates="1000 25000"; [ "$quick" = 1 ] && { nodes=2; per=1; }
    if tbf_available; then
        step cluster-10000mbit 50 bash -c 'cluster_rate "$@"' cluster_rate 10000 "$nodes" "$per"
    else
        printf 'cluster-shaped\tnot run: this kernel has no tbf qdisc (tc), so no link can be shaped\t0\n' >> "$steps_file"
        step cluster-unshaped 50 bash -c 'cluster_rate "$@"' cluster_rate unshaped "$nodes" "$per"
        rates=""
    fi
    # Zero-bubble schedules against 1F1B and interleaved at P = 4 (issue 50): 4 ranks of 4 cores
    # (the VM's measurement is P = 2: scripts/measure-zero-bubble.sh); records in zero-bubble/,
    # tagged as that script tags them, so that its table code reads them.
    # Three compute threads per 4-core rank: where the kernel has no single-copy path (that
    # machine's has none), the pipelines' progress thread needs the fourth core (with 4 threads
    # 1F1B idled 15 points above its replay, with 3 within 2, at the same images/s).
    local m schedule zb_threads=3; [ "$quick" = 1 ] && zb_threads=1
    for m in 4 8 16; do
        for schedule in 1f1b interleaved zb-h1 zb-v; do
            local virtual=(); [ "$schedule" = interleaved ] && virtual=(--virtual-stages 2)
            step "pipeline-p4-$schedule-m$m" 40 "${mpi[@]}" 4 "${pe[@]}" "$B" --device cpu --model resnet18 --data "$data/cifar.h5" --batch-size 64 \
                --steps 12 --skip-steps 4 --threads "$zb_threads" --no-eval --pipeline-stages 4 --micro-batches "$m" --schedule "$schedule" "${virtual[@]}" \
                --results "$out/zero-bubble" --study "zb-resnet18-p4-$schedule-m$m"
        done
    done
    # Where a P = 4 step's idle time goes (chrome://tracing): 1F1B at M = 8 with a compute
    # thread on every core of the rank, and with one core left to MPI and its progress thread.
    local t threads_each="4 3"; [ "$quick" = 1 ] && threads_each=1
    for t in $threads_each; do
        step "pipeline-p4-timeline-1f1b-m8-t$t" 40 "${mpi[@]}" 4 "${pe[@]}" "$B" --device cpu --model resnet18 --data "$data/cifar.h5" --batch-size 64 \
            --steps 12 --skip-steps 4 --threads "$t" --no-eval --pipeline-stages 4 --micro-batches 8 --schedule 1f1b \
            --pipeline-timeline "$out/zero-bubble/timeline-1f1b-m8-t$t.json" --results "$out/zero-bubble" --study "zb-resnet18-p4-1f1b-m8-t$t"
    done
    local scaling
    for scaling in weak strong; do
        # Strong scaling splits 32 images over each point's training ranks: ps's servers sit
        # beside its workers (--ps-colocate), or its 1, 3, 7 and 15 workers would not divide it.
        local size=(--batch-size 8); [ "$scaling" = strong ] && size=(--global-batch 32 --ps-colocate)
        step "study-$scaling" 90 "${mpi[@]}" "$ranks" "${bind[@]}" "$B" study --ranks "$cpu_ranks" --strategies ring,rhd,auto,allreduce,horovod,ps \
            --scaling "$scaling" "${size[@]}" --device cpu --model resnet18 --data "$data/cifar.h5" --steps 6 --skip-steps 2 --threads 1 \
            --no-eval --results "$out/studies" --study-id "device-$scaling"
    done
    [ -f "$out/studies/runs.jsonl" ] && step studies-report 20 "$B" report --input "$out/studies/runs.jsonl" --out "$out/studies/report"
    overlap_pair 2
    overlap_pair 3
    step bench-16-ps 40 "${mpi[@]}" "$ranks" "${bind[@]}" "$B" bench --strategies ps --min-bytes 1K --max-bytes 64M --factor 4 --iters 3 \
        --warmup 1 --results "$out/bench"
    for mbit in $rates; do
        step "cluster-${mbit}mbit" 50 bash -c 'cluster_rate "$@"' cluster_rate "$mbit" "$nodes" "$per"
    done
}

# cluster_rate MBIT NODES CORES: bench ring, rhd and MPI_Allreduce over NODES nodes (one rank
# each) at MBIT Mbit/s, sizes 64 KiB-64 MiB by factors of 2; the model fitted on the sizes 4^k,
# auto benched with it; every row of the other sizes (ring, rhd, auto) checked against the model.
# cluster_rate MBIT|unshaped NODES CORES: the cost model fitted and checked on NODES namespaced
# nodes of CORES cores whose links are shaped to MBIT Mbit/s, or left at the veth pairs' own rate
# ("unshaped": where the kernel has no tbf qdisc).
cluster_rate() {
    local mbit=$1 nodes=$2 per=$3 c=/tmp/hpc-device-cluster per_node_ranks=$3
    [ "$per_node_ranks" -ge 2 ] || per_node_ranks=2  # a one-core node (--quick) still gets a pair
    local dir="$out/cluster/${mbit}mbit" rate=(--link-mbit "$mbit") top=64M
    [ "$mbit" = unshaped ] && { dir="$out/cluster/unshaped"; rate=(); }
    [ "$mbit" != unshaped ] && [ "$mbit" -le 1000 ] && top=16M
    [ "$quick" = 1 ] && top=1M
    mkdir -p "$dir"
    "$root/scripts/local-cluster.sh" down "$c" > /dev/null 2>&1
    trap '"$root/scripts/local-cluster.sh" down "$c" > /dev/null 2>&1' EXIT
    "$root/scripts/local-cluster.sh" up "$c" --nodes "$nodes" "${rate[@]}" --cpus-per-node "$per" || return 1
    on_nodes() { "$root/scripts/local-cluster.sh" run "$c" -- mpirun -n "$nodes" --map-by ppr:1:node "$@"; }
    on_nodes "$B" bench --strategies ring,rhd,allreduce --min-bytes 64K --max-bytes "$top" --factor 2 --iters 8 --warmup 2 \
        "${rate[@]}" --results "$dir" || return 1
    "$PYTHON" - "$dir/bench.jsonl" "$dir/fit.jsonl" "$dir/held-out.jsonl" <<'SPLIT' || return 1
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
with open(sys.argv[2], "w") as fit, open(sys.argv[3], "w") as held:
    for row in rows:
        # sizes 4^k to the fit, the others (2 x 4^k) held out
        (fit if int(math.log2(row["size"])) % 2 == 0 else held).write(json.dumps(row) + "\n")
SPLIT
    # Rows within one node (the fit needs the node's own links too): the node's cores' ranks on
    # node1 alone, measured here, so that the fit does not depend on this part's 16-rank bench
    # (which a later call may skip) and sees the nodes' own cores.
    "$root/scripts/local-cluster.sh" run "$c" -- mpirun --oversubscribe -n "$per_node_ranks" --map-by "ppr:$per_node_ranks:node" "$B" bench \
        --strategies ring,rhd --min-bytes 64K --max-bytes "$top" --factor 2 --iters 8 --warmup 2 --results "$dir/node" || return 1
    cat "$dir/fit.jsonl" "$dir/node/bench.jsonl" > "$dir/fit-and-node.jsonl"
    "$B" model fit --bench "$dir/fit-and-node.jsonl" "${rate[@]}" --nics-per-node 1 --out "$dir/cost-model.json" || return 1
    on_nodes "$B" bench --strategies auto --cost-model "$dir/cost-model.json" --min-bytes 64K --max-bytes "$top" --factor 2 \
        --iters 8 --warmup 2 "${rate[@]}" --results "$dir/auto" || return 1
    "$PYTHON" - "$dir/auto/bench.jsonl" >> "$dir/held-out.jsonl" <<'SPLIT'
import json, math, sys
for line in open(sys.argv[1]):
    if int(math.log2(json.loads(line)["size"])) % 2 == 1:
        print(line.strip())
SPLIT
    printf 'name = "namespaced nodes, %s (fitted)"\nranks_per_node = 1\nfitted = "%s"\n' "${rate[*]:-unshaped links}" "$dir/cost-model.json" > "$dir/profile.toml"
    "$B" project --profile "$dir/profile.toml" --model resnet18 --batch 16 --ranks "1,$nodes" --compute-ms 10 \
        --validate-bench "$dir/held-out.jsonl" --out "$dir/projection"
}

# Whether tc can put a token bucket (tbf) on a link here: a veth pair made and deleted at once.
# Test hook: DEVICE_CHECK_NO_TBF=1 answers no.
tbf_available() {
    [ "${DEVICE_CHECK_NO_TBF:-0}" = 1 ] && return 1
    ip link add hpctbf0 type veth peer name hpctbf1 2> /dev/null || return 1
    local answer=1
    tc qdisc add dev hpctbf0 root tbf rate 10gbit burst 1mb latency 10ms 2> /dev/null && answer=0
    ip link del hpctbf0 2> /dev/null
    return "$answer"
}

# cluster_rate runs in a shell of its own (under timeout): what it reads goes with it.
export -f cluster_rate
export out root B PYTHON quick

echo "device-check.sh --part $part: budget $budget s, bundle $bundle, python $PYTHON, quick $quick"
"${part}_part"
