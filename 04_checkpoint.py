r"""04_checkpoint.py: 03_ddp_train.py's job plus checkpoints: exact resume, restarts, preemption.

Run
  # one command shows failure, restart and resume: rank 1 dies at step 30
  torchrun --standalone --nproc_per_node 2 --max-restarts 1 04_checkpoint.py --simulate-failure 30
  python 04_checkpoint.py --spawn 2               # mp.spawn (no restarts: run it again to resume)
  python 04_checkpoint.py                         # one process
  # two nodes: the checkpoint directory must be on storage that both nodes see
  torchrun --nnodes 2 --nproc_per_node 4 --max-restarts 3 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 04_checkpoint.py --checkpoint-dir /shared/ckpt

The same job as 03_ddp_train.py, plus what a long job on a cluster needs: read it as
`diff 03_ddp_train.py 04_checkpoint.py`, and copy this file for a job that must survive.
- The training state (model, optimizer, schedule, fp16 scaler, epoch, global step and the
  position in the epoch's order) is one object with state_dict() and load_state_dict().
- Every --save-every steps and at each epoch's end, rank 0 copies it and a background thread
  writes it (atomically, its sha256 beside it) while training goes on; --keep are kept.
- At start every rank loads the newest checkpoint that verifies and carries on at the same
  step, with the same data order, augmentations and random streams: bit for bit the weights
  of an uninterrupted run with the same processes (GPUs too: cuDNN and cuBLAS are set to be
  deterministic). On another world size the data position is exact; the random streams and
  the schedule's length cannot be, and it says so.
- SIGTERM (what SLURM and Kubernetes send before a kill, and torchrun forwards) or SIGUSR1
  (sbatch --signal): every rank finishes its step, all agree on the step to stop at, rank 0
  saves, and each rank ends with exit code 128 + the signal, for the scheduler to retry.
  If the launcher itself is killed, its workers do the same.
- A second job in the same folder is refused (rank 0 holds a lock), and so are a folder it
  cannot write and a checkpoint that does not fit the model or the settings.
Under torchrun --max-restarts the ranks restart and resume on their own; a run resumes
whenever --checkpoint-dir holds checkpoints (start over in a new one). Torch >= 2.4.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import datetime
import errno
import fcntl
import hashlib
import io
import math
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, fields
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
# the options a resume must share with the run it resumes
SHAPES_THE_RUN = "arch norm sync_bn unused_layer data train_size num_classes image_size epochs "
SHAPES_THE_RUN += "batch_size accum_steps lr weight_decay amp float64 seed"


def main(args: argparse.Namespace) -> None:
    # bit for bit on GPUs: deterministic cuDNN, a fixed cuBLAS workspace (before cuBLAS starts)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    d = setup(args.timeout, store=attempt_store(args.timeout))
    checkpoints = Checkpoints(args, d)  # rank 0 locks the folder; SIGTERM now asks to stop
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
    seen = torch.zeros(len(train_set), dtype=torch.int64)  # coverage: visits per image
    sums = torch.zeros(3, dtype=torch.float64, device=d.device)  # the epoch's loss, accuracy
    state = TrainState(model, optimizer, scheduler, scaler, seen=seen, sums=sums)
    checkpoints.load(state, steps_per_epoch)  # every rank: the newest that verifies, if any
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
        sampler.set_position(state.epoch, state.position)  # this epoch's order, from there on
        train_loader.dataset.set_epoch(state.epoch)  # and new augmentations, wherever drawn
        train = train_one_epoch(ddp_model, train_loader, state, args, d, checkpoints)
        check_coverage(state, sampler, d)
        # rank 0's BatchNorm statistics on every rank: all evaluate the model rank 0 saves
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        val = evaluate(model, val_loader, args, d) if len(val_set) else None
        history.append((train, val))
        if d.rank == 0:
            say(f"epoch {state.epoch + 1} done: {describe(train, val)}")
        state.epoch += 1
        state.position = 0
        state.seen.zero_()
        state.sums.zero_()
        checkpoints.save(state, f"end of epoch {state.epoch}")  # every rank: at the same step
    checkpoints.finish()  # every rank: the last write is on disk (or all stop on its error)

    # ---- after training: the replica check, the saved model, the summary ----------------
    verified = verify_replicas_identical(model, d)
    # the last checkpoint as an inference job loads it: a plain model. Every rank checks (the
    # folder is shared), so a failure stops all at once and none waits for rank 0 alone.
    last = checkpoints.path(checkpoints.steps()[0])
    verified += "; " + verify_inference_copy(model, last, args, num_classes)
    if args.save_model:  # the plain model: keys without "module."
        rank0_writes(args.save_model, lambda f: torch.save(model.state_dict(), f), d)
    if d.rank == 0:
        done = f"nothing to do: --epochs {args.epochs} are done; use a new --checkpoint-dir"
        say(summary(history, state, d) if history else done)
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
    sampler = ResumableSampler(train_set, num_replicas=d.world_size, rank=d.rank, seed=args.seed)
    # iter(loader) draws the workers' base seed from rng, not from the global RNG (dropout's),
    # so a resumed run keeps the same random stream.
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


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way into an epoch. DistributedSampler orders
    the dataset by seed + epoch, pads the order to a multiple of the world size with its own
    first indices, and deals every world_size-th index to each rank. After s full steps of
    b images on W ranks, that deal has used exactly the first s*b*W positions of the order,
    whichever ranks took them. So a resume skips that many positions and deals the rest the
    same way over the ranks it has now: nothing is loaded again, nothing is skipped. It also
    records what it dealt, for the coverage check."""

    start = 0  # positions of this epoch's order already consumed

    def set_position(self, epoch: int, start: int) -> None:
        self.set_epoch(epoch)  # same seed + epoch on every rank: one order they all agree on
        self.start = start

    def order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def __iter__(self):
        order = self.order()
        rest = order[self.start :]
        padding = -len(rest) % self.num_replicas  # repeats of the order's head
        rest += (order * (padding // len(order) + 1))[:padding]
        self.dealt = rest[self.rank :: self.num_replicas]
        if self.start == 0:  # from the top, this must be exactly what DistributedSampler deals
            stock = list(super().__iter__())
            check(self.dealt == stock, "sampler matches DistributedSampler", f"epoch {self.epoch}")
        return iter(self.dealt)

    def __len__(self) -> int:
        return math.ceil((len(self.dataset) - self.start) / self.num_replicas)


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
    """What training changes as it goes, in one place, with state_dict() and load_state_dict()
    (torch.distributed.checkpoint's Stateful): what a checkpoint saves and a resume restores."""

    model: nn.Module  # the plain model, not the DDP wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # one-cycle: it steps with every step
    scaler: torch.amp.GradScaler  # fp16's loss scale; a no-op unless --amp fp16
    epoch: int = 0  # the epoch in progress
    step: int = 0  # optimizer steps taken: the global step
    position: int = 0  # images of this epoch's order consumed, over all ranks (the sampler's)
    seen: torch.Tensor = None  # this epoch's visits per training image, this rank's: coverage
    sums: torch.Tensor = None  # this epoch's loss sum, correct and images, this rank's: report

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),  # the plain model: keys without "module."
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "position": self.position,
            "seen": self.seen,
            "sums": self.sums,  # this epoch's loss sum, correct, images so far: its report
        }

    def load_state_dict(self, saved: dict) -> None:
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.scaler.load_state_dict(saved["scaler"])
        self.epoch, self.step, self.position = saved["epoch"], saved["step"], saved["position"]
        self.seen.copy_(saved["seen"])
        self.sums.copy_(saved["sums"])


