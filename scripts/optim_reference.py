#!/usr/bin/env python3
"""The PyTorch side of scripts/compare-optim-pytorch.sh (issue 35): trains a few steps of what
hpc-train trains with torch.optim (SGD, AdamW, and LARS written below from the formula of the
spec) and torch.optim.lr_scheduler, in float64 or float32, from weights both programs load, so
that hpc-train's final weights can be measured against PyTorch's.

    optim_reference.py init --model tiny --data D.h5 --out init.safetensors
    optim_reference.py subset --data datasets/fashion-mnist.h5 --train 32 --test 16 --out D.h5
    optim_reference.py train --model tiny --data D.h5 --batch-size 32 --steps 8 \\
        --init-weights init.safetensors --dtype float64 --optimizer lars --lr 2 \\
        --lr-schedule poly --warmup-epochs 2 --out f64.safetensors [--verbose]
    optim_reference.py compare --reference f64.safetensors --torch f32.safetensors \\
        [--nudged f32-nudge1.safetensors,...] --hpc hpc.safetensors [--init init.safetensors]
    optim_reference.py check-schedules        the schedulers against the spec's formulas
    optim_reference.py table --rows raw.jsonl --meta meta.json --output table.md

What `train` matches with hpc-train (the rules of issue 35: warm-up, decay, --scale-lr, LARS,
label smoothing; models, data and normalisation from scripts/pytorch_reference.py):

* one process, one worker, batch norm in training mode, torch.set_num_threads(1),
  torch.use_deterministic_algorithms(True);
* the weights of --init-weights (safetensors by torchvision names, as hpc-train's
  --save-weights writes: parameters and batch-norm running statistics) loaded with
  load_state_dict(strict=True), num_batches_tracked (which hpc-train does not keep, and which
  momentum 0.1 never reads) taken from the fresh model;
* images normalised in float32 as pytorch_reference.py does, then cast to --dtype;
* loss = cross_entropy(logits, y, reduction="sum", label_smoothing=S) x 1 / the step's samples
  (the global batch, but at an epoch's short last step of hpc-train's order); backward;
  optimizer.step(); scheduler.step() (the rate of step s is the one step s's update uses);
* E (steps per epoch, for the schedule) = ceil(train samples / global batch), hpc-train's rule
  (pytorch_reference.Schedule, with --order torch, forms full steps only).

The data order: by default (--order hpc-train) the samples of hpc-train's shuffle, rebuilt here
(ChaCha8Rng and rand 0.8's shuffle, checked against the Rust crates for several sizes, seeds and
epochs), so that both sides add up the same samples in the same order; pytorch_reference.Schedule
(torch.randperm, --order torch) reads other samples. compare-optim-pytorch.sh trains on a subset
of exactly one batch (`subset`), so that E = 1 and --warmup-epochs and --lr-steps count steps.

Yardstick: float32 rounding alone moves the weights by an amount that varies between equally
good runs by an order of magnitude or more on ResNet-18 (a value near a kink, such as ReLU's 0,
falls on one side or the other, and the gradient jumps), so `train --nudge 1,2,3` also trains from the initial
weights moved by at most one ulp per element, and `compare --nudged` takes the largest float32
distance as PyTorch float32's.

Weights files are written and read here without the safetensors package (the format is an
8-byte header length, a JSON header and the raw little-endian tensors).
"""

import argparse
import json
import math
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_reference import Schedule, build_model, load_dataset  # noqa: E402

DEFAULT_WEIGHT_DECAY = {"sgd": 1e-4, "lars": 5e-5, "adamw": 1e-2}
BUFFER_SUFFIXES = ("running_mean", "running_var")


def die(msg):
    raise SystemExit(f"optim_reference.py: {msg}")


# ---------------------------------------------------------------------------------------------
# safetensors

_ST = {"F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2), "I64": ("<i8", 8), "I32": ("<i4", 4),
       "I16": ("<i2", 2), "I8": ("i1", 1), "U8": ("u1", 1), "BOOL": ("?", 1)}


