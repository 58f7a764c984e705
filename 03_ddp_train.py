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
A job that must survive restarts and preemption: 04_checkpoint.py is this file plus
checkpoints.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import datetime
import hashlib
import io
import math
import os
import re
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets.folder import IMG_EXTENSIONS, ImageFolder

# setup(), launch(), check() and SetupError are the shared plumbing at the bottom of this file.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --amp none: no autocast


def main(args: argparse.Namespace) -> None:
    d = setup(args.timeout)
    # GPUs: cuDNN times its algorithms once per input shape and keeps the fastest; training's
    # shapes never change (drop_last). 04 leaves it off: its resumed run must pick the same.
    torch.backends.cudnn.benchmark = d.device.type == "cuda"
    train_set, val_set, num_classes = build_datasets(args)
    train_loader, sampler, val_loader = make_loaders(args, d, train_set, val_set)
    steps_per_epoch = len(train_loader) // args.accum_steps
    if steps_per_epoch == 0:  # full batches only: a last batch of one image fails BatchNorm
        batches = f"each rank's {len(sampler)} image(s) make {len(train_loader)} full batch(es)"
        raise SetupError(f"{batches} of {args.batch_size}; a step takes {args.accum_steps}")
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts too)
    model = build_model(args, num_classes).to(d.device, args.dtype)
    if args.compile:  # compile the module, then wrap it: its state_dict keeps plain keys
        model.compile(backend=args.compile)  # (torch.compile(model) would add "_orig_mod.")
    ddp_model = DDP(
        model,
        device_ids=[d.device] if d.device.type == "cuda" else None,  # CPU: None
        bucket_cap_mb=args.bucket_cap_mb,  # gradients are all-reduced in buckets of this size
        find_unused_parameters=args.find_unused_parameters,  # only if some get no gradient
        static_graph=args.static_graph,  # the same graph every step: DDP can plan ahead
        gradient_as_bucket_view=args.gradient_as_bucket_view,  # gradients live in the buckets
    )
    torch.manual_seed(args.seed + d.rank)  # but each rank draws its own dropout masks
    optimizer = build_optimizer(model, args, fused=d.device.type == "cuda")
    total_steps = steps_per_epoch * args.epochs
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps)
    scaler = torch.amp.GradScaler(d.device.type, enabled=args.amp == "fp16")
    state = TrainState(model, optimizer, scheduler, scaler)
    if d.rank == 0:
        say(
            f"training {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} "
            f"params, {num_classes} classes) on {d.world_size} x {d.device.type} "
            f"({dist.get_backend()}); {len(train_set)} train / {len(val_set)} val images; "
            f"global batch {d.world_size * args.batch_size * args.accum_steps} = "
            f"{d.world_size} ranks x {args.batch_size} x {args.accum_steps} accum; "
            f"{state.scheduler.total_steps} steps"
        )
    history = []
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)  # same seed + epoch on every rank: a shared new order
        train_loader.dataset.set_epoch(state.epoch)  # and new augmentations, wherever drawn
        train = train_one_epoch(ddp_model, train_loader, state, args, d)
        # rank 0's BatchNorm statistics on every rank: all evaluate the model rank 0 saves
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        val = evaluate(model, val_loader, args, d) if len(val_set) else None
        history.append((train, val))
        if d.rank == 0:
            say(f"epoch {state.epoch + 1} done: {describe(train, val)}")
        state.epoch += 1

    # ---- after training: the replica check, the saved model, the summary ----------------
    verified = verify_replicas_identical(model, d)
    if args.save_model:  # the plain model: keys without "module."
        rank0_writes(args.save_model, lambda f: torch.save(model.state_dict(), f), d)
    if d.rank == 0:
        say(summary(history, state, d))
        saved = f"; rank 0 saved them to {args.save_model}" if args.save_model else ""
        say(f"verified: {verified}{saved}")


