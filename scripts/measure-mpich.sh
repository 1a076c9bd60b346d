#!/usr/bin/env bash
# The MPICH figures of results/mpich/ (issue 34), on an otherwise idle machine: `hpc-train bench`
# built against Debian's MPICH (target/mpich/, made by scripts/setup.sh --mpi mpich when missing)
# at 2 and 4 ranks for every strategy, every element of every result checked on every rank (the
# bench fails on a wrong one, and so does this script), and the from-scratch strategies' busbw
# against MPICH's own MPI_Allreduce, size by size, in results/mpich/README.md. Where the Open MPI
# build (target/) exists, its MPI_Allreduce is measured in the same way right after, for the
# libraries side by side on the same machine at the same time.
#   scripts/measure-mpich.sh                       into results/mpich/ (about 15 min on 2 cores)
#   OUT=/tmp/m QUICK=1 scripts/measure-mpich.sh    a quick trial: fewer sizes, iterations, rounds
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh --no-run --mpi mpich >/dev/null
export HPC_TRAIN_MPI=mpich
source scripts/env.sh
B="$HPC_TRAIN_BIN"
OPENMPI_BIN="$HPC_TRAIN_ROOT/target/release/hpc-train"
OUT=${OUT:-results/mpich}
STRATEGIES=ring,rhd,auto,ps,allreduce,horovod
if [ "${QUICK:-0}" = 1 ]; then
    SIZES=(--min-bytes 4K --max-bytes 1M --factor 16); TIMING=(--iters 3 --warmup 1 --rounds 1)
else
    # Rounds: every strategy in turn, the first one changing from round to round, each row pooled
    # over the rounds (this VM's speed drifts by tens of percent within minutes).
    SIZES=(--min-bytes 4K --max-bytes 64M --factor 4); TIMING=(--iters 10 --warmup 3 --rounds 5)
fi
rm -rf "$OUT/bench.jsonl" "$OUT/openmpi"
mkdir -p "$OUT"
stamp() { echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, $(git rev-parse --short HEAD): $*"; }
# As Open MPI's mpirun does by default (and so results/speed/): one rank per core, bound, when
# they fit; unbound when oversubscribed. Hydra binds nothing unless asked.
binding() { if [ "$1" -le "$(nproc)" ]; then echo "-bind-to core"; fi; }

"$B" --version | tee "$OUT/version.txt"
start=$SECONDS
for ranks in 2 4; do
    # shellcheck disable=SC2046
    { stamp "MPICH: bench, $ranks ranks, one tensor, every strategy against MPI_Allreduce"
      "$HPC_TRAIN_MPIEXEC" -n "$ranks" $(binding "$ranks") "$B" bench --strategies "$STRATEGIES" \
          "${SIZES[@]}" "${TIMING[@]}" --results "$OUT"; } 2>&1 | tee "$OUT/bench-$ranks-ranks.txt"
done
if [ -x "$OPENMPI_BIN" ] && "$OPENMPI_BIN" --version | grep -q "openmpi family"; then
    mkdir -p "$OUT/openmpi"
    for ranks in 2 4; do
        { stamp "Open MPI (same machine, right after): bench, $ranks ranks, MPI_Allreduce and the ring"
          mpirun -n "$ranks" --oversubscribe "$OPENMPI_BIN" bench --strategies ring,allreduce \
              "${SIZES[@]}" "${TIMING[@]}" --results "$OUT/openmpi"; } 2>&1 | tee "$OUT/openmpi/bench-$ranks-ranks.txt"
    done
fi
echo "# measured in $((SECONDS - start)) s"

# The tables: busbw per size and strategy, and each one's ratio to MPICH's MPI_Allreduce.
python3 - "$OUT" "$STRATEGIES" "$(git rev-parse --short=12 HEAD)" "$((SECONDS - start))" <<'PY'
import json, os, platform, subprocess, sys
out, strategies, head, seconds = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]
def rows(path):
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if l.strip()]
mpich, openmpi = rows(f"{out}/bench.jsonl"), rows(f"{out}/openmpi/bench.jsonl")
wrong = sum(r["wrong"] for r in mpich + openmpi)
assert mpich and wrong == 0, f"{len(mpich)} rows, {wrong} wrong elements"
def human(size):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"
def table(ranks):
    by = {(r["strategy"], r["size"]): r for r in mpich if r["ranks"] == ranks}
    ompi = {(r["strategy"], r["size"]): r for r in openmpi if r["ranks"] == ranks}
    sizes = sorted({s for (_, s) in by})
    others = [s for s in strategies if s != "allreduce"]
    head_cells = ["size", "MPI_Allreduce"] + [f"{s} (/ MPI_Allreduce)" for s in others]
    if ompi:
        head_cells += ["Open MPI's MPI_Allreduce", "Open MPI's ring"]
    lines = ["| " + " | ".join(head_cells) + " |", "|" + "---:|" * len(head_cells)]
    for size in sizes:
        base = by.get(("allreduce", size))
        cells = [human(size), f"{base['busbw']:.3f} ({base['time_us']:.0f})" if base else "—"]
        for s in others:
            r = by.get((s, size))
            if r is None:
                cells.append("—")
            else:
                ratio = f" / {r['busbw'] / base['busbw']:.2f}" if base and base["busbw"] > 0 else ""
                cells.append(f"{r['busbw']:.3f} ({r['time_us']:.0f}){ratio}")
        if ompi:
            for s in ("allreduce", "ring"):
                r = ompi.get((s, size))
                cells.append(f"{r['busbw']:.3f} ({r['time_us']:.0f})" if r else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
first = mpich[0]
commits = sorted({r["git_commit"] for r in mpich + openmpi})
mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
version = open(f"{out}/version.txt").read().strip().splitlines()
text = f"""# hpc-train under MPICH (issue 34)

`hpc-train bench` built against {first['mpi_library']} (Debian 12's `mpich`, ch4:ucx), started with
Hydra (`mpiexec.mpich -n N`, `-bind-to core` at 2 ranks as Open MPI binds by default, unbound at 4).
Written by `scripts/measure-mpich.sh` on {first['date'][:10]}, in {seconds} s.

- **Machine:** host `{first['host']}`, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.release()}, device {first['device']}.
- **Binary:** commit {', '.join(commits)} (checkout at {head}); `hpc-train --version`:
  {' / '.join(version[1:])}.
- **Ranks:** 2 and 4 (4 ranks on {os.cpu_count()} cores are oversubscribed). **Sizes:** {human(min(r['size'] for r in mpich))} to
  {human(max(r['size'] for r in mpich))}, one f32 tensor. **Timing:** median of {first['iters']} iterations after the warm-up,
  over {first['rounds']} round(s) in rotated strategy order.
- **Correctness:** every element of every result checked on every rank: {wrong} wrong in {len(mpich) + len(openmpi)} rows.

busbw in GB/s (time per exchange in us), nccl-tests' convention (size x 2(n-1)/n / time); after a
slash, the strategy's busbw divided by MPICH's own `MPI_Allreduce` at that size (above 1: faster).
{"The last columns: Open MPI's build (target/) measured the same way right after, for comparison." if openmpi else ""}
Open MPI's figures of other days are in `results/speed/` and `results/strategies/`.
"""
for ranks in sorted({r["ranks"] for r in mpich}):
    text += f"\n## {ranks} ranks\n\n{table(ranks)}\n"
open(f"{out}/README.md", "w").write(text)
print(f"wrote {out}/README.md")
PY
