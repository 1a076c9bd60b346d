#!/usr/bin/env python3
"""The summary of one scripts/device-check.sh part, as Markdown on stdout, from what the part
wrote into its folder (environment.txt, steps.tsv, logs/, runs.jsonl and bench.jsonl rows):

    device_summary.py --part gpu|cpu --dir DIR > DIR/summary.md

Standard library only (it runs with whatever Python the GPU machine has)."""

import argparse
import csv
import json
import os
import re
import statistics
from collections import defaultdict

# NVIDIA's published ResNet-50 v1.5 training throughput on one A100 80GB with AMP (PyTorch,
# DeepLearningExamples, batch 256): the goal the bf16 figure is held against.
A100_AMP_IMAGES_PER_SEC = 2470
# The strategies' order in the tables: the from-scratch ones, then the baselines.
STRATEGY_ORDER = ["ring", "rhd", "auto", "allreduce", "horovod", "ps"]


def rows(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(header, body):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines)


def fmt(value, digits=1):
    return "-" if value is None else f"{value:,.{digits}f}"


def size_name(size):
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= factor:
            return f"{size / factor:g} {unit}"
    return f"{size} B"


def environment_and_steps(d):
    out = ["## The machine", "", "```"]
    env = os.path.join(d, "environment.txt")
    out += open(env).read().rstrip().splitlines() if os.path.exists(env) else ["(no environment.txt)"]
    out += ["```", "", "## Steps", ""]
    steps = os.path.join(d, "steps.tsv")
    if os.path.exists(steps):
        with open(steps) as f:
            reader = list(csv.reader(f, delimiter="\t"))
        out.append(table(reader[0], reader[1:]))
    return out


def binding(study):
    """The run's CPU binding, from its study tag (device-check.sh adds "-bind-core" to the run
    that keeps Open MPI's default binding of one core)."""
    return "core" if study and study.endswith("-bind-core") else "none"


def single_gpu(d):
    ours = rows(os.path.join(d, "single", "runs.jsonl"))
    theirs = rows(os.path.join(d, "single", "pytorch.jsonl"))
    if not ours and not theirs:
        return []
    measured = {}
    for r in ours:
        extra = r.get("extra", {})
        setting = extra.get("precision", "?") + ("-cl" if extra.get("channels_last") else "")
        measured.setdefault((r["batch_per_rank"], setting), {})["hpc-train bind " + binding(r.get("study"))] = r
    for r in theirs:
        setting = r["precision"] + ("-cl" if r["channels_last"] else "")
        measured.setdefault((r["batch"], setting), {})["pytorch"] = r
    body = []
    for (batch, setting), got in sorted(measured.items(), key=lambda kv: (-kv[0][0], kv[0][1] != "bf16-cl", kv[0][1])):
        b = got.get("pytorch")
        variants = sorted(k for k in got if k != "pytorch") or [None]
        for variant in variants:
            a = got.get(variant) if variant else None
            ratio = a["images_per_sec"] / b["images_per_sec"] if a and b else None
            body.append([batch, setting, variant.removeprefix("hpc-train bind ") if variant else "-", fmt(a and a["images_per_sec"]), fmt(a and a["step_ms"]),
                         fmt(a and a.get("compute_ms")), fmt(a and a.get("comm_ms")), fmt(a and a.get("optimizer_ms")), fmt(a and a.get("data_wait_ms")),
                         a["threads"] if a else "-", fmt(b and b["images_per_sec"]), fmt(b and b["step_ms"]), fmt(ratio, 2)])
    gpus = sorted({r.get("gpu") for r in theirs if r.get("gpu")})
    out = ["## One GPU: ResNet-50, 3x224x224 synthetic, hpc-train against PyTorch eager", "",
           f"GPU: {', '.join(gpus) or 'see environment.txt'}. Images/s over the steps after the warm-up (the device synchronised at both ends). "
           "hpc-train's columns are ms per measured step as its record splits them (compute = forward and backward; exchange; optimizer; "
           "data wait = the loader's batch not ready); `binding` is mpirun's: `none` (--bind-to none, every core) or `core` (Open MPI's "
           "default for 1-2 ranks: one core). PyTorch: DataLoader(pin_memory=True, 4 workers), SGD(fused=True), the loss read every "
           "50 steps, as hpc-train's --log-every.", "",
           table(["batch", "setting", "binding", "hpc-train img/s", "ms/step", "compute ms", "exchange ms", "optimizer ms", "data wait ms", "threads",
                  "PyTorch img/s", "PyTorch ms/step", "hpc-train / PyTorch"], body), ""]
    bf16 = [r["images_per_sec"] for (batch, setting), got in measured.items() for k, r in got.items() if setting == "bf16-cl" and k != "pytorch"]
    if bf16:
        best = max(bf16)
        out.append(f"Goal, bf16: above NVIDIA's published A100 AMP figure of {A100_AMP_IMAGES_PER_SEC:,} img/s: "
                   f"best {best:,.0f} img/s, {'met' if best > A100_AMP_IMAGES_PER_SEC else 'NOT met'}.")
    fair = "hpc-train bind none"
    slower = [f"{setting} at {batch}" for (batch, setting), got in measured.items()
              if fair in got and "pytorch" in got and got[fair]["images_per_sec"] < got["pytorch"]["images_per_sec"]]
    compared = [1 for got in measured.values() if fair in got and "pytorch" in got]
    out.append("Goal, at least PyTorch's images/s (binding none): " + ("no pair measured." if not compared else "met in every setting measured." if not slower else "NOT met for " + ", ".join(slower) + "."))
    return out + [""]


