#!/usr/bin/env python3
"""PyTorch eager on one GPU as its users train there, for the single-GPU throughput comparison of
scripts/device-check.sh (run with the GPU machine's own torch):

    gpu_reference.py --model resnet50 --shape 3x224x224 --classes 1000 \
        --configs fp32:128,tf32:128,bf16-cl:256 --steps 30 --warmup-steps 10 --out runs.jsonl

Two ranks (DDP over gloo, the GPU shared), as hpc-train's two-rank runs on one GPU:

    python -m torch.distributed.run --nproc-per-node 2 gpu_reference.py --ddp gloo ...

Each config is PRECISION[-cl]:BATCH and appends one JSON line (images_per_sec, step_ms, ...).

What is matched with hpc-train's GPU step (src/train/net.rs, setup.rs, the SGD of src/optim):

* model: torchvision's resnet50 / resnet18 (v1.5, the ImageNet stem at 224 px), num_classes
  --classes, in float32 parameters;
* data: uint8 images held in host memory, read through the loader a PyTorch user writes:
  `DataLoader(shuffle=True, pin_memory=True, num_workers=--workers, persistent_workers=True)`,
  which gathers and pins batches ahead of the step (hpc-train's loader thread also reads ahead
  into pinned memory); each batch copied to the GPU without blocking, normalised there (mean
  127.5, std 64: the values do not matter for speed), labels int64;
* precision: fp32 = no TF32 anywhere (cuBLAS and cuDNN; PyTorch's own default leaves cuDNN's TF32
  on, hpc-train's fp32 does not), tf32 = TF32 in both, bf16 = CUDA autocast to bfloat16 around
  forward and loss; "-cl" puts the model and each batch in channels-last;
* cuDNN's autotuner on (hpc-train sets cudnn benchmark on a GPU);
* optimizer: torch.optim.SGD(lr 0.05, momentum 0.9, weight_decay 1e-4, fused=True): the fused
  kernel, as a user who asks for speed runs it (hpc-train's SGD is the same fused kernel);
  gradients set to None between steps (zero_grad's default);
* the loss read back on the host every --log-every steps (hpc-train's --log-every, default 50),
  as a training loop that logs does, not every step;
* timing: the device synchronised when the measured steps begin and when they end; images/s =
  measured images / that time (the first --warmup-steps steps left out); with --ddp, every
  rank's images over the slowest rank's time.
"""

import argparse
import json
import os
import platform
import time

import torch
import torch.distributed as dist
import torchvision
from torch.utils.data import DataLoader, TensorDataset


def parse_configs(text):
    configs = []
    for item in text.split(","):
        precision, batch = item.split(":")
        channels_last = precision.endswith("-cl")
        precision = precision.removesuffix("-cl")
        if precision not in ("fp32", "tf32", "bf16"):
            raise SystemExit(f"gpu_reference.py: unknown precision {precision!r} in {item!r} (fp32, tf32, bf16)")
        configs.append((precision, channels_last, int(batch)))
    return configs


def train(args, precision, channels_last, batch, images, labels):
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = getattr(torchvision.models, args.model)(num_classes=args.classes).to(device)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, fused=cuda)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = DataLoader(
        TensorDataset(images, labels),
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        pin_memory=cuda,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        generator=torch.Generator().manual_seed(args.seed),
    )
    batches = iter(loader)
    profiler = start_profiler(args, precision, channels_last, batch, device)
    final_loss = None
    started = None
    for step in range(args.steps):
        if step == args.warmup_steps:
            synchronize(device)
            started = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        x = ((x.float() - 127.5) / 64.0).contiguous(memory_format=memory_format)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            final_loss = loss.item()
        if profiler is not None:
            profiler.step()
    synchronize(device)
    measured_time = time.perf_counter() - started
    if profiler is not None:
        profiler.stop()
    measured_steps = args.steps - args.warmup_steps
    world = dist.get_world_size() if args.ddp else 1
    if args.ddp:
        slowest = torch.tensor([measured_time], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        measured_time = slowest.item()
    return {
        "implementation": "pytorch-ddp-" + args.ddp if args.ddp else "pytorch-eager",
        "model": args.model,
        "image_shape": list(images.shape[1:]),
        "classes": args.classes,
        "precision": precision,
        "channels_last": channels_last,
        "batch": batch,
        "ranks": world,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "images_per_sec": measured_steps * batch * world / measured_time,
        "step_ms": measured_time / measured_steps * 1e3,
        "final_loss": final_loss,
        "loader_workers": args.workers,
        "log_every": args.log_every,
        "optimizer": "SGD(fused=True)" if cuda else "SGD",
        "device": device.type,
        "threads": torch.get_num_threads(),
        "peak_gpu_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "host": platform.node(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_profiler(args, precision, channels_last, batch, device):
    """--profile-dir: torch.profiler over --profile-steps steps from the first measured one,
    as hpc-train's --profile-dir profiles (its steps "ProfilerStep#N" alike), written as a
    Chrome trace for scripts/trace_summary.py."""
    if not args.profile_dir:
        return None
    os.makedirs(args.profile_dir, exist_ok=True)
    name = f"pytorch-{precision}{'-cl' if channels_last else ''}-{batch}.json"
    path = os.path.join(args.profile_dir, name)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities,
        # Collecting from the first measured step: one step of the profiler's own warm-up
        # before it, as torch.profiler recommends.
        schedule=torch.profiler.schedule(wait=max(args.warmup_steps - 1, 0), warmup=min(args.warmup_steps, 1), active=args.profile_steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(path),
    )
    profiler.start()
    return profiler


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", choices=["resnet50", "resnet18"])
    parser.add_argument("--shape", default="3x224x224")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--images", type=int, default=512, help="synthetic images held in host memory")
    parser.add_argument("--configs", default="fp32:128,tf32:128,bf16-cl:128")
    parser.add_argument("--steps", type=int, default=30)
    # --skip-steps as hpc-train names it, so that device-check.sh passes one list to both.
    parser.add_argument("--warmup-steps", "--skip-steps", dest="warmup_steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True, help="JSON lines file to append to")
    parser.add_argument("--profile-dir", help="write a torch.profiler trace of --profile-steps measured steps per config here")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of this script only")
    parser.add_argument("--workers", type=int, default=4, help="DataLoader worker processes")
    parser.add_argument("--log-every", type=int, default=50, help="read the loss back every this many steps (hpc-train's --log-every)")
    parser.add_argument("--ddp", choices=["gloo", "nccl"], help="DistributedDataParallel over this backend (under torch.distributed.run; every rank on the one GPU)")
    args = parser.parse_args()
    if args.warmup_steps >= args.steps:
        raise SystemExit("gpu_reference.py: --warmup-steps must be below --steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_reference.py: torch sees no GPU")
    if args.ddp:
        dist.init_process_group(args.ddp)
        if args.device == "cuda":
            # Every rank on the one GPU, as hpc-train's --allow-gpu-sharing runs.
            torch.cuda.set_device(0)
            args.device = "cuda:0"
    shape = [int(side) for side in args.shape.split("x")]
    generator = torch.Generator().manual_seed(args.seed)
    images = torch.randint(0, 256, [args.images, *shape], dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, args.classes, [args.images], dtype=torch.int64, generator=generator)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for precision, channels_last, batch in parse_configs(args.configs):
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        record = train(args, precision, channels_last, batch, images, labels)
        line = json.dumps(record)
        if not args.ddp or dist.get_rank() == 0:
            print(line, flush=True)
            with open(args.out, "a") as out:
                out.write(line + "\n")
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