def train_one_epoch(model: DDP, loader: DataLoader, state: TrainState, args, d: Dist, checkpoints):
    """One pass over this rank's shard; the epoch's loss and accuracy over all ranks."""
    model.train()
    amp = AMP_DTYPES.get(args.amp)
    sums = state.sums  # loss sum, correct, images (resumed mid-epoch: rank 0's holds all so far)
    batches = iter(loader)
    steps = len(loader) // args.accum_steps  # whole steps only: a partial one would not sync
    started = None
    for i in range(steps):
        for k in range(args.accum_steps):
            images, labels = next(batches)
            images = images.to(d.device, dtype=args.dtype, non_blocking=True)
            labels = labels.to(d.device, non_blocking=True)
            # no_sync: the first K-1 backward passes only add up gradients here; the K-th
            # all-reduces their sum. (static_graph: the first backward syncs; see NOTES.md)
            sync = k == args.accum_steps - 1 or (args.static_graph and i == 0)
            with nullcontext() if sync else model.no_sync():
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

        # ---- the checkpoint lesson: at every step boundary -----------------------------
        images_per_step = args.batch_size * args.accum_steps
        dealt = loader.sampler.dealt[i * images_per_step : (i + 1) * images_per_step]
        state.seen.index_add_(0, torch.tensor(dealt), torch.ones(len(dealt), dtype=torch.int64))
        state.position += images_per_step * d.world_size
        # --simulate-failure: the last rank dies abruptly, like a machine that is gone
        last_rank = d.rank == d.world_size - 1
        if args.simulate_failure == state.step and last_rank and not checkpoints.resumed:
            say(f"[rank {d.rank}] simulated failure at step {state.step}")
            os.kill(os.getpid(), signal.SIGKILL)
        stop = checkpoints.stop_requested()  # every rank, every step: a small CPU all-reduce
        if stop or (state.step % args.save_every == 0 and i < steps - 1):  # (epoch end: main)
            checkpoints.save(state, f"epoch {state.epoch + 1}, {state.position} images in")
        if stop:
            checkpoints.finish()  # the save is on disk before this rank ends
            if d.rank == 0:
                say(f"stopping on {stop} at step {state.step}: run the same command to resume")
            raise KeyboardInterrupt(stop)  # run_rank: one line, exit 128 + the signal

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
    images = max(steps - 1, 0) * args.batch_size * args.accum_steps * d.world_size
    seconds = clock(d) - started if started else 0.0
    return {"loss": loss, "acc": acc, "images": images, "seconds": seconds}


