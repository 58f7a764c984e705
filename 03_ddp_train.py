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
(checked at the end: every rank holds the same parameters) and N processes with batch b
take the steps one process with batch N*b would. Exactly so where nothing depends on how
the batch is split: BatchNorm normalises each rank's shard (--norm group does not), and
each rank draws its own dropout masks; the tests check the equivalence to 1e-9 with
--norm group in float64. Global batch = world size x --batch-size x --accum-steps; --lr is
used as given: to train the same, keep the global batch.
Your own model and data: replace build_model() and build_datasets(); nothing else depends
on their shapes. torch.compile: add model.compile() where main() marks it, before
DDP(model): compiled in place, the model keeps its state_dict's keys (torch.compile(model)
would add "_orig_mod."); the first step waits for the slowest rank's compile, so give
--timeout room for it. --metrics PATH: rank 0 appends a JSON line per progress line and
per epoch; plot_metrics.py draws the learning curve. A progress line ends with the rank that
held up the others, if one did (slowest_rank). Needs torch >= 2.4. A job that must
survive restarts and preemption: 04_checkpoint.py is this file plus checkpoints.
"""

import argparse
import atexit
import concurrent.futures
import contextlib
import datetime
import faulthandler
import hashlib
import io
import json
import math
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import PIL.Image
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset
from torchvision.datasets.folder import IMG_EXTENSIONS, ImageFolder

# The shared plumbing is at the bottom of this file, the same in all six scripts (01 explains
# it): setup() reads the launcher's RANK, WORLD_SIZE and LOCAL_RANK, binds this process's
# device, joins the process group and returns d (rank, world_size, device); launch() starts
# the ranks, and run_rank() ends each with one line (so no destroy_process_group: NOTES.md
# says why); check() and SetupError fail loudly. Read it last, or not at all.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --amp's choices


def main(args):
    d = setup(args.timeout)
    cuda = d.device.type == "cuda"
    # GPUs: cuDNN times its algorithms once per input shape and keeps the fastest; training's
    # shapes never change (drop_last). 04 leaves it off: a bitwise resume needs the same
    # algorithms as the run it resumes.
    torch.backends.cudnn.benchmark = cuda
    train_set, val_set, num_classes = build_datasets(args)
    train_loader, val_loader = make_loaders(args, d, train_set, val_set)
    steps_per_epoch = len(train_loader) // args.accum_steps
    if not steps_per_epoch:  # too few images for one step on each rank
        raise SetupError(
            f"each rank has {len(train_loader)} full batch(es) of {args.batch_size} images; "
            f"a step takes {args.accum_steps}"
        )
    # the same initial weights on every rank, and in a one-process run (DDP would copy
    # rank 0's to the others anyway)
    torch.manual_seed(0)
    model = build_model(args, num_classes).to(d.device, args.dtype)
    # torch.compile: model.compile() here, before DDP (the docstring says why)
    ddp_model = DDP(
        model,
        device_ids=[d.device] if cuda else None,  # CPU: None
        # DDP's knobs, not passed here (so at their defaults); to change one, pass it as
        # shown (the tests train with every two of them set together):
        # bucket_cap_mb=25: gradients are all-reduced in buckets of about this many MB, each
        #   as soon as backward has filled it (overlapping communication with computation);
        # find_unused_parameters=True: some parameters may get no gradient in a step (DDP
        #   would wait for them: an error at the next step, which names this argument);
        # static_graph=True: every step uses the same parameters, so DDP can plan ahead;
        # gradient_as_bucket_view=True: the gradients live in the buckets, saving a copy
    )
    # By default DDP overwrites every rank's buffers (BatchNorm's running statistics) with
    # rank 0's at each forward: a collective per step. Off here; the epoch loop copies
    # rank 0's once an epoch, before validation. (An attribute: torch 2.15 deprecates
    # DDP(..., broadcast_buffers=False) for forward_sync_buffers=, which torch 2.4 lacks.)
    ddp_model.broadcast_buffers = False
    torch.manual_seed(d.rank)  # but each rank draws its own dropout masks
    # SGD with momentum; OneCycleLR (below) cycles the momentum between 0.85 and 0.95
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=5e-4)
    total_steps = steps_per_epoch * args.epochs
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps)
    scaler = torch.amp.GradScaler(d.device.type, enabled=args.amp == "fp16")
    state = TrainState(model, optimizer, scheduler, scaler)
    if d.rank == 0:
        say(f"{args.arch} on {d.world_size} x {d.device.type} ({dist.get_backend()})")
        say(f"{len(train_set)} train / {len(val_set)} val images, {num_classes} classes")
        say(f"{total_steps} steps of {args.batch_size} images x {args.accum_steps} accum per rank")
    losses = []
    while state.epoch < args.epochs:
        train_loader.sampler.set_epoch(state.epoch)  # same seed + epoch on every rank: one order
        # and new augmentations: SeededAugmentation draws each image's from (epoch, index)
        train_loader.dataset.epoch = state.epoch
        loss, acc, speed = train_one_epoch(ddp_model, train_loader, state, args, d)
        losses.append(loss)
        # Each rank's BatchNorm statistics followed its own shard (broadcast_buffers off,
        # above): rank 0's are copied to every rank now, so that all evaluate the model
        # rank 0 saves.
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        val_loss, val_acc, val_count = evaluate(
            model, val_loader, args, d, f"step {state.step}, evaluation"
        )
        if d.rank == 0:
            say(f"epoch {state.epoch + 1} done: train loss {loss:.4f} acc {acc:.1%}")
            say(f"  val loss {val_loss:.4f} acc {val_acc:.1%} on {val_count:.0f} images")
            log_metrics(args, state, val_loss=val_loss, val_acc=val_acc, img_s=speed)
        state.epoch += 1

    # ---- after training: the replica check, the saved model, the summary ----------------
    verified = verify_replicas_identical(model, d)
    # rank 0 saves the plain model (keys without "module."); every rank hears if that failed
    if args.save_model:
        rank0_writes(args.save_model, lambda f: torch.save(model.state_dict(), f), d)
    if d.rank == 0:
        # the last epoch's speed: the first pays one-off costs (compiling, cuDNN's timing)
        say(f"summary: {state.step} steps, {speed:.1f} img/s (the last epoch's)")
        say(f"train loss {losses[0]:.4f} -> {loss:.4f}")
        say(f"verified: {verified}")


# ---- your data: any Dataset of (image, label); replace build_datasets() ------------------
def build_datasets(args):
    """The training set, the validation set and the number of classes."""
    if not args.data:  # synthetic images of 10 classes, made in memory
        train_set = synthetic_images(args.train_size, args.image_size, split=0)
        val_set = synthetic_images(args.val_size, args.image_size, split=1)
        return train_set, val_set, 10
    T = torchvision.transforms
    size = args.image_size
    # torchvision's ImageNet recipe: random crops and flips to train (each image's drawn from
    # its own seed: SeededAugmentation, below), a centre crop to validate
    # (pretrained weights would also want ImageNet's mean and std: T.Normalize(...))
    # Small images (digits, 32 px icons): crops down to 8% of the image lose what it shows,
    # and flips change a digit; use RandomResizedCrop(size, scale=(0.6, 1)), no flip (NOTES.md)
    augment = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor()])
    centre = T.Compose([T.Resize(size * 8 // 7), T.CenterCrop(size), T.ToTensor()])  # 224 of 256
    train_set = image_folder(args.data / "train", augment)
    val_set = image_folder(args.data / "val", centre)
    # each split numbers its own folders' classes: a class missing from one shifts the labels
    if train_set.classes != val_set.classes:
        raise SetupError(f"--data {args.data}: train and val hold different class folders")
    return train_set, val_set, len(train_set.classes)


def synthetic_images(count, size, split):
    """Learnable and deterministic: class c is a fixed random 8x8 colour pattern, upsampled,
    plus noise; split 0 (train) and 1 (val) draw different images of the same classes."""
    g = torch.Generator().manual_seed(0)
    patterns = F.interpolate(torch.randn(10, 3, 8, 8, generator=g), size=size, mode="bilinear")
    g.manual_seed(1 + split)
    labels = torch.randint(10, (count,), generator=g)
    noise = torch.randn(count, 3, size, size, generator=g)
    return TensorDataset(patterns[labels] + 1.5 * noise, labels)


def image_folder(root, transform):
    """torchvision's ImageFolder (root/CLASS/IMAGE), without hidden files (macOS's ._x.png
    are not images) or hidden folders (file browsers' .thumbnails/ are not training data).
    03, 04 and 05 read --data with it."""

    def is_image(path):
        inside = os.path.relpath(path, root)  # CLASS/IMAGE, or deeper
        return inside.lower().endswith(IMG_EXTENSIONS) and "/." not in f"/{inside}"

    try:
        return ImageFolder(root, transform, loader=load_image, is_valid_file=is_image)
    except (FileNotFoundError, RuntimeError) as e:  # no class folders, or no images in them
        raise SetupError(f"--data {root}: {e}") from e  # names the split


def load_image(path):
    """The image at path in RGB, or a SetupError naming the file. (16-bit greyscale, common in
    scientific and medical imaging, saturates in RGB: NOTES.md says how to scale it.)"""
    try:
        return PIL.Image.open(path).convert("RGB")
    # truncated, not an image at all, or a decompression bomb: a header claiming more than
    # twice PIL.Image.MAX_IMAGE_PIXELS (about 179 megapixels), refused before decoding
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as e:
        raise SetupError(f"cannot read image {path}: {e}") from None


def make_loaders(args, d, train_set, val_set):
    """This rank's training loader (its DistributedSampler's shard) and validation loader."""
    # --workers left out: on CPU none (the cores train), on GPUs this process's share of the
    # cores (setup() gave torch's threads that share), up to 8
    cuda = d.device.type == "cuda"
    workers = args.workers
    if workers is None:
        workers = min(8, torch.get_num_threads()) if cuda else 0
    train_loader = DataLoader(
        SeededAugmentation(train_set),
        args.batch_size,
        # this rank's shard (world size and rank from the process group); shuffled: each
        # epoch a new order, the same on every rank (seed + epoch)
        sampler=DistributedSampler(train_set),
        num_workers=workers,
        pin_memory=cuda,  # page-locked: copies to the GPU run async
        drop_last=True,  # full batches only: one image fails BatchNorm where a layer sees 1x1
    )
    # Validation: rank r takes samples r, r+W, r+2W, ... with no padding, so each counts once
    # (DistributedSampler would pad with repeats; 05_eval_gather.py shows what that costs).
    val_shard = Subset(val_set, range(d.rank, len(val_set), d.world_size))
    val_loader = DataLoader(val_shard, args.batch_size, num_workers=workers, pin_memory=cuda)
    return train_loader, val_loader


@dataclass
class SeededAugmentation(Dataset):
    """The training set, each sample's random augmentation drawn from a seed of its own (from
    the epoch and the sample's index) instead of the random stream of whichever process loads
    it (a DataLoader worker's differs by rank and by worker). So N processes train on exactly
    what one would, and a resumed run (04_checkpoint.py) on what the interrupted one would
    have. Transforms that draw from torch's global RNG (torchvision's do) are covered."""

    dataset: Dataset
    # set before each iter(loader), which starts the workers with a copy of this object
    # (persistent_workers would keep epoch 0's)
    epoch: int = 0

    def __getitem__(self, index):
        with torch.random.fork_rng(devices=[]):  # this process's own stream is left as it was
            # one seed per (epoch, image), for the CPU's generator alone: torch.manual_seed
            # would reseed the GPU's too (dropout's), at every image the main process loads
            torch.default_generator.manual_seed(self.epoch * len(self.dataset) + index)
            return self.dataset[index]


# ---- your model: any nn.Module; replace build_model() ------------------------------------
def build_model(args, num_classes):
    kwargs = {}
    if args.norm == "group":  # no batch statistics: the same model however the batch is split
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(32, channels)
    model = torchvision.models.get_model(args.arch, num_classes=num_classes, **kwargs)
    # GPUs: BatchNorm statistics over the global batch, not each rank's shard (synced at every
    # forward; DDP refuses it on the CPU):
    # model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


@dataclass
class TrainState:
    """What training changes as it goes, in one place (04_checkpoint.py saves exactly this)."""

    model: nn.Module  # the plain model, not the DDP wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # one-cycle: it steps with every step
    scaler: torch.amp.GradScaler  # fp16's loss scale; a no-op unless --amp fp16
    epoch: int = 0  # the epoch in progress
    step: int = 0  # optimizer steps taken: the global step


def train_one_epoch(model, loader, state, args, d):
    """One pass over this rank's shard. Returns the epoch's loss and accuracy over all ranks,
    and its speed in images per second. model is the DDP wrapper (main's ddp_model);
    state.model, the plain model it wraps."""
    model.train()
    amp = AMP_DTYPES.get(args.amp)
    now = time.perf_counter  # seconds: for the speed, and each rank's time in data and forward
    started = now()
    sums = torch.zeros(3, device=d.device)  # loss sum, correct, images
    # seconds since the last progress line, one row per rank: (data loading, forward), both
    # before the gradient all-reduce. This rank fills its own row; slowest_rank sums the
    # tables of all ranks (an all-reduce), which gathers every row.
    times = torch.zeros(d.world_size, 2)
    batches = iter(loader)
    steps = len(loader) // args.accum_steps  # whole steps only: a partial one would not sync
    for i in range(steps):
        step_sums = sums.new_zeros(3)  # the same, for this step alone
        for k in range(args.accum_steps):
            # Diagnostics, not DDP: d.beat records where this rank is (its data, then its
            # compute: forward, backward and the gradient all-reduce), for the error line
            # that names who is elsewhere if a collective times out, and re-arms a watchdog
            # that ends a rank stuck for --timeout + 5 s with its stacks (Dist, the plumbing).
            d.beat(f"step {state.step}, data")
            loading = now()
            images, labels = next(batches)
            images = images.to(d.device, args.dtype, non_blocking=True)
            labels = labels.to(d.device, non_blocking=True)
            # no_sync: the first K-1 backward passes only add up gradients here; the K-th
            # all-reduces their sum. With static_graph=True passed to DDP (not by default),
            # the first backward must sync (inside no_sync it fails an assertion,
            # pytorch#143580); the extra sync is exact: every rank then holds the same average.
            sync = k == args.accum_steps - 1 or (model.static_graph and i == 0)
            with contextlib.nullcontext() if sync else model.no_sync():
                d.beat(f"step {state.step}, compute")
                loaded = now()  # data: the loader, the copies and the beats; compute: forward
                with torch.autocast(d.device.type, dtype=amp, enabled=amp is not None):
                    logits = model(images)
                    loss = F.cross_entropy(logits, labels)  # the mean over this rank's batch
                times[d.rank] += torch.tensor([loaded - loading, now() - loaded])
                state.scaler.scale(loss / args.accum_steps).backward()
            # running sums stay on the device: no wait for the GPU
            step_sums[0] += loss.detach() * len(labels)
            step_sums[1] += (logits.argmax(1) == labels).sum()
            step_sums[2] += len(labels)
        sums += step_sums
        state.scaler.step(state.optimizer)  # optimizer.step(), skipped if fp16 overflowed
        state.scaler.update()
        state.optimizer.zero_grad()
        state.scheduler.step()
        state.step += 1

        # ---- the progress line, not part of the step ----------------------------------
        # (this step's loss and accuracy, over every rank's images: a resumed run logs the same)
        if state.step % args.log_every == 0:
            step_loss, step_acc, _ = all_reduce_metrics(step_sums)  # every rank
            # every rank: each rank's [data, forward] seconds since the last line, and "" or
            # "  slowest: rank 2 (data +0.27s)"
            seconds, slowest = slowest_rank(times, d)
            if d.rank == 0:
                say(
                    f"epoch {state.epoch + 1}  step {state.step:>5}/{state.scheduler.total_steps}"
                    f"  loss {step_loss:.4f}  acc {step_acc:6.1%}{slowest}"
                )
                log_metrics(args, state, loss=step_loss, acc=step_acc, rank_seconds=seconds)
    loss, acc, images = all_reduce_metrics(sums)  # the whole epoch: every rank's
    # all ranks' images per second (the .tolist() above waited for the GPU)
    return loss, acc, images / (now() - started)


def slowest_rank(times, d):
    """Which rank held up the others since the last progress line, and where.

    The gradient all-reduce makes every rank's step as slow as the slowest's, so the rank
    with the most seconds before it (data loading + forward) is the one the others waited
    for. It is named when that is over twice the median rank's, with the phase where its
    excess over the median is larger ("data", or "compute" for the forward) and its whole
    excess in seconds: about what the others waited. Backward is not timed: on Gloo it holds
    the all-reduce's wait. On GPUs only the data column tells much: the forward's host time
    is the time to queue its kernels, so a slow GPU is not named (NOTES.md).

    Returns every rank's [data, forward] seconds (for --metrics) and the text for the
    progress line ("" or "  slowest: rank 2 (data +0.27s)"). Every rank calls it."""
    table = times.to(d.device, copy=True)
    dist.all_reduce(table)  # each rank's row (the others are zeros here)
    times.zero_()
    seconds = table.tolist()  # (waits for the GPU, as all_reduce_metrics' .tolist() did)
    before = table.sum(1)
    rank = int(before.argmax())
    if before[rank] < 2 * before.median():
        return seconds, ""
    data, forward = table[rank] - table.median(0).values  # its excess in each
    phase = "data" if data > forward else "compute"
    return seconds, f"  slowest: rank {rank} ({phase} +{before[rank] - before.median():.2f}s)"


def all_reduce_metrics(sums):
    """Every rank's running (loss sum, correct, images) summed over all ranks: the mean loss,
    the accuracy and the number of images (sums becomes the total). Every rank calls it at the
    same point, and all stop together if the loss is not finite."""
    dist.all_reduce(sums)
    loss_sum, correct, count = sums.tolist()  # (waits for the GPU)
    check(math.isfinite(loss_sum), "finite loss", f"the loss is {loss_sum}: lower --lr")
    return loss_sum / (count or 1), correct / (count or 1), count


@torch.no_grad()
def evaluate(model, loader, args, d, where):
    """The loss and accuracy over every rank's validation shard, and the number of images.
    where: this rank's beat (Dist.beat) at each batch, the phase an error line names."""
    # The raw module, not DDP: no gradient sync is wanted, and ranks' batch counts may differ.
    model.eval()
    sums = torch.zeros(3, device=d.device)  # loss sum, correct, images
    for images, labels in loader:
        d.beat(where)
        logits = model(images.to(d.device, args.dtype))
        labels = labels.to(d.device)
        sums[0] += F.cross_entropy(logits, labels, reduction="sum")
        sums[1] += (logits.argmax(1) == labels).sum()
        sums[2] += len(labels)
    return all_reduce_metrics(sums)  # every rank, whatever its number of batches


def log_metrics(args, state, **fields):
    """--metrics: rank 0 appends one JSON line to the file: the step, the learning rate (the
    next step's) and the fields (rank_seconds: slowest_rank's). plot_metrics.py draws the
    learning curve from it."""
    if args.metrics:
        lr = state.scheduler.get_last_lr()[0]
        with open(args.metrics, "a") as f:
            print(json.dumps(dict(step=state.step, lr=lr, **fields)), file=f)


def verify_replicas_identical(model, d):
    """Every rank holds the same parameters and buffers: their sha256, compared across ranks.
    (The buffers are rank 0's since the broadcast before validation; the parameters are what
    DDP keeps equal.)"""
    tensors = model.state_dict().values()
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.cpu().numpy().tobytes())
    digest = sha.hexdigest()
    digests = [None] * d.world_size
    dist.all_gather_object(digests, digest)
    check(len(set(digests)) == 1, "identical replicas", f"sha256 by rank: {digests}")
    return (
        f"{d.world_size} rank(s) hold identical parameters and buffers "
        f"({sum(t.numel() for t in tensors):,} values, sha256 {digest[:16]})"
    )