# ---- your data: any Dataset of (image, label); replace build_datasets() ------------------
def build_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset, int]:
    """The training set, the validation set and the number of classes."""
    if not args.data:
        shape = (args.num_classes, args.image_size, args.seed)
        train = SyntheticImages(args.train_size, *shape, train=True)
        return train, SyntheticImages(args.val_size, *shape, train=False), args.num_classes
    T = torchvision.transforms
    # torchvision's ImageNet recipe: random crops and flips to train (each image's drawn from
    # its own seed: SeededAugmentation, below), a centre crop to validate; ImageNet's mean/std
    tensor = [T.ToTensor(), T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])]
    augment = [T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip()]
    centre = [T.Resize(round(args.image_size * 256 / 224)), T.CenterCrop(args.image_size)]
    train_set = image_folder(args.data / "train", T.Compose(augment + tensor))
    val_set = image_folder(args.data / "val", T.Compose(centre + tensor))
    if val_set.classes != train_set.classes:  # each split numbers its own folders' classes
        differ = f"val's classes {val_set.classes} differ from train's {train_set.classes}"
        raise SetupError(f"--data {args.data}: {differ}; their labels would not match")
    return train_set, val_set, len(train_set.classes)


def image_folder(root, transform):
    """torchvision's ImageFolder (root/CLASS/IMAGE), without hidden files: macOS's ._x.png
    are not images. 03, 04 and 05 read --data with it."""

    def is_image(path):
        name = os.path.basename(path)
        return name.lower().endswith(IMG_EXTENSIONS) and not name.startswith(".")

    try:
        return ImageFolder(root, transform, loader=load_image, is_valid_file=is_image)
    except (FileNotFoundError, RuntimeError) as e:  # no class folders, or no images in them
        raise SetupError(f"--data {root.parent}: {e}") from e


def load_image(path):
    """The image at path in RGB, or a SetupError naming the file. 16-bit greyscale (common in
    scientific and medical imaging) is scaled to 8 bits: converted as it is, it saturates."""
    try:
        image = PIL.Image.open(path)
        if image.mode.startswith("I"):  # "I;16" and kin: values up to 65535
            image = image.convert("I").point(lambda value: value / 256)  # (I;16B has no point)
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:  # truncated, or not an image at all
        raise SetupError(f"cannot read image {path}: {e}") from None


class SyntheticImages(Dataset):
    """Learnable and deterministic: class c is a fixed random 8x8 colour pattern, upsampled,
    plus noise. Nothing random at load time, so N processes see exactly what one would."""

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int, train: bool):
        patterns = torch.randn(num_classes, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
        patterns = F.interpolate(patterns, size=image_size, mode="bilinear", align_corners=False)
        g = torch.Generator().manual_seed(seed + (1 if train else 2))  # train and val differ
        self.labels = torch.randint(num_classes, (size,), generator=g)
        noise = torch.randn(size, 3, image_size, image_size, generator=g)
        self.images = patterns[self.labels] + 1.5 * noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], int(self.labels[index])


def make_loaders(args: argparse.Namespace, d: Dist, train_set: Dataset, val_set: Dataset):
    """The training loader with its DistributedSampler, and this rank's validation loader."""
    # --workers left out: on CPU none (the cores train), on GPUs this process's cores (up to 8)
    auto = 0 if d.device.type == "cpu" else min(8, torch.get_num_threads())
    workers = auto if args.workers is None else args.workers
    common = dict(
        batch_size=args.batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,  # keep the workers alive from epoch to epoch
        pin_memory=d.device.type == "cuda",  # page-locked: copies to the GPU run async
    )
    train_set = SeededAugmentation(train_set, args.seed)
    # shuffled (the default): each epoch a new order, the same on every rank (seed + epoch)
    sampler = DistributedSampler(train_set, num_replicas=d.world_size, rank=d.rank, seed=args.seed)
    # iter(loader) draws the workers' base seed from rng, not from the global RNG (dropout's),
    # so a resumed run (04_checkpoint.py) keeps the same random stream.
    # drop_last: full batches only (a batch of one image fails BatchNorm in training)
    rng = torch.Generator().manual_seed(args.seed + d.rank)
    train_loader = DataLoader(train_set, sampler=sampler, drop_last=True, generator=rng, **common)
    # Validation: rank r takes samples r, r+W, r+2W, ... with no padding, so each counts once
    # (DistributedSampler would pad with repeats; 05_eval_gather.py shows what that costs).
    val_shard = Subset(val_set, range(d.rank, len(val_set), d.world_size))
    return train_loader, sampler, DataLoader(val_shard, **common)


