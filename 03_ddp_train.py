"""03_ddp_train.py: train a torchvision classifier with DistributedDataParallel.

The main job. Every process holds a replica of the model and trains on its own shard of
each global batch; DDP averages the gradients during backward, so the replicas stay equal
and N processes with batch b train exactly like one process with batch N*b. At the end the
script checks that every rank holds identical parameters.

Run
  torchrun --standalone --nproc_per_node 2 03_ddp_train.py        # 2 processes (GPUs or CPU)
  python 03_ddp_train.py --spawn 2                                 # the same via mp.spawn
  python 03_ddp_train.py                                           # one process
  python 03_ddp_train.py --data /data/imagenette --arch resnet50 --image-size 224 --amp bf16
  # two nodes, 4 GPUs each: run on both machines
  torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 03_ddp_train.py --epochs 10

Global batch = world size x --batch-size x --accum-steps. --lr is used as given, so if you
change the world size and want the same training, keep the global batch or scale --lr.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import hashlib
import inspect
import io
import math
import os
import re
import shutil
import socket
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

# The plumbing used below is defined at the bottom of this file, the same in all six
# scripts: setup() binds this process to its device, joins the process group and returns a
# Dist (rank, local_rank, world_size, device, is_main); check(ok, name, detail) raises
# CheckFailed, SetupError reports a job that cannot run as configured, and both end the rank
# with one line; launch(main, args) runs main on every rank (torchrun, --spawn N, or one
# process); add_launch_args adds --spawn, --backend and --timeout.


# ---- Data: synthetic images that need no download, or your own ImageFolder tree ----------

class SyntheticImages(Dataset):
    """Learnable and deterministic: class c is a fixed random 8x8 colour pattern, upsampled,
    plus noise. Nothing random at load time, so N processes see exactly what one would."""

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int, train: bool):
        patterns = torch.randn(num_classes, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
        patterns = F.interpolate(patterns, size=image_size, mode="bilinear", align_corners=False)
        g = torch.Generator().manual_seed(seed + (1 if train else 2))  # train and val differ
        self.labels = torch.randint(num_classes, (size,), generator=g)
        self.images = patterns[self.labels] + 1.5 * torch.randn(size, 3, image_size, image_size,
                                                                generator=g)
        self.classes = list(range(num_classes))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], int(self.labels[index])


def build_datasets(args: argparse.Namespace):
    if not args.data:
        return tuple(SyntheticImages(size, args.num_classes, args.image_size, args.seed, train)
                     for size, train in ((args.train_size, True), (args.val_size, False)))
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    # Random transforms draw from each DataLoader worker's RNG, which differs per rank.
    norm = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(),
                       T.ToTensor(), norm])
    val = T.Compose([T.Resize(round(args.image_size * 256 / 224)),
                     T.CenterCrop(args.image_size), T.ToTensor(), norm])
    try:
        return ImageFolder(args.data / "train", train), ImageFolder(args.data / "val", val)
    except (FileNotFoundError, RuntimeError) as e:  # no class folders, or no images in them
        raise SetupError(f"--data {args.data}: {e}") from e


def make_loaders(args: argparse.Namespace, d: Dist, train_set, val_set):
    workers = args.workers  # auto: on CPU the cores train; on a GPU workers prepare batches
    if workers is None:
        workers = 0 if d.device.type == "cpu" else min(8, os.cpu_count() // d.local_world_size)
    common = dict(batch_size=args.batch_size, num_workers=workers,
                  persistent_workers=workers > 0,        # keep workers alive across epochs
                  pin_memory=d.device.type == "cuda")    # page-locked: async copies to the GPU
    sampler = DistributedSampler(train_set, num_replicas=d.world_size, rank=d.rank,
                                 shuffle=True, seed=args.seed)
    # Validation: rank r takes samples r, r+W, r+2W, ... with no padding, so each counts once
    # (DistributedSampler would pad with repeats; 05_eval_gather.py shows what that costs).
    val_shard = Subset(val_set, range(d.rank, len(val_set), d.world_size))
    return DataLoader(train_set, sampler=sampler, **common), sampler, \
        DataLoader(val_shard, **common)


# ---- Model: any torchvision classifier, wrapped in DistributedDataParallel ---------------

ARCHS = sorted(torchvision.models.list_models(module=torchvision.models))


def build_model(args: argparse.Namespace, num_classes: int) -> nn.Module:
    kwargs = {"num_classes": num_classes}
    if args.norm == "group":
        # GroupNorm normalises each sample on its own: no batch statistics, so the model
        # computes the same thing however the batch is split across processes.
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(math.gcd(32, channels), channels)
    try:
        model = torchvision.models.get_model(args.arch, **kwargs)
    except TypeError as e:
        raise SetupError(f"--norm group needs an architecture with a norm_layer argument "
                         f"(resnet*, resnext*, wide_resnet*); {args.arch} has none") from e
    if args.sync_bn:  # BatchNorm statistics over the global batch, not each rank's shard
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.unused_layer:  # forward never calls it, so its parameters never get a gradient
        model.unused_layer = nn.Linear(8, 8)
    return model


def wrap_ddp(model: nn.Module, args: argparse.Namespace, d: Dist, total_steps: int) -> DDP:
    if args.compile:  # compile the inner module, then wrap: its state_dict keys stay plain,
        model.compile(backend=args.compile)  # and Dynamo's DDPOptimizer splits the graph at
    knobs = {}                               # DDP's bucket boundaries, so all-reduces overlap
    if args.no_broadcast_buffers:  # each rank keeps its own buffers (BN running stats)
        # torch 2.14 renamed broadcast_buffers to forward_sync_buffers; the old name warns
        new_name = "forward_sync_buffers" in inspect.signature(DDP).parameters
        knobs["forward_sync_buffers" if new_name else "broadcast_buffers"] = False
    ddp_model = DDP(model,
        device_ids=[d.local_rank] if d.device.type == "cuda" else None,  # CPU: None
        bucket_cap_mb=args.bucket_cap_mb,     # gradients all-reduce in buckets of this size
        find_unused_parameters=args.find_unused_parameters,  # only if some params get no grad
        static_graph=args.static_graph,       # same graph every step: DDP can plan ahead
        gradient_as_bucket_view=args.gradient_as_bucket_view,  # grads live in the buckets
        **knobs,
    )
    # A comm hook replaces each bucket's all-reduce. fp16/bf16 halve the bytes sent (each
    # rank's gradient is rounded first). PowerSGD sends a rank-2 approximation of each weight
    # matrix and carries what it dropped into the next step; plain all-reduces until ~10% of
    # the steps (2 at least: DDP rebuilds its buckets after step 1).
    if args.comm_hook == "powersgd":
        state = powerSGD.PowerSGDState(None, matrix_approximation_rank=2,
                                       start_powerSGD_iter=max(2, total_steps // 10))
        gloo = d.backend == "gloo"
        ddp_model.register_comm_hook(state, powersgd_in_order if gloo else powerSGD.powerSGD_hook)
    elif args.comm_hook != "none":  # state None: all-reduce over the default process group
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        ddp_model.register_comm_hook(None, hook[args.comm_hook])
    return ddp_model


def powersgd_in_order(state, bucket):
    """PowerSGD for Gloo. Its 2nd and 3rd all-reduces start from callbacks, which Gloo runs on
    its own threads, so ranks can start them in different orders (seen here as a size mismatch
    between ranks). Waiting for each bucket before the next one keeps one order; no overlap."""
    done = torch.futures.Future()
    done.set_result(powerSGD.powerSGD_hook(state, bucket).wait())
    return done


# ---- Training and evaluation -------------------------------------------------------------

@dataclass
class Optim:
    """The optimizer and what steps with it: the lr schedule and, for fp16, the scaler."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # disabled (a no-op) unless --amp fp16
    steps: int = 0                # optimizer steps taken so far