def profile(d):
    """The bf16 step of hpc-train and PyTorch profiled side by side (scripts/trace_summary.py)."""
    path = os.path.join(d, "profile", "summary.md")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    return ["## One GPU: where the bf16 step goes, hpc-train beside PyTorch (profiled steps)", "", text, ""]


def test_results(d):
    log = os.path.join(d, "logs", "gpu-tests.log")
    if not os.path.exists(log):
        return []
    text = open(log).read()
    tests = re.findall(r"^test (\S+) \.\.\. (\w+)", text, re.M)
    result = re.findall(r"^test result: .*$", text, re.M)
    skipped = sorted(set(re.findall(r"skipped: [^\n]*", text)))
    out = ["## tests/gpu.rs on this machine", "", table(["test", "result"], tests), ""]
    out += [f"`{line}`" for line in result] + [""]
    if skipped:
        out += ["Skipped:", ""] + [f"- {s}" for s in skipped] + [""]
    failures = re.search(r"^failures:\n(.*?)^test result", text, re.M | re.S)
    if failures:
        out += ["```", failures.group(1).strip()[:4000], "```", ""]
    return out


def bench_table(bench, title, note):
    """Each strategy's median time per size, and its ratio to MPI_Allreduce's."""
    if not bench:
        return []
    times = defaultdict(list)
    bound = {}
    for r in bench:
        times[(r["size"], r["strategy"])].append(r["time_us"])
        if r.get("memory_bound_busbw"):
            bound[r["size"]] = r["memory_bound_busbw"]
    strategies = sorted({s for _, s in times}, key=lambda s: STRATEGY_ORDER.index(s) if s in STRATEGY_ORDER else len(STRATEGY_ORDER))
    sizes = sorted({size for size, _ in times})
    ranks = bench[0].get("ranks")
    header = ["size"] + [f"{s} us" for s in strategies] + [f"{s} / allreduce" for s in strategies if s != "allreduce" and "allreduce" in strategies]
    if bound:
        header += ["ring busbw GB/s", "memory bound busbw GB/s"]
    body = []
    for size in sizes:
        med = {s: statistics.median(times[(size, s)]) for s in strategies if (size, s) in times}
        row = [size_name(size)] + [fmt(med.get(s)) for s in strategies]
        row += [fmt(med[s] / med["allreduce"], 2) if s in med and "allreduce" in med else "-" for s in strategies if s != "allreduce" and "allreduce" in strategies]
        if bound:
            ring = med.get("ring")
            busbw = 2 * (ranks - 1) / ranks * size / (ring * 1e-6) / 1e9 if ring and ranks else None
            row += [fmt(busbw, 2), fmt(bound.get(size), 2)]
        body.append(row)
    return [title, "", note.format(ranks=ranks), "", table(header, body), ""]


