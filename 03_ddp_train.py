r"""03_ddp_train.py: train a torchvision classifier with DistributedDataParallel.

Run
  torchrun --standalone --nproc_per_node 2 03_ddp_train.py        # 2 processes (GPUs or CPU)
  python 03_ddp_train.py --spawn 2                                 # the same via mp.spawn
  python 03_ddp_train.py                                           # one process
  python 03_ddp_train.py --data /data/imagenette --arch resnet50 --image-size 224 --amp bf16
  # two nodes, 4 GPUs each: run on both machines
  torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 03_ddp_train.py --epochs 10

The main job. Every process holds a replica of the model and trains on its own shard of
each global batch; DDP averages the gradients during backward, so the replicas stay equal
and N processes with batch b train exactly like one process with batch N*b (checked: every
rank ends with identical parameters and buffers). Global batch = world size x --batch-size
x --accum-steps; --lr is used as given: to train the same, keep the global batch.
Your own model and data: replace build_model() and build_datasets(); nothing else depends
on their shapes. torch.compile: call model.compile() in main, before DDP(model); the
first step waits for the slowest rank's compile, so give --timeout room for it. Needs
torch >= 2.4; for torchrun --max-restarts, copy 04_checkpoint.py's attempt_store().
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import hashlib
import io
import math
import os
import re
import socket
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

# setup(), launch(), check() and SetupError are the shared plumbing at the bottom of this file.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --amp none: no autocast


def main(args: argparse.Namespace) -> None:
    d = setup(args.timeout)
    train_set, val_set, num_classes = build_datasets(args)
    train_loader, sampler, val_loader = make_loaders(args, d, train_set, val_set)
    steps = len(train_loader) // args.accum_steps * args.epochs  # optimizer steps in all
    if steps == 0:  # full batches only: a last batch of one image would fail in BatchNorm
        raise SetupError(f"each rank's {len(sampler)} image(s) make {len(train_loader)} full "
                         f"batch(es) of {args.batch_size}; a step takes {args.accum_steps}")
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts too)
    model = build_model(args, num_classes).to(d.device, args.dtype)
    ddp_model = DDP(model,
        device_ids=[d.device] if d.device.type == "cuda" else None,  # CPU: None
        bucket_cap_mb=args.bucket_cap_mb,     # gradients all-reduce in buckets of this size
        find_unused_parameters=args.find_unused_parameters,  # only if some params get no grad
        static_graph=args.static_graph,       # same graph every step: DDP can plan ahead
        gradient_as_bucket_view=args.gradient_as_bucket_view)  # grads live in the buckets
    torch.manual_seed(args.seed + d.rank)  # but each rank its own dropout masks
    # fused (GPUs): one kernel per step, and fp16's GradScaler.step then needs no .item() sync
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=args.weight_decay, fused=d.device.type == "cuda")
    opt = Optim(optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, steps),
                torch.amp.GradScaler(d.device.type, enabled=args.amp == "fp16"))
    if d.is_main:
        print(f"training {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} "
              f"params, {num_classes} classes) on {d.world_size} x {d.device.type} "
              f"({dist.get_backend()}); {len(train_set)} train / {len(val_set)} val images; "
              f"global batch {d.world_size * args.batch_size * args.accum_steps} = "
              f"{d.world_size} ranks x {args.batch_size} x {args.accum_steps} accum; {steps} steps")
    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # same seed + epoch on every rank: a new shared permutation
        train = train_one_epoch(ddp_model, train_loader, opt, args, d, epoch)
        # rank 0's BatchNorm statistics on every rank: all evaluate the model rank 0 saves
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        val = evaluate(model, val_loader, d, args) if len(val_set) else None
        history.append((train, val))
        if d.is_main:
            print(f"epoch {epoch + 1} done: train loss {train['loss']:.4f} acc "
                  f"{100 * train['acc']:.1f}%" + (f" | val loss {val['loss']:.4f} acc "
                  f"{100 * val['acc']:.1f}% on {val['n']} images" if val else ""), flush=True)

    # ---- after training: the replica check, the saved model, the summary ----
    verified = verify_replicas_identical(model, d)
    if args.save_model:
        if d.is_main:
            save_atomic(model.state_dict(), args.save_model)  # raw module: no "module." keys
        dist.barrier()  # nobody exits (or reads the file) before rank 0 has written it
    if d.is_main:
        (first, _), (last, last_val) = history[0], history[-1]
        images, seconds = (sum(t[key] for t, _ in history) for key in ("images", "seconds"))
        speed = f"{images / seconds:.1f} img/s" if images else "n/a"  # step 1 is not timed
        print(f"summary: {steps} steps, {speed} on {d.world_size} rank(s) (from each "
              f"epoch's step 2); train loss {first['loss']:.4f} -> {last['loss']:.4f}, acc "
              f"{100 * first['acc']:.1f}% -> {100 * last['acc']:.1f}%"
              + (f"; val acc {100 * last_val['acc']:.1f}%" if last_val else ""))
        print(f"verified: {verified}" + (f"; rank 0 saved them to {args.save_model}" if
                                          args.save_model else ""), flush=True)


# ---- your data: any Dataset of (image, label); replace build_datasets() ------------------
def build_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset, int]:
    """The training set, the validation set and the number of classes."""
    if not args.data:
        shape = (args.num_classes, args.image_size, args.seed)
        return (SyntheticImages(args.train_size, *shape, train=True),
                SyntheticImages(args.val_size, *shape, train=False), args.num_classes)
    T = torchvision.transforms
    # Random transforms draw from each DataLoader worker's RNG, which differs per rank.
    norm = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(),
                       T.ToTensor(), norm])
    val = T.Compose([T.Resize(round(args.image_size * 256 / 224)),
                     T.CenterCrop(args.image_size), T.ToTensor(), norm])
    try:
        train_set = torchvision.datasets.ImageFolder(args.data / "train", train)
        val_set = torchvision.datasets.ImageFolder(args.data / "val", val)
    except (FileNotFoundError, RuntimeError) as e:  # no class folders, or no images in them
        raise SetupError(f"--data {args.data}: {e}") from e
    if val_set.classes != train_set.classes:  # each split numbers its own folders' classes
        raise SetupError(f"--data {args.data}: val's classes {val_set.classes} differ from "
                         f"train's {train_set.classes}; their labels would not match")
    return train_set, val_set, len(train_set.classes)


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


def make_loaders(args: argparse.Namespace, d: Dist, train_set: Dataset, val_set: Dataset):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    auto = 0 if d.device.type == "cpu" else min(8, cores // int(os.environ["LOCAL_WORLD_SIZE"]))
    workers = auto if args.workers is None else args.workers  # CPU: the cores train, not workers
    common = dict(batch_size=args.batch_size, num_workers=workers,
                  persistent_workers=workers > 0,        # keep workers alive across epochs
                  pin_memory=d.device.type == "cuda")    # page-locked: async copies to the GPU
    sampler = DistributedSampler(train_set, num_replicas=d.world_size, rank=d.rank,
                                 shuffle=True, seed=args.seed)
    # Validation: rank r takes samples r, r+W, r+2W, ... with no padding, so each counts once
    # (DistributedSampler would pad with repeats; 05_eval_gather.py shows what that costs).
    val_shard = Subset(val_set, range(d.rank, len(val_set), d.world_size))
    # drop_last: full batches only (a batch of one image fails BatchNorm in training)
    return DataLoader(train_set, sampler=sampler, drop_last=True, **common), sampler, \
        DataLoader(val_shard, **common)


# ---- your model: any nn.Module; replace build_model() ------------------------------------
def build_model(args: argparse.Namespace, num_classes: int) -> nn.Module:
    kwargs = {"num_classes": num_classes}
    if args.norm == "group":
        # GroupNorm has no batch statistics: the same model however the batch is split
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(math.gcd(32, channels), channels)
    try:
        model = torchvision.models.get_model(args.arch, **kwargs)
    except TypeError as e:
        raise SetupError(f"--norm group needs an architecture with a norm_layer argument "
                         f"(resnet*, resnext*, wide_resnet*); {args.arch} has none") from e
    try:  # one image through it (eval: no statistics change), so a mismatch is named here
        model.eval()(torch.zeros(1, 3, args.image_size, args.image_size))
    except (AssertionError, RuntimeError, ValueError) as e:  # vit_b_16 at 16 px, say
        raise SetupError(f"--arch {args.arch} cannot take {args.image_size} px images: {e}") from e
    if args.sync_bn:  # BatchNorm statistics over the global batch, not each rank's shard
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.unused_layer:  # forward never calls it, so its parameters never get a gradient
        model.unused_layer = nn.Linear(8, 8)
    return model


class Optim(NamedTuple):  # the optimizer and what steps with it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # its last_epoch: the steps taken so far
    scaler: torch.amp.GradScaler  # disabled (a no-op) unless --amp fp16


def train_one_epoch(model: DDP, loader, opt: Optim, args, d: Dist, epoch: int) -> dict:
    model.train()
    micro_batches = len(loader) // args.accum_steps * args.accum_steps  # whole groups only
    amp = AMP_DTYPES.get(args.amp)
    sums = torch.zeros(3, dtype=torch.float64, device=d.device)  # loss sum, correct, count
    timed_images, started = 0, None
    for i, (images, labels) in enumerate(loader):
        if i == micro_batches:
            break
        images = images.to(d.device, dtype=args.dtype, non_blocking=True)
        labels = labels.to(d.device, non_blocking=True)
        step = (i + 1) % args.accum_steps == 0
        # no_sync: micro-batches 1..K-1 accumulate locally, the K-th backward all-reduces the
        # sum. static_graph's first backward must sync (#143580): exact, the K-th keeps it.
        sync = step or (args.static_graph and opt.scheduler.last_epoch == 0 and i == 0)
        with nullcontext() if sync else model.no_sync():
            with torch.autocast(d.device.type, dtype=amp, enabled=amp is not None):
                logits = model(images)
                loss = F.cross_entropy(logits, labels)  # the mean over this rank's batch
            opt.scaler.scale(loss / args.accum_steps).backward()
        with torch.no_grad():  # running sums stay on the device: no wait for the GPU here
            sums += torch.stack([loss.detach().double() * len(labels),
                                 (logits.argmax(1) == labels).sum(), sums.new_tensor(len(labels))])
        timed_images += len(labels) if started else 0
        if not step:
            continue
        opt.scaler.step(opt.optimizer)  # optimizer.step(), skipped if fp16 overflowed
        opt.scaler.update()
        opt.optimizer.zero_grad(set_to_none=True)
        opt.scheduler.step()
        if started is None:  # time from the end of step 1: it pays one-off costs
            started = clock(d)
        if opt.scheduler.last_epoch % args.log_every == 0:
            so_far = sums.clone()
            dist.all_reduce(so_far)  # every rank, at the same steps: the epoch so far, all ranks
            loss_sum, correct, count = so_far.tolist()
            if not math.isfinite(loss_sum):  # all-reduced: every rank stops here together
                raise SetupError(f"loss is not finite at step {opt.scheduler.last_epoch}; "
                                 f"lower --lr")
            if d.is_main:
                print(f"epoch {epoch + 1}/{args.epochs}  step {opt.scheduler.last_epoch:>5}/"
                      f"{opt.scheduler.total_steps}  loss {loss_sum / count:.4f}  "
                      f"acc {100 * correct / count:5.1f}%  "
                      f"lr {opt.scheduler.get_last_lr()[0]:.4f}", flush=True)
    dist.all_reduce(sums)  # the whole epoch, over every rank's batches
    loss_sum, correct, count = sums.tolist()
    if not math.isfinite(loss_sum):  # checked before anything is evaluated or saved
        raise SetupError(f"loss is not finite at step {opt.scheduler.last_epoch}; lower --lr")
    return {"loss": loss_sum / max(count, 1), "acc": correct / max(count, 1),
            "images": timed_images * d.world_size, "seconds": clock(d) - started if started else 0}


def clock(d: Dist) -> float:
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)  # GPU work is queued: time what has finished
    return time.perf_counter()


@torch.no_grad()
def evaluate(model: nn.Module, loader, d: Dist, args: argparse.Namespace) -> dict:
    # The raw module, not DDP: no gradient sync is wanted, and ranks' batch counts may differ.
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=d.device)
    for images, labels in loader:
        images = images.to(d.device, dtype=args.dtype, non_blocking=True)
        labels = labels.to(d.device, non_blocking=True)
        logits = model(images)
        sums += torch.stack([F.cross_entropy(logits.double(), labels, reduction="sum"),
                             (logits.argmax(1) == labels).sum(), sums.new_tensor(len(labels))])
    dist.all_reduce(sums)  # every rank calls this once, whatever its number of batches
    loss_sum, correct, count = sums.tolist()
    return {"loss": loss_sum / max(count, 1), "acc": correct / max(count, 1), "n": int(count)}


def verify_replicas_identical(model: nn.Module, d: Dist) -> str:
    """Every rank holds the same parameters and buffers: their sha256, compared across ranks."""
    flat = torch.cat([t.detach().reshape(-1).double().cpu() for t in model.state_dict().values()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    digests = [None] * d.world_size
    dist.all_gather_object(digests, digest)
    check(len(set(digests)) == 1, "identical replicas",
          f"ranks hold different parameters or buffers: sha256 {[h[:12] for h in digests]}")
    return (f"{d.world_size} rank(s) hold identical parameters and buffers "
            f"({flat.numel():,} values, sha256 {digest[:16]})")


def save_atomic(state: dict, path: Path) -> None:
    """torch.save, whole or not at all: into memory, a temporary file, then renamed over path."""
    buffer = io.BytesIO()
    torch.save(state, buffer)  # writing a file, torch would fail with a RuntimeError, no reason
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(buffer.getvalue())
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    except OSError as e:  # a full disk, say: name the file, not a traceback
        tmp.unlink(missing_ok=True)
        raise SetupError(f"cannot write {path}: {e.strerror or e}") from e


def build_parser() -> argparse.ArgumentParser:
    run = re.search(r"Run\n.*?(?:\n\n|$)", __doc__, re.S)[0]  # --help ends with the Run block
    parser = argparse.ArgumentParser(description=__doc__.replace(run, ""), epilog=run,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    m = parser.add_argument_group("model")
    m.add_argument("--arch", default="resnet18", metavar="ARCH",
                   choices=sorted(torchvision.models.list_models(module=torchvision.models)),
                   help="any torchvision classification model (default: %(default)s)")
    m.add_argument("--norm", choices=["batch", "group"], default="batch",
                   help="group: GroupNorm instead of BatchNorm, resnet family (default: batch)")
    m.add_argument("--sync-bn", action="store_true", help="BatchNorm over the global batch (GPUs)")
    m.add_argument("--unused-layer", action="store_true", help="a layer forward never calls")
    g = parser.add_argument_group("data (default: synthetic images, made in memory)")
    g.add_argument("--data", type=Path, metavar="DIR",
                   help="an ImageFolder tree: DIR/train and DIR/val, a folder per class")
    for name, default, what in (("--train-size", 4096, "synthetic training images"),
                                ("--val-size", 1024, "synthetic validation images, 0: none"),
                                ("--num-classes", 10, "synthetic classes"),
                                ("--image-size", 32, "image side in pixels")):
        g.add_argument(name, type=int, default=default, help=f"{what} (default: %(default)s)")
    g.add_argument("--workers", type=int, help="DataLoader workers per process "
                   "(default: auto, 0 on CPU, else up to 8)")
    t = parser.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=3, help="passes over the data (default: 3)")
    t.add_argument("--batch-size", type=int, default=128,
                   help="images per micro-batch on each process (default: %(default)s)")
    t.add_argument("--accum-steps", type=int, default=1,
                   help="micro-batches per optimizer step, under no_sync (default: %(default)s)")
    t.add_argument("--lr", type=float, default=0.05, help="one-cycle peak (default: %(default)g)")
    t.add_argument("--weight-decay", type=float, default=5e-4, help="SGD's (default: 5e-4)")
    t.add_argument("--amp", choices=["none", *AMP_DTYPES], default="none",
                   help="autocast dtype; fp16 (with GradScaler) needs CUDA (default: none)")
    t.add_argument("--float64", action="store_true", help="for sharp equivalence checks (slow)")
    t.add_argument("--seed", type=int, default=0, help="seeds weights and data (default: 0)")
    t.add_argument("--log-every", type=int, default=10, metavar="STEPS",
                   help="a progress line every STEPS optimizer steps (default: %(default)s)")
    t.add_argument("--save-model", type=output_file, metavar="PATH",
                   help="rank 0 saves model.module.state_dict() there at the end")
    k = parser.add_argument_group("DDP knobs")
    k.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="larger: fewer all-reduces; smaller: earlier overlap (default: 25)")
    k.add_argument("--find-unused-parameters", action="store_true",
                   help="needed when some parameters get no gradient (a graph walk each step)")
    k.add_argument("--static-graph", action="store_true",
                   help="the set of used parameters never changes: DDP can plan ahead")
    k.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="gradients are views into the all-reduce buckets: saves memory, a copy")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_launch_args(parser, args)
    lowest = dict(train_size=1, val_size=0, num_classes=2, image_size=1, workers=0, epochs=1,
                  batch_size=1, accum_steps=1, log_every=1, seed=0)  # (one class: always right)
    for name, low in lowest.items():  # and below 2**32: a seed past 2**64 overflows torch's
        value = getattr(args, name)
        if value is not None and not low <= value < 2**32:
            parser.error(f"--{name.replace('_', '-')}: must be >= {low} and < 2**32, got {value}")
    if not (args.lr > 0 and args.bucket_cap_mb > 0):  # not nan either
        parser.error(f"--lr, --bucket-cap-mb: must be > 0, got {args.lr:g}, {args.bucket_cap_mb:g}")
    if args.amp == "fp16" and not torch.cuda.is_available():
        parser.error("--amp fp16 needs CUDA (float16 autocast, GradScaler); on CPU use bf16")
    if args.sync_bn and not torch.cuda.is_available():
        parser.error("--sync-bn needs CUDA: SyncBatchNorm does not run on Gloo; try --norm group")
    if args.data and not all((args.data / split).is_dir() for split in ("train", "val")):
        parser.error(f"--data {args.data}: expected folders {args.data}/train and "
                     f"{args.data}/val, one sub-folder per class")
    if args.float64 and args.amp != "none":
        parser.error("--float64 and --amp pick opposite precisions; use one")
    args.dtype = torch.float64 if args.float64 else torch.float32
    return args


def output_file(text: str) -> Path:
    """An argparse type for a file this run writes: tried now (folder made, file created)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: it is a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        why = "not a folder" if isinstance(e, FileExistsError) else e.strerror
        raise argparse.ArgumentTypeError(f"cannot write {text}: {e.filename}: {why}") from None
    return path