def clock(d: Dist) -> float:
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)  # GPU work is queued: time what has finished
    return time.perf_counter()


def compile_warm_up(model: DDP, args: argparse.Namespace, d: Dist) -> list[float]:
    """Compile before training: a forward and backward on zeros of the training shape, under
    no_sync, then undone. Ranks compile at different speeds; the others wait for the slowest
    in a gather on a Gloo group with a 30-minute timeout, with no NCCL collective pending that
    the watchdog could time out. A later recompile (a new shape; eval mode) stalls its rank
    inside the next collective instead, within --timeout; TORCH_LOGS=recompiles says why."""
    patient = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))
    images = torch.zeros(args.batch_size, 3, args.image_size, args.image_size,
                         device=d.device, dtype=args.dtype)
    saved, start = [b.clone() for b in model.module.buffers()], clock(d)  # BN statistics
    try:  # static_graph: its first backward must sync (see train_one_epoch), so it waits there
        with nullcontext() if args.static_graph else model.no_sync():
            with torch.autocast(d.device.type, dtype=args.amp, enabled=args.amp is not None):
                loss = F.cross_entropy(model(images), images.new_zeros(len(images), dtype=int))
            loss.backward()
    except torch._dynamo.exc.BackendCompilerFailed as e:  # its first line, not 200
        raise SetupError(f"--compile {args.compile} failed: {str(e).splitlines()[0]}") from e
    seconds = clock(d) - start
    model.zero_grad(set_to_none=True)
    for buffer, value in zip(model.module.buffers(), saved):
        buffer.copy_(value)
    every_rank = [0.0] * d.world_size
    dist.all_gather_object(every_rank, seconds, group=patient)
    dist.destroy_process_group(patient)
    return every_rank


