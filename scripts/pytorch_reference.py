#!/usr/bin/env python3
"""The PyTorch side of scripts/compare-pytorch.sh: trains what hpc-train trains, the same way,
and appends one JSON record per run in the spirit of hpc-train's runs.jsonl.

    pytorch_reference.py train --model tiny --data datasets/fashion-mnist.h5 --batch-size 64 \
        --threads 2 --steps 400 --out runs.jsonl            # PyTorch eager, one process
    pytorch_reference.py train --ranks 2 ...                 # DDP over gloo on 127.0.0.1
    pytorch_reference.py table --runs raw.jsonl ...          # the Markdown comparison table

What is matched with hpc-train (src/model.rs, src/train.rs, src/optim.rs):

* models: the tiny CNN (conv 3x3 16, ReLU, max-pool 2, conv 3x3 32, ReLU, global average pool,
  linear; convolutions with bias), ResNet-18 and ResNet-50 as torchvision builds them (v1.5,
  bias-free convolutions, batch norm eps 1e-5 momentum 0.1), with hpc-train's CIFAR-style stem
  (3x3 stride-1 convolution, no max-pool) for images under 64 px;
* data: the same HDF5 file, the training images held as uint8 and normalised per batch with the
  file's per-channel mean/std (in raw byte units: (x - 255 mean) / (255 std)), labels as int64;
  every epoch a shuffled order, worker w of W taking positions w, w+W, ... of it;
* loss: cross-entropy summed over the rank's samples times workers / global samples (the
  global batch's mean once the gradients are averaged over the workers);
* optimizer: torch.optim.SGD(lr, momentum, weight_decay), defaults 0.05, 0.9, 1e-4;
* threads: torch.set_num_threads(--threads) in every process;
* timing: each step timed from fetching its batch to the end of the optimizer step (the loss is
  read back every step, as hpc-train does); the first --warmup-steps steps (at most steps - 1)
  are left out; images/s = measured samples over all ranks / the slowest rank's measured time.

DDP (--ranks > 1): torch.multiprocessing.spawn, init_process_group("gloo") on tcp://127.0.0.1
(GLOO_SOCKET_IFNAME=lo), DistributedDataParallel with its default buckets (25 MiB, first one
1 MiB); broadcast_buffers=False by default, since hpc-train does not send batch-norm statistics
every step (--broadcast-buffers restores DDP's default).
"""

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from datetime import datetime, timezone


# ---------------------------------------------------------------------------------------------
# Models (imported lazily with torch: the `table` subcommand needs no torch).

SMALL_IMAGE = 64  # src/model.rs: images below this get the CIFAR-style stem