class SeededAugmentation(Dataset):
    """The training set, each sample's random augmentation drawn from its own seed (the run's
    seed, the epoch, the sample's index) instead of the random stream of whichever process
    loads it (a DataLoader worker's differs by rank and by worker). So N processes train on
    exactly what one would, and a resumed run (04_checkpoint.py) on what the interrupted one
    would have. Transforms that draw from torch's global RNG (torchvision's do) are covered."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed
        # in shared memory: DataLoader workers, which hold copies of this object, see it change
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:  # before iter(loader), as for the sampler
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        seed = (self.seed * 1_000_003 + int(self.epoch)) * 1_000_003 + index
        with torch.random.fork_rng(devices=[]):  # this process's own stream is left as it was
            torch.manual_seed(seed % 2**63)
            return self.dataset[index]


# ---- your model: any nn.Module; replace build_model() ------------------------------------
def build_model(args: argparse.Namespace, num_classes: int) -> nn.Module:
    kwargs = {"num_classes": num_classes}
    if args.norm == "group":
        # GroupNorm has no batch statistics: the same model however the batch is split
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(math.gcd(32, channels), channels)
    try:
        model = torchvision.models.get_model(args.arch, **kwargs)
    except TypeError as e:  # resnet*, resnext* and wide_resnet* take a norm_layer
        raise SetupError(f"--norm group: {args.arch} takes no norm_layer (try a resnet)") from e
    model.eval()  # one image through it now (no statistics change), so a misfit is named here
    try:
        model(torch.zeros(1, 3, args.image_size, args.image_size))
    except (AssertionError, RuntimeError, ValueError) as e:  # vit_b_16 at 16 px, say
        raise SetupError(f"--arch {args.arch} cannot take {args.image_size} px images: {e}") from e
    if args.sync_bn:  # BatchNorm statistics over the global batch, not each rank's shard
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.unused_layer:  # forward never calls it, so its parameters never get a gradient
        model.unused_layer = nn.Linear(8, 8)
    return model


def build_optimizer(model: nn.Module, args: argparse.Namespace, fused: bool) -> torch.optim.SGD:
    """SGD with momentum; fused (GPUs): one kernel per step, and fp16's GradScaler.step then
    needs no .item()."""
    optimizer = torch.optim.SGD(
        model.parameters(), args.lr, momentum=0.9, weight_decay=args.weight_decay, fused=fused
    )
    # Momentum buffers made now, as zeros: fused SGD makes missing ones with torch.empty_like
    # and keeps them unwritten if the first step is skipped (fp16 overflow): see NOTES.md
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


@dataclass
class TrainState:
    """What training changes as it goes, in one place (04_checkpoint.py saves exactly this)."""

    model: nn.Module  # the plain model, not the DDP wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # one-cycle: it steps with every step
    scaler: torch.amp.GradScaler  # fp16's loss scale; a no-op unless --amp fp16
    epoch: int = 0  # the epoch in progress
    step: int = 0  # optimizer steps taken: the global step


def train_one_epoch(model: DDP, loader: DataLoader, state: TrainState, args, d: Dist) -> dict:
    """One pass over this rank's shard; the epoch's loss and accuracy over all ranks."""
    model.train()
    amp = AMP_DTYPES.get(args.amp)
    sums = torch.zeros(3, dtype=torch.float64, device=d.device)  # loss sum, correct, images
    batches = iter(loader)
    steps = len(loader) // args.accum_steps  # whole steps only: a partial one would not sync
    for i in range(steps):
        for k in range(args.accum_steps):
            images, labels = next(batches)
            images = images.to(d.device, dtype=args.dtype, non_blocking=True)
            labels = labels.to(d.device, non_blocking=True)
            # no_sync: the first K-1 backward passes only add up gradients here; the K-th
            # all-reduces their sum. (static_graph: the first backward syncs; see NOTES.md)
            sync = k == args.accum_steps - 1 or (args.static_graph and i == 0)
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast(d.device.type, dtype=amp, enabled=amp is not None):
                    logits = model(images)
                    loss = F.cross_entropy(logits, labels)  # the mean over this rank's batch
                state.scaler.scale(loss / args.accum_steps).backward()
            with torch.no_grad():  # running sums stay on the device: no wait for the GPU
                sums[0] += loss.double() * len(labels)
                sums[1] += (logits.argmax(1) == labels).sum()
                sums[2] += len(labels)
        state.scaler.step(state.optimizer)  # optimizer.step(), skipped if fp16 overflowed
        state.scaler.update()
        state.optimizer.zero_grad(set_to_none=True)
        state.scheduler.step()
        state.step += 1

        # ---- bookkeeping: the clock and the progress line, not part of the step ----------
        if i == 0:
            started = clock(d)  # time from the end of step 1: it pays one-off costs
        if state.step % args.log_every == 0:
            so_far = sums.clone()
            dist.all_reduce(so_far)  # every rank, at the same steps: the epoch so far
            progress = f"step {state.step:>5}/{state.scheduler.total_steps}"
            report(so_far, f"epoch {state.epoch + 1}/{args.epochs}  {progress}", state, d)
    dist.all_reduce(sums)  # the whole epoch, over every rank's batches
    loss, acc = report(sums, "", state, d)
    images = (steps - 1) * args.batch_size * args.accum_steps * d.world_size
    return {"loss": loss, "acc": acc, "images": images, "seconds": clock(d) - started}


def report(sums: torch.Tensor, where: str, state: TrainState, d: Dist) -> tuple[float, float]:
    """The loss and accuracy in all-reduced sums, checked finite on every rank; rank 0 prints
    them after where (if any)."""
    loss_sum, correct, count = sums.tolist()
    diverged = f"the loss is not finite at step {state.step}: lower --lr"
    check(math.isfinite(loss_sum), "finite loss", diverged)  # all-reduced: all stop together
    if d.rank == 0 and where:
        lr, acc = state.scheduler.get_last_lr()[0], 100 * correct / count
        say(f"{where}  loss {loss_sum / count:.4f}  acc {acc:5.1f}%  lr {lr:.4f}")
    return loss_sum / count, correct / count


def clock(d: Dist) -> float:
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)  # GPU work is queued: time what has finished
    return time.perf_counter()


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, args, d: Dist) -> dict:
    # The raw module, not DDP: no gradient sync is wanted, and ranks' batch counts may differ.
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=d.device)  # loss sum, correct, images
    for images, labels in loader:
        images = images.to(d.device, dtype=args.dtype, non_blocking=True)
        labels = labels.to(d.device, non_blocking=True)
        logits = model(images)
        sums[0] += F.cross_entropy(logits.double(), labels, reduction="sum")
        sums[1] += (logits.argmax(1) == labels).sum()
        sums[2] += len(labels)
    dist.all_reduce(sums)  # every rank calls this once, whatever its number of batches
    loss_sum, correct, count = sums.tolist()
    return {"loss": loss_sum / max(count, 1), "acc": correct / max(count, 1), "n": int(count)}


def describe(train: dict, val: dict | None) -> str:
    line = f"train loss {train['loss']:.4f} acc {100 * train['acc']:.1f}%"
    if val:
        line += f" | val loss {val['loss']:.4f} acc {100 * val['acc']:.1f}% on {val['n']} images"
    return line


# ---- checks and the summary ---------------------------------------------------------------
def verify_replicas_identical(model: nn.Module, d: Dist) -> str:
    """Every rank holds the same parameters and buffers: their sha256, compared across ranks."""
    flat = torch.cat([t.detach().reshape(-1).double().cpu() for t in model.state_dict().values()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    digests = [None] * d.world_size
    dist.all_gather_object(digests, digest)
    differ = f"ranks hold different parameters or buffers: sha256 {[h[:12] for h in digests]}"
    check(len(set(digests)) == 1, "identical replicas", differ)
    values = f"{flat.numel():,} values, sha256 {digest[:16]}"
    return f"{d.world_size} rank(s) hold identical parameters and buffers ({values})"


def summary(history: list, state: TrainState, d: Dist) -> str:
    """Speed over the timed part of every epoch (from its step 2: step 1 pays one-off costs),
    and the training loss from the first epoch to the last."""
    images = sum(train["images"] for train, _ in history)
    seconds = sum(train["seconds"] for train, _ in history)
    speed = f"{images / seconds:.1f} img/s" if images else "n/a"  # one step per epoch: untimed
    loss = f"train loss {history[0][0]['loss']:.4f} -> {history[-1][0]['loss']:.4f}"
    return f"summary: {state.step} steps, {speed} on {d.world_size} rank(s); {loss}"


def build_parser() -> argparse.ArgumentParser:
    run = re.search(r"Run\n.*?(?:\n\n|$)", __doc__, re.S)[0]  # --help ends with the Run block
    parser = argparse.ArgumentParser(description=__doc__.replace(run, ""), epilog=run)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the docstring as written

    def add(group, name: str, what: str, **how) -> None:  # the help states a default once
        if how.get("default") is not None:
            what += " (default: %(default)s)"
        group.add_argument(name, help=what, **how)

    m = parser.add_argument_group("model")
    models = sorted(torchvision.models.list_models(module=torchvision.models))
    add(m, "--arch", "any torchvision classifier", default="resnet18", choices=models, metavar="A")
    add(m, "--norm", "group: GroupNorm, resnet family", default="batch", choices=["batch", "group"])
    add(m, "--sync-bn", "BatchNorm over the global batch (GPUs)", action="store_true")
    add(m, "--unused-layer", "a layer forward never calls", action="store_true")
    g = parser.add_argument_group("data (default: synthetic images, made in memory)")
    add(g, "--data", "an ImageFolder tree: DIR/train, DIR/val", type=Path, metavar="DIR")
    add(g, "--train-size", "synthetic training images", type=number(int, 1), default=4096)
    add(g, "--val-size", "synthetic validation images, 0: none", type=number(int, 0), default=1024)
    add(g, "--num-classes", "synthetic classes", type=number(int, 2), default=10)
    add(g, "--image-size", "image side in pixels", type=number(int, 1), default=32)
    auto = "(default: 0 on CPU, else the cores, up to 8)"
    add(g, "--workers", f"DataLoader workers per process {auto}", type=number(int, 0))
    t = parser.add_argument_group("training")
    add(t, "--epochs", "passes over the data", type=number(int, 1), default=3)
    add(t, "--batch-size", "images per micro-batch, per process", type=number(int, 1), default=128)
    add(t, "--accum-steps", "micro-batches per step, under no_sync", type=number(int, 1), default=1)
    add(t, "--lr", "the one-cycle schedule's peak", type=number(float, 0), default=0.05)
    add(t, "--weight-decay", "SGD's", type=number(float, 0), default=5e-4)
    add(t, "--amp", "autocast; fp16 needs CUDA", default="none", choices=["none", *AMP_DTYPES])
    add(t, "--float64", "for sharp equivalence checks (slow)", action="store_true")
    what = "model.compile() before DDP, with this backend (left out: inductor)"
    add(t, "--compile", what, nargs="?", const="inductor", metavar="BACKEND")
    add(t, "--seed", "seeds weights and data", type=number(int, 0), default=0)
    add(t, "--log-every", "steps between progress lines", type=number(int, 1), default=10)
    add(t, "--save-model", "rank 0 saves the weights there", type=output_file, metavar="PATH")
    k = parser.add_argument_group("DDP knobs")
    add(k, "--bucket-cap-mb", "size of the all-reduce buckets", type=number(float, 0), default=25.0)
    add(k, "--find-unused-parameters", "for parameters that get no gradient", action="store_true")
    add(k, "--static-graph", "the same parameters are used every step", action="store_true")
    add(k, "--gradient-as-bucket-view", "gradients live in the buckets", action="store_true")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.amp == "fp16" and not torch.cuda.is_available():
        parser.error("--amp fp16 needs CUDA (float16 autocast, GradScaler); on CPU use bf16")
    if args.sync_bn and not torch.cuda.is_available():
        parser.error("--sync-bn needs CUDA: SyncBatchNorm does not run on Gloo; try --norm group")
    if args.data and not all((args.data / split).is_dir() for split in ("train", "val")):
        folders = f"{args.data}/train and {args.data}/val, one sub-folder per class"
        parser.error(f"--data {args.data}: expected folders {folders}")
    # DETAIL: DDP's constructor segfaults on Gloo in torch 2.14.1 and 2.15.0, not 2.4.1 (NOTES.md)
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL and torch.__version__ >= (2, 14)
    if detail and not torch.cuda.is_available():
        v = torch.__version__  # TorchVersion: compared as numbers above
        parser.error(f"TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DDP on Gloo in torch {v}: use INFO")
    if args.float64 and args.amp != "none":
        parser.error("--float64 and --amp pick opposite precisions; use one")
    args.dtype = torch.float64 if args.float64 else torch.float32
    return args


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
    with contextlib.suppress(OSError):
        print(text, flush=True)


def number(cast, low, high=2**32):
    """An argparse type: a number with low <= value < high, which nan and inf never are."""

    def parse(text):
        value = cast(text)
        if not low <= value < high:
            raise argparse.ArgumentTypeError(f"must be >= {low} and < {high}, got {text}")
        return value

    parse.__name__ = cast.__name__  # so that argparse says "invalid int value: 'x'"
    return parse


def output_file(text):
    """An argparse type for a file the job writes: its folder is made now and must be
    writable, so that a bad path ends the run before any work is done."""
    path = Path(text)
    with contextlib.suppress(OSError):  # a file in the way, say: named below
        path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() or not (path.parent.is_dir() and os.access(path.parent, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: not a file in a writable folder")
    return path


def rank0_writes(path, save, d):
    """Rank 0 runs save(file) into memory and writes the result to path whole; then every
    rank raises rank 0's error, if any. The others wait for that outcome, not in a barrier,
    where a rank 0 that failed would leave them waiting (on NCCL, for --timeout)."""
    error = [None]
    if d.rank == 0:
        buffer = io.BytesIO()
        save(buffer)
        try:
            write_atomic(path, buffer.getvalue())
        except SetupError as e:
            error = [str(e)]
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
    except OSError as e:  # a full disk, say: name the file, not a traceback
        tmp.unlink(missing_ok=True)
        raise SetupError(f"cannot write {path}: {e.strerror}") from e


def add_launch_args(parser):
    if torch.__version__ < (2, 4):  # a TorchVersion: compared as numbers
        parser.error(f"needs torch >= 2.4; torch {torch.__version__} is installed")
    g = parser.add_argument_group("launch (NCCL when CUDA GPUs are visible, else Gloo)")
    g.add_argument(
        "--spawn",
        nargs="?",
        const=0,
        type=number(int, 0),
        metavar="N",
        help="start N processes with mp.spawn; N left out or 0: one per GPU, else 2",
    )
    g.add_argument(
        "--timeout",
        type=number(float, 0.1, 1e6),
        default=300.0,
        help="seconds to wait for a peer or a collective (default: %(default)g)",
    )


def launch(main, args):
    """Run main(args) on every rank: under torchrun, with --spawn N, or as one process."""
    if "RANK" in os.environ:  # a launcher started this process and set its variables
        run_rank(None, main, args)
    n = 1 if args.spawn is None else args.spawn or torch.cuda.device_count() or 2
    with socket.create_server(("127.0.0.1", 0)) as s:  # a free port, for a job started here
        port = s.getsockname()[1]
    # what torchrun would set; run_rank adds each rank's RANK and LOCAL_RANK
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n)
    )
    if args.spawn is None:  # no launcher: a world of one, through the same code path
        run_rank(0, main, args)
    try:
        mp.spawn(run_rank, args=(main, args), nprocs=n)  # run_rank(i, main, args), i < n
    except mp.ProcessExitedException as e:  # that rank has printed its own reason
        sys.exit(f"error: spawned process {e.error_index} exited with code {e.exit_code}")
    except KeyboardInterrupt:  # Ctrl-C reached every rank too, and each has said so
        sys.exit(128 + signal.SIGINT)


def run_rank(index, main, args):
    """Run main(args) and end the process: exit 0, or non-zero after one line naming the rank."""
    if index is not None:  # under --spawn: mp.spawn passes the index
        os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # Ctrl-C, a scheduler, a terminal
        if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (nohup's SIGHUP): it stays so
            signal.signal(sig, stop)
    try:
        try:
            main(args)
        except CheckFailed as e:
            end(1, f"CHECK FAILED: {e}")
        except (SetupError, dist.DistError) as e:  # expected: one line says why
            # (a DataLoader worker's SetupError comes back as torch's text, ours at its end)
            end(1, "error: " + str(e).strip().rpartition("SetupError: ")[2])
        except Exception as e:
            # Raised in torch.distributed: a collective failed (a peer is gone, say), and
            # torch's message says so. Raised anywhere else: a bug, keep its traceback.
            where = traceback.extract_tb(e.__traceback__)[-1].filename
            if not where.startswith(os.path.dirname(dist.__file__)):
                traceback.print_exc()
            end(1, f"error: {type(e).__name__}: {e}")
        end(0)
    # from stop(): unwound, now one line; also when the signal (torchrun's SIGTERM to the
    # others, say) arrives while the rank is already ending on an error of its own
    except KeyboardInterrupt as e:
        end(128 + signal.Signals[str(e)], f"stopped by {e}")


def stop(signum, frame):
    # KeyboardInterrupt: the rank unwinds as on Ctrl-C, and DataLoader workers end quietly
    raise KeyboardInterrupt(signal.Signals(signum).name)


def end(code, why=""):
    """End the process now: one line naming the rank, the program's exit hooks, os._exit."""
    if why:
        sys.stderr.write(f"[rank {os.environ['RANK']}] {why}\n")  # one write: one whole line
    atexit._run_exitfuncs()  # exit hooks (a logger's, say), which os._exit would skip
    with contextlib.suppress(AttributeError, OSError, ValueError):  # stdout closed or broken
        sys.stdout.flush()
    os._exit(code)  # no interpreter shutdown and no destroy_process_group: NOTES.md says why