def rank0_writes(path, save, d):
    """Rank 0 runs save(file) into memory and writes the result to path whole; then every
    rank raises rank 0's error, if any. The others wait for that outcome, not in a barrier,
    where a rank 0 that failed would leave them waiting (on NCCL, for --timeout)."""
    error = [None]
    if d.rank == 0:
        buffer = io.BytesIO()
        save(buffer)  # into memory first: torch.save's own failed write names no cause
        try:
            write_atomic(path, buffer.getvalue())
        except OSError as e:  # a full disk, say: name the file, not a traceback
            error = [f"cannot write {path}: {e.strerror}"]
    dist.broadcast_object_list(error, src=0)  # every rank waits for it: none leaves early
    if error[0]:
        raise SetupError(error[0])


def write_atomic(path, data):
    """The whole file or nothing: written beside it, synced, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; after a failure, nothing is left


def build_parser():
    # --help shows the docstring as written, its Run block first
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    positive = number(int, 1)  # argparse types: an int >= 1, an int >= 0
    count = number(int, 0)
    add(
        "--arch",
        default="resnet18",
        choices=torchvision.models.list_models(module=torchvision.models),
        metavar="A",
        help="any torchvision classifier (default: %(default)s)",
    )
    add(
        "--norm",
        default="batch",
        choices=["batch", "group"],
        help="group: GroupNorm, resnet family (default: %(default)s)",
    )
    add(
        "--data",
        type=Path,
        metavar="DIR",
        help="an ImageFolder tree DIR/{train,val}/CLASS/IMAGE; without it, synthetic images",
    )
    add(
        "--train-size",
        type=positive,
        default=4096,
        help="synthetic training images (default: %(default)s)",
    )
    add(
        "--val-size",
        type=count,
        default=1024,
        help="synthetic validation images (default: %(default)s)",
    )
    add(
        "--image-size",
        type=positive,
        default=32,
        help="image side in pixels (default: %(default)s)",
    )
    add(
        "--workers",
        type=count,
        help="DataLoader workers per process (default: 0 on CPU, else its cores, up to 8)",
    )
    add("--epochs", type=positive, default=3, help="passes over the data (default: %(default)s)")
    add(
        "--batch-size",
        type=positive,
        default=128,
        help="images per micro-batch, per process (default: %(default)s)",
    )
    add(
        "--accum-steps",
        type=positive,
        default=1,
        help="micro-batches per step, under no_sync (default: %(default)s)",
    )
    add(
        "--lr",
        type=number(float, 0),
        default=0.05,
        help="the one-cycle schedule's peak (default: %(default)s)",
    )
    add(
        "--amp",
        choices=AMP_DTYPES,
        help="autocast to this dtype; fp16 adds a GradScaler (default: off)",
    )
    add(
        "--float64",
        dest="dtype",  # args.dtype: the model's and the images' dtype
        action="store_const",
        const=torch.float64,
        default=torch.float32,
        help="train in float64, for sharp equivalence checks (slow; default: float32)",
    )
    add(
        "--log-every",
        type=positive,
        default=10,
        help="steps between progress lines (default: %(default)s)",
    )
    add("--save-model", type=output_file, metavar="PATH", help="rank 0 saves the weights there")
    add("--metrics", type=output_file, metavar="PATH", help="rank 0 appends JSON lines there")
    add_launch_args(parser)
    return parser


def output_file(text):
    """An argparse type for a file the job writes: not a folder, and in a folder it can
    create files in (write and search permission), so that a bad path ends the run before
    any work is done."""
    path = Path(text)
    if path.is_dir() or not os.access(path.parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: not a file in a writable folder")
    return path


# ==== shared plumbing: begin ==== the same in all six scripts; 01_init_methods.py explains it


class SetupError(RuntimeError):
    """The job cannot run as configured: the message says why."""


class CheckFailed(RuntimeError):
    """A property this script demonstrates did not hold."""


def check(ok, name, detail):
    if not ok:
        raise CheckFailed(f"{name}: {detail}")


def say(text):
    """Rank 0's story, a line at a time. Text that cannot be written (stdout closed, or a pipe
    into `head` that has exited) is dropped: the job goes on and succeeds as it would."""
    try:
        print(text, flush=True)
    except OSError:
        pass


def number(cast, low, high=2**32):
    """An argparse type: a number with low <= value < high, which nan and inf never are."""

    def parse(text):
        value = cast(text)
        if not low <= value < high:
            raise argparse.ArgumentTypeError(f"must be >= {low} and < {high}, got {text}")
        return value

    return parse


def add_launch_args(parser):
    parser.add_argument(
        "--spawn",
        type=number(int, 0),
        help="start SPAWN processes with mp.spawn; 0: one per GPU, else 2",
    )
    parser.add_argument(
        "--timeout",
        type=number(float, 0.1, 1e6),
        default=300.0,
        help="seconds to wait for a peer or a collective (default: %(default)g)",
    )


def launch(main, args):
    """Run main(args) on every rank: under torchrun, with --spawn N, or as one process."""
    if "RANK" in os.environ:  # a launcher started this process and set its variables
        run_rank(None, main, args)  # (it never returns: run_rank ends the process)
    # --spawn N (0: one per GPU, else 2); no launcher and no --spawn: a world of one, through
    # the same code path
    n = 1 if args.spawn is None else args.spawn or torch.cuda.device_count() or 2
    with socket.create_server(("127.0.0.1", 0)) as s:  # a free port, for a job started here
        port = s.getsockname()[1]
    # what torchrun would set; run_rank adds each rank's RANK and LOCAL_RANK
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n)
    )
    if args.spawn is None:
        run_rank(0, main, args)  # (never returns)
    ranks = mp.start_processes(run_rank, args=(main, args), nprocs=n, join=False)  # spawned

    # This process waits for its ranks. A signal sent to it alone (Kubernetes signals a
    # container's first process) goes on to each, as torchrun forwards it; Ctrl-C reaches all.
    def forward(signum, frame):
        for p in ranks.processes:
            os.kill(p.pid, signum)

    for sig in STOP_SIGNALS[1:]:
        signal.signal(sig, forward)
    try:
        while not ranks.join():  # True once all have ended; raises when one has failed
            pass
    except mp.ProcessExitedException as e:  # that rank has printed its own reason
        sys.exit(f"error: spawned process {e.error_index} exited with code {e.exit_code}")
    except KeyboardInterrupt:  # Ctrl-C reached every rank too, and each has said so
        sys.exit(130)  # 128 + SIGINT


# The signals that end a rank with one line: Ctrl-C, a scheduler's warning (SIGTERM; SIGUSR1
# from sbatch --signal), a closed terminal, and SIGQUIT, which torchrun forwards too.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def run_rank(index, main, args):
    """Run main(args) and end the process: exit 0, or non-zero after one line naming the rank;
    then the program's exit hooks and os._exit."""
    if index is not None:  # under --spawn: mp.spawn passes the index
        os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (nohup's SIGHUP): it stays so
            signal.signal(sig, stop)
    code = 1  # unless main returns
    why = ""
    try:
        try:
            main(args)
            code = 0
        except CheckFailed as e:
            why = f"CHECK FAILED: {e}"
        except (SetupError, dist.DistError) as e:  # expected: one line says why
            # (a DataLoader worker's SetupError comes back as torch's text, ours at its end)
            why = "error: " + str(e).strip().rpartition("SetupError: ")[2]
        except Exception as e:
            why = f"error: {type(e).__name__}: {e}"
            # Gloo's errors name its source files (".../gloo/transport/tcp/pair.cc"): a
            # collective failed (a peer is gone, or a wait timed out), wherever it surfaced
            # (in DDP's all-reduce inside backward, say), and the message says so. (NCCL's are
            # DistErrors.) Anything else is a bug: keep its traceback.
            if "gloo/" not in why:
                traceback.print_exc()
            else:
                # A failed collective: where each rank was at its last beat (Dist.beat), if
                # every rank has beaten, from the job's store: "; rank by rank: ['step 2,
                # compute', 'step 2, data']". After a timeout (Gloo's words), every rank;
                # after a lost peer, rank 0 alone: the store's host is rank 0 or torchrun's
                # agent (one node), and a peer's read would fail if rank 0 is the peer that
                # was lost (with a C++ warning, breaking the one line).
                try:
                    store = dist.distributed_c10d._get_default_store()
                    keys = [f"beat {rank}" for rank in range(dist.get_world_size())]
                    read = "Timed out" in why or dist.get_rank() == 0
                    if read and store.check(keys):  # get() will not wait
                        beats = [store.get(key).decode() for key in keys]
                        why += f"; rank by rank: {beats}"
                except Exception:  # the store unreachable: nothing to add
                    pass
        finally:
            # Ending already: a signal from now on could only garble the line. One that
            # arrives before this loop is done is caught below, like one arriving in the
            # handlers above; after it, none can escape (an unhandled KeyboardInterrupt ends
            # Python by SIGINT, with no line: torchrun's SIGTERM did so to a rank ending on
            # its own error, about one run in six here).
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
    # from stop() (the signal's number, and where it found this rank): unwound, now one line.
    # A rank already ending on an error of its own when the signal came (torchrun's SIGTERM
    # to the others, say) keeps that error's line and exit code.
    except KeyboardInterrupt as e:
        if not why:
            code = 128 + e.args[0]
            why = f"stopped by {signal.Signals(e.args[0]).name}{e.args[1]}"
    # The end, out of the except blocks: their exception held the frames it passed through,
    # and what those held is released now (DataLoader workers end), before the exit hooks.
    if why:
        sys.stderr.write(f"[rank {os.environ['RANK']}] {why}\n")  # one write: one whole line
    atexit._run_exitfuncs()  # exit hooks (a logger's, say), which os._exit would skip
    try:
        sys.stdout.flush()
    except Exception:  # stdout closed or broken: nothing more to say
        pass
    os._exit(code)  # no interpreter shutdown and no destroy_process_group: NOTES.md says why


def stop(signum, frame):
    # KeyboardInterrupt: the rank unwinds as on Ctrl-C, and DataLoader workers end quietly.
    # Its line says where the signal found it: the innermost frame of this file (run_rank's
    # at least), so a rank stuck in torch's code or a library's names the line here that
    # called it.
    while frame.f_code.co_filename != __file__:
        frame = frame.f_back
    raise KeyboardInterrupt(signum, f" in {frame.f_code.co_name} (line {frame.f_lineno})")


class Dist(NamedTuple):
    """Who this process is in the job: setup() returns it."""

    rank: int
    world_size: int
    device: torch.device
    timeout: float

    def beat(self, where):
        """Where this rank is, in the job's store, read without a collective: a rank whose
        collective fails names where every rank was (run_rank). A rank that
        makes no progress, no beat within --timeout + 5 s, dumps its stacks and exits."""
        faulthandler.dump_traceback_later(self.timeout + 5, exit=True)
        dist.distributed_c10d._get_default_store().set(f"beat {self.rank}", where)


def setup(timeout, store=None, gloo=False):
    """Check the launcher's variables, bind this process to its device, join the group."""
    # set by the launcher
    env = {
        name: os.environ.get(name, "")
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    # missing or not a number: -1
    rank, world, local_rank, local_world = [int(v) if v.isdigit() else -1 for v in env.values()]
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise SetupError(f"the launcher's variables are invalid: {env}")
    device = bind_device(local_rank, local_world, gloo)
    cuda = device.type == "cuda"
    # A thread joins and this one waits for it: torch's store waits in C++, where a signal
    # (Ctrl-C) cannot end it, and may wait past the timeout (a client retries, and a port held
    # by another program never answers); this wait ends at either. device_id: NCCL connects
    # now, on this process's GPU.
    where = f"env:// at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        concurrent.futures.ThreadPoolExecutor(1).submit(
            dist.init_process_group,
            "nccl" if cuda else "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
            device_id=device if cuda else None,
        ).result(timeout + 2)
    except concurrent.futures.TimeoutError:  # (before OSError: on Python >= 3.11 it is one)
        raise SetupError(
            f"not all of {world} ranks joined within {timeout:g}s ({where}); start the others"
        ) from None
    except Exception as e:
        first = str(e).partition("\n")[0]  # torch's C++ errors add a stack trace
        raise SetupError(f"cannot join the process group at {where}: {first}") from e
    return Dist(rank, world, device, timeout)


def bind_device(local_rank, local_world, gloo):
    """This process's share of the cores for torch's threads; NCCL: its GPU, bound before init."""
    # the cores this process may run on (Linux), shared by the node's ranks
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    if gloo or not torch.cuda.is_available():  # Gloo, on the CPU
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    # Sees one GPU: the launcher gave each process its own (srun --gpus-per-task=1 sets
    # CUDA_VISIBLE_DEVICES per task), or a one-GPU machine, where NCCL refuses a second process
    if local_world > gpus and (gpus != 1 or "CUDA_VISIBLE_DEVICES" not in os.environ):
        raise SetupError(f"{local_world} processes here, {gpus} GPU(s): NCCL needs a GPU each")
    device = torch.device("cuda", local_rank if gpus > 1 else 0)  # GPU ids restart per node
    torch.cuda.set_device(device)  # before init, so that nothing lands on GPU 0 by default
    return device


# ==== shared plumbing: end =================================================================


if __name__ == "__main__":
    launch(main, build_parser().parse_args())
