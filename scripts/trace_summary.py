#!/usr/bin/env python3
"""Where the steps of a profiled run go, from its Chrome traces (Kineto's format: hpc-train's
--profile-dir, torch.profiler's export_chrome_trace), with one trace or several side by side:

    trace_summary.py hpc=profile/rank-0.json pytorch=reference.json [--top 15] [--out FILE]

Steps are the "ProfilerStep#N" scopes both write. For each trace, per step on average: the
step's wall time, the GPU's busy time (the union of its kernels, copies and memsets, counted in
the step's window: from its start to the next step's start), the GPU idle time, the kernels
launched and their summed time, the copies' time; on a trace without GPU activity (a CPU run)
the host ops' time instead; the synchronising CUDA calls per step (the host waits for the device
in each: stream, device and event synchronisations, blocking copies), by name. Then the kernels
(or host ops) by summed time per step, each trace's beside the first one's, largest differences
first: what one implementation runs that the other does not, or runs slower; and each trace's
largest GPU idle gaps inside its steps, with the host op running when the gap began (what the
GPU was waiting for). Standard library only.
"""

import argparse
import json
import re
import sys
from collections import defaultdict

STEP = re.compile(r"^ProfilerStep#(\d+)$")
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# CUDA runtime and driver calls after which the host has waited for the device (cudaMemcpy
# without Async waits for the copy; from pageable memory an Async copy waits too, but the trace
# does not say which memory a copy used, so those are not counted).
SYNCHRONISING = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy|cudaMemcpy2D|cudaStreamWaitEvent_blocking|cuStreamSynchronize|cuCtxSynchronize|cuEventSynchronize|cuMemcpyDtoH_v2|cuMemcpyHtoD_v2)$")
# The gaps listed per trace.
GAPS = 6


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
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    on_gpu = bool(gpu)
    gaps = []
    windows = []
    for i, (start, stop, number) in enumerate(steps):
        window_end = steps[i + 1][0] if i + 1 < len(steps) else max([stop] + [float(e["ts"]) + float(e["dur"]) for e in gpu if float(e["ts"]) >= start])
        windows.append((start, window_end, stop - start, number))
    totals = defaultdict(float)
    by_name = defaultdict(float)
    syncs_by_name = defaultdict(int)
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
            for e in runtime:
                if start <= float(e["ts"]) < end and SYNCHRONISING.match(str(e.get("name", ""))):
                    totals["syncs"] += 1
                    syncs_by_name[e["name"]] += 1
            gaps.extend(idle_gaps(intervals, start, end, host))
        else:
            top = top_level(inside)
            totals["host_ops"] += sum(float(e["dur"]) for e in top)
            totals["ops"] += len(top)
            for e in top:
                by_name[e["name"]] += float(e["dur"])
    n = len(windows)
    averages = {k: (v / n if k in ("kernels", "ops", "syncs") else v / n / 1e3) for k, v in totals.items()}
    if on_gpu:
        averages.setdefault("syncs", 0.0)
    per_step = {name: t / n / 1e3 for name, t in by_name.items()}
    syncs = {name: count / n for name, count in syncs_by_name.items()}
    gaps = sorted(gaps, reverse=True)[:GAPS]
    return {"path": path, "steps": [w[3] for w in windows], "gpu": on_gpu, "averages": averages, "by_name": per_step, "syncs": syncs, "gaps": gaps}


def idle_gaps(intervals, start, end, host):
    """The GPU's idle stretches in [start, end) as (milliseconds, offset into the step in ms,
    the innermost host op running when the stretch began, or "-")."""
    out = []
    cursor = start
    for begin, stop in sorted(intervals) + [(end, end)]:
        if begin > cursor:
            out.append(((begin - cursor) / 1e3, (cursor - start) / 1e3, running_at(host, cursor)))
        cursor = max(cursor, stop)
    return out


def running_at(host, moment):
    """The shortest host op that spans `moment` (the innermost one), by name."""
    spanning = [e for e in host if float(e["ts"]) <= moment < float(e["ts"]) + float(e["dur"])]
    if not spanning:
        return "-"
    return min(spanning, key=lambda e: float(e["dur"]))["name"]


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
    if all(s["gpu"] for _, s in summaries):
        lines.append("")
        lines.append("Synchronising CUDA calls per step (the host waited for the device in each):")
        lines.append("")
        for label, s in summaries:
            calls = ", ".join(f"{name} {count:.1f}" for name, count in sorted(s["syncs"].items(), key=lambda kv: -kv[1])) or "none"
            lines.append(f"- {label}: {calls}")
        lines.append("")
        lines.append(f"The {GAPS} largest GPU idle gaps inside the profiled steps, with the host op running when each began:")
        lines.append("")
        lines.append("| trace | idle ms | at ms into its step | host op then |")
        lines.append("|---|---:|---:|---|")
        for label, s in summaries:
            for length, offset, op in s["gaps"]:
                lines.append(f"| {label} | {length:.3f} | {offset:.2f} | `{short(op, 70)}` |")
    return "\n".join(lines) + "\n"


def column_keys(summaries):
    if all(s["gpu"] for _, s in summaries):
        return ["wall", "gpu_busy", "gpu_idle", "kernels", "kernel_time", "copy_time", "syncs"]
    return ["wall", "host_ops", "ops"]


def columns(summaries):
    names = {"wall": "step ms", "gpu_busy": "GPU busy ms", "gpu_idle": "GPU idle ms", "kernels": "kernels",
             "kernel_time": "kernel ms", "copy_time": "copy ms", "syncs": "syncs", "host_ops": "host ops ms", "ops": "host ops"}
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
