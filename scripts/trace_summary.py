#!/usr/bin/env python3
"""Where the steps of a profiled run go, from its Chrome traces (Kineto's format: hpc-train's
--profile-dir, torch.profiler's export_chrome_trace), with one trace or several side by side:

    trace_summary.py hpc=profile/rank-0.json pytorch=reference.json [--top 15] [--out FILE]

Steps are the "ProfilerStep#N" scopes both write. For each trace, per step on average: the
step's wall time, the GPU's busy time (the union of its kernels, copies and memsets, counted in
the step's window: from its start to the next step's start), the GPU idle time, the kernels
launched and their summed time, the copies' time; on a trace without GPU activity (a CPU run)
the host ops' time instead. Then the kernels (or host ops) by summed time per step, each trace's
beside the first one's, largest differences first: what one implementation runs that the other
does not, or runs slower. Standard library only.
"""

import argparse
import json
import re
import sys
from collections import defaultdict

STEP = re.compile(r"^ProfilerStep#(\d+)$")
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def union_length(intervals):
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarize(path):
    """Per-step averages and per-name times per step (milliseconds) of one trace."""
    events = load(path)
    steps = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(STEP.match(e["name"]).group(1)))
        for e in events
        if e.get("cat") == "user_annotation" and STEP.match(str(e.get("name", "")))
    )
    if not steps:
        raise SystemExit(f"trace_summary.py: {path}: no ProfilerStep#N scopes (not a profile of training steps?)")
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    # Host ops at the top of their thread's stack are what a CPU step spends its time in.
    host = [e for e in events if e.get("cat") == "cpu_op"]
    on_gpu = bool(gpu)
    windows = []
    for i, (start, stop, number) in enumerate(steps):
        window_end = steps[i + 1][0] if i + 1 < len(steps) else max([stop] + [float(e["ts"]) + float(e["dur"]) for e in gpu if float(e["ts"]) >= start])
        windows.append((start, window_end, stop - start, number))
    totals = defaultdict(float)
    by_name = defaultdict(float)
    for start, end, wall, _ in windows:
        inside = [e for e in (gpu if on_gpu else host) if start <= float(e["ts"]) < end]
        totals["wall"] += wall
        if on_gpu:
            intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in inside]
            busy = union_length(intervals)
            totals["gpu_busy"] += busy
            totals["gpu_idle"] += (end - start) - busy
            kernels = [e for e in inside if e["cat"] == "kernel"]
            totals["kernels"] += len(kernels)
            totals["kernel_time"] += sum(float(e["dur"]) for e in kernels)
            totals["copy_time"] += sum(float(e["dur"]) for e in inside if e["cat"] == "gpu_memcpy")
            for e in kernels:
                by_name[e["name"]] += float(e["dur"])
        else:
            top = top_level(inside)
            totals["host_ops"] += sum(float(e["dur"]) for e in top)
            totals["ops"] += len(top)
            for e in top:
                by_name[e["name"]] += float(e["dur"])
    n = len(windows)
    averages = {k: (v / n if k in ("kernels", "ops") else v / n / 1e3) for k, v in totals.items()}
    per_step = {name: t / n / 1e3 for name, t in by_name.items()}
    return {"path": path, "steps": [w[3] for w in windows], "gpu": on_gpu, "averages": averages, "by_name": per_step}


def top_level(events):
    """The events not inside another event of the same thread."""
    out = []
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for thread in by_thread.values():
        end = None
        for e in sorted(thread, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
            if end is None or float(e["ts"]) >= end:
                out.append(e)
                end = float(e["ts"]) + float(e["dur"])
    return out


def short(name, width=90):
    return name if len(name) <= width else name[: width - 3] + "..."


def render(summaries, top):
    labels = [label for label, _ in summaries]
    lines = ["| trace | steps | " + " | ".join(columns(summaries)) + " |", "|---|---|" + "---:|" * len(columns(summaries))]
    for label, s in summaries:
        a = s["averages"]
        cells = [fmt(a.get(key)) for key in column_keys(summaries)]
        lines.append(f"| {label} | {', '.join(str(x) for x in s['steps'])} | " + " | ".join(cells) + " |")
    lines.append("")
    unit = "kernels" if all(s["gpu"] for _, s in summaries) else "host ops (top level)"
    lines.append(f"Milliseconds per step by {unit}, largest differences from {labels[0]} first:")
    lines.append("")
    lines.append("| name | " + " | ".join(labels) + (" | difference |" if len(labels) > 1 else " |"))
    lines.append("|---|" + "---:|" * (len(labels) + (1 if len(labels) > 1 else 0)))
    names = set()
    for _, s in summaries:
        names.update(s["by_name"])
    base = summaries[0][1]["by_name"]

    def spread(name):
        values = [s["by_name"].get(name, 0.0) for _, s in summaries]
        return max(abs(v - values[0]) for v in values) if len(values) > 1 else values[0]

    for name in sorted(names, key=spread, reverse=True)[:top]:
        values = [s["by_name"].get(name, 0.0) for _, s in summaries]
        row = f"| `{short(name)}` | " + " | ".join(f"{v:.3f}" for v in values)
        if len(values) > 1:
            row += f" | {max(values[1:], key=lambda v: abs(v - base.get(name, 0.0))) - base.get(name, 0.0):+.3f}"
        lines.append(row + " |")
    return "\n".join(lines) + "\n"


def column_keys(summaries):
    if all(s["gpu"] for _, s in summaries):
        return ["wall", "gpu_busy", "gpu_idle", "kernels", "kernel_time", "copy_time"]
    return ["wall", "host_ops", "ops"]


def columns(summaries):
    names = {"wall": "step ms", "gpu_busy": "GPU busy ms", "gpu_idle": "GPU idle ms", "kernels": "kernels",
             "kernel_time": "kernel ms", "copy_time": "copy ms", "host_ops": "host ops ms", "ops": "host ops"}
    return [names[k] for k in column_keys(summaries)]


def fmt(value):
    return "" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="LABEL=PATH (or PATH) of a Chrome trace")
    parser.add_argument("--top", type=int, default=15, help="names listed")
    parser.add_argument("--out", help="Markdown file to write (default: standard output)")
    args = parser.parse_args()
    summaries = []
    for item in args.traces:
        label, _, path = item.rpartition("=")
        summaries.append((label or path, summarize(path)))
    text = render(summaries, args.top)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