# ---- checkpoints: DIR/step-40.pt beside DIR/step-40.pt.sha256 (sha256sum's format) ------
class Checkpoints:
    """The checkpoint folder of one job. Rank 0 locks it; saves are written by a background
    thread, atomically, the sha256 last; at start the newest that verifies is loaded. It also
    holds the preemption flag: SIGTERM and SIGUSR1 only set it, and the ranks agree on it at a
    step boundary (no collective may run inside a signal handler)."""

    def __init__(self, args: argparse.Namespace, d: Dist):
        self.dir, self.args, self.d = args.checkpoint_dir, args, d
        self.writer, self.error, self.signal = None, None, 0
        self.resumed = False
        # a Gloo group for the flag: CPU tensors, so no wait for the GPU at every step
        limit = datetime.timedelta(seconds=args.timeout)
        self.group = dist.new_group(backend="gloo", timeout=limit)
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # a scheduler's warning: finish, save
            signal.signal(sig, self.request_stop)
        # a launcher killed outright (SIGKILL) cannot stop its workers: they stop themselves
        threading.Thread(target=self.stop_when_orphaned, args=(os.getppid(),), daemon=True).start()
        raise_rank0_error(self.prepare() if d.rank == 0 else None)  # every rank: the outcome

    def request_stop(self, signum: int, frame) -> None:  # in the signal handler: a flag only
        self.signal = signum

    def stop_when_orphaned(self, parent: int) -> None:
        while os.getppid() == parent:
            time.sleep(1)
        self.signal = self.signal or signal.SIGTERM  # as if preempted: finish the step, save

    def stop_requested(self) -> str:
        """Every rank, at the same step: the signal any rank was asked to stop by, or ""."""
        flag = torch.tensor([self.signal])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return signal.Signals(int(flag)).name if flag else ""

    def prepare(self) -> str | None:
        """Rank 0, before training: lock the folder for this job (another job there would prune
        and overwrite its checkpoints), make sure it can write there, remove a killed save's
        leftovers. The error, if any."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            lock = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT)  # open while we live
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            tempfile.TemporaryFile(dir=self.dir).close()  # the lock file alone may be writable
            for leftover in self.dir.glob(".step-*.tmp*"):
                leftover.unlink()
        except BlockingIOError:
            return f"another job holds {self.dir}/.lock: use another --checkpoint-dir, or wait"
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return f"{self.dir} is on a filesystem without locks (flock: {e.strerror})"
            return f"cannot write checkpoints in {self.dir}: {e.strerror or e}"
        return None

    def steps(self) -> list[int]:
        """The steps of the checkpoints in the folder, newest first: names that match exactly
        (step-best.pt, a copy, is ignored: never loaded, never pruned)."""
        names = (re.fullmatch(r"step-(\d+)\.pt", p.name) for p in self.dir.iterdir())
        return sorted((int(m[1]) for m in names if m), reverse=True)

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step:08d}.pt"

    def load(self, state: TrainState, steps_per_epoch: int) -> None:
        """Every rank, before the first step: load the newest checkpoint that verifies, falling
        back past unreadable ones (renamed *.unreadable); start from step 0 if there is none."""
        d, saved, path, skipped = self.d, None, None, []
        for step in self.steps():
            try:
                path, saved = self.path(step), read_checkpoint(self.path(step))
                break
            except (Unreadable, OSError) as e:
                skipped.append(f"{self.path(step).name}: {e}")
        names = [None] * d.world_size
        dist.all_gather_object(names, path and path.name)
        same = "is --checkpoint-dir the same folder on every node?"
        check(len(set(names)) == 1, "one checkpoint", f"ranks chose {names}; {same}")
        # never start from scratch over a finished checkpoint (one with its sha256) that no
        # longer verifies; one whose write was cut short (no sha256 yet) was never finished
        if not saved and any(marker(self.path(step)).exists() for step in self.steps()):
            none = f"{self.dir} holds {len(skipped)} checkpoint(s) and none is readable"
            raise SetupError(f"{none} ({'; '.join(skipped)}). Move them away to start over")
        if d.rank == 0:
            for why in skipped:
                name = why.split(":")[0]
                print(
                    f"WARNING: {why}; renamed it *.unreadable, used an older one", file=sys.stderr
                )
                os.rename(self.dir / name, self.dir / f"{name}.unreadable")  # kept, out of the way
        if not saved:
            if d.rank == 0:
                say(f"no checkpoint in {self.dir}: starting from step 0")
            return
        check_settings(saved["args"], settings(self.args), path)
        try:
            state.load_state_dict(saved)
        except (RuntimeError, KeyError, ValueError) as e:  # build_model changed, say
            first = str(e).strip().splitlines()[0]
            raise SetupError(f"{path} does not fit this model or optimizer: {first}") from e
        self.resumed = True
        if d.rank != 0:
            state.seen.zero_()  # rank 0 carries the epoch's counts and sums so far
            state.sums.zero_()
        if saved["world_size"] == d.world_size:
            cpu, cuda = saved["rng"][d.rank]  # this rank's random streams, where they were
            torch.set_rng_state(cpu)
            if cuda is not None and d.device.type == "cuda":
                torch.cuda.set_rng_state(cuda, d.device)
        else:  # the data position carries on; the schedule is stretched to the steps left
            torch.manual_seed(self.args.seed + d.rank + 1_000_003 * state.step)
            per_rank = math.ceil((len(state.seen) - state.position) / d.world_size)
            left = per_rank // self.args.batch_size // self.args.accum_steps
            left += steps_per_epoch * (self.args.epochs - state.epoch - 1)
            state.scheduler = torch.optim.lr_scheduler.OneCycleLR(
                state.optimizer, self.args.lr, state.step + left, last_epoch=state.step - 1
            )
            if d.rank == 0:
                change = f"world size {saved['world_size']} -> {d.world_size}"
                say(f"{change}: random streams reseeded, schedule of {state.step + left} steps")
        if d.rank == 0:
            done = f"epoch {state.epoch + 1} with {state.position} of its images done"
            say(f"resuming from {path}: {done}, global step {state.step}")

    def save(self, state: TrainState, where: str) -> None:
        """Every rank, at the same step: the random streams, the epoch's counts and sums are
        gathered; rank 0 copies the state to the CPU and a background thread writes it while
        training goes on. The previous write must have finished: all learn its outcome."""
        d = self.d
        rngs = [None] * d.world_size
        cuda = torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else None
        dist.all_gather_object(rngs, (torch.get_rng_state(), cuda))  # dropout's, say
        totals = {}
        for name in ("seen", "sums"):  # over all ranks (NCCL reduces GPU tensors)
            totals[name] = getattr(state, name).to(d.device, copy=True)
            dist.all_reduce(totals[name])
        weights = [t for t in state.model.state_dict().values() if t.is_floating_point()]
        finite = all(t.isfinite().all() for t in weights)  # the same on every rank: all stop
        check(finite, "finite weights", f"not finite at step {state.step}: lower --lr")
        self.finish()
        if d.rank == 0:
            saved = {**state.state_dict(), **totals, "rng": rngs, "world_size": d.world_size}
            saved["args"] = settings(self.args)
            snapshot = cpu_copy(saved)  # the training thread's part: training goes on after
            self.writer = threading.Thread(target=self.write, args=(snapshot, state.step, where))
            self.writer.start()

    def write(self, snapshot: dict, step: int, where: str) -> None:
        """Rank 0's background thread: serialise, write, sync and rename, the sha256 last (it
        marks the checkpoint finished); then prune to the newest --keep."""
        path = self.path(step)
        try:
            buffer = io.BytesIO()
            torch.save(snapshot, buffer)
            data = buffer.getvalue()
            write_atomic(path, data)
            digest = f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode()
            write_atomic(marker(path), digest)
            folder = os.open(self.dir, os.O_RDONLY)
            os.fsync(folder)  # the renames themselves survive a power cut
            os.close(folder)
            for old in self.steps()[self.args.keep :]:
                marker(self.path(old)).unlink(missing_ok=True)  # the marker first
                self.path(old).unlink(missing_ok=True)
            say(f"saved {path.name} ({where})")
        except Exception as e:  # noqa: BLE001 - any: this thread reports to finish()
            self.error = f"rank 0 could not write a checkpoint in {self.dir}: {e}"

    def finish(self) -> None:
        """Every rank: rank 0 waits for the background write; all raise its error, if any."""
        if self.writer:
            self.writer.join()
            self.writer = None
        raise_rank0_error(self.error)


def raise_rank0_error(error: str | None) -> None:
    """A collective: every rank raises rank 0's error, so none waits for a rank that left."""
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise SetupError(outcome[0])