def train_one_epoch(model: DDP, loader, opt: Optim, args, d: Dist, epoch: int) -> dict:
    model.train()
    micro_batches = len(loader) // args.accum_steps * args.accum_steps  # whole groups only
    total_steps = micro_batches // args.accum_steps * args.epochs
    window = torch.zeros(3, dtype=torch.float64, device=d.device)  # loss sum, correct, count
    epoch_sums = torch.zeros_like(window)
    timed_images, started, logged = 0, None, opt.steps
    window_start = clock(d)
    for i, (images, labels) in enumerate(loader):
        if i == micro_batches:
            break
        images = images.to(d.device, dtype=args.dtype, non_blocking=True)
        labels = labels.to(d.device, non_blocking=True)
        step = (i + 1) % args.accum_steps == 0
        # no_sync: the first K-1 micro-batches only accumulate gradients locally; the K-th
        # backward all-reduces the accumulated sum, once. static_graph's first backward must
        # sync (in no_sync it fails an assert, pytorch/pytorch#143580); that is exact: every
        # rank then holds the same average, which the K-th all-reduce leaves unchanged.
        sync = step or (args.static_graph and opt.steps == 0 and i == 0)
        with nullcontext() if sync else model.no_sync():
            with torch.autocast(d.device.type, dtype=args.amp, enabled=args.amp is not None):
                logits = model(images)
                loss = F.cross_entropy(logits, labels)  # the mean over this rank's batch
            opt.scaler.scale(loss / args.accum_steps).backward()
        with torch.no_grad():  # running sums stay on the device: no wait for the GPU here
            window[0] += loss.detach() * len(labels)
            window[1] += (logits.argmax(1) == labels).sum()
            window[2] += len(labels)
        timed_images += len(labels) if started else 0
        if not step:
            continue
        opt.scaler.step(opt.optimizer)  # optimizer.step(), skipped if fp16 overflowed
        opt.scaler.update()
        opt.optimizer.zero_grad(set_to_none=True)
        opt.scheduler.step()
        opt.steps += 1
        if started is None:  # time from the end of step 1: it pays one-off costs
            started = clock(d)
        if opt.steps % args.log_every == 0 or opt.steps == total_steps:
            epoch_sums += window
            dist.all_reduce(window)  # every rank, at the same steps: the global batch's loss
            now = clock(d)
            loss_sum, correct, count = window.tolist()
            per_step = (now - window_start) / (opt.steps - logged)
            eta = datetime.timedelta(seconds=round((total_steps - opt.steps) * per_step))
            if d.is_main:
                print(f"epoch {epoch + 1}/{args.epochs}  step {opt.steps:>5}/{total_steps}  "
                      f"loss {loss_sum / count:.4f}  acc {100 * correct / count:5.1f}%  "
                      f"lr {opt.scheduler.get_last_lr()[0]:.4f}  "
                      f"{count / (now - window_start):8.1f} img/s  eta {eta}", flush=True)
            window.zero_()
            window_start, logged = now, opt.steps
    epoch_sums += window
    dist.all_reduce(epoch_sums)  # the whole epoch, over every rank's batches
    loss_sum, correct, count = epoch_sums.tolist()
    return {"loss": loss_sum / max(count, 1), "acc": correct / max(count, 1),
            "images": timed_images * d.world_size, "seconds": clock(d) - started if started else 0}


