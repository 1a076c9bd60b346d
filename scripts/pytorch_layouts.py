#!/usr/bin/env python3
"""The PyTorch side of scripts/compare-pytorch-layouts.sh: hpc-train's pipelines, `--zero 3` and
tensor parallelism against PyTorch's own versions of them, each run as its users call it.

    pytorch_layouts.py train --layout pipeline --schedule 1f1b --model resnet18 --data D.h5 \
        --batch-size 16 --micro-batches 4 --cut layer3 --steps 16 --out runs.jsonl
    pytorch_layouts.py train --layout fsdp2 --model resnet18 --ranks 2 ...
    pytorch_layouts.py train --layout tp --model vit-tiny --ranks 2 ...
    pytorch_layouts.py table --runs raw.jsonl --meta meta.json --output table.md

Layouts (2 processes spawned with torch.multiprocessing, gloo on 127.0.0.1, one thread each):

* pipeline: torch.distributed.pipelining. The model is cut into two nn.Sequential stages before
  `--cut` (a ResNet layer: the stem and the layers before it on stage 0, the rest and the head on
  stage 1, as hpc-train's `--partition` block index), each wrapped in a PipelineStage and run by
  Schedule1F1B or ScheduleGPipe over `--micro-batches`. Stage 0 reads the images, the last stage
  the labels.
* fsdp2: torch.distributed.fsdp.fully_shard on every residual block, then on the root (stem and
  head), as torchtitan applies it: FSDP2's defaults (reshard after forward, implicit prefetch).
  With --units model, on the root alone (hpc-train's --fsdp-unit model). Each rank trains its
  own part of the global batch, as DDP would.
* tp: DTensor tensor parallelism (torch.distributed.tensor.parallel.parallelize_module) of a ViT
  in hpc-train's vit-tiny configuration, written here with Megatron's fused-QKV layout so that a
  column cut gives each rank whole heads: ColwiseParallel on qkv and the MLP's first layer,
  RowwiseParallel on the attention's output projection and the MLP's second layer (torchtitan's
  plan for a transformer block). Both ranks read the same batch. Attention is
  F.scaled_dot_product_attention, as torchvision's and torchtitan's models call it.

Everything else is scripts/pytorch_reference.py's: models, data, the loss's scale, SGD (lr 0.05,
momentum 0.9, weight decay 1e-4), timing (each step from taking its batch to the end of the
optimizer step, the loss read back every step, the first --warmup-steps left out, images/s over
the slowest rank).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_reference as ref  # noqa: E402  (models, data, ports, the spawned processes' exit)

RESNET_LAYERS = ("layer1", "layer2", "layer3", "layer4")


# ---------------------------------------------------------------------------------------------
# Models

def resnet_stages(model, cut):
    """ResNet cut before `cut` into two nn.Sequential stages that compute model.forward."""
    import torch.nn as nn

    if cut not in RESNET_LAYERS[1:]:
        raise SystemExit(f"pytorch_layouts.py: --cut {cut}: expected one of {', '.join(RESNET_LAYERS[1:])}")
    stem = [model.conv1, model.bn1, nn.ReLU()]
    if not model.small:
        stem.append(nn.MaxPool2d(3, 2, 1))
    k = RESNET_LAYERS.index(cut)
    first = nn.Sequential(*stem, *(getattr(model, n) for n in RESNET_LAYERS[:k]))
    second = nn.Sequential(*(getattr(model, n) for n in RESNET_LAYERS[k:]), nn.AdaptiveAvgPool2d(1), nn.Flatten(1), model.fc)
    return [first, second]


def build_vit(channels, height, width, classes, patch=4, hidden=64, layers=4, heads=4, mlp=128):
    """hpc-train's vit-tiny (src/model/vit.rs: torchvision's ViT layout) with the attention's
    in-projection laid out per head as [q, k, v] (Megatron's fused QKV), so that cutting its
    output features into T contiguous parts gives each rank heads/T whole heads."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    head_dim = hidden // heads

    class EncoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.out_proj = nn.Linear(hidden, hidden)
            self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
            self.mlp_0 = nn.Linear(hidden, mlp)
            self.mlp_3 = nn.Linear(mlp, hidden)

        def forward(self, x):
            n, t, _ = x.shape
            # (n, t, local heads, 3, head_dim) -> q, k, v of (n, local heads, t, head_dim); under
            # ColwiseParallel this rank's output holds its heads only, so -1 counts them.
            qkv = self.qkv(self.ln_1(x)).view(n, t, -1, 3, head_dim).permute(3, 0, 2, 1, 4)
            attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
            x = x + self.out_proj(attended.transpose(1, 2).reshape(n, t, -1))
            return x + self.mlp_3(F.gelu(self.mlp_0(self.ln_2(x))))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_proj = nn.Conv2d(channels, hidden, patch, stride=patch)
            tokens = (height // patch) * (width // patch) + 1
            self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
            self.pos_embedding = nn.Parameter(torch.randn(1, tokens, hidden) * 0.02)
            self.layers = nn.ModuleList(EncoderLayer() for _ in range(layers))
            self.ln = nn.LayerNorm(hidden, eps=1e-6)
            self.head = nn.Linear(hidden, classes)

        def forward(self, x):
            n = x.shape[0]
            x = self.conv_proj(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.class_token.expand(n, -1, -1), x], 1) + self.pos_embedding
            for layer in self.layers:
                x = layer(x)
            return self.head(self.ln(x)[:, 0])

    return ViT()


# ---------------------------------------------------------------------------------------------
# Training

def worker(rank, args, port, queue):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    world = args.ranks
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))

    images, labels, classes, mean, inv_std = ref.load_dataset(args.data)
    n, c, h, w = images.shape
    # Who reads which samples, and the loss's scale: data parallelism (fsdp2) gives each rank its
    # part and averages the gradients (world / global samples, as DDP); a pipeline and a
    # tensor-parallel group are one worker of the whole batch (1 / global samples).
    data_ranks = world if args.layout == "fsdp2" else 1
    schedule = ref.Schedule(n, data_ranks, rank if data_ranks > 1 else 0, args.batch_size, args.seed)
    global_batch = args.batch_size * data_ranks
    factor = data_ranks / global_batch

    step_fn, params, held = None, 0, None
    if args.layout == "pipeline":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        model = ref.build_model(args.model, c, h, w, classes)
        params = sum(p.numel() for p in model.parameters())
        stages = resnet_stages(model, args.cut)
        if len(stages) != world:
            raise SystemExit(f"pytorch_layouts.py: {len(stages)} stages need {len(stages)} ranks, not {world}")
        module = stages[rank]
        module.train()
        held = sum(p.numel() for p in module.parameters())
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[args.schedule]

        def loss_fn(out, y):
            return F.cross_entropy(out, y, reduction="sum") * factor
        pipe = kind(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn, scale_grads=False)
        opt = torch.optim.SGD(module.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
        last = rank == world - 1

        def step_fn(x, y):
            if rank == 0:
                pipe.step(x)
                return float("nan")
            losses = []
            pipe.step(target=y, losses=losses)
            return sum(l.item() for l in losses) / factor / args.batch_size if last else float("nan")
    else:
        if args.layout == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            model = ref.build_model(args.model, c, h, w, classes)
            params = sum(p.numel() for p in model.parameters())
            if args.units == "block":
                for layer in RESNET_LAYERS:
                    for block in getattr(model, layer):
                        fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            held = sum(p.to_local().numel() for p in model.parameters())
        else:  # tp
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            if args.model != "vit-tiny":
                raise SystemExit("pytorch_layouts.py: --layout tp trains vit-tiny")
            model = build_vit(c, h, w, classes)
            params = sum(p.numel() for p in model.parameters())
            plan = {"qkv": ColwiseParallel(), "out_proj": RowwiseParallel(),
                    "mlp_0": ColwiseParallel(), "mlp_3": RowwiseParallel()}
            for layer in model.layers:
                parallelize_module(layer, mesh, plan)
            held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)

        def step_fn(x, y):
            loss = F.cross_entropy(model(x), y, reduction="sum")
            (loss * factor).backward()
            return loss.item() / args.batch_size

    warmup = min(args.warmup_steps, args.steps - 1)
    measured, measured_steps, loss_value = 0.0, 0, float("nan")
    started = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        idx = schedule.indices(step)
        x = images.index_select(0, idx).float().sub(mean).mul(inv_std)
        y = labels.index_select(0, idx)
        opt.zero_grad()
        loss_value = step_fn(x, y)
        opt.step()
        dt = time.perf_counter() - t0
        if step >= warmup:
            measured += dt
            measured_steps += 1
    total = time.perf_counter() - started

    t = torch.tensor([measured], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    slowest = t.item()
    # The loss: the last stage's in a pipeline, any rank's otherwise (the mean over ranks that
    # know it); the held parameters: the largest over the ranks.
    known = 0.0 if loss_value != loss_value else 1.0
    t = torch.tensor([measured / max(measured_steps, 1), loss_value if known else 0.0, known], dtype=torch.float64)
    dist.all_reduce(t)
    mean_step, loss_sum, knowing = t.tolist()
    mean_step /= world
    loss_value = loss_sum / knowing if knowing else float("nan")
    t = torch.tensor([held], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    held = int(t.item())
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        ref.finish_spawned(world)
        return
    mode = {"pipeline": f"pipelining-{args.schedule}", "fsdp2": f"fsdp2-{args.units}", "tp": "dtensor-tp"}[args.layout]
    record = {
        "side": "pytorch", "mode": mode, "layout": args.layout, "ranks": world, "model": args.model,
        "dataset": os.path.basename(args.data), "image_shape": [c, h, w], "parameters": params,
        "parameters_held_max": held, "batch_per_rank": args.batch_size, "global_batch": global_batch,
        "micro_batches": args.micro_batches if args.layout == "pipeline" else None,
        "cut": args.cut if args.layout == "pipeline" else None,
        "steps": args.steps, "warmup_steps": warmup,
        "images_per_sec": measured_steps * global_batch / slowest if slowest > 0 else 0.0,
        "step_ms": mean_step * 1e3, "wall_s": total, "final_loss": loss_value,
        "threads": torch.get_num_threads(), "lr": args.lr, "momentum": args.momentum, "weight_decay": args.weight_decay,
        "torch_version": torch.__version__, "python": platform.python_version(), "host": socket.gethostname(),
        "timestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    queue.put(record)
    ref.finish_spawned(world)


def train(args):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, args=(args, ref.free_port(), queue), nprocs=args.ranks, join=True)
    record = queue.get()
    record.update(json.loads(args.tag) if args.tag else {})
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(f"pytorch ({record['mode']}): {record['model']} {record['image_shape']}, {record['ranks']} ranks, "
          f"global batch {record['global_batch']}: {record['images_per_sec']:.1f} images/s, step {record['step_ms']:.1f} ms, "
          f"loss {record['final_loss']:.4f}, {record['steps']} steps ({record['warmup_steps']} warm-up)")


# ---------------------------------------------------------------------------------------------
# The Markdown table

def table(args):
    records = [json.loads(line) for line in open(args.runs) if line.strip()]
    meta = json.load(open(args.meta))
    out = []
    w = out.append
    w("# hpc-train's layouts against PyTorch's: pipelining, FSDP2 and DTensor")
    w("")
    w(f"Measured {meta['date']} by `{meta['command']}`{' (QUICK smoke test: not a measurement)' if meta['quick'] else ''}.")
    w("")
    w("| | |")
    w("|---|---|")
    commits = {}
    for r in records:
        if r.get("side") == "hpc-train":
            commits.setdefault(r["label"], set()).add(r.get("git_commit", "?"))
    torch_versions = sorted({r.get("torch_version", "?") for r in records if r.get("side") == "pytorch"})
    busy = [r["busy_before"] for r in records if r.get("busy_before") is not None]
    for k, v in [
        ("machine", f"{meta['host']}: {meta['cpu']}, {meta['nproc']} cores (nproc), {meta['mem']} memory"),
        ("load average before / after", f"{meta['load_before']} / {meta['load_after']}"),
        ("CPU busy (other processes) just before each run",
         f"median {statistics.median(busy):.0f}%, max {max(busy)}%" if busy else "not measured"),
        ("hpc-train", "; ".join(f"{label}: `{meta['binaries'][label]}`, git_commit {', '.join(sorted(c))}" for label, c in sorted(commits.items()))
         + f"; {meta['mpi']}"),
        ("PyTorch", f"torch {', '.join(torch_versions) or '?'} (Python {meta['python']}), gloo on 127.0.0.1, torch.multiprocessing.spawn"),
        ("repetitions", f"{meta['reps']} per configuration, order rotated each repetition; figures are medians (min–max)"),
        ("optimizer", "SGD lr 0.05, momentum 0.9, weight decay 1e-4 on both sides"),
        ("timing", "each step timed from taking its batch to the end of the optimizer step, the first steps left out "
                   "(column *steps*: measured + left out), images/s = global samples / the slowest rank's time"),
    ]:
        w(f"| {k} | {v} |")
    w("")
    w("Columns: *img/s* is the global rate. *vs PyTorch* = this hpc-train build / PyTorch (goal: >= 1). "
      "*vs before* = this build / the build named `before` (goal: 1 within the runs' spread).")
    w("")
    w("| # | layout, model, input | ranks, global batch | steps | side | img/s median (min–max) | step ms | vs PyTorch | vs before |")
    w("|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for row in meta["rows"]:
        rid = row["id"]
        mine = [r for r in records if r.get("row") == rid]

        def rates(label):
            return [r["images_per_sec"] for r in mine if r["label"] == label and r.get("images_per_sec", 0) > 0]

        def median_of(label, key):
            v = [r[key] for r in mine if r["label"] == label and r.get(key) is not None]
            return statistics.median(v) if v else None
        torch_rates = rates("pytorch")
        before_rates = rates("before")
        for k, label in enumerate(row["labels"]):
            prefix = f"| {rid} | {row['desc']} | {row['ranks']}, {row['global_batch']} | {row['steps']} " if k == 0 else "| | | | "
            rs = rates(label)
            med = statistics.median(rs) if rs else None
            step = median_of(label, "step_ms")
            vs_torch = vs_before = ""
            if label != "pytorch" and med and torch_rates:
                ratio = med / statistics.median(torch_rates)
                vs_torch = f"{ratio:.2f}"
                if label == "after":
                    verdicts.append((f"row {rid} after vs PyTorch", ratio, ratio >= 1.0, ">= 1"))
            if label == "after" and med and before_rates:
                ratio = med / statistics.median(before_rates)
                lo, hi = min(rs) / max(before_rates), max(rs) / min(before_rates)
                vs_before = f"{ratio:.2f} ({lo:.2f}–{hi:.2f})"
                verdicts.append((f"row {rid} after vs before", ratio, lo <= 1.0 <= hi or ratio >= 1.0, "1 within the spread"))
            side = row["sides"][label]
            w(f"{prefix}| {side} | {ref.fmt_rate(rs)} | {f'{step:.1f}' if step is not None else ''} | {vs_torch} | {vs_before} |")
    w("")
    w("*vs before*'s range is the slowest run of this build over the fastest of the other, and the fastest over the slowest.")
    w("")
    if verdicts:
        w("## Goals")
        w("")
        w("| check | value | goal | met |")
        w("|---|---|---|---|")
        for name, value, ok, goal in verdicts:
            w(f"| {name} | {value:.2f} | {goal} | {'yes' if ok else '**no**'} |")
        w("")
    w("## Settings of each row")
    w("")
    for row in meta["rows"]:
        w(f"- **{row['id']}**: {row['notes']}")
    w("")
    w(f"Raw records (runs.jsonl, each tagged with row, side and repetition), the run logs and every run's "
      f"exact command are in `{meta['raw_dir']}/`.")
    text = "\n".join(out) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    sys.stdout.write(text)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one layout and append a JSON record")
    t.add_argument("--layout", choices=["pipeline", "fsdp2", "tp"], required=True)
    t.add_argument("--model", choices=["resnet18", "resnet50", "vit-tiny"], required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--batch-size", type=int, required=True,
                   help="samples per step of a pipeline or a tensor-parallel group; per rank under fsdp2")
    t.add_argument("--ranks", type=int, default=2)
    t.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    t.add_argument("--micro-batches", type=int, default=4)
    t.add_argument("--cut", default="layer3", help="pipeline: the ResNet layer that begins stage 1")
    t.add_argument("--units", choices=["block", "model"], default="block",
                   help="fsdp2: fully_shard every residual block and the root (torchtitan's way), or the root alone")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--steps", type=int, default=16)
    t.add_argument("--warmup-steps", type=int, default=4)
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--momentum", type=float, default=0.9)
    t.add_argument("--weight-decay", type=float, default=1e-4)
    t.add_argument("--seed", type=int, default=42)
    t.add_argument("--tag", help="JSON object merged into the record")
    t.add_argument("--out", help="JSONL file to append the record to")
    r = sub.add_parser("table", help="the Markdown table from the raw records")
    r.add_argument("--runs", required=True)
    r.add_argument("--meta", required=True)
    r.add_argument("--output", required=True)
    args = p.parse_args()
    if args.command == "train":
        if min(args.steps, args.batch_size, args.ranks, args.threads, args.micro_batches) < 1:
            raise SystemExit("pytorch_layouts.py: --steps, --batch-size, --ranks, --threads and --micro-batches must be at least 1")
        train(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