def settings(args: argparse.Namespace) -> dict:
    """The options that shape the run: a resume must use the same (paths as text)."""
    values = {name: getattr(args, name) for name in SHAPES_THE_RUN.split()}
    return {k.replace("_", "-"): str(v) if isinstance(v, Path) else v for k, v in values.items()}


def check_settings(saved: dict, ours: dict, path: Path) -> None:
    """A resume must use the settings the checkpoint was written with, and this script."""
    if saved.keys() != ours.keys():
        raise SetupError(f"{path} was written by another version of this script")
    differ = [f"--{k} {saved[k]} there, {v} here" for k, v in ours.items() if saved[k] != v]
    if differ:
        same = "resume with the same ones or use another --checkpoint-dir"
        raise SetupError(f"{path} was written with other settings ({', '.join(differ)}); {same}")


def cpu_copy(value):
    """A copy of value whose tensors are on the CPU and share nothing with training's."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(v) for v in value)
    return value


def read_checkpoint(path: Path) -> dict:
    """Verify and load one checkpoint, or raise Unreadable."""
    if not marker(path).exists():
        raise Unreadable(f"no {marker(path).name}: the save did not finish")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != (marker(path).read_text().split() or ["-"])[0]:
        raise Unreadable(f"sha256 mismatch ({len(data)} bytes): truncated or corrupted")
    try:
        # Onto the CPU (load_state_dict moves each tensor where its parameter is), and
        # weights_only: tensors and plain containers only, no code runs.
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means unreadable
        raise Unreadable(f"torch.load failed: {str(e).splitlines()[0]}") from e
    # every key save() writes: TrainState's fields (its state_dict), and the rest
    required = {*(field.name for field in fields(TrainState)), "rng", "world_size", "args"}
    missing = required - set(saved) if isinstance(saved, dict) else required
    if missing:
        raise Unreadable(f"not a checkpoint of this script (no {', '.join(sorted(missing))})")
    return saved


def marker(path: Path) -> Path:  # step-40.pt.sha256: its sha256 in sha256sum's format
    return path.with_name(path.name + ".sha256")


class Unreadable(Exception): ...  # a checkpoint file that cannot be trusted: the message says why


def attempt_store(timeout: float):
    """Under torchrun --max-restarts, a fresh TCPStore per attempt: the agent's outlives restarts
    with the dead group's keys, and restart counts differ by node (NOTES.md). Rank 0 posts its
    port in the agent's store; the others use it once it answers. No restarts: the agent's."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
    if not restarts or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, limit = os.environ["MASTER_ADDR"], datetime.timedelta(seconds=timeout)
    agent = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=limit)
    if os.environ["RANK"] == "0":
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
    raise SetupError(f"rank 0 posted no live store within {timeout:g}s")