@torch.no_grad()
def evaluate(model: nn.Module, loader, d: Dist, dtype: torch.dtype) -> dict:
    # The raw module, not the DDP wrapper: no gradient sync or buffer broadcast is wanted
    # here, and ranks may hold different numbers of validation batches.
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=d.device)
    for images, labels in loader:
        images = images.to(d.device, dtype=dtype, non_blocking=True)
        labels = labels.to(d.device, non_blocking=True)
        logits = model(images)
        sums[0] += F.cross_entropy(logits, labels, reduction="sum").double()
        sums[1] += (logits.argmax(1) == labels).sum()
        sums[2] += len(labels)
    dist.all_reduce(sums)  # every rank calls this once, whatever its number of batches
    loss_sum, correct, count = sums.tolist()
    return {"loss": loss_sum / max(count, 1), "acc": correct / max(count, 1), "n": int(count)}


def verify_replicas_identical(model: nn.Module, d: Dist) -> str:
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    digests = [None] * d.world_size
    dist.all_gather_object(digests, digest)
    check(len(set(digests)) == 1, "identical replicas",
          f"ranks hold different parameters: sha256 {[h[:12] for h in digests]}")
    return (f"{d.world_size} rank(s) hold identical parameters "
            f"({flat.numel():,} values, sha256 {digest[:16]})")