def read_safetensors(path):
    import numpy as np
    import torch
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        die(f"{path}: {e.strerror}")
    if len(data) < 8:
        die(f"{path}: not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        die(f"{path}: not a safetensors file (header: {e})")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST:
            die(f"{path}: tensor {name} has dtype {info['dtype']}, which this reader does not know")
        np_dtype, size = _ST[info["dtype"]]
        begin, end = info["data_offsets"]
        count = (end - begin) // size
        arr = np.frombuffer(data, dtype=np_dtype, count=count, offset=8 + n + begin).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


def write_safetensors(path, tensors):
    import torch
    names = {torch.float64: "F64", torch.float32: "F32", torch.int64: "I64", torch.int32: "I32"}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in names:
            die(f"cannot write {name} of dtype {t.dtype}")
        blob = t.numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def model_weights(model):
    """Parameters and batch-norm running statistics by torchvision name (what hpc-train's
    --save-weights writes: no num_batches_tracked)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def load_init(model, path):
    import torch
    weights = read_safetensors(path)
    state = model.state_dict()
    for name, fresh in state.items():
        if name.endswith("num_batches_tracked") and name not in weights:
            weights[name] = fresh.clone()
    for name, t in weights.items():
        if name in state and tuple(t.shape) != tuple(state[name].shape):
            die(f"{path}: {name} has shape {list(t.shape)}, the model's is {list(state[name].shape)}")
        if name in state and state[name].is_floating_point():
            weights[name] = t.to(torch.float32)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        die(f"{path} does not fit the model: {e}")


# ---------------------------------------------------------------------------------------------
# hpc-train's data order (src/data/loader.rs): per epoch, 0..N shuffled by rand 0.8's
# SliceRandom::shuffle with ChaCha8Rng::seed_from_u64(seed), set_stream(epoch) (rand_chacha 0.3);
# worker w of W reads positions w + j W, j in step b .. (step + 1) b, of it; the last step of an
# epoch takes what is left.

_M32 = 0xFFFFFFFF


def _rotl(v, n):
    return ((v << n) | (v >> (32 - n))) & _M32


class ChaCha8:
    """rand_chacha's ChaCha8Rng: key from rand_core's seed_from_u64 (PCG32), 64-bit block
    counter in words 12-13, the stream in words 14-15, four double rounds."""

    def __init__(self, seed, stream):
        state, key = seed & 0xFFFFFFFFFFFFFFFF, []
        for _ in range(8):
            state = (state * 6364136223846793005 + 11634580027462260723) & 0xFFFFFFFFFFFFFFFF
            xorshifted = (((state >> 18) ^ state) >> 27) & _M32
            rot = state >> 59
            key.append(((xorshifted >> rot) | (xorshifted << (32 - rot))) & _M32 if rot else xorshifted)
        self.key, self.stream, self.counter, self.words = key, stream & 0xFFFFFFFFFFFFFFFF, 0, []

    def _block(self):
        s = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574] + self.key + [
            self.counter & _M32, self.counter >> 32, self.stream & _M32, self.stream >> 32]
        x = list(s)

        def qr(a, b, c, d):
            x[a] = (x[a] + x[b]) & _M32; x[d] = _rotl(x[d] ^ x[a], 16)
            x[c] = (x[c] + x[d]) & _M32; x[b] = _rotl(x[b] ^ x[c], 12)
            x[a] = (x[a] + x[b]) & _M32; x[d] = _rotl(x[d] ^ x[a], 8)
            x[c] = (x[c] + x[d]) & _M32; x[b] = _rotl(x[b] ^ x[c], 7)

        for _ in range(4):
            qr(0, 4, 8, 12); qr(1, 5, 9, 13); qr(2, 6, 10, 14); qr(3, 7, 11, 15)
            qr(0, 5, 10, 15); qr(1, 6, 11, 12); qr(2, 7, 8, 13); qr(3, 4, 9, 14)
        self.counter += 1
        return [(a + b) & _M32 for a, b in zip(x, s)]

    def next_u32(self):
        if not self.words:
            self.words = self._block()[::-1]
        return self.words.pop()

    def below(self, n):
        """rand 0.8's gen_range(0..n) for u32 (widening multiply, rejection zone)."""
        zone = ((n << (32 - n.bit_length())) - 1) & _M32
        while True:
            m = self.next_u32() * n
            if m & _M32 <= zone:
                return m >> 32


def hpc_train_order(samples, seed, epoch):
    rng, order = ChaCha8(seed, epoch), list(range(samples))
    for i in range(samples - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


class HpcTrainSchedule:
    """The samples hpc-train's worker `worker` of `workers` reads at each global step."""

    def __init__(self, samples, workers, worker, batch, seed):
        self.samples, self.workers, self.worker, self.batch, self.seed = samples, workers, worker, batch, seed
        self.steps_per_epoch = steps_per_epoch(samples, batch * workers)
        self.epoch, self.order = None, None

    def indices(self, global_step):
        import torch
        epoch, step = divmod(global_step, self.steps_per_epoch)
        if epoch != self.epoch:
            self.epoch, self.order = epoch, hpc_train_order(self.samples, self.seed, epoch)
        first = step * self.batch
        pos = [self.worker + j * self.workers for j in range(first, first + self.batch)]
        return torch.tensor([self.order[p] for p in pos if p < self.samples], dtype=torch.int64)

    def global_samples(self, global_step):
        start = (global_step % self.steps_per_epoch) * self.batch * self.workers
        return min(self.batch * self.workers, self.samples - start)


# ---------------------------------------------------------------------------------------------
# The rules of the spec: learning rate, LARS

def steps_per_epoch(samples, global_batch):
    return -(-samples // global_batch)


def scale_factor(scale, global_batch, base_batch):
    ratio = global_batch / max(base_batch, 1)
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[scale]


def warmup_steps(warmup_epochs, E):
    """round(warmup_epochs x E), halves away from zero as Rust's f64::round (Python's round()
    takes halves to even)."""
    x = warmup_epochs * E
    return int(math.floor(x)) + (1 if x - math.floor(x) >= 0.5 else 0)


def milestone_steps(epochs, E):
    """The first step s with m x E <= s, for each milestone m (in epochs)."""
    return sorted(int(math.ceil(m * E)) for m in epochs)


def spec_lr(s, peak, kind, W, T, E, milestones, gamma, end, power):
    """The spec's formula of the rate of step s (0-based)."""
    if s < W:
        return peak * (s + 1) / W
    t = s - W
    D = max(T - W, 1)
    if kind == "constant":
        return peak
    if kind == "step":
        return peak * gamma ** sum(1 for m in milestones if m * E <= s)
    if kind == "cosine":
        return end + (peak - end) * (1 + math.cos(math.pi * t / D)) / 2
    if kind == "poly":
        return end + (peak - end) * (1 - t / D) ** power
    die(f"unknown schedule {kind}")


def make_scheduler(opt, kind, peak, W, T, E, milestones, gamma, end, power):
    """torch.optim.lr_scheduler as the spec says, stepped once after every optimizer step; None
    for a constant rate without warm-up. The optimizer's lr must be `peak`."""
    from torch.optim import lr_scheduler as L
    D = max(T - W, 1)
    if kind == "constant":
        main = None
    elif kind == "step":
        main = L.MultiStepLR(opt, milestones=[m - W for m in milestone_steps(milestones, E)], gamma=gamma)
    elif kind == "cosine":
        main = L.CosineAnnealingLR(opt, T_max=D, eta_min=end)
    elif kind == "poly":
        if end == 0:
            main = L.PolynomialLR(opt, total_iters=D, power=power)
        else:
            main = L.LambdaLR(opt, lambda t: (end + (peak - end) * (1 - min(t, D) / D) ** power) / peak)
    else:
        die(f"unknown schedule {kind}")
    if W == 0:
        return main
    warm = L.LinearLR(opt, start_factor=1.0 / W, end_factor=1.0, total_iters=W - 1)
    if main is None:
        main = L.LambdaLR(opt, lambda t: 1.0)
    return L.SequentialLR(opt, [warm, main], milestones=[W])


def lars_class():
    import torch

    class LARS(torch.optim.Optimizer):
        """LARS (You et al. 2017) in the form of MLPerf's ResNet-50 reference, per the spec:
        tensors of at most one dimension (batch-norm weights and biases, every bias) take
        v = m v + lr g, p = p - v; the others
        trust = eta ||p|| / (||g|| + wd ||p||) where ||p|| > 0 and ||g|| > 0, else 1;
        v = m v + lr trust (g + wd p), p = p - v. v starts at 0."""

        def __init__(self, params, lr, momentum, weight_decay, eta):
            super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                lr, m, wd, eta = group["lr"], group["momentum"], group["weight_decay"], group["eta"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    g = p.grad
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    v = state["momentum_buffer"]
                    if p.ndim <= 1:
                        v.mul_(m).add_(g, alpha=lr)
                    else:
                        p_norm = torch.linalg.vector_norm(p)
                        g_norm = torch.linalg.vector_norm(g)
                        trust = torch.where((p_norm > 0) & (g_norm > 0), eta * p_norm / (g_norm + wd * p_norm),
                                            torch.ones_like(p_norm))
                        v.mul_(m).add_(g.add(p, alpha=wd).mul_(trust * lr))
                    p.sub_(v)

    return LARS


def make_optimizer(params, args, peak):
    import torch
    wd = args.weight_decay if args.weight_decay is not None else DEFAULT_WEIGHT_DECAY[args.optimizer]
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=peak, momentum=args.momentum, dampening=0, weight_decay=wd,
                               nesterov=False, foreach=False), wd
    if args.optimizer == "lars":
        return lars_class()(params, lr=peak, momentum=args.momentum, weight_decay=wd, eta=args.lars_eta), wd
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=peak, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                 weight_decay=wd, amsgrad=False, foreach=False), wd
    die(f"unknown optimizer {args.optimizer}")


# ---------------------------------------------------------------------------------------------
# Subcommands

def deterministic():
    import torch
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.use_deterministic_algorithms(True)


def cmd_init(args):
    import torch
    deterministic()
    _, _, classes, _, _ = load_dataset(args.data)
    import h5py
    with h5py.File(args.data, "r") as f:
        _, c, h, w = f["train/images"].shape
    torch.manual_seed(args.seed)
    model = build_model(args.model, c, h, w, classes)
    write_safetensors(args.out, {k: v.to(torch.float32) for k, v in model_weights(model).items()})
    print(f"init: {args.model} ({sum(p.numel() for p in model.parameters())} parameters, seed {args.seed}) -> {args.out}")


def cmd_subset(args):
    """The first --train and --test samples of a dataset file, with its attributes (mean and std
    too, so that the inputs are normalised as in the full file)."""
    import h5py
    if args.train < 1 or args.test < 1:
        die("--train and --test must be at least 1")
    with h5py.File(args.data, "r") as src:
        for split, n in (("train", args.train), ("test", args.test)):
            have = src[f"{split}/images"].shape[0]
            if n > have:
                die(f"{args.data}: {split} holds {have} samples, fewer than {n}")
        tmp = f"{args.out}.tmp"
        with h5py.File(tmp, "w") as dst:
            for name in src.attrs:
                dst.attrs.create(name, src.attrs[name], dtype=src.attrs.get_id(name).dtype)
            for split, n in (("train", args.train), ("test", args.test)):
                for part in ("images", "labels"):
                    d = src[f"{split}/{part}"]
                    dst.create_dataset(f"{split}/{part}", data=d[:n], dtype=d.dtype)
        os.replace(tmp, args.out)
    print(f"subset: {args.train} training and {args.test} test samples of {args.data} -> {args.out}")


def nudge(model, seed):
    """Moves every parameter element by at most one unit in the last place of its dtype (-1, 0
    or +1 ulp, drawn with `seed`): a start as good as the original for a float32 run, from which
    float32 rounding takes its own path."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            r = torch.randint(-1, 2, p.shape, generator=g)
            toward = torch.where(r > 0, torch.tensor(math.inf), torch.tensor(-math.inf)).to(p.dtype)
            p.copy_(torch.where(r == 0, p, torch.nextafter(p, toward)))


def nudged_path(out, seed):
    root, ext = os.path.splitext(out)
    return f"{root}-nudge{seed}{ext}"


def cmd_train(args):
    import torch
    import torch.nn.functional as F

    deterministic()
    dtype = {"float64": torch.float64, "float32": torch.float32}[args.dtype]
    images, labels, classes, mean, inv_std = load_dataset(args.data)
    n, c, h, w = images.shape
    global_batch = args.batch_size  # one worker
    E = steps_per_epoch(n, global_batch)
    T = args.steps
    peak = args.lr * scale_factor(args.scale_lr, global_batch, args.base_batch)
    W = warmup_steps(args.warmup_epochs, E)
    milestones = [float(m) for m in args.lr_steps.split(",") if m.strip()] if args.lr_steps else []
    if args.lr_schedule == "step" and not milestones:
        die("--lr-schedule step needs --lr-steps")
    if any(m <= 0 for m in milestones):
        die("--lr-steps: milestones are epochs after the start, greater than 0")
    nudges = [int(x) for x in args.nudge.split(",") if x.strip()] if args.nudge else []
    if nudges and args.dtype != "float32":
        die("--nudge is for float32 runs (the ulps are float32's)")

    def run(nudge_seed):
        torch.manual_seed(args.seed)
        model = build_model(args.model, c, h, w, classes)
        load_init(model, args.init_weights)
        if nudge_seed is not None:
            nudge(model, nudge_seed)
        model.to(dtype)
        model.train()
        opt, wd = make_optimizer(model.parameters(), args, peak)
        sched = make_scheduler(opt, args.lr_schedule, peak, W, T, E, milestones, args.lr_gamma, args.end_lr, args.poly_power)
        if args.order == "hpc-train":
            sampler = HpcTrainSchedule(n, 1, 0, args.batch_size, args.seed)
        else:
            sampler = Schedule(n, 1, 0, args.batch_size, args.seed)
        lrs, losses, worst = [], [], 0.0
        for step in range(T):
            lr = opt.param_groups[0]["lr"]
            want = spec_lr(step, peak, args.lr_schedule, W, T, E, milestones, args.lr_gamma, args.end_lr, args.poly_power)
            rel = abs(lr - want) / max(abs(want), 1e-300)
            worst = max(worst, rel)
            idx = sampler.indices(step)
            x = images.index_select(0, idx).float().sub(mean).mul(inv_std).to(dtype)
            y = labels.index_select(0, idx)
            opt.zero_grad(set_to_none=True)
            # The mean over the step's global samples: 1 / global batch but at an epoch's last,
            # short step of hpc-train's order.
            factor = 1.0 / len(idx)
            loss = F.cross_entropy(model(x), y, reduction="sum", label_smoothing=args.label_smoothing) * factor
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            lrs.append(lr)
            losses.append(loss.item())
            if args.verbose and nudge_seed is None:
                print(f"step {step}: lr {lr:.17g} (spec {want:.17g}, relative difference {rel:.1e}), loss {losses[-1]:.10f}")
        if worst > 1e-12:
            die(f"the scheduler's rates differ from the spec's formula by {worst:.2e} (relative): see --verbose")
        return model, wd, lrs, losses, worst

    model, wd, lrs, losses, worst = run(None)
    write_safetensors(args.out, model_weights(model))
    print(f"torch {args.dtype}: {args.model} {args.optimizer} {args.lr_schedule}, {T} steps of {global_batch} "
          f"(E {E}, warm-up {W}, peak {peak:g}): loss {losses[0]:.6f} -> {losses[-1]:.6f} -> {args.out}")
    nudged = []
    for seed in nudges:
        m, _, _, nl, _ = run(seed)
        path = nudged_path(args.out, seed)
        write_safetensors(path, model_weights(m))
        nudged.append({"seed": seed, "out": path, "final_loss": nl[-1]})
        print(f"torch {args.dtype}, start nudged by ulps (seed {seed}): loss {nl[0]:.6f} -> {nl[-1]:.6f} -> {path}")
    summary = {
        "side": f"torch-{args.dtype}", "model": args.model, "optimizer": args.optimizer, "schedule": args.lr_schedule,
        "steps": T, "batch": global_batch, "train_samples": n, "order": args.order, "steps_per_epoch": E, "warmup_steps": W,
        "peak_lr": peak, "weight_decay": wd, "label_smoothing": args.label_smoothing,
        "lrs": lrs, "losses": losses, "lr_max_rel_diff_from_spec": worst, "torch_version": torch.__version__,
        "out": args.out, "nudged": nudged,
    }
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f)
            f.write("\n")


def distances(ref, other, names):
    import torch
    sq, worst = 0.0, 0.0
    for k in names:
        d = other[k].to(torch.float64) - ref[k].to(torch.float64)
        sq += float((d * d).sum())
        worst = max(worst, float(d.abs().max())) if d.numel() else worst
    return math.sqrt(sq), worst


def norm(weights, names):
    import torch
    return math.sqrt(sum(float((weights[k].to(torch.float64) ** 2).sum()) for k in names))


def compare(reference, torch32, hpc, init=None, factor=2.0, nudged=()):
    """Distances of the torch float32 and the hpc-train weights from the float64 reference, over
    the parameters and over the buffers (running statistics) apart. PyTorch float32's distance,
    the yardstick, is the largest of the float32 runs' (`torch32` and the runs from nudged
    starts, `nudged`); a group passes when hpc-train's distance is at most `factor` times it."""
    ref = {k: v for k, v in read_safetensors(reference).items() if not k.endswith("num_batches_tracked")}
    files = {"torch_f32": torch32, "hpc_train": hpc}
    files.update({f"torch_f32_nudged_{i}": path for i, path in enumerate(nudged)})
    loaded = {}
    for side, path in files.items():
        w = {k: v for k, v in read_safetensors(path).items() if not k.endswith("num_batches_tracked")}
        missing, extra = sorted(set(ref) - set(w)), sorted(set(w) - set(ref))
        if missing or extra:
            die(f"{path} ({side}) does not hold the reference's tensors: missing {missing[:5]}, extra {extra[:5]}")
        for k in ref:
            if tuple(w[k].shape) != tuple(ref[k].shape):
                die(f"{path} ({side}): {k} has shape {list(w[k].shape)}, the reference's is {list(ref[k].shape)}")
        loaded[side] = w
    start = None
    if init:
        start = {k: v for k, v in read_safetensors(init).items() if k in ref}
    groups = {
        "parameters": sorted(k for k in ref if not k.endswith(BUFFER_SUFFIXES)),
        "buffers": sorted(k for k in ref if k.endswith(BUFFER_SUFFIXES)),
    }
    out = {"pass": True, "factor": factor}
    for group, names in groups.items():
        if not names:
            continue
        g = {"tensors": len(names), "elements": sum(ref[k].numel() for k in names), "reference_norm": norm(ref, names)}
        if start is not None:
            g["reference_moved"] = distances(start, ref, names)[0]
        for side in ("torch_f32", "hpc_train"):
            l2, mx = distances(ref, loaded[side], names)
            g[side] = {"l2": l2, "max_abs": mx}
        l2, mx = distances(loaded["torch_f32"], loaded["hpc_train"], names)
        g["hpc_train_to_torch_f32"] = {"l2": l2, "max_abs": mx}
        g["torch_f32_nudged"] = [distances(ref, loaded[f"torch_f32_nudged_{i}"], names)[0] for i in range(len(nudged))]
        g["yardstick"] = max([g["torch_f32"]["l2"]] + g["torch_f32_nudged"])
        a, b = g["hpc_train"]["l2"], g["yardstick"]
        g["ratio"] = a / b if b > 0 else (0.0 if a == 0 else math.inf)
        t = g["torch_f32"]["l2"]
        g["ratio_to_torch_f32"] = a / t if t > 0 else (0.0 if a == 0 else math.inf)
        g["pass"] = a <= factor * b
        out["pass"] = out["pass"] and g["pass"]
        out[group] = g
    return out


def cmd_compare(args):
    nudged = [p for p in args.nudged.split(",") if p] if args.nudged else []
    result = compare(args.reference, args.torch, args.hpc, args.init, args.factor, nudged)
    record = json.loads(args.tag) if args.tag else {}
    record.update(result)
    line = json.dumps(record)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    print(line)


def cmd_check_schedules(args):
    """Every schedule, with and without warm-up, over a grid of run lengths, epoch sizes and
    settings: the rate torch.optim.lr_scheduler gives each step against the spec's formula."""
    import torch
    worst, cases = 0.0, 0
    failures = []
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    for kind in ("constant", "step", "cosine", "poly"):
        for peak in (0.1, 3.2, 0.05 * 1024 / 256):
            for E in (1, 3, 7, 1875):
                for warm_epochs in (0, 0.5, 1, 2.5, 1.0 / 1875):
                    W = warmup_steps(warm_epochs, E)
                    for T in (1, 2, 5, 13, 40):
                        for milestones, gamma in (([1, 2], 0.1), ([0.5, 1.5, 4], 0.5), ([3], 0.2)):
                            if kind != "step" and (milestones, gamma) != ([1, 2], 0.1):
                                continue
                            for end, power in ((0.0, 2.0), (1e-3, 2.0), (0.0, 1.0), (1e-4, 0.5)):
                                if kind in ("constant", "step") and (end, power) != (0.0, 2.0):
                                    continue
                                if kind == "cosine" and power != 2.0:
                                    continue
                                opt = torch.optim.SGD([p], lr=peak)
                                sched = make_scheduler(opt, kind, peak, W, T, E, milestones, gamma, end, power)
                                for s in range(T):
                                    got = opt.param_groups[0]["lr"]
                                    want = spec_lr(s, peak, kind, W, T, E, milestones, gamma, end, power)
                                    rel = abs(got - want) / max(abs(want), 1e-300)
                                    worst = max(worst, rel)
                                    if rel > 1e-12:
                                        failures.append(f"{kind} peak {peak} E {E} W {W} T {T} milestones {milestones} "
                                                        f"gamma {gamma} end {end} power {power}: step {s} lr {got!r}, spec {want!r}")
                                    opt.step()
                                    if sched is not None:
                                        sched.step()
                                cases += 1
    for f in failures[:20]:
        print("MISMATCH", f)
    print(f"check-schedules: {cases} schedules, largest relative difference from the spec {worst:.2e} "
          f"({'all within 1e-12' if not failures else f'{len(failures)} rate(s) beyond 1e-12'})")
    if failures:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------
# The Markdown table

def fmt(x):
    return f"{x:.3e}" if x else "0"


def cmd_table(args):
    rows = [json.loads(l) for l in open(args.rows) if l.strip()]
    meta = json.load(open(args.meta))
    out = []
    w = out.append
    w("# hpc-train's weights against PyTorch's: optimizers and learning-rate schedules (issue 35)")
    w("")
    w("Each row trains the same steps from the same initial weights on the same samples: PyTorch in float64 (the "
      "reference), PyTorch in float32, and hpc-train (float32, one rank). The figures are L2 distances from the "
      "float64 run's final weights, over all parameters (for ResNet-18 the batch-norm running statistics are "
      "measured apart, as *buffers*).")
    w("")
    w(f"**The rule**: hpc-train's distance is at most {meta['factor']:g} times PyTorch float32's, for the "
      "parameters and for the buffers. PyTorch float32's distance is the largest of its float32 runs: the one "
      f"from the shared initial weights and {meta.get('nudges', 0)} from those weights nudged by at most one unit "
      "in the last place per element (`optim_reference.py train --nudge`). One float32 run is not a yardstick "
      "on its own: float32 rounding decides on which side of a kink (ReLU's 0, for one) a value close to it "
      "falls, and the gradient jumps there, so the distances of equally good float32 runs spread over an order "
      "of magnitude or more on ResNet-18 (the *nudged* column). The ratio to the single un-nudged run is shown "
      "as well, and so is the distance between hpc-train's weights and PyTorch float32's (0: bitwise equal).")
    w("")
    passed = sum(1 for r in rows if r["pass"])
    w(f"**{passed} of {len(rows)} rows pass.**")
    w("")
    w("| # | model | optimizer | schedule | other flags | steps | hpc-train | torch f32 | torch f32, nudged starts "
      "| ratio | ratio to torch f32 alone | hpc-train to torch f32 | buffers: hpc-train, yardstick (ratio) "
      "| moved from init | result |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "parameters" not in r:
            w(f"| {r['row']} | {r['model']} | {r['optimizer']} | {r['schedule']} | {r.get('extra') or '-'} | "
              f"{r['steps']} | - | - | - | - | - | - | - | - | **ERROR**: {r.get('error', '?')} |")
            continue
        p = r["parameters"]
        b = r.get("buffers")
        nudged = p.get("torch_f32_nudged", [])
        spread = f"{fmt(min(nudged))} - {fmt(max(nudged))}" if nudged else "-"
        buf = f"{fmt(b['hpc_train']['l2'])}, {fmt(b['yardstick'])} ({b['ratio']:.2f})" if b else "-"
        w(f"| {r['row']} | {r['model']} | {r['optimizer']} | {r['schedule']} | {r.get('extra') or '-'} | {r['steps']} | "
          f"{fmt(p['hpc_train']['l2'])} | {fmt(p['torch_f32']['l2'])} | {spread} | {p['ratio']:.2f} | "
          f"{p['ratio_to_torch_f32']:.2f} | {fmt(p['hpc_train_to_torch_f32']['l2'])} | {buf} | "
          f"{fmt(p.get('reference_moved', 0))} | "
          f"{'pass' if r['pass'] else '**FAIL**'} |")
    w("")
    w("Columns: *hpc-train*, *torch f32* = ||w - w_float64||_2 over all parameters; *nudged starts* = the "
      "smallest and largest of the nudged float32 runs; *ratio* = hpc-train's over the largest float32 "
      "distance (the rule's); *hpc-train to torch f32* = ||w_hpc-train - w_torch_f32||_2; *moved from init* = ||w_float64 - w_init||_2, how far the steps took the weights.")
    w("")
    notes = [r for r in rows if r.get("note")]
    if notes:
        w("Notes:")
        w("")
        for r in notes:
            w(f"- row {r['row']}: {r['note']}")
        w("")
    w("## Setup")
    w("")
    for line in meta["setup"]:
        w(f"- {line}")
    w("")
    w("## Machine")
    w("")
    for k in ("date", "commit", "uname", "nproc", "cpu", "torch", "hpc_train"):
        w(f"- {k}: {meta.get(k, '?')}")
    w("")
    w("## Commands")
    w("")
    w("```bash")
    w(meta["command"])
    w("```")
    w("")
    w("Each row's commands (paths relative to the run's scratch folder):")
    w("")
    w("```bash")
    for r in rows:
        w(f"# row {r['row']}")
        for c in r.get("commands", []):
            w(c)
    w("```")
    w("")
    w(f"Raw records (one JSON line per row, every distance): `{meta['raw']}`.")
    text = "\n".join(out) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    sys.stdout.write(text)


# ---------------------------------------------------------------------------------------------

def cmd_strict_load(args):
    """A --save-weights file of hpc-train (issue 38: vit-b16, whole or glued from tensor-parallel
    parts) into torchvision's own constructor, with strict names and shapes; one forward."""
    import torch
    import torchvision
    model = getattr(torchvision.models, args.torchvision)(weights=None, num_classes=args.classes)
    load_init(model, args.weights)
    with torch.no_grad():
        y = model.eval()(torch.zeros(1, 3, 224, 224))
    print(f"strict-load: {args.weights} loads into torchvision.models.{args.torchvision}(num_classes={args.classes}) "
          f"with strict=True ({sum(p.numel() for p in model.parameters())} parameters; logits {tuple(y.shape)})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    i = sub.add_parser("init", help="the model's initial weights (seeded) as float32 safetensors")
    i.add_argument("--model", choices=["tiny", "resnet18", "resnet50", "vit-tiny"], required=True)
    i.add_argument("--data", required=True, help="the dataset (its image shape and classes)")
    i.add_argument("--seed", type=int, default=42)
    i.add_argument("--out", required=True)

    s = sub.add_parser("subset", help="the first samples of a dataset file, in the same layout")
    s.add_argument("--data", required=True)
    s.add_argument("--train", type=int, required=True)
    s.add_argument("--test", type=int, default=16)
    s.add_argument("--out", required=True)

    t = sub.add_parser("train", help="a few steps in float64 or float32; the final weights as safetensors")
    t.add_argument("--model", choices=["tiny", "resnet18", "resnet50", "vit-tiny"], required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--batch-size", type=int, required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--init-weights", required=True)
    t.add_argument("--dtype", choices=["float64", "float32"], required=True)
    t.add_argument("--optimizer", choices=["sgd", "lars", "adamw"], default="sgd")
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--momentum", type=float, default=0.9)
    t.add_argument("--weight-decay", type=float, default=None, help="default: sgd 1e-4, lars 5e-5, adamw 1e-2")
    t.add_argument("--lars-eta", type=float, default=0.001)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--lr-schedule", choices=["constant", "step", "cosine", "poly"], default="constant")
    t.add_argument("--warmup-epochs", type=float, default=0.0)
    t.add_argument("--lr-steps", default="", help="milestones in epochs, e.g. 30,60,80")
    t.add_argument("--lr-gamma", type=float, default=0.1)
    t.add_argument("--end-lr", type=float, default=0.0)
    t.add_argument("--poly-power", type=float, default=2.0)
    t.add_argument("--scale-lr", choices=["none", "linear", "sqrt"], default="none")
    t.add_argument("--base-batch", type=int, default=256)
    t.add_argument("--label-smoothing", type=float, default=0.0)
    t.add_argument("--seed", type=int, default=42, help="data order")
    t.add_argument("--order", choices=["hpc-train", "torch"], default="hpc-train",
                   help="hpc-train's shuffle (ChaCha8, as src/data/loader.rs) or pytorch_reference.Schedule's (torch.randperm)")
    t.add_argument("--out", required=True, help="final weights (safetensors, in --dtype)")
    t.add_argument("--summary", help="JSON of the run (rates and losses of every step)")
    t.add_argument("--nudge", metavar="SEEDS",
                   help="float32: also train from the initial weights nudged by at most one ulp per element, once per seed "
                        "(e.g. 1,2,3), writing OUT-nudgeSEED.safetensors beside --out")
    t.add_argument("--verbose", action="store_true", help="each step's rate beside the spec's, and its loss")

    c = sub.add_parser("compare", help="distances from the float64 reference, as a JSON line")
    c.add_argument("--reference", required=True, help="PyTorch float64 weights")
    c.add_argument("--torch", required=True, help="PyTorch float32 weights")
    c.add_argument("--hpc", required=True, help="hpc-train's weights")
    c.add_argument("--nudged", metavar="FILES", help="float32 weights from nudged starts (comma-separated): the "
                   "yardstick is the largest float32 distance of --torch and these")
    c.add_argument("--init", help="the initial weights (to report how far the reference moved)")
    c.add_argument("--factor", type=float, default=2.0, help="pass: hpc-train's distance <= factor x PyTorch float32's")
    c.add_argument("--tag", help="JSON object merged into the record")
    c.add_argument("--out", help="JSONL file to append the record to")

    sub.add_parser("check-schedules", help="the schedulers' rates against the spec's formulas (within 1e-12)")

    k = sub.add_parser("strict-load", help="load a weights file into torchvision's own model with strict=True")
    k.add_argument("--torchvision", required=True, choices=["vit_l_16", "vit_b_16", "resnet18"], help="the torchvision.models constructor")
    k.add_argument("--classes", type=int, required=True)
    k.add_argument("--weights", required=True)

    r = sub.add_parser("table", help="the Markdown table of compare's records")
    r.add_argument("--rows", required=True)
    r.add_argument("--meta", required=True)
    r.add_argument("--output", required=True)

    args = p.parse_args(argv)
    if args.command == "train":
        if args.steps < 1 or args.batch_size < 1:
            die("--steps and --batch-size must be at least 1")
        if not 0 <= args.label_smoothing <= 1:
            die("--label-smoothing must lie in [0, 1]")
    {"init": cmd_init, "subset": cmd_subset, "train": cmd_train, "compare": cmd_compare,
     "check-schedules": cmd_check_schedules, "table": cmd_table, "strict-load": cmd_strict_load}[args.command](args)


if __name__ == "__main__":
    main()