# ---- checks: each image once per epoch, a plain model loads the last checkpoint -----------
def check_coverage(state: TrainState, sampler: ResumableSampler, d: Dist) -> None:
    """This epoch's images, over all ranks and any resume: the consumed head of the epoch's
    order, each once (and the sampler's padding repeats, if the head reached them)."""
    total = state.seen.to(d.device, copy=True)
    dist.all_reduce(total)  # NCCL reduces GPU tensors; the counts live on the CPU
    head = sampler.order()[: min(state.position, len(total))]
    ok = int(total.sum()) == state.position and bool((total[head] >= 1).all())
    detail = f"{int(total.sum())} visits, {state.position} expected"
    check(ok and int(total.max()) <= 1 + (state.position > len(total)), "each image once", detail)


def verify_inference_copy(model: nn.Module, path: Path, args, num_classes: int) -> str:
    """The last checkpoint loaded into a new plain model (no DDP) has the trained weights."""
    plain = build_model(args, num_classes).to(args.dtype)
    plain.load_state_dict(read_checkpoint(path)["model"])
    trained = model.state_dict()
    same = all(torch.equal(v, trained[k].cpu()) for k, v in plain.state_dict().items())
    check(same, "inference copy", f"a plain model from {path.name} has other weights")
    return f"a plain model loads the same from {path.name}"


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

    c = parser.add_argument_group("checkpoints")
    add(c, "--checkpoint-dir", "on storage every node sees", type=Path, default=Path("checkpoints"))
    add(c, "--save-every", "also save every N steps, mid-epoch", type=number(int, 1), default=20)
    add(c, "--keep", "newest checkpoints kept", type=number(int, 1), default=3)
    what = "the last rank SIGKILLs itself at this global step, in a run that did not resume"
    add(c, "--simulate-failure", what, type=number(int, 1), metavar="STEP")
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