class Dist(NamedTuple):
    """Who this process is in the job: setup() returns it."""

    rank: int
    world_size: int
    device: torch.device


def setup(timeout, store=None, gloo=False):
    """Check the launcher's variables, bind this process to its device, join the group."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = [os.environ.get(name, "") for name in names]
    rank, world, local_rank, local_world = (int(v) if v.isdigit() else -1 for v in env)
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise SetupError(f"{', '.join(names)} are {env}: invalid")
    device = bind_device(local_rank, local_world, gloo)
    # A thread joins and this one waits for it: torch's store waits in C++, where a signal
    # (Ctrl-C) cannot end it, and may wait past the timeout (a client retries, and a port held
    # by another program never answers); this wait ends at either. device_id: NCCL connects
    # now, on this process's GPU.
    joining = concurrent.futures.ThreadPoolExecutor(1).submit(
        dist.init_process_group,
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
        device_id=device if device.type == "cuda" else None,
    )
    where = f"env:// at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        joining.result(timeout + 2)
    except concurrent.futures.TimeoutError:  # (before OSError: on Python >= 3.11 it is one)
        raise SetupError(f"not all of {world} ranks joined within {timeout:g}s ({where})") from None
    except Exception as e:
        first = str(e).partition("\n")[0]  # torch's C++ errors add a stack trace
        raise SetupError(f"cannot join the process group at {where}: {first}") from e
    return Dist(rank, world, device)


def bind_device(local_rank, local_world, gloo=False):
    """This process's share of the cores for torch's threads; NCCL: its GPU, bound before init."""
    affinity = getattr(os, "sched_getaffinity", lambda pid: {0})  # macOS has none: one thread
    mine = affinity(0)  # the cores this process may run on
    # fewer than its parent's: a launcher bound it alone (srun --cpus-per-task=N), all its own;
    # else (torchrun, mp.spawn) the node's processes share them
    alone = mine < affinity(os.getppid())
    torch.set_num_threads(len(mine) if alone else max(1, len(mine) // local_world))
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
    launch(main, parse_args())