def shared_gpu(d):
    out = []
    bench = rows(os.path.join(d, "shared", "bench.jsonl"))
    # One table per data path (the rows say it since 2026-11-27; older rows make one table).
    for path in sorted({r.get("data_path") for r in bench}, key=lambda p: (p is None, p != "staged", p or "")):
        chosen = [r for r in bench if r.get("data_path") == path]
        what = {"staged": "staged through pinned host memory", "direct": "direct: device buffers to the CUDA-aware Open MPI (CUDA IPC)"}.get(path, "the staged path unless MPI is CUDA-aware")
        out += bench_table(chosen, f"## Two ranks sharing the GPU: the exchange alone (hpc-train bench --device cuda), {path or 'as run'}",
                           "{ranks} ranks, one tensor, median time per all-reduce; " + what + ".")
    runs = rows(os.path.join(d, "shared", "runs.jsonl"))
    if runs:
        body = []
        for r in runs:
            extra = r.get("extra", {})
            copy = extra.get("staging_copy_ms")
            total = r["steps"] * r["step_ms"] if r.get("step_ms") else None
            hidden = extra.get("fsdp_gather_hidden")
            body.append([r["strategy"] + (f" + zero {extra['zero']}" if extra.get("zero") else ""), "on" if extra.get("overlap") else "off", r.get("data_path", "-"),
                         fmt(r["images_per_sec"]), fmt(r["step_ms"]), fmt(r.get("comm_ms")), fmt(copy / r["steps"] if copy is not None else None),
                         fmt(100 * copy / total if copy is not None and total else None), fmt(100 * hidden if hidden is not None else None)])
        out += ["## Two ranks sharing the GPU: ResNet-50 steps (bf16, 3x224x224; channels-last but for ZeRO 3)", "",
                "Per-rank batch as in steps.tsv's command (logs/); `comm ms` is the exchange per measured step; the copy share is the staged path's "
                "copy waits over every step of the run against the run's step time; `gathers hidden %` is ZeRO 3's share of its gathers' time "
                "that ran beside a unit's compute, from CUDA events on the two streams (builds before session 16: as the host saw it).", "",
                table(["strategy", "overlap", "data path", "img/s", "ms/step", "comm ms", "staging copies ms/step", "copy share %", "gathers hidden %"], body), ""]
    ddp = rows(os.path.join(d, "shared", "pytorch-ddp.jsonl"))
    if ddp:
        body = [[r["implementation"], r["ranks"], r["batch"], r["precision"] + ("-cl" if r["channels_last"] else ""), fmt(r["images_per_sec"]), fmt(r["step_ms"])] for r in ddp]
        out += ["PyTorch DDP beside them (the same two ranks on the one GPU, as its users run it: DistributedDataParallel's defaults, "
                "its 25 MB buckets overlapping backward):", "",
                table(["implementation", "ranks", "batch per rank", "setting", "img/s", "ms/step"], body), ""]
    return out


def cpu_bench(d):
    return bench_table(rows(os.path.join(d, "bench", "bench.jsonl")), "## `mpirun -n 16 hpc-train bench`: every strategy against MPI_Allreduce",
                       "{ranks} ranks, one per core, one tensor, median time per all-reduce; the ring's bus bandwidth beside the memory bound "
                       "measured in the same run (every core copying and adding at once).")