def main(args: argparse.Namespace) -> None:
    d = setup(args.backend, args.timeout)
    train_set, val_set = build_datasets(args)
    train_loader, sampler, val_loader = make_loaders(args, d, train_set, val_set)
    steps_per_epoch = len(train_loader) // args.accum_steps
    if steps_per_epoch == 0:
        raise SetupError(f"--accum-steps {args.accum_steps} needs at least {args.accum_steps} "
                         f"batches per rank per epoch, but each rank has {len(train_loader)}")

    global_batch = d.world_size * args.batch_size * args.accum_steps
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also
    model = build_model(args, len(train_set.classes)).to(d.device, args.dtype)  # broadcasts)
    ddp_model = wrap_ddp(model, args, d, steps_per_epoch * args.epochs)
    torch.manual_seed(args.seed + d.rank)  # but each rank its own dropout masks
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    opt = Optim(optimizer,
                torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=steps_per_epoch * args.epochs),
                torch.amp.GradScaler(d.device.type, enabled=args.amp == torch.float16))
    if d.is_main:
        print(f"training {args.arch} ({sum(p.numel() for p in model.parameters()):,} params, "
              f"{len(train_set.classes)} classes) on {d.world_size} x {d.device.type} "
              f"({d.backend}); {len(train_set)} train / {len(val_set)} val images; global batch "
              f"{global_batch} = {d.world_size} ranks x {args.batch_size} x {args.accum_steps} "
              f"accum; {steps_per_epoch * args.epochs} steps", flush=True)
    if args.compile:
        seconds = compile_warm_up(ddp_model, args, d)
        if d.is_main:
            print(f"compiled ({args.compile}) in {max(seconds):.1f} s on the slowest rank, "
                  f"{min(seconds):.1f} s on the fastest", flush=True)

    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # same seed + epoch on every rank: a new shared permutation
        train = train_one_epoch(ddp_model, train_loader, opt, args, d, epoch)
        val = evaluate(model, val_loader, d, args.dtype) if len(val_set) else None
        history.append((train, val))
        if d.is_main:
            print(f"epoch {epoch + 1} done: train loss {train['loss']:.4f} acc "
                  f"{100 * train['acc']:.1f}%" + (f" | val loss {val['loss']:.4f} acc "
                  f"{100 * val['acc']:.1f}% on {val['n']} images" if val else ""), flush=True)

    verified = verify_replicas_identical(model, d)
    if args.save_model:
        if d.is_main:  # the raw module: keys without "module."; the file whole or absent
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)
            write_atomic(args.save_model, buffer.getvalue())
        dist.barrier()  # nobody exits (or reads the file) before rank 0 has written it
    if d.is_main:
        (first, _), (last, last_val) = history[0], history[-1]
        images, seconds = (sum(t[key] for t, _ in history) for key in ("images", "seconds"))
        speed = (f"{images / seconds:.1f} img/s, {seconds / images * global_batch:.3f} s/step"
                 if images else "n/a")  # n/a: one step per epoch, and step 1 is not timed
        print(f"summary: {opt.steps} steps, {speed} on {d.world_size} "
              f"rank(s) (from each epoch's step 2); train loss {first['loss']:.4f} -> "
              f"{last['loss']:.4f}, acc {100 * first['acc']:.1f}% -> {100 * last['acc']:.1f}%"
              + (f"; val acc {100 * last_val['acc']:.1f}%" if last_val else ""))
        if args.save_model:
            print(f"saved model.module.state_dict() to {args.save_model}")
        print(f"verified: {verified}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    m = parser.add_argument_group("model")
    m.add_argument("--arch", default="resnet18", choices=ARCHS, metavar="ARCH",
                   help="any torchvision classification model (default: %(default)s)")
    m.add_argument("--norm", choices=["batch", "group"], default="batch",
                   help="group: GroupNorm instead of BatchNorm, resnet family (default: batch)")
    m.add_argument("--sync-bn", action="store_true",
                   help="SyncBatchNorm: BatchNorm statistics over the global batch (GPUs only)")
    m.add_argument("--unused-layer", action="store_true",
                   help="add a layer forward never uses (see --find-unused-parameters)")
    g = parser.add_argument_group("data (default: synthetic images, made in memory)")
    g.add_argument("--data", type=Path, metavar="DIR",
                   help="an ImageFolder tree: DIR/train and DIR/val, a folder per class")
    for name, default, what in (("--train-size", 4096, "synthetic training images"),
                                ("--val-size", 1024, "synthetic validation images, 0: none"),
                                ("--num-classes", 10, "synthetic classes"),
                                ("--image-size", 32, "image side in pixels")):
        g.add_argument(name, type=nonnegative_int if name == "--val-size" else positive_int,
                       default=default, help=f"{what} (default: %(default)s)")
    g.add_argument("--workers", type=nonnegative_int,
                   help="DataLoader workers per process (default: auto, 0 on CPU, else up to 8)")
    t = parser.add_argument_group("training")
    t.add_argument("--epochs", type=positive_int, default=3, help="(default: %(default)s)")
    t.add_argument("--batch-size", type=positive_int, default=128,
                   help="images per micro-batch on each process (default: %(default)s)")
    t.add_argument("--accum-steps", type=positive_int, default=1,
                   help="micro-batches per optimizer step, under no_sync (default: %(default)s)")
    t.add_argument("--lr", type=positive_float, default=0.05,
                   help="peak of the one-cycle schedule (default: %(default)g)")
    t.add_argument("--weight-decay", type=float, default=5e-4, help="(default: %(default)g)")
    t.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                   help="autocast dtype; fp16 (with GradScaler) needs CUDA (default: none)")
    t.add_argument("--float64", action="store_true",
                   help="double precision: slow, but makes equivalence checks sharp")
    t.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    t.add_argument("--log-every", type=positive_int, default=10, metavar="STEPS",
                   help="a progress line every STEPS optimizer steps (default: %(default)s)")
    t.add_argument("--save-model", type=output_file, metavar="PATH",
                   help="rank 0 saves model.module.state_dict() there at the end")
    k = parser.add_argument_group("DDP knobs")
    k.add_argument("--bucket-cap-mb", type=positive_float, default=25.0,
                   help="larger: fewer all-reduces; smaller: earlier overlap (default: 25)")
    k.add_argument("--find-unused-parameters", action="store_true",
                   help="needed when some parameters get no gradient (a graph walk each step)")
    k.add_argument("--static-graph", action="store_true",
                   help="the set of used parameters never changes: DDP can plan ahead")
    k.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="gradients are views into the all-reduce buckets: saves memory, a copy")
    k.add_argument("--no-broadcast-buffers", action="store_true",
                   help="keep each rank's own buffers (BN stats), not rank 0's each forward")
    k.add_argument("--comm-hook", choices=["none", "fp16", "bf16", "powersgd"], default="none",
                   help="compress gradients before the all-reduce (default: none)")
    k.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                   help="torch.compile the model, with inductor unless BACKEND is given")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_launch_args(parser, args)
    gpu = torch.cuda.is_available() and args.backend != "gloo"
    if args.amp == "fp16" and not gpu:
        parser.error("--amp fp16 needs CUDA (float16 autocast with GradScaler); "
                     "on CPU use --amp bf16")
    if args.sync_bn and not gpu:
        parser.error("--sync-bn needs CUDA GPUs: SyncBatchNorm does not run on CPU with Gloo; "
                     "on CPU use --norm group for batch-independent normalisation")
    if args.compile and args.compile not in torch.compiler.list_backends(exclude_tags=()):
        parser.error(f"--compile {args.compile}: not a torch.compile backend (try inductor or "
                     f"aot_eager; torch.compiler.list_backends(exclude_tags=()) has them all)")
    cxx = os.environ.get("CXX", "g++")  # inductor builds its CPU kernels with it
    if args.compile == "inductor" and not gpu and not shutil.which(cxx):
        parser.error(f"--compile inductor on CPU needs a C++ compiler; {cxx} is not found")
    if args.sync_bn and args.norm == "group":
        parser.error("--sync-bn converts BatchNorm layers; --norm group has none")
    if args.data and not all((args.data / split).is_dir() for split in ("train", "val")):
        parser.error(f"--data {args.data}: expected folders {args.data}/train and "
                     f"{args.data}/val (one sub-folder per class)")
    if args.float64 and args.amp != "none":
        parser.error("--float64 and --amp pick opposite precisions; use one")
    args.amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)  # or None
    args.dtype = torch.float64 if args.float64 else torch.float32
    return args