# ==== shared plumbing: begin ==== the same in all six scripts; 01_init_methods.py explains it


class SetupError(RuntimeError): ...  # the job cannot run as configured: the message says why


class CheckFailed(RuntimeError): ...  # a property this script demonstrates did not hold


def check(ok: bool, name: str, detail: str) -> None:
    if not ok:
        raise CheckFailed(f"{name}: {detail}")


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("launch (NCCL when CUDA GPUs are visible, else Gloo)")
    g.add_argument("--spawn", nargs="?", type=int, const=0, metavar="N",
                   help="start N processes with mp.spawn; N left out or 0: one per GPU, else 2")
    g.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="wait for a peer or a collective, at most 1e6 (default: %(default)g)")


def check_launch_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 4):  # oldest tested
        parser.error(f"needs torch >= 2.4; torch {torch.__version__} is installed")
    if args.spawn is not None and (args.spawn < 0 or "RANK" in os.environ):
        parser.error("--spawn N needs N >= 0 and no launcher (under torchrun, drop --spawn)")
    if not 0 < args.timeout <= 1e6:
        parser.error(f"--timeout: must be > 0 and <= 1e6 seconds, got {args.timeout:g}")


def launch(main, args: argparse.Namespace) -> None:
    """Run main(args) on every rank: under torchrun, with --spawn N, or as one process."""
    if args.spawn is None and "RANK" in os.environ:  # a launcher started this process
        run_rank(None, main, args)
    n = 1 if args.spawn is None else args.spawn or torch.cuda.device_count() or 2
    with socket.create_server(("127.0.0.1", 0)) as s:  # a free port, for a job started here
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]),
                          WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))  # as torchrun sets them
    if args.spawn is None:  # no launcher: a world of one, through the same code path
        run_rank(0, main, args)
    try:
        mp.spawn(run_rank, args=(main, args), nprocs=n)  # run_rank(i, main, args), i < n
    except mp.ProcessExitedException as e:  # that rank has printed its own reason
        sys.exit(f"error: spawned process {e.error_index} exited with code {e.exit_code}")
    except KeyboardInterrupt:  # Ctrl-C reached every rank too, and each has said so
        sys.exit(1)