def overlap(d):
    runs = rows(os.path.join(d, "overlap", "runs.jsonl"))
    if not runs:
        return []
    body = [[r["study"], fmt(r["images_per_sec"]), fmt(r["step_ms"]), fmt(r.get("comm_ms")), fmt(r.get("compute_ms")),
             "on" if r.get("extra", {}).get("overlap") else "off", r.get("extra", {}).get("overlap_reason", "-")] for r in runs]
    by = defaultdict(list)
    for r in runs:
        by[r["study"]].append(r["step_ms"])
    out = ["## Overlap on, off and auto: ResNet-50, 2 ranks of 4 cores (3 compute threads each)", "",
           table(["run", "img/s", "ms/step", "comm ms", "compute ms", "overlap ran", "why"], body), ""]
    if by.get("overlap-on") and by.get("overlap-off"):
        on, off = statistics.median(by["overlap-on"]), statistics.median(by["overlap-off"])
        out.append(f"Median step: on {on:.1f} ms, off {off:.1f} ms: on/off {on / off:.3f}.")
        if by.get("overlap-auto"):
            auto = statistics.median(by["overlap-auto"])
            # Issue 51's goal: the default at least the better of on and off, within 2%.
            out.append(f"Auto (the default) {auto:.1f} ms: {auto / min(on, off):.3f} of the better of on and off "
                       f"(goal: within 1.02: {'met' if auto <= 1.02 * min(on, off) else 'NOT met'}).")
    return out + [""]


def studies(d):
    runs = rows(os.path.join(d, "studies", "runs.jsonl"))
    if not runs:
        return []
    out = ["## Scaling studies: ResNet-18, 3x32x32, one core per rank", ""]
    for scaling in ("weak", "strong"):
        chosen = [r for r in runs if r.get("scaling") == scaling]
        if not chosen:
            continue
        strategies = sorted({r["strategy"] for r in chosen})
        ranks = sorted({r["ranks"] for r in chosen})
        cell = {(r["strategy"], r["ranks"]): r["images_per_sec"] for r in chosen}
        body = [[s] + [fmt(cell.get((s, n))) for n in ranks] for s in strategies]
        out += [f"### {scaling} scaling (images/s)", "", table(["strategy"] + [f"{n} ranks" for n in ranks], body), ""]
    if os.path.exists(os.path.join(d, "studies", "report", "report.md")):
        out += ["The full report: studies/report/report.md.", ""]
    return out


def cluster(d):
    base = os.path.join(d, "cluster")
    if not os.path.isdir(base):
        return []
    out = ["## The cost model on 4 namespaced nodes of 4 cores", "",
           "Fitted on the sizes 4^k (64 KiB-64 MiB; 16 MiB at 1 Gbit/s), checked on the sizes in between (auto benched with the fitted model). "
           "`unshaped`: links left at the veth pairs' own rate, where the kernel has no tbf qdisc to shape them.", ""]
    body = []
    for rate in sorted(os.listdir(base), key=lambda name: int(re.sub(r"\D", "", name) or 0)):
        validation = os.path.join(base, rate, "projection", "validation.csv")
        if not os.path.exists(validation):
            body.append([rate, "-", "-", "-", "-", "no validation (logs/cluster-" + rate + ".log)"])
            continue
        with open(validation) as f:
            errors = defaultdict(list)
            for row in csv.DictReader(f):
                errors[row["strategy"]].append(abs(float(row["error_pct"])))
        for strategy, e in sorted(errors.items()):
            verdict = ""
            if rate == "10000mbit" and strategy in ("ring", "rhd", "auto"):
                verdict = "met" if statistics.median(e) <= 10 and max(e) <= 20 else "NOT met"
            body.append([rate, strategy, len(e), fmt(statistics.median(e)), fmt(max(e)), verdict])
    out += [table(["link", "strategy", "held-out rows", "median |error| %", "max |error| %", "goal at 10 Gbit/s (median <= 10%, all <= 20%)"], body), ""]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["gpu", "cpu"], required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    d = args.dir
    out = [f"# device-check.sh --part {args.part}", ""]
    out += environment_and_steps(d) + [""]
    if args.part == "gpu":
        out += single_gpu(d) + profile(d) + test_results(d) + shared_gpu(d)
    else:
        out += cpu_bench(d) + overlap(d) + studies(d) + cluster(d)
    print("\n".join(out))


if __name__ == "__main__":
    main()