# ==== shared plumbing: begin ==== the same in all six scripts (tests/test_repo.py checks) ====

class SetupError(RuntimeError):
    """The job cannot run as configured; the message says what to change."""


class CheckFailed(RuntimeError):
    """A property this script demonstrates did not hold."""


def check(ok: bool, name: str, detail: str) -> None:
    if not ok:
        raise CheckFailed(f"{name}: {detail}")


def bounded(cast, test, rule: str):
    """An argparse type: cast the text, refuse values outside the rule."""
    def parse(text: str):
        value = cast(text)
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    parse.__name__ = cast.__name__  # argparse says "invalid int value: 'x'"
    return parse


positive_int = bounded(int, lambda v: v >= 1, ">= 1")
nonnegative_int = bounded(int, lambda v: v >= 0, ">= 0")
positive_float = bounded(float, lambda v: v > 0, "> 0")


def output_file(text: str) -> Path:
    """An argparse type for a file this run writes: refused now, not after the work."""
    path = Path(text).absolute()
    folder = next(p for p in path.parents if p.exists())  # missing folders are created
    if path.is_dir() or not (folder.is_dir() and os.access(folder, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: " + ("it is a folder" if
                                         path.is_dir() else f"{folder} is not a writable folder"))
    return Path(text)


def write_atomic(path: Path, data: bytes) -> None:
    """Write the whole file or nothing: a temporary file, synced, then renamed over path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, never half
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("launch")
    g.add_argument("--spawn", nargs="?", type=positive_int, const=0, metavar="N",
                   help="start N processes with torch.multiprocessing.spawn; N left out: one "
                        "per GPU, else 2 (default: the launcher's processes, else one)")
    g.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: NCCL when a CUDA GPU is visible, else Gloo (default: auto)")
    g.add_argument("--timeout", type=positive_float, default=300.0, metavar="SECONDS",
                   help="give up on a missing peer or a stuck collective (default: %(default)g)")


def check_launch_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl needs a CUDA GPU and torch sees none; use --backend gloo")


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def launch(main, args: argparse.Namespace) -> None:
    """Run main(args) on every rank: under torchrun, with --spawn N, or as one process."""
    if args.spawn is not None:
        n = args.spawn or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
        # what torchrun would set, inherited by the children; the port is chosen once, here
        os.environ.update(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        try:
            mp.spawn(_spawned, args=(main, args), nprocs=n)
        except mp.ProcessExitedException as e:  # the child has printed its own reason
            sys.exit(f"error: spawned process {e.error_index} exited with code {e.exit_code}")
        return
    if "RANK" not in os.environ:  # no launcher: a world of one, through the same code path
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run_rank(main, args)


def _spawned(index: int, main, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index))  # mp.spawn passes the index
    run_rank(main, args)


def run_rank(main, args: argparse.Namespace) -> None:
    """Run main(args), then end the process: exit 0, or 1 with one line naming the rank
    (written in one call: ranks share a terminal, and print() writes text and newline apart)."""
    rank, code = os.environ.get("RANK", "?"), 1
    try:
        main(args)
        code = 0
    except KeyboardInterrupt:
        sys.stderr.write(f"[rank {rank}] interrupted\n")
    except Exception as e:  # every failure ends in a line naming the rank
        expected = describe_error(e)
        if expected is None:  # a bug, most likely in code pasted in: keep its traceback
            traceback.print_exc()
        label = "CHECK FAILED" if isinstance(e, CheckFailed) else "error"
        sys.stderr.write(f"[rank {rank}] {label}: {expected or f'{type(e).__name__}: {e}'}\n")
    if code == 0 and dist.is_initialized():  # never after a failure: with NCCL it would
        dist.destroy_process_group()  # wait for collectives that peers may never join
    atexit._run_exitfuncs()  # the program's exit hooks (a logger's finish, say) still run
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter shutdown: Gloo's threads outlive destroy_process_group once DDP has run,
    # and one releasing tensors while Python finalizes aborts the process ("terminate called
    # without an active exception", pytorch/pytorch#190489). Everything is written by now.
    os._exit(code)


def describe_error(e: Exception) -> str | None:
    """One line for an expected failure (ours, or the process group's); None for a bug."""
    text = str(e)
    lost = re.search(r"Connection (reset|closed) by peer|Broken pipe", text)
    if lost:  # what a surviving rank sees when another process dies in the middle of a job
        return (f"a peer process is gone (crashed or killed), so this collective cannot "
                f"finish; that process's own output says why ({text[:lost.end()]})")
    if isinstance(e, (SetupError, CheckFailed, dist.DistError)) or "third_party/gloo" in text:
        return text  # a usage problem, or the process group's own error (a timeout, say)
    return None


@dataclass
class Dist:
    """Who this process is in the job; setup() returns it."""
    rank: int
    local_rank: int  # its index on its own node: it picks the GPU
    world_size: int
    local_world_size: int
    node_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(backend: str, timeout: float, init_method: str = "env://") -> Dist:
    """Bind this process to its device, then join the process group."""
    env = lambda name, default: int(os.environ.get(name, default))
    rank, world = env("RANK", 0), env("WORLD_SIZE", 1)
    local_rank, local_world = env("LOCAL_RANK", rank), env("LOCAL_WORLD_SIZE", world)
    node_rank = env("GROUP_RANK", (rank - local_rank) // local_world)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        if local_world > gpus:
            raise SetupError(f"{local_world} processes on this node but only {gpus} GPU(s): "
                             f"start at most {gpus} per node (one process per GPU)")
        device = torch.device("cuda", local_rank)  # by LOCAL rank: GPU ids restart per node
        torch.cuda.set_device(device)  # before init, so nothing lands on GPU 0 by default
    else:  # Gloo: CPU tensors, and the cores shared among this node's processes
        device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        torch.set_num_threads(max(1, cores // local_world))
    try:
        kwargs = dict(init_method=init_method)
        if init_method != "env://":  # tcp:// and file:// name the meeting point only
            kwargs.update(rank=rank, world_size=world)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # under torchrun
            kwargs = dict(store=torchrun_store(rank, timeout), rank=rank, world_size=world)
        # device_id (NCCL): connect now, on this GPU; barriers and new_group use it too
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout),
                                device_id=device if backend == "nccl" else None, **kwargs)
    except (dist.DistError, RuntimeError, ValueError, OSError) as e:
        raise SetupError(explain_init_failure(str(e), init_method, world, timeout)) from e
    return Dist(rank, local_rank, world, local_world, node_rank, backend, device)


def torchrun_store(rank: int, timeout: float):
    """A fresh store per torchrun attempt: the agent's outlives restarts with the dead group's
    keys (pytorch/pytorch#135712), and restart counts differ by node (pytorch/pytorch#147064).
    Rank 0 (on MASTER_ADDR) posts its port; the others use it once it answers: a dead one won't."""
    host, limit = os.environ["MASTER_ADDR"], datetime.timedelta(seconds=timeout)
    agent = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=limit)
    if rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, timeout=limit)
        agent.set("ddp_by_example/store_port", str(store.port))
        return store
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        port = int(agent.get("ddp_by_example/store_port"))
        try:
            socket.create_connection((host, port), timeout=5).close()
            return dist.TCPStore(host, port, is_master=False, timeout=limit)
        except OSError:  # refused: still the previous attempt's port
            time.sleep(0.1)
    raise TimeoutError(f"rank 0 posted no live store within {timeout:g}s")


def explain_init_failure(message: str, init_method: str, world_size: int, timeout: float) -> str:
    where = init_method if init_method != "env://" else \
        f"env:// at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if "EADDRINUSE" in message or "address already in use" in message:
        return f"the rendezvous port is already in use ({where}); choose another port"
    joined = re.search(r"(\d+)/(\d+) clients joined", message)
    if joined or re.search(r"timeout|timed out", message, re.I):
        count = f"only {joined[1]} of {joined[2]}" if joined else f"not all {world_size}"
        return (f"{count} ranks joined within {timeout:g}s ({where}); start the missing "
                f"ranks or lower the world size")
    return f"init_process_group failed ({where}): {message}"
# ==== shared plumbing: end =================================================================


if __name__ == "__main__":
    launch(main, parse_args())