def run_rank(index: int | None, main, args: argparse.Namespace) -> None:
    """Run main(args), then end the process: exit 0, or 1 after one line naming the rank."""
    if index is not None:  # under --spawn: mp.spawn passes the index
        os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    rank, code = os.environ["RANK"], 1
    try:
        main(args)
        code = 0
    except KeyboardInterrupt:
        sys.stderr.write(f"[rank {rank}] interrupted\n")
    except Exception as e:  # expected: ours, or the process group's (a timeout, a lost peer)
        expected = isinstance(e, (SetupError, CheckFailed, dist.DistError)) or \
            re.search(r"third_party/gloo|pair closure|by peer", str(e))
        if not expected:  # a bug, most likely in code pasted in: keep its traceback
            traceback.print_exc()
        tag = "CHECK FAILED" if isinstance(e, CheckFailed) else "error"  # one write: ranks
        sys.stderr.write(f"[rank {rank}] {tag}: {'' if expected else type(e).__name__ + ': '}{e}\n")
    atexit._run_exitfuncs(), sys.stdout.flush(), sys.stderr.flush()  # exit hooks (a logger's)
    os._exit(code)  # no interpreter shutdown (Gloo aborts it, #190489), no destroy: NOTES.md


class Dist(NamedTuple):  # who this process is in the job; setup() returns it
    rank: int
    world_size: int
    device: torch.device
    is_main: bool  # rank 0: it prints and saves


