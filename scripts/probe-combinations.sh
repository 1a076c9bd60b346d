#!/usr/bin/env bash
# Issue 48's probe, run again: every case the review ran as a new user would, with what it must
# end in now (the right weights, or one line naming the flag and a non-zero exit, peers named by
# world rank), and what it ended in. Writes results/compat/probes.md (and the runs' logs under
# results/compat/probe-logs/).
#   scripts/probe-combinations.sh            the build in target/ (Open MPI)
#   HPC_TRAIN_MPI=mpich scripts/probe-combinations.sh
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
B=$HPC_TRAIN_BIN
[ -x "$B" ] || { echo "build first: scripts/setup.sh --no-run" >&2; exit 1; }
out=results/compat
logs=$out/probe-logs
work=$(mktemp -d)
trap 'umount "$work/full" 2>/dev/null; rm -rf "$work"' EXIT
mkdir -p "$logs"
rm -f "$logs"/*.log
"$B" data synth --samples 64 --test-samples 16 --shape 1x16x16 --classes 4 --out "$work/d.h5" >/dev/null
common=(--data "$work/d.h5" --scaling strong --global-batch 8 --steps 4 --seed 7 --threads 1 --log-every 1000 --skip-steps 1 --no-eval)
tiny=(--model tiny "${common[@]}")
vit=(--model vit-tiny "${common[@]}")
pipe=(--pipeline-stages 2 --micro-batches 2 --partition params)
rows=()
n=0

# case NAME EXPECT TIMEOUT COMMAND...: runs COMMAND (stdin closed), records exit code, seconds and
# the first error line. EXPECT is `ok` (exit 0) or `fail` (non-zero with an error line).
case_() {
    local name=$1 expect=$2 limit=$3; shift 3
    n=$((n + 1))
    local log=$logs/$(printf '%02d' $n).log start end code line verdict
    start=$(date +%s.%N)
    timeout -k 5 "$limit" "$@" </dev/null >"$log" 2>&1
    code=$?
    end=$(date +%s.%N)
    line=$(grep -m1 -E '^(error|hpc-train: error)|error:|exchange watchdog|panicked|exiting at step' "$log" | cut -c1-300 | sed 's/|/\\|/g')
    case "$expect:$code" in
        ok:0) verdict="as expected" ;;
        fail:124|fail:137) verdict="NOT AS EXPECTED (hung until the ${limit} s limit)" ;;
        fail:0) verdict="NOT AS EXPECTED (exit 0)" ;;
        fail:*) if [ -n "$line" ] && ! grep -q panicked "$log"; then verdict="as expected"; else verdict="NOT AS EXPECTED (no error line, or a panic)"; fi ;;
        *) verdict="NOT AS EXPECTED" ;;
    esac
    rows+=("| $n | $name | $expect | $code | $(printf '%.1f' "$(echo "$end - $start" | bc)") | ${line:-} | $verdict |")
}

# weights_equal NAME RANKS ARGS...: RANKS ranks with ARGS against one process with the same
# options less the layout's, by the largest relative difference of any tensor.
compare() {
    local name=$1 ranks=$2 ref=$3; shift 3
    n=$((n + 1))
    local log=$logs/$(printf '%02d' $n).log code diff verdict
    hpc_train_mpirun "$ranks" "$B" "$@" --results "$work/r" --save-weights "$work/w$n.st" </dev/null >"$log" 2>&1
    code=$?
    diff=$(python3 - "$ref" "$work/w$n.st" <<'EOF' 2>>"$log"
import json, math, struct, sys
def load(p):
    b = open(p, 'rb').read(); k = struct.unpack('<Q', b[:8])[0]; h = json.loads(b[8:8 + k]); d = b[8 + k:]
    return {n: struct.unpack('<%df' % ((v['data_offsets'][1] - v['data_offsets'][0]) // 4), d[v['data_offsets'][0]:v['data_offsets'][1]]) for n, v in h.items() if n != '__metadata__'}
a, b = load(sys.argv[1]), load(sys.argv[2])
print('%.1e' % max(math.sqrt(sum((x - y) ** 2 for x, y in zip(a[n], b[n]))) / max(math.sqrt(sum(x * x for x in a[n])), 1e-12) for n in a))
EOF
)
    if [ "$code" = 0 ] && python3 -c "import sys; sys.exit(0 if float('${diff:-nan}') <= 2e-5 else 1)"; then verdict="as expected"; else verdict="NOT AS EXPECTED"; fi
    rows+=("| $n | $name | weights of one process | $code | | largest relative difference ${diff:-none} | $verdict |")
}

# One-process references.
hpc_train_mpirun 1 "$B" "${vit[@]}" --optimizer lars --lr 1 --results "$work/r" --save-weights "$work/lars1.st" >/dev/null 2>&1
for t in 2 4; do
    compare "LARS with --tensor-parallel $t" "$t" "$work/lars1.st" "${vit[@]}" --optimizer lars --lr 1 --tensor-parallel "$t"
done
compare "LARS with --tensor-parallel 2 in 2 stages" 4 "$work/lars1.st" "${vit[@]}" --optimizer lars --lr 1 --tensor-parallel 2 "${pipe[@]}"

for fault in exit 'stall:30' 'stall-after:30' nan nangrad; do
    kind=${fault%%:*}; secs=${fault#*:}; [ "$secs" = "$fault" ] && secs= || secs=":$secs"
    for at in "2 0" "2 1" "4 3"; do
        set -- $at
        HPC_TRAIN_FAULT="$kind@$2:1$secs" case_ "HPC_TRAIN_FAULT=$kind@$2:1$secs, 2-stage pipeline on $1 ranks" fail 60 \
            env HPC_TRAIN_FAULT="$kind@$2:1$secs" bash -c "source scripts/env.sh; hpc_train_mpirun $1 $B ${tiny[*]} ${pipe[*]} --exchange-timeout-s 5 --results $work/r"
    done
done
case_ "HPC_TRAIN_FAULT=stall-after@1:1:30 with --zero 3" fail 60 \
    env HPC_TRAIN_FAULT="stall-after@1:1:30" bash -c "source scripts/env.sh; hpc_train_mpirun 2 $B ${tiny[*]} --zero 3 --exchange-timeout-s 5 --results $work/r"
case_ "HPC_TRAIN_FAULT=stall@3:1:30 with --tensor-parallel 2 (D = 2)" fail 60 \
    env HPC_TRAIN_FAULT="stall@3:1:30" bash -c "source scripts/env.sh; hpc_train_mpirun 4 $B ${vit[*]} --tensor-parallel 2 --exchange-timeout-s 5 --results $work/r"

# A SIGSTOPped stage (D = 1) with --exchange-timeout-s 10: ended within 15 s, naming the peer.
n=$((n + 1)); log=$logs/$(printf '%02d' $n).log
long=(--model tiny --data "$work/d.h5" --scaling strong --global-batch 8 --steps 100000 --seed 7 --threads 1 --log-every 1 --skip-steps 1 --no-eval)
hpc_train_mpirun 2 "$B" "${long[@]}" "${pipe[@]}" --exchange-timeout-s 10 --results "$work/r" </dev/null >"$log" 2>&1 &
launcher=$!
# Stopped once it trains (a rank stopped in MPI's start-up is the launcher's to notice).
for _ in $(seq 600); do grep -q 'step 3:' "$log" 2>/dev/null && break; sleep 0.1; done
victim=$(pgrep -f "^$B --model tiny" | sort -n | tail -1)
start=$(date +%s.%N)
[ -n "$victim" ] && kill -STOP "$victim"
( sleep 40; kill -9 $launcher 2>/dev/null ) &
killer=$!
wait $launcher; code=$?
kill $killer 2>/dev/null
[ -n "$victim" ] && kill -CONT "$victim" 2>/dev/null; pkill -9 -f "^$B --model tiny" 2>/dev/null
end=$(date +%s.%N)
line=$(grep -m1 'exchange watchdog' "$log" | cut -c1-300 | sed 's/|/\\|/g')
took=$(echo "$end - $start" | bc)
verdict="NOT AS EXPECTED"; [ "$code" != 0 ] && [ -n "$line" ] && python3 -c "import sys; sys.exit(0 if $took <= 15 else 1)" && verdict="as expected"
rows+=("| $n | SIGSTOP of stage 1 of a 2-stage pipeline (D = 1), --exchange-timeout-s 10 | fail within 15 s | $code | $(printf '%.1f' "$took") after the stop | $line | $verdict |")

# A full disk: a 16 KiB tmpfs, which the traces outgrow (unmounted on exit, whatever happens).
mkdir -p "$work/full"
if mount -t tmpfs -o size=16k hpc-train-probe "$work/full" 2>/dev/null; then
    case_ "--profile-dir on a full disk (16 KiB tmpfs)" fail 60 bash -c "source scripts/env.sh; hpc_train_mpirun 2 $B ${tiny[*]} --profile-dir $work/full/profile --profile-steps 1 --results $work/r"
    umount "$work/full"
fi
for bad in "stall@0:2:-1" "stall@0:2:nan" "stall@0:2:1e30" "nan@7:1"; do
    case_ "HPC_TRAIN_FAULT=$bad on 2 ranks" fail 60 env HPC_TRAIN_FAULT="$bad" bash -c "source scripts/env.sh; hpc_train_mpirun 2 $B ${tiny[*]} --results $work/r"
done
plan=(project --plan --profile jobs/clusters/dgx-a100-hdr.toml --transformer gpt3-175b --gpu-memory-gb 80 --gpu-tflops 156 --out "$work/plan")
# A batch this large is laid out (one micro-batch per sample): a plan, not the panic it was.
case_ "project --plan --global-batch 18446744073709551615" ok 60 "$B" "${plan[@]}" --gpus 1024 --global-batch 18446744073709551615
case_ "project --plan --gpus 18446744073709551615" fail 60 "$B" "${plan[@]}" --gpus 18446744073709551615 --global-batch 1536
for flag in "--lr 1e39" "--lars-eta 1e300 --optimizer lars" "--weight-decay 1e300"; do
    case_ "$flag" fail 60 bash -c "source scripts/env.sh; hpc_train_mpirun 2 $B ${tiny[*]} $flag --results $work/r"
done
case_ "--label-smoothing 1" ok 60 bash -c "source scripts/env.sh; hpc_train_mpirun 2 $B ${tiny[*]} --label-smoothing 1 --results $work/r"
case_ "study --stages 3 on 4 ranks" fail 60 bash -c "source scripts/env.sh; hpc_train_mpirun 4 $B study --ranks 1,2,4 --strategies ring --stages 3 ${tiny[*]} --results $work/r"
case_ "--precision bf16 in a 2-stage pipeline (CPU autocast)" ok 60 bash -c "source scripts/env.sh; hpc_train_mpirun 2 $B ${tiny[*]} ${pipe[*]} --precision bf16 --results $work/bf16 && grep -q '\"precision\":\"bf16\"' $work/bf16/runs.jsonl"
case_ "--precision fp16 with --tensor-parallel 2" ok 60 bash -c "source scripts/env.sh; hpc_train_mpirun 2 $B ${vit[*]} --precision fp16 --tensor-parallel 2 --results $work/r"
case_ "--overlap on with --pipeline-stages 2 (accepted and ignored before)" fail 60 bash -c "source scripts/env.sh; hpc_train_mpirun 2 $B ${tiny[*]} ${pipe[*]} --overlap on --results $work/r"
case_ "--checkpoint-dir with --ps-mode async" fail 60 bash -c "source scripts/env.sh; hpc_train_mpirun 2 $B ${tiny[*]} --strategy ps --ps-mode async --checkpoint-dir $work/ck --results $work/r"

{
    echo "# Issue 48's probe, run again"
    echo
    echo "\`scripts/probe-combinations.sh\` on $(hostname) ($(nproc) cores), $(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD), $("$B" --version | sed -n 's/^MPI built against: //p' | head -1)."
    echo "Tiny CNN or vit-tiny on synthetic 1x16x16 images, global batch 8, 4 steps, 1 thread per rank. Logs: probe-logs/NN.log."
    echo
    echo "| # | case | expected | exit | s | first error line | verdict |"
    echo "|---|---|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
} > "$out/probes.md"
bad=$(printf '%s\n' "${rows[@]}" | grep -c "NOT AS EXPECTED")
echo "wrote $out/probes.md: ${#rows[@]} cases, $bad not as expected"