def build_model(kind, channels, height, width, classes):
    import torch.nn as nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(channels, 16, 3, padding=1)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
            self.fc = nn.Linear(32, classes)

        def forward(self, x):
            x = nn.functional.max_pool2d(self.conv1(x).relu(), 2)
            x = nn.functional.adaptive_avg_pool2d(self.conv2(x).relu(), 1)
            return self.fc(x.flatten(1))

    def conv(c_in, c_out, k, padding, stride):
        return nn.Conv2d(c_in, c_out, k, stride=stride, padding=padding, bias=False)

    def downsample(c_in, c_out, stride):
        if stride == 1 and c_in == c_out:
            return None
        return nn.Sequential(conv(c_in, c_out, 1, 0, stride), nn.BatchNorm2d(c_out))

    class Basic(nn.Module):
        expansion = 1

        def __init__(self, c_in, planes, stride):
            super().__init__()
            self.conv1 = conv(c_in, planes, 3, 1, stride)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = conv(planes, planes, 3, 1, 1)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = downsample(c_in, planes, stride)

        def forward(self, x):
            y = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
            s = x if self.downsample is None else self.downsample(x)
            return (s + y).relu()

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, c_in, planes, stride):
            super().__init__()
            out = planes * 4
            self.conv1 = conv(c_in, planes, 1, 0, 1)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = conv(planes, planes, 3, 1, stride)  # v1.5: stride on the 3x3
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = conv(planes, out, 1, 0, 1)
            self.bn3 = nn.BatchNorm2d(out)
            self.downsample = downsample(c_in, out, stride)

        def forward(self, x):
            y = self.bn1(self.conv1(x)).relu()
            y = self.bn2(self.conv2(y)).relu()
            y = self.bn3(self.conv3(y))
            s = x if self.downsample is None else self.downsample(x)
            return (s + y).relu()

    class ResNet(nn.Module):
        def __init__(self, block, counts):
            super().__init__()
            self.small = min(height, width) < SMALL_IMAGE
            self.conv1 = conv(channels, 64, 3, 1, 1) if self.small else conv(channels, 64, 7, 3, 2)
            self.bn1 = nn.BatchNorm2d(64)
            e = block.expansion
            c_in = 64
            layers = []
            for planes, stride, count in zip((64, 128, 256, 512), (1, 2, 2, 2), counts):
                blocks = [block(c_in, planes, stride)]
                c_in = planes * e
                blocks += [block(c_in, planes, 1) for _ in range(count - 1)]
                layers.append(nn.Sequential(*blocks))
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.fc = nn.Linear(512 * e, classes)

        def forward(self, x):
            x = self.bn1(self.conv1(x)).relu()
            if not self.small:
                x = nn.functional.max_pool2d(x, 3, 2, 1)
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))

    if kind == "vit-tiny":
        # torchvision's own VisionTransformer in hpc-train's vit-tiny configuration
        # (src/model/vit.rs: 4x4 patches, width 64, 4 layers of 4 heads, an MLP of 128).
        from torchvision.models.vision_transformer import VisionTransformer
        if height != width:
            raise SystemExit(f"pytorch_reference.py: torchvision's VisionTransformer takes square images, not {height}x{width}")
        vit = VisionTransformer(image_size=height, patch_size=4, num_layers=4, num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=classes)
        if channels != 3:
            # torchvision's patch convolution takes RGB; the same layer for the dataset's channels.
            vit.conv_proj = nn.Conv2d(channels, 64, kernel_size=4, stride=4)
        return vit
    if kind == "tiny":
        return Tiny()
    if kind == "resnet18":
        return ResNet(Basic, (2, 2, 2, 2))
    if kind == "resnet50":
        return ResNet(Bottleneck, (3, 4, 6, 3))
    raise SystemExit(f"pytorch_reference.py: unknown model {kind}")


# ---------------------------------------------------------------------------------------------
# Data

def load_dataset(path):
    """The training split as a uint8 tensor (N, C, H, W), int64 labels, and the normaliser's
    per-channel mean and 1/std in raw byte units, shaped (1, C, 1, 1)."""
    import h5py
    import numpy as np
    import torch

    with h5py.File(path, "r") as f:
        images = torch.from_numpy(np.ascontiguousarray(f["train/images"][...]))
        labels = torch.from_numpy(f["train/labels"][...].astype(np.int64))
        classes = int(f.attrs["num_classes"])
        c = images.shape[1]
        if "mean" in f.attrs and "std" in f.attrs:
            mean = np.asarray(f.attrs["mean"], dtype=np.float32)
            std = np.asarray(f.attrs["std"], dtype=np.float32)
        else:  # hpc-train's default without the attributes
            mean = np.full(c, 0.5, np.float32)
            std = np.full(c, 0.5, np.float32)
    mean = torch.from_numpy(mean * 255.0).view(1, c, 1, 1)
    inv_std = torch.from_numpy(1.0 / (std * 255.0)).view(1, c, 1, 1)
    return images, labels, classes, mean, inv_std