def setup(timeout: float, backend: str = "auto", init_method: str = "env://", store=None) -> Dist:
    """Check the launcher's variables, bind this process to its device, join the group."""
    env = [os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")]
    rank, world, local_rank, local_world = (int(v) if v.isdigit() else -1 for v in env)
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise SetupError(f"RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE are {env}: a launcher "
                         f"sets whole numbers, each rank below its size, the node's <= the world's")
    if backend == "nccl" or backend == "auto" and torch.cuda.is_available():
        if (gpus := torch.cuda.device_count()) != 1 and local_world > gpus:  # 1: its own
            raise SetupError(f"{local_world} processes here, {gpus} GPU(s): NCCL needs a GPU each")
        device = torch.device("cuda", local_rank if gpus > 1 else 0)  # ids restart per node
        torch.cuda.set_device(device)  # before init, so nothing lands on GPU 0 by default
    else:  # Gloo: CPU tensors, and the node's cores shared among its processes
        device = torch.device("cpu")
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else [0]
        torch.set_num_threads(max(1, len(cores) // local_world))
    where = init_method if init_method != "env://" else \
        f"env:// at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    address = re.fullmatch(r"(?:env:// at |tcp://)(.+):(\d+)", where)  # rank 0's TCP store
    deadline = time.monotonic() + timeout  # one deadline, where torch's own client would retry
    while address and not store:  # after a random delay: up to twice the timeout (TCPStore.cpp)
        try:  # the host must resolve; every other rank waits until rank 0 listens there
            socket.create_connection(address.groups(), 5).close() if rank else \
                socket.getaddrinfo(*address.groups())
            break
        except socket.gaierror as e:
            raise SetupError(f"cannot resolve the host of {where}: {e.strerror}") from e
        except OSError:
            if time.monotonic() > deadline:
                raise SetupError(f"rank 0 is not listening at {where} after {timeout:g}s") from None
            time.sleep(0.1)
    try:  # device_id (NCCL): connect now, on this GPU; barriers and new_group use it too
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout),
                                store=store, init_method=None if store else init_method,
                                device_id=device if device.type == "cuda" else None)
    except (dist.DistError, RuntimeError, ValueError, OSError) as e:
        late = re.match(r"(?is)(?=.*?(\d+)/\d+ clients joined)|(?=.*?timeout|.*?timed out)", str(e))
        raise SetupError(f"{f'only {late[1]}' if late[1] else 'not all'} of {world} ranks joined "
                         f"within {timeout:g}s ({where}); start the missing ones" if late else
                         f"cannot join the process group at {where}: {e}") from e
    return Dist(rank, world, device, rank == 0)
# ==== shared plumbing: end =================================================================


if __name__ == "__main__":
    launch(main, parse_args())