class Schedule:
    """hpc-train's sharding (src/data/loader.rs): one shuffled order per epoch, the same on every
    rank; worker w of W reads positions w + j W, for j in step*b .. (step+1)*b. Only full steps
    are used (the compare script keeps its runs inside whole steps)."""

    def __init__(self, samples, workers, worker, batch, seed):
        import torch
        self.torch = torch
        self.samples, self.workers, self.worker, self.batch, self.seed = samples, workers, worker, batch, seed
        self.steps_per_epoch = samples // (batch * workers)
        if self.steps_per_epoch == 0:
            raise SystemExit(f"pytorch_reference.py: {samples} samples, fewer than ranks x batch = {workers} x {batch}")
        self.epoch = None

    def indices(self, global_step):
        torch = self.torch
        epoch, step = divmod(global_step, self.steps_per_epoch)
        if epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
            order = torch.randperm(self.samples, generator=g)
            # positions w, w+W, ... of the order, cut into steps of b
            self.mine = order[self.worker::self.workers][: self.steps_per_epoch * self.batch].view(-1, self.batch)
            self.epoch = epoch
        return self.mine[step]


# ---------------------------------------------------------------------------------------------
# Training

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port, queue):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    world = args.ranks
    if world > 1:
        import torch.distributed as dist
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    images, labels, classes, mean, inv_std = load_dataset(args.data)
    n, c, h, w = images.shape
    model = build_model(args.model, c, h, w, classes)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, broadcast_buffers=args.broadcast_buffers, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    schedule = Schedule(n, world, rank, args.batch_size, args.seed)
    global_batch = args.batch_size * world
    factor = world / global_batch  # hpc-train: loss sum x workers / global samples

    warmup = min(args.warmup_steps, args.steps - 1)
    measured = 0.0
    measured_steps = 0
    loss_value = float("nan")
    prof = None
    if args.profile and rank == 0:
        from torch.profiler import profile, ProfilerActivity
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)

    started = time.perf_counter()
    for step in range(args.steps):
        if prof is not None and step == warmup:
            prof.__enter__()
        t0 = time.perf_counter()
        idx = schedule.indices(step)
        x = images.index_select(0, idx).float().sub(mean).mul(inv_std)
        y = labels.index_select(0, idx)
        opt.zero_grad(set_to_none=not args.zero_grads)
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss_value = loss.item() / args.batch_size
        (loss * factor).backward()
        opt.step()
        dt = time.perf_counter() - t0
        if step >= warmup:
            measured += dt
            measured_steps += 1
    total = time.perf_counter() - started
    if prof is not None:
        prof.__exit__(None, None, None)

    slowest = measured
    mean_step = measured / max(measured_steps, 1)
    if world > 1:
        import torch.distributed as dist
        t = torch.tensor([measured], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest = t.item()
        t = torch.tensor([mean_step, loss_value], dtype=torch.float64)
        dist.all_reduce(t)
        mean_step, loss_value = (t / world).tolist()
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        finish_spawned(world)
        return
    record = {
        "side": "pytorch",
        "mode": "ddp-gloo" if world > 1 else "eager",
        "ranks": world,
        "model": args.model,
        "dataset": os.path.basename(args.data),
        "image_shape": [c, h, w],
        "parameters": params,
        "batch_per_rank": args.batch_size,
        "global_batch": global_batch,
        "steps": args.steps,
        "warmup_steps": warmup,
        "images_per_sec": measured_steps * global_batch / slowest if slowest > 0 else 0.0,
        "step_ms": mean_step * 1e3,
        "wall_s": total,
        "final_loss": loss_value,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "lr": args.lr, "momentum": args.momentum, "weight_decay": args.weight_decay,
        "broadcast_buffers": args.broadcast_buffers if world > 1 else None,
        "zero_grad": "in place" if args.zero_grads else "set_to_none",
        "bucket_mb": args.bucket_mb if world > 1 else None,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "timestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if prof is not None:
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        with open(args.profile, "w") as f:
            f.write(f"torch.profiler, rank 0, {measured_steps} measured steps: {args.model} batch {args.batch_size} x {world} rank(s), {args.threads} thread(s)\n")
            f.write(table + "\n")
    if queue is not None:
        queue.put(record)
    else:
        write_record(args, record)
    finish_spawned(world)


def finish_spawned(world):
    """Ends a spawned DDP process without running C++ static destructors: about one exit in ten
    otherwise aborts in them ("terminate called without an active exception", after
    destroy_process_group), which mp.spawn reports as a failed run. Everything is written by
    then (SimpleQueue.put writes to its pipe before returning)."""
    if world > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def write_record(args, record):
    record.update(json.loads(args.tag) if args.tag else {})
    line = json.dumps(record)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    print(f"pytorch ({record['mode']}): {record['model']} {record['image_shape']}, batch {record['batch_per_rank']} x {record['ranks']} rank(s), "
          f"{record['threads']} thread(s): {record['images_per_sec']:.1f} images/s, step {record['step_ms']:.1f} ms, "
          f"loss {record['final_loss']:.4f}, {record['steps']} steps ({record['warmup_steps']} warm-up)")


def train(args):
    if args.ranks == 1:
        worker(0, args, None, None)
        return
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, args=(args, free_port(), queue), nprocs=args.ranks, join=True)
    write_record(args, queue.get())


# ---------------------------------------------------------------------------------------------
# The Markdown table (compare-pytorch.sh calls this with the raw records of all runs).

def fmt_rate(values):
    if not values:
        return "failed"
    med = statistics.median(values)
    f = (lambda v: f"{v:,.0f}") if med >= 100 else (lambda v: f"{v:.1f}")
    if len(values) == 1:
        return f(med)
    return f"{f(med)} ({f(min(values))}–{f(max(values))})"


def busy_summary(records, meta):
    busy = [r["busy_before"] for r in records if r.get("busy_before") is not None]
    if not busy:
        return "not measured"
    wait = f"; each run waited up to {meta['wait_idle']} s for < 25%" if meta.get("wait_idle") else ""
    return (f"median {statistics.median(busy):.0f}%, max {max(busy)}% of the {meta['nproc']} cores over 0.5 s "
            f"({sum(b >= 25 for b in busy)} of {len(busy)} runs started at >= 25%{wait})")


def table(args):
    records = [json.loads(line) for line in open(args.runs) if line.strip()]
    meta = json.load(open(args.meta))
    rows = meta["rows"]
    out = []
    w = out.append
    w("# hpc-train against PyTorch eager / DDP (gloo), same model, data, batch, threads and optimizer")
    w("")
    w(f"Measured {meta['date']} by `scripts/compare-pytorch.sh{(' ' + meta['args']) if meta['args'] else ''}`"
      f"{' (QUICK smoke test: few steps, one repetition; not a measurement)' if meta['quick'] else ''}.")
    w("")
    w("| | |")
    w("|---|---|")
    commits = sorted({r.get("git_commit", "?") for r in records if r.get("side") == "hpc-train"})
    torch_versions = sorted({r.get("torch_version", "?") for r in records if r.get("side") == "pytorch"})
    for k, v in [
        ("machine", f"{meta['host']}: {meta['cpu']}, {meta['nproc']} cores (nproc), {meta['mem']} memory"),
        ("load average before / after", f"{meta['load_before']} / {meta['load_after']}"),
        ("CPU busy (other processes) just before each run", busy_summary(records, meta)),
        ("hpc-train", f"`{meta['binary']}`, git_commit {', '.join(commits) or '?'} (from runs.jsonl), {meta['mpi']}"),
        ("PyTorch", f"torch {', '.join(torch_versions) or '?'} (Python {meta['python']}, venv `{meta['venv']}`)"),
        ("libtorch of hpc-train", meta["libtorch"]),
        ("repetitions", f"{meta['reps']} per configuration, order rotated each repetition; figures are medians (min–max)"),
        ("optimizer", "SGD lr 0.05, momentum 0.9, weight decay 1e-4 on both sides"),
        ("timing", "steady state on both sides: the first 5 steps left out, each step timed from taking its batch to the end of the optimizer step, images/s = samples / the slowest rank's time"),
    ]:
        w(f"| {k} | {v} |")
    w("")
    single = [r["extra"]["exchange_hidden_share"] for r in records
              if r.get("extra", {}).get("overlap_buckets") == 1 and r["extra"].get("exchange_hidden_share", 0) > 0.5]
    w("Columns: *img/s* is the global rate (all ranks). *vs PyTorch* = hpc-train / PyTorch (goal: >= 1). "
      "*on/off* = hpc-train with `--overlap on` / the same with `--overlap off` (goal: >= 0.97 on the tiny CNN and ResNet-18, > 1 on ResNet-50 at 2 ranks). "
      "*hidden* = `extra.exchange_hidden_share` of the overlap-on runs: the share of the exchange time that ran while backward was still going, as hpc-train counts it "
      "(it takes backward's end to be the moment its MPI thread reads the end-of-backward report, which comes after the exchange of buckets completed by the last "
      "gradient hooks, so an exchange that ran after backward can count as hidden" + (
          ": here the tiny CNN's single bucket, complete only at backward's end, shows "
          f"{max(single) * 100:.0f}%). " if single else "). ") +
      "*hpc-train ms* are the medians of the record's compute_ms (forward and backward, with overlap also the exchange hidden behind backward), "
      "comm_ms (exchange not hidden), optimizer_ms and data_wait_ms.")
    w("")
    w("| # | model, input | ranks x batch, threads/rank | steps | side, configuration | img/s median (min–max) | step ms | hpc-train ms: compute / exchange / optimizer / data | vs PyTorch | on/off | hidden |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for row in rows:
        rid = row["id"]
        mine = [r for r in records if r.get("row") == rid]
        by_label = {}
        for r in mine:
            by_label.setdefault(r["label"], []).append(r)
        def rates(label):
            return [r["images_per_sec"] for r in by_label.get(label, []) if r.get("images_per_sec", 0) > 0]
        torch_rates = rates("pytorch")
        torch_med = statistics.median(torch_rates) if torch_rates else None
        for k, cfg in enumerate(row["configs"]):
            prefix = (f"| {rid} | {row['model_desc']} | {row['ranks']} x {row['batch']}, {row['threads']} | {row['steps']} "
                      if k == 0 else "| | | | ")
            label = cfg["label"]
            rs = rates(label)
            med = statistics.median(rs) if rs else None
            runs = by_label.get(label, [])
            def med_of(key):
                v = [r[key] for r in runs if r.get(key) is not None]
                return statistics.median(v) if v else None
            step_ms = f"{med_of('step_ms'):.1f}" if med_of("step_ms") is not None else ""
            parts = ""
            if cfg["side"] == "hpc-train" and med_of("compute_ms") is not None:
                parts = " / ".join(f"{med_of(k):.1f}" for k in ("compute_ms", "comm_ms", "optimizer_ms", "data_wait_ms"))
            vs = on_off = hidden = ""
            if cfg["side"] == "hpc-train":
                if med and torch_med:
                    ratio = med / torch_med
                    vs = f"{ratio:.2f}"
                    verdicts.append((f"row {rid} {label} vs PyTorch", ratio, ratio >= 1.0, ">= 1"))
                if cfg.get("overlap") == "on":
                    off = rates(label.replace("overlap on", "overlap off"))
                    # hpc-train declines overlap where it cannot hide anything (one rank, or
                    # every gradient in one bucket) and records extra.overlap false: then "on"
                    # and "off" ran the same code, and their ratio is the machine's noise.
                    declined = bool(runs) and all(r.get("extra", {}).get("overlap") is False for r in runs)
                    if med and off:
                        r_on_off = med / statistics.median(off)
                        on_off = f"{r_on_off:.2f}" + (" †" if declined else "")
                        goal = row.get("overlap_goal")
                        if goal == "faster":
                            verdicts.append((f"row {rid} {label} / off", r_on_off, None if declined else r_on_off > 1.0, "> 1"))
                        elif goal:
                            verdicts.append((f"row {rid} {label} / off", r_on_off, None if declined else r_on_off >= goal, f">= {goal}"))
                    shares = [r.get("extra", {}).get("exchange_hidden_share") for r in runs]
                    shares = [s for s in shares if s is not None]
                    if shares:
                        hidden = f"{statistics.median(shares) * 100:.0f}%"
            side = f"hpc-train {label}" if cfg["side"] == "hpc-train" else ("PyTorch DDP (gloo)" if row["ranks"] > 1 else "PyTorch eager")
            w(f"{prefix}| {side} | {fmt_rate(rs)} | {step_ms} | {parts} | {vs} | {on_off} | {hidden} |")
    w("")
    w("## Goals")
    w("")
    if verdicts:
        w("| check | value | goal | met |")
        w("|---|---|---|---|")
        for name, value, ok, goal in verdicts:
            met = "n/a †" if ok is None else ("yes" if ok else "**no**")
            w(f"| {name} | {value:.2f} | {goal} | {met} |")
        if any(ok is None for _, _, ok, _ in verdicts):
            w("")
            w("† hpc-train declined overlap in these runs (runs.jsonl `extra.overlap` false: one rank, or every "
              "gradient in one bucket, so nothing could be hidden), so `--overlap on` and `off` ran the same code; "
              "the ratio shows the machine's run-to-run noise, not overlap.")
    w("")
    w("## Settings of each row")
    w("")
    for row in rows:
        w(f"- **{row['id']}**: {row['notes']}")
    w("")
    w("## Regenerate")
    w("")
    w("```bash")
    w(meta["command"])
    w("```")
    w("")
    w(f"Raw records (`runs.jsonl`: hpc-train's records and the PyTorch ones, each tagged with row, "
      f"configuration and repetition), the run logs and the exact command of every run are in "
      f"`{meta['raw_dir']}/`.")
    w("")
    w("The machine is shared and small: figures move by several percent between repetitions "
      "(the spread is in each cell); compare sides within one table, not across tables.")
    text = "\n".join(out) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    sys.stdout.write(text)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train as hpc-train does and append a JSON record")
    t.add_argument("--model", choices=["tiny", "resnet18", "resnet50", "vit-tiny"], required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    t.add_argument("--ranks", type=int, default=1, help="1: plain eager; more: DDP over gloo on 127.0.0.1")
    t.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every process")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--warmup-steps", type=int, default=5)
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--momentum", type=float, default=0.9)
    t.add_argument("--weight-decay", type=float, default=1e-4)
    t.add_argument("--seed", type=int, default=42)
    t.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (its default)")
    t.add_argument("--broadcast-buffers", action="store_true", help="DDP's default: send batch-norm buffers from rank 0 every forward")
    t.add_argument("--zero-grads", action="store_true",
                   help="zero the gradients in place each step as hpc-train does (default: PyTorch's set_to_none)")
    t.add_argument("--profile", metavar="FILE", help="torch.profiler table of the measured steps (rank 0)")
    t.add_argument("--tag", help="JSON object merged into the record")
    t.add_argument("--out", help="JSONL file to append the record to")
    r = sub.add_parser("table", help="the Markdown table from the raw records")
    r.add_argument("--runs", required=True)
    r.add_argument("--meta", required=True)
    r.add_argument("--output", required=True)
    args = p.parse_args()
    if args.command == "train":
        if args.steps < 1 or args.batch_size < 1 or args.ranks < 1 or args.threads < 1:
            raise SystemExit("pytorch_reference.py: --steps, --batch-size, --ranks and --threads must be at least 1")
        train(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
