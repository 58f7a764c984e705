r"""04_checkpoint.py: 03_ddp_train.py's job plus what a long job on a cluster needs.

Run
  # one command shows failure, restart and resume: rank 1 dies at step 30
  torchrun --standalone --nproc_per_node 2 --max-restarts 1 04_checkpoint.py --simulate-failure 30
  python 04_checkpoint.py --spawn 2               # mp.spawn (no restarts: run it again to resume)
  python 04_checkpoint.py                         # one process
  # two nodes: the checkpoint directory must be on storage that both nodes see
  torchrun --nnodes 2 --nproc_per_node 4 --max-restarts 3 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 04_checkpoint.py --checkpoint-dir /shared/ckpt

Read it as `diff 03_ddp_train.py 04_checkpoint.py`: 03's job plus four parts, each a section
below.
- Checkpoints: every --save-every steps and at each epoch's end rank 0 serialises the
  training state and a thread writes it, atomically, with its sha256. At start rank 0 picks
  the newest that verifies and every rank resumes from it, with the same data order,
  augmentations and random numbers: on the same ranks and nodes, bit for bit (NOTES.md). A
  resume may change the world size, --epochs, --batch-size and --accum-steps. Under torchrun
  --max-restarts, a rank's death restarts every rank, which resume.
- Stopping: on SIGTERM (a scheduler's warning) or SIGUSR1 (sbatch --signal) the ranks agree
  to stop a step later; rank 0 saves and marks DIR/preempted; each rank exits 128 + the
  signal (README.md's batch script requeues).
- Forensics: a rank --timeout seconds in one phase (a hang) writes its stacks and
  collectives' record to DIR and ends on a line naming the phase ("step 3, data"), as a
  failed collective does; a progress line names the rank the others waited for.
- Metrics: --metrics PATH, a JSON line per progress line and per epoch, for plot_metrics.py.
"""

from __future__ import annotations  # (unevaluated: an old torch reaches launch()'s check)

import argparse
import atexit
import contextlib
import faulthandler
import fcntl
import hashlib
import io
import itertools
import json
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import PIL.Image
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset
from torchvision.datasets.folder import ImageFolder

# The shared plumbing is at the bottom of this file, the same in all six scripts: setup()
# joins the process group and returns d (rank, world_size, device). Read it last, or not
# at all.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --amp's choices
# the options a resume must share with the run it resumes, besides the data (--epochs,
# --batch-size and --accum-steps may change); your own model: drop those it ignores
SAME_ON_RESUME = "arch norm image_size lr amp".split()


def main(args):
    preemption = Preemption()  # SIGTERM or SIGUSR1 from here on: a preemption
    # bit for bit on GPUs: deterministic cuDNN, a fixed cuBLAS workspace (before cuBLAS starts),
    # no NVLS (NVSwitch's reduction, in no fixed order)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "^NVLS")
    torch.backends.cudnn.deterministic = True
    # the flight recorder's dumps go beside the checkpoints
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", f"{args.checkpoint_dir}/comm_lib_trace_rank_")
    # the group's timeout: 10 s past the watchdog's (Phases), which ends a hang first
    d = setup(args.timeout + 10, store=attempt_store(args.timeout))
    phases = Phases(d, args)
    # images per step, over all ranks
    args.global_batch = d.world_size * args.batch_size * args.accum_steps
    train_set, val_set, num_classes = build_datasets(args)
    # what a checkpoint must share with this run
    identity = {f"--{k.replace('_', '-')}": str(getattr(args, k)) for k in SAME_ON_RESUME}
    identity["images"] = data_identity(args, train_set)
    checkpoint = choose_checkpoint(args.checkpoint_dir, identity, d)
    train_loader, val_loader = make_loaders(args, d, train_set, val_set)
    steps_per_epoch = len(train_loader) // args.accum_steps
    if not steps_per_epoch:  # too few images for one step on each rank
        raise SetupError(
            f"each rank has {len(train_loader)} full batch(es) of {args.batch_size} images; "
            f"a step takes {args.accum_steps}"
        )
    torch.manual_seed(0)  # the same initial weights in any world size: runs compare
    model = build_model(args, num_classes).to(d.device)
    # torch.compile: model.compile() here, before DDP (the state_dict keeps its keys)
    # here DDP copies rank 0's weights and buffers to every rank
    ddp_model = DDP(
        model,
        # DDP's knobs, none passed (defaults); to change one, pass it here:
        # bucket_cap_mb=25: gradients are all-reduced in buckets of about this many MB, each
        #   once backward has filled it (communication overlaps computation);
        # find_unused_parameters=True: some parameters get no gradient in a step (DDP's
        #   error at the next step names this argument);
        # static_graph=True: every step uses the same parameters, so DDP can plan ahead;
        # gradient_as_bucket_view=True: the gradients live in the buckets, saving a copy
    )
    # By default DDP broadcasts rank 0's buffers (BatchNorm's running statistics, which only
    # evaluation reads) at every forward. Off after the constructor's first copy: the epoch
    # loop copies them once, before evaluating (DDP(broadcast_buffers=False) skips both).
    ddp_model.broadcast_buffers = False
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, args.lr, steps_per_epoch * args.epochs
    )
    scaler = torch.amp.GradScaler(d.device.type, enabled=args.amp == "fp16")
    state = TrainState(model, optimizer, scheduler, scaler)
    resumed = checkpoint is not None
    if resumed:
        resume(state, checkpoint, args, d, train_loader.sampler, steps_per_epoch)
    del checkpoint  # (frees it)
    writer = Writer()
    if d.rank == 0:
        say(f"{args.arch} on {d.world_size} x {d.device.type} ({dist.get_backend()})")
        say(f"{len(train_set)} train / {len(val_set)} val images, {num_classes} classes")
        say(
            f"{state.scheduler.total_steps} steps of {args.batch_size} images x "
            f"{args.accum_steps} accum per rank"
        )

    def after_step(due=False):
        """Every rank, after each step (an epoch's last: after validation): --simulate-failure;
        a save every --save-every steps and at an epoch's end (due); a stop, saved first, if
        any rank was asked (none after the last epoch)."""
        if state.step == args.simulate_failure and d.rank == d.world_size - 1 and not resumed:
            say(f"[rank {d.rank}] simulated failure at step {state.step}")
            signal.raise_signal(signal.SIGKILL)  # abruptly, like a machine that is gone
        stop = preemption.agreed(d.device) if state.epoch < args.epochs else 0
        if stop or due or state.step % args.save_every == 0:
            phases.enter(state.step, "save")
            save(state, writer, args, d, identity)
        if stop:
            writer.finish()  # the save is on disk before this rank ends
            dist.barrier()  # (NCCL: rank 0's broadcast completes before it exits)
            if d.rank == 0:
                (args.checkpoint_dir / "preempted").touch()
                say(
                    f"stopping on {signal.Signals(stop).name} at step {state.step}: "
                    "run the same command to resume"
                )
            raise KeyboardInterrupt(stop)  # run_rank: one line, exit 128 + the signal
        phases.armed = True  # (a first step may compile)

    hooks = (phases, after_step)
    losses = []
    with phases:
        while state.epoch < args.epochs:
            train_loader.sampler.set_position(state.epoch, state.position)
            # and new augmentations: SeededAugmentation draws each image's from (epoch, index)
            train_loader.dataset.epoch = state.epoch
            loss, acc, speed = train_one_epoch(ddp_model, train_loader, state, args, d, hooks)
            losses.append(loss)
            # each rank's BatchNorm statistics followed its own shard: all take rank 0's
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
            # a stop cuts validation short (a scheduler's grace is often 30 s; evaluate's one
            # all-reduce lets ranks stop at other batches), but the last one's
            val_batches = itertools.takewhile(
                lambda batch: state.epoch == args.epochs - 1 or not preemption.asked, val_loader
            )
            phases.enter(state.step, "evaluation")
            val_loss, val_acc, val_count = evaluate(model, val_batches, d.device)
            if d.rank == 0:
                say(f"epoch {state.epoch + 1} done: train loss {loss:.4f} acc {acc:.1%}")
                say(f"  val loss {val_loss:.4f} acc {val_acc:.1%} on {val_count:.0f} images")
                if val_count == len(val_set):  # not cut short by a stop
                    log_metrics(args, state, val_loss=val_loss, val_acc=val_acc, img_s=speed)
            state.epoch += 1
            state.position = 0
            after_step(due=True)
        writer.finish()  # the last write on disk (or all stop on its error)
        verified = verify_replicas_identical(model, d)

    # ---- after training: the saved model, the summary -------------------------------------
    if d.rank == 0:
        if args.save_model:  # the plain model: its keys have no "module."
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)
            write_atomic(args.save_model, buffer.getvalue())
        if not losses:  # its checkpoint was the run's last
            say(f"the run had finished at step {state.step}: nothing to train")
        else:
            say(f"summary: {state.step} steps, {speed:.1f} img/s over all ranks (the last epoch's)")
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
    # torchvision's ImageNet recipe. Small images (digits, icons): RandomResizedCrop(size,
    # scale=(0.6, 1)), no flip.
    augment = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor()])
    centre = T.Compose([T.Resize(size * 8 // 7), T.CenterCrop(size), T.ToTensor()])  # 224 of 256
    train_set = image_folder(args.data / "train", augment)
    val_set = image_folder(args.data / "val", centre)
    # each split numbers its own class folders: a class missing from one shifts the labels
    if train_set.classes != val_set.classes:
        raise SetupError(f"--data {args.data}: train and val hold different class folders")
    return train_set, val_set, len(train_set.classes)


def data_identity(args, train_set):
    """What the training data is, not where it lies, for a resume to compare: the number of
    images and the classes (no file is opened). Your own data: what identifies it (a
    version, a manifest's sha256)."""
    if not args.data:
        return f"{args.train_size} synthetic"
    return f"{len(train_set)} in classes {train_set.classes}"


def synthetic_images(count, size, split):
    """Learnable and deterministic: class c is a fixed random 8x8 colour pattern, upsampled,
    plus noise; split 0 (train) and 1 (val) draw different images."""
    g = torch.Generator().manual_seed(0)
    patterns = F.interpolate(torch.randn(10, 3, 8, 8, generator=g), size=size, mode="bilinear")
    g.manual_seed(1 + split)
    labels = torch.randint(10, (count,), generator=g)
    noise = torch.randn(count, 3, size, size, generator=g)
    return TensorDataset(patterns[labels] + 1.5 * noise, labels)


def image_folder(root, transform):
    """torchvision's ImageFolder: root/CLASS/IMAGE, each image read by load_image."""
    try:
        return ImageFolder(root, transform, loader=load_image)
    except (OSError, RuntimeError) as e:  # not a folder, no class folders, or no images
        raise SetupError(f"--data {root}: {e}") from e


def load_image(path):
    """The image at path in RGB, or a SetupError naming the file (truncated, not an image)."""
    try:
        image = PIL.Image.open(path)
        if image.mode == "I;16":  # 16-bit greyscale: to 8 bits, or RGB clips it to white
            image = image.point(lambda value: value / 256)
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise SetupError(f"cannot read image {path}: {e}") from None


def make_loaders(args, d, train_set, val_set):
    """This rank's training loader (its DistributedSampler's shard) and validation loader."""
    cuda = d.device.type == "cuda"
    workers = args.workers
    if workers is None:
        workers = min(8, torch.get_num_threads()) if cuda else 0
    train_loader = DataLoader(
        SeededAugmentation(train_set),
        args.batch_size,
        # this rank's shard of a shuffled order, padded: every rank gets as many batches, as
        # DDP needs (each all-reduce waits for every rank)
        sampler=ResumableSampler(train_set),
        num_workers=workers,
        worker_init_fn=quiet_worker,  # a stop is the rank's to make
        pin_memory=cuda,  # page-locked: copies to the GPU run async
        drop_last=True,  # full batches only (a batch of one image can fail BatchNorm)
    )
    # Validation: rank r takes samples r, r+W, r+2W, ...: each counts once (DistributedSampler
    # would repeat some: 05_eval_gather.py)
    val_shard = Subset(val_set, range(d.rank, len(val_set), d.world_size))
    val_loader = DataLoader(
        val_shard,
        args.batch_size,
        num_workers=workers,
        worker_init_fn=quiet_worker,
        pin_memory=cuda,
    )
    return train_loader, val_loader


def quiet_worker(worker_id):
    """A DataLoader worker ignores the signals that stop a job (SLURM and `timeout` signal the
    whole process group): a dead worker would end its rank before it saved."""
    handle(STOP_SIGNALS, signal.SIG_IGN)


@dataclass
class SeededAugmentation(Dataset):
    """The training set, each sample's random augmentation drawn from a seed of its own (the
    epoch and its index), not from the stream of whichever worker or rank loads it: a resumed
    run, on any number of ranks, draws what the interrupted one would have. (torch's
    generator: an augmentation that draws from `random` or NumPy needs them seeded too.)"""

    dataset: Dataset
    # set before each iter(loader), which gives the workers a copy (not persistent_workers)
    epoch: int = 0

    def __getitem__(self, index):
        with torch.random.fork_rng(devices=[]):  # this process's own stream is left as it was
            # the CPU's generator alone: torch.manual_seed would reseed the GPU's (dropout's)
            torch.default_generator.manual_seed(self.epoch * len(self.dataset) + index)
            return self.dataset[index]


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way into an epoch. DistributedSampler deals
    every world_size-th index of one shuffled order to each rank, so s full steps of b images
    on W ranks use exactly the order's first s*b*W positions. A resume deals the rest over
    the ranks it has now: none is skipped, none repeats but the padding (the order's head,
    as DistributedSampler pads)."""

    def set_position(self, epoch, start):
        self.set_epoch(epoch)  # same seed + epoch on every rank: one order they all agree on
        self.start = start
        # len(): this rank's share
        self.num_samples = math.ceil((len(self.dataset) - start) / self.num_replicas)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=g).tolist()
        rest = order[self.start :]
        rest += order[: -len(rest) % self.num_replicas]  # padding: the order's head
        return iter(rest[self.rank :: self.num_replicas])


# ---- your model: any nn.Module; replace build_model() ------------------------------------
def build_model(args, num_classes):
    kwargs = {}
    if args.norm == "group":  # no batch statistics: the same model however the batch is split
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(32, channels)
    model = torchvision.models.get_model(args.arch, num_classes=num_classes, **kwargs)
    # GPUs: BatchNorm statistics over the global batch (SyncBatchNorm refuses CPU tensors):
    # model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


@dataclass
class TrainState:
    """What training changes as it goes, in one place, with state_dict() and load_state_dict()
    (torch.distributed.checkpoint's Stateful): what a checkpoint saves and a resume restores."""

    model: nn.Module  # not the DDP wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # one-cycle: it steps with every step
    scaler: torch.amp.GradScaler  # fp16's loss scale; a no-op unless --amp fp16
    epoch: int = 0  # the epoch in progress
    step: int = 0  # optimizer steps taken: the global step
    position: int = 0  # images of this epoch's order consumed, over all ranks (the sampler's)

    def state_dict(self):
        """Each part's own state_dict(), and the numbers as they are: a field added above is
        saved and restored too."""
        return {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in vars(self).items()}

    def load_state_dict(self, saved):
        for k, v in vars(self).items():
            if hasattr(v, "state_dict"):
                v.load_state_dict(saved[k])
            else:
                setattr(self, k, saved[k])


def train_one_epoch(model, loader, state, args, d, hooks):
    """One pass over this rank's shard (model: the DDP wrapper): the epoch's loss and accuracy
    over all ranks, and its images per second."""
    phases, after_step = hooks  # main's forensics, and its saves and stops
    model.train()
    amp = AMP_DTYPES.get(args.amp)
    started = time.perf_counter()
    sums = torch.zeros(3, device=d.device)  # loss sum, correct, images
    batches = iter(loader)
    steps = len(loader) // args.accum_steps  # whole steps: a partial one's gradients never sync
    for i in range(steps):
        step_sums = sums.new_zeros(3)  # the same, for this step alone
        # this step's random numbers (dropout) from the rank and the step, not main's seed:
        # a resumed run draws what the interrupted one would have, with no state to save
        torch.manual_seed(d.rank + 1_000_003 * state.step)
        step = state.step + 1  # the step in progress, as progress lines count: "step 3, data"
        for k in range(args.accum_steps):
            phases.enter(step, "data")
            images, labels = next(batches)
            phases.enter(step, "forward")  # from the copies to the device
            images = images.to(d.device, non_blocking=True)
            labels = labels.to(d.device, non_blocking=True)
            # no_sync: the first K-1 micro-batches' backward passes only add up gradients
            # here; the K-th all-reduces the sum, averaged over the ranks: with loss / K, the
            # global batch's mean. The forward must run inside no_sync (DDP decides there).
            sync = k == args.accum_steps - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast(d.device.type, dtype=amp, enabled=amp is not None):
                    logits = model(images)
                    loss = F.cross_entropy(logits, labels)  # the mean over this rank's batch
                # backward, with the gradient all-reduce (it waits for the slowest rank)
                phases.enter(step, "backward")
                state.scaler.scale(loss / args.accum_steps).backward()
            # running sums stay on the device: no GPU wait
            step_sums[0] += loss.detach() * len(labels)
            step_sums[1] += (logits.argmax(1) == labels).sum()
            step_sums[2] += len(labels)
        sums += step_sums  # before the progress line all-reduces step_sums in place
        state.scaler.step(state.optimizer)  # optimizer.step(), skipped if fp16 overflowed
        state.scaler.update()
        state.optimizer.zero_grad()
        state.scheduler.step()
        state.step += 1
        state.position += args.global_batch

        # the progress line: this step's loss and accuracy over every rank's images (logged
        # before this step's save, so that a resume from it finds the line)
        if state.step % args.log_every == 0:
            phases.enter(state.step, "progress line")
            step_loss, step_acc, _ = all_reduce_metrics(step_sums)  # every rank
            seconds, slowest = phases.slowest()
            if d.rank == 0:
                say(
                    f"epoch {state.epoch + 1}  step {state.step:>5}/{state.scheduler.total_steps}"
                    f"  loss {step_loss:.4f}  acc {step_acc:6.1%}{slowest}"
                )
                log_metrics(args, state, loss=step_loss, acc=step_acc, rank_seconds=seconds)
        if i < steps - 1:  # (the last: main's, after validation)
            after_step()  # every rank
    loss, acc, images = all_reduce_metrics(sums)  # the whole epoch: every rank's
    return loss, acc, images / (time.perf_counter() - started)  # (.tolist() waited for the GPU)


def all_reduce_metrics(sums):
    """Every rank calls it: (loss sum, correct, images) summed over all ranks, as the mean loss,
    the accuracy and the count; all stop together if the loss is not finite."""
    dist.all_reduce(sums)
    loss_sum, correct, count = sums.tolist()
    check(math.isfinite(loss_sum), "finite loss", f"the loss is {loss_sum}: lower --lr")
    return loss_sum / (count or 1), correct / (count or 1), count


@torch.no_grad()
def evaluate(model, loader, device):
    """The loss and accuracy over every rank's validation shard, and the number of images."""
    # the plain model, not DDP: no gradient sync is wanted, and ranks' batch counts may differ
    model.eval()
    sums = torch.zeros(3, device=device)  # loss sum, correct, images
    for images, labels in loader:
        logits = model(images.to(device))
        labels = labels.to(device)
        sums[0] += F.cross_entropy(logits, labels, reduction="sum")
        sums[1] += (logits.argmax(1) == labels).sum()
        sums[2] += len(labels)
    return all_reduce_metrics(sums)  # every rank, whatever its number of batches


def verify_replicas_identical(model, d):
    """Every rank holds the same parameters and buffers: their sha256, compared across ranks."""
    tensors = model.state_dict().values()
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.cpu().double().numpy().tobytes())  # (NumPy has no bfloat16)
    digest = sha.hexdigest()
    digests = [None] * d.world_size
    dist.all_gather_object(digests, digest)
    check(len(set(digests)) == 1, "identical replicas", f"sha256 by rank: {digests}")
    return (
        f"{d.world_size} rank(s) hold identical parameters and buffers "
        f"({sum(t.numel() for t in tensors):,} values, sha256 {digest[:16]})"
    )


# ---- metrics: --metrics PATH, JSON lines for plot_metrics.py -----------------------------
def log_metrics(args, state, **fields):
    """--metrics: rank 0 appends one JSON line to the file: the step, the learning rate and
    the fields. plot_metrics.py draws the learning curve from it."""
    if args.metrics:
        with open(args.metrics, "a") as f:  # lr: the next step's
            print(
                json.dumps(dict(step=state.step, lr=state.scheduler.get_last_lr()[0], **fields)),
                file=f,
            )


# ---- stopping: a signal asks to stop, the ranks agree at a step boundary -----------------
class Preemption:
    """A stop asked for by SIGTERM or SIGUSR1. The handler only sets a flag (no collective
    may run inside one); the ranks agree on it after every step."""

    def __init__(self):
        self.asked = 0  # the signal that asked to stop; 0: none
        self.in_flight = (torch.zeros(1), lambda: None)  # the last step's flags, and a wait
        # instead of run_rank's handler, which ends the rank at once: a scheduler's warning
        # before its SIGKILL (SIGTERM; sbatch --signal=USR1@120, say) saves first
        handle((signal.SIGTERM, signal.SIGUSR1), self.ask)

    def ask(self, signum, frame):
        self.asked = signum

    def agreed(self, device):
        """Every rank calls it at the same step; it returns the signal that any rank was asked
        to stop by, or 0. Each call starts an all-reduce (MAX) of this step's flags and
        returns the previous call's result, which arrived long ago: no rank waits here for a
        slower one, and a stop takes effect one step after it was asked."""
        flag = torch.full([1], self.asked, device=device)  # (torch.tensor would sync)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        arrived = work.wait  # Gloo: the host waits for it
        if flag.is_cuda:  # NCCL: the GPU waits for it and copies the result to the host
            work.wait()
            flag = flag.to("cpu", non_blocking=True)
            arrived = torch.cuda.current_stream().record_event().synchronize  # for the copy
        (flag, arrived), self.in_flight = self.in_flight, (flag, arrived)
        arrived()
        return int(flag)


# ---- forensics: where each rank is, and which rank the others waited for -----------------
class Phases(contextlib.AbstractContextManager):
    """This rank's phase ("step 5, forward") and its seconds in data loading and in forward,
    in memory. A thread ends a rank stuck in one phase for --timeout; within `with phases:`,
    a failed collective's line ends with the phase too."""

    def __init__(self, d, args):
        self.d = d
        self.limit = args.timeout
        self.stacks = f"{args.checkpoint_dir}/stacks_rank_{d.rank}"
        self.cuda = d.device.type == "cuda"
        self.where = self.phase = "start"
        self.armed = False  # from step 1's end (watch)
        self.since = time.perf_counter()
        self.seconds = {"data": 0.0, "forward": 0.0}
        self.events = []  # GPUs: CUDA events at forwards' starts and ends
        threading.Thread(target=self.watch, daemon=True).start()
        faulthandler.enable()  # stacks if NCCL's watchdog aborts the rank

    def enter(self, step, phase):
        now = time.perf_counter()
        if self.phase in self.seconds:
            self.seconds[self.phase] += now - self.since
        self.since = now
        self.phase = phase
        self.where = f"step {step}, {phase}"
        # GPUs: CUDA events around each forward, 1,000 at most
        if self.cuda and phase in ("forward", "backward") and len(self.events) < 2000:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()

    def watch(self):
        """The thread, once a second. It counts its own seconds in a watched phase: a
        suspended job is not stuck."""
        entered = still = 0  # when the phase seen last began; this thread's seconds in it
        while True:
            # data from the start, the rest once armed, but a (long) evaluation
            watched = self.phase == "data" or self.armed and self.phase != "evaluation"
            still = still + 1 if watched and self.since == entered else 0
            entered = self.since
            if still > self.limit:
                signal.alarm(10)  # SIGALRM ends the rank if what follows hangs
                sys.stderr.write(
                    f"[rank {self.d.rank}] stuck for {still} s in {self.where} ({self.stacks})\n"
                )
                try:
                    faulthandler.dump_traceback(open(self.stacks, "w"))
                    # the flight recorder's record, by the engine's own name: gloo (none in torch
                    # 2.4.1: to the finally), nccl2, or the legacy engine's nccl
                    engine = dist.group.WORLD._get_backend(self.d.device).name()
                    c10d = torch._C._distributed_c10d
                    record = (
                        c10d._dump_nccl_trace()
                        if engine == "nccl"
                        else c10d._dump_fr_trace(backend=engine)
                    )
                    Path(f"{os.environ['TORCH_FR_DUMP_TEMP_FILE']}{self.d.rank}").write_bytes(
                        record
                    )
                finally:  # workers last: their SIGCHLD would raise in the main thread
                    for worker in mp.active_children():
                        worker.kill()
                    os._exit(1)
            time.sleep(1)

    def slowest(self):
        """Every rank, at a progress line: the slowest rank's [data, forward] seconds since the
        last one, and "" or "  slowest: rank 2 (data +0.27s)": the rank the others waited
        for, its seconds over the median's (most of them in data), named when that excess is
        at least the median (the rank took twice as long) and 0.1 s. On GPUs the forward's
        time is the GPU's."""
        if self.events:  # (the progress line's .tolist() waited for them)
            # each forward's (start, end) events: milliseconds between them
            pairs = zip(self.events[::2], self.events[1::2])
            self.seconds["forward"] = sum(a.elapsed_time(b) for a, b in pairs) / 1000
            self.events = []
        table = torch.zeros(self.d.world_size, 2, device=self.d.device)
        table[self.d.rank] = torch.tensor([*self.seconds.values()])  # [data, forward]
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        dist.all_reduce(table)  # each rank's own row (zeros elsewhere): all rows
        before = table.sum(1)
        rank = int(before.argmax())
        logged = {rank: table[rank].tolist()}  # not every rank's: 8,192 ranks, say
        median = before.median()
        excess = before[rank] - median
        if excess < max(median, 0.1):
            return logged, ""
        in_data, in_forward = table[rank] - table.median(0).values
        phase = "data" if in_data > in_forward else "forward"
        return logged, f"  slowest: rank {rank} ({phase} +{excess:.2f}s)"

    def __exit__(self, kind, error, trace):
        self.limit = math.inf  # (never fires)
        # a failed collective's error gains the phase
        if re.search("gloo/|pair closure|NCCL Last Error", str(error)):
            raise SetupError(f"{kind.__name__}: {str(error).strip()}; in {self.where}")


# ---- checkpoints: DIR/step-00000040.pt beside DIR/step-00000040.pt.sha256 (sha256sum's) --
def choose_checkpoint(folder, identity, d):
    """Every rank, before any work: rank 0 locks the folder and reads the newest checkpoint
    that verifies and fits identity, and one broadcast gives every rank its path and
    contents (None: from step 0) or why the job cannot go on: one read from storage,
    not one per rank."""
    choice = [None, None]  # (path, the checkpoint) to resume from; rank 0's error
    if d.rank == 0:
        try:
            lock(folder)
            choice[0] = newest_readable(folder, identity)
        except (SetupError, OSError) as e:  # every rank must hear it, or the others wait
            choice[1] = str(e)
    dist.broadcast_object_list(choice, src=0)
    if choice[1]:
        raise SetupError(choice[1])
    return choice[0]


def lock(folder):
    """Rank 0 holds DIR/.lock while its job lives: a second job there would prune and
    overwrite its checkpoints. Also: the folder must be writable (not only the lock file);
    a killed save's temporary files and DIR/preempted (this run's to write) go."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
        # held until this process exits (lockf: its forked workers do not inherit it)
        fcntl.lockf(
            os.open(folder / ".lock", os.O_RDWR | os.O_CREAT), fcntl.LOCK_EX | fcntl.LOCK_NB
        )
    except BlockingIOError:
        raise SetupError(
            f"another job holds {folder}/.lock: use another --checkpoint-dir, or wait"
        ) from None
    except OSError as e:  # not a folder, read-only, or a filesystem without locks
        raise SetupError(f"cannot write checkpoints in {folder}: {e.strerror}") from None
    for leftover in folder.glob(".step-*.tmp*"):
        leftover.unlink()
    (folder / "preempted").unlink(missing_ok=True)


def newest_readable(folder, identity):
    """Rank 0: (path, contents) of the newest checkpoint that verifies, or None; it must fit
    identity. Newer ones that do not are renamed *.unreadable, for a person to look at (and
    out of prune's way)."""
    for path in checkpoints_in(folder):
        try:
            saved = read_checkpoint(path)
        except SetupError as e:
            sys.stderr.write(f"WARNING: {e}; renamed it *.unreadable\n")
            path.rename(f"{path}.unreadable")
            continue
        there = saved["args"]  # a resume must share identity with its checkpoint
        differ = [
            f"{k} {there.get(k)} there, {v} here" for k, v in identity.items() if there.get(k) != v
        ]
        if differ:
            raise SetupError(
                f"{path} was written with other settings: {'; '.join(differ)}. "
                "Resume with the same ones or use another --checkpoint-dir"
            )
        return path, saved
    say(f"no checkpoint in {folder}: starting from step 0")


def checkpoints_in(folder):
    """The checkpoints in folder, newest first: step-N.pt by the number N, of any length. A
    name that is not a number (a user's step-best.pt) is never loaded and never pruned."""
    paths = [path for path in folder.glob("step-*.pt") if path.stem[5:].isdigit()]
    return sorted(paths, key=lambda path: -int(path.stem[5:]))


def read_checkpoint(path):
    """The checkpoint at path, loaded onto the CPU once its sha256 matches; or a SetupError
    that names it and says why not."""
    sha256 = Path(f"{path}.sha256")  # sha256sum's format, written last
    if not sha256.exists():
        raise SetupError(f"{path.name}: no {sha256.name}: the save did not finish")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256.read_text()[:64]:
        raise SetupError(
            f"{path.name}: sha256 mismatch ({len(data)} bytes): truncated or corrupted"
        )
    # Onto the CPU (load_state_dict copies each tensor to its parameter's device);
    # weights_only: tensors and plain containers, no code runs.
    try:
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if "args" in saved:
            return saved
    except Exception:  # weights_only refused a class
        pass
    raise SetupError(f"{path.name}: not a checkpoint of this script")


def resume(state, checkpoint, args, d, sampler, steps_per_epoch):
    """Every rank: the checkpoint rank 0 chose, (path, contents), loaded into the training
    state; with other processes, batch or --epochs, from the same place in the data, on a
    one-cycle schedule rebuilt for the new number of steps. state.position counts the images
    of this epoch's order used so far, over all ranks; the sampler deals the rest: this
    rank's share, in whole steps, is the steps left."""
    path, saved = checkpoint
    try:
        state.load_state_dict(saved)
    except (RuntimeError, KeyError, ValueError) as e:  # build_model changed, say
        raise SetupError(f"{path} does not fit this model or optimizer: {e}") from e
    sampler.set_position(state.epoch, state.position)
    left = len(sampler) // args.batch_size // args.accum_steps  # steps left in this epoch
    total = state.step + left + steps_per_epoch * (args.epochs - state.epoch - 1)
    done = f"epoch {state.epoch + 1} with {state.position} of its images done"
    if total < state.step:
        raise SetupError(f"--epochs {args.epochs} ends before {path.name}: {done}")
    planned = state.scheduler.total_steps  # the checkpoint's plan (loaded)
    # last_epoch: the step reached (OneCycleLR reads the loaded initial_lr)
    if total != planned:
        state.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            state.optimizer, args.lr, total, last_epoch=state.step - 1
        )
    was = (saved["global_batch"], planned)
    now = (args.global_batch, total)
    if d.rank == 0:
        say(f"resuming from {path}: {done}, global step {state.step}")
        if was != now:
            say(
                f"global batch, steps: {was} -> {now} "
                "(global batch = world size x --batch-size x --accum-steps)"
            )


def save(state, writer, args, d, identity):
    """Every rank, at the same step: the previous write must have finished; then rank 0
    serialises the state, and the Writer's thread writes the bytes while training goes on."""
    # rank 0 may still be writing the last (slow disk: a longer --timeout)
    writer.finish()
    if d.rank == 0:
        saved = state.state_dict() | {
            "global_batch": args.global_batch,
            "args": identity,
        }
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        path = args.checkpoint_dir / f"step-{state.step:08d}.pt"
        writer.thread = threading.Thread(
            target=writer.write, args=(buffer.getvalue(), path, args.keep)
        )
        writer.thread.start()


class Writer:
    """Rank 0's thread (save() starts it) that writes one checkpoint while training goes on."""

    thread = None  # the write under way, if any
    error = None  # how the last write failed, if it did

    def write(self, data, path, keep):
        """The thread: the file, then its sha256 (each atomically; the sha256 marks the
        checkpoint finished), then all but the newest keep deleted."""
        try:
            write_atomic(path, data)
            write_atomic(
                Path(f"{path}.sha256"),
                f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode(),
            )
            prune(path.parent, keep)
            say(f"saved {path.name}")
        except Exception as e:  # noqa: BLE001 - any: finish() reports it on every rank
            self.error = f"rank 0 could not write a checkpoint: {e}"

    def finish(self):
        """Every rank: rank 0 waits for its write; all raise its error, if any, so that none
        trains on alone. (A rank ending on an error or a signal does not wait: that write is
        lost, not the earlier ones.)"""
        if self.thread:
            self.thread.join()
        error = [self.error]
        dist.broadcast_object_list(error, src=0)
        if error[0]:
            raise SetupError(error[0])


def prune(folder, keep):
    """All but the newest keep checkpoints deleted, each marker first (without it, a
    checkpoint is never loaded)."""
    for path in checkpoints_in(folder)[keep:]:
        Path(f"{path}.sha256").unlink(missing_ok=True)
        path.unlink(missing_ok=True)


def attempt_store(timeout):
    """Where torchrun shares its agent's store with the workers (torch 2.15), a TCPStore of
    this attempt's own, hosted by rank 0: the agent's outlives a restart with the dead
    attempt's keys, which a new group would take for its own (NOTES.md). Rank 0 posts its
    port in the agent's store. Otherwise None: init's own store."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    host = env["MASTER_ADDR"]
    limit = timedelta(seconds=timeout)
    agent = dist.TCPStore(host, int(env["MASTER_PORT"]), is_master=False, timeout=limit)
    if env["RANK"] == "0":
        store = dist.TCPStore(host, 0, is_master=True, timeout=limit)
        agent.set("ddp_by_example/store_port", str(store.port))
        return store
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        port = int(agent.get("ddp_by_example/store_port"))
        try:
            socket.create_connection((host, port), timeout=5).close()
            return dist.TCPStore(host, port, is_master=False, timeout=limit)
        except OSError:  # refused: the key holds the last attempt's port (a restart)
            time.sleep(0.1)
    raise SetupError(f"rank 0 posted no live store within {timeout:g}s")


def write_atomic(path, data):
    """The whole file or nothing: written beside it, synced, renamed over it; an error names
    the file."""
    tmp = path.with_name(f".{path.name[:50]}.tmp{os.getpid()}")  # (a name has 255 bytes)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, path)  # a reader sees the old file or the new one
    except OSError as e:
        raise SetupError(f"cannot write {path}: {e.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)  # after a failure, nothing is left


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
        "--log-every",
        type=positive,
        default=10,
        help="steps between progress lines (default: %(default)s)",
    )
    add("--save-model", type=output_file, metavar="PATH", help="rank 0 saves the weights there")
    add("--metrics", type=output_file, metavar="PATH", help="rank 0 appends JSON lines there")
    add(
        "--checkpoint-dir",
        type=Path,
        default="checkpoints",
        help="on storage every node sees (default: %(default)s)",
    )
    add(
        "--save-every",
        type=positive,
        default=20,
        help="also save every N steps, mid-epoch (default: %(default)s)",
    )
    add("--keep", type=positive, default=3, help="newest checkpoints kept (default: %(default)s)")
    add(
        "--simulate-failure",
        type=positive,
        metavar="STEP",
        help="the last rank SIGKILLs itself at this global step, in a run that did not resume "
        "(past a save, or each restart dies there again)",
    )
    add_launch_args(parser)
    return parser


def output_file(text):
    """An argparse type for a file the job writes: not a folder, and in a folder it may write
    in, so that a bad path ends the run before any work is done."""
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
    """Rank 0's story, a line at a time (flushed: os._exit leaves buffers unwritten)."""
    print(text, flush=True)


def number(cast, low):
    """An argparse type: a number with low <= value < 2**32, which nan and inf never are."""

    def parse(text):
        value = cast(text)
        if not low <= value < 4294967296:  # 2**32
            raise argparse.ArgumentTypeError(f"must be >= {low} and < 4294967296, got {text}")
        return value

    return parse


def add_launch_args(parser):
    parser.add_argument(
        "--spawn",
        type=number(int, 1),
        help="start SPAWN processes with mp.spawn (on GPUs: one per GPU)",
    )
    parser.add_argument(
        "--timeout",
        type=number(float, 0.1),
        default=300.0,
        help="seconds to wait for a peer or a collective (default: %(default)g)",
    )


def launch(main, args):
    """Run main(args) on every rank: under torchrun, with --spawn N, or as one process."""
    if torch.__version__ < (2, 4):  # a TorchVersion compares as numbers
        sys.exit(f"error: needs torch >= 2.4; torch {torch.__version__} is installed")
    if "RANK" in os.environ:  # a launcher (torchrun) started this process
        run_rank(None, main, args)  # (never returns)
    n = args.spawn or 1  # without --spawn: a world of one
    with socket.create_server(("127.0.0.1", 0)) as s:  # a free port
        port = s.getsockname()[1]
    # as torchrun would set them; run_rank adds RANK and LOCAL_RANK
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n)
    )
    if not args.spawn:
        run_rank(0, main, args)
    # a signal sent to this process alone (Kubernetes signals a container's first process)
    # goes on to every rank, as torchrun forwards it
    handle(STOP_SIGNALS[1:], forward)
    try:
        mp.spawn(run_rank, (main, args), n)  # waits for all; raises if one failed
    except mp.ProcessExitedException as e:  # that rank has said why
        sys.exit(f"error: spawned process {e.error_index} exited with code {e.exit_code}")
    except KeyboardInterrupt:  # each rank has said so too
        sys.exit(130)  # 128 + SIGINT


def forward(signum, frame):
    for rank in mp.active_children():
        os.kill(rank.pid, signum)


# Ctrl-C, a scheduler's warning (SIGTERM; SIGUSR1 from sbatch --signal), a closed terminal:
# each ends a rank with one line
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def run_rank(index, main, args):
    """Run main(args), then end the process: exit 0, or one line naming the rank and a
    non-zero exit."""
    if index is not None:  # from mp.spawn
        os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(index)
    handle(STOP_SIGNALS, stop)
    code = 1
    why = ""
    try:
        try:
            main(args)
            code = 0
        except CheckFailed as e:
            why = f"CHECK FAILED: {e}"
        except (SetupError, dist.DistError) as e:
            # (a DataLoader worker's SetupError ends torch's text)
            why = "error: " + str(e).rpartition("SetupError: ")[2]
        except Exception as e:
            why = f"error: {type(e).__name__}: {e}"
            # A failed collective (a peer gone, or timed out): Gloo's errors name its files
            # (".../gloo/...") or say "pair closure"; torch 2.15's NCCL's end "NCCL Last
            # Error". Anything else is a bug: keep its traceback.
            if not re.search("gloo/|pair closure|NCCL Last Error", why):
                traceback.print_exc()
        finally:
            # ending already: a signal now would garble the line
            handle(STOP_SIGNALS, signal.SIG_IGN)
    except KeyboardInterrupt as e:  # from stop(); a rank ending on its own error keeps it
        if not why:
            code = 128 + e.args[0]
            why = f"stopped by {signal.Signals(e.args[0]).name}"
    # out of the except blocks, the exception's frames are freed (DataLoader workers end)
    if why:  # one write, one line
        sys.stderr.write(f"[rank {os.environ['RANK']}] {' '.join(why.split())}\n")
    atexit._run_exitfuncs()  # exit hooks (a logger's), which os._exit skips
    os._exit(code)  # no interpreter shutdown, no destroy_process_group: NOTES.md says why


def handle(signals, handler):
    for sig in signals:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            signal.signal(sig, handler)


def stop(signum, frame):
    # the rank unwinds as on Ctrl-C; run_rank names the signal
    raise KeyboardInterrupt(signum)


def setup(timeout, store=None):
    """Check the launcher's variables, bind this process to its device, join the group;
    returns who this process is in the job (d: rank, world_size, device)."""
    # set by the launcher; -1: not set
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    rank, world, local_rank, local_world = [int(os.getenv(v, -1)) for v in names]
    if not (0 <= rank < world and 0 <= local_rank < local_world):
        raise SetupError(
            f"the launcher's variables are invalid: RANK {rank}, WORLD_SIZE {world}, "
            f"LOCAL_RANK {local_rank}, LOCAL_WORLD_SIZE {local_world} (-1: not set)"
        )
    device = bind_device(local_rank, local_world)
    cuda = device.type == "cuda"
    # A thread joins, so that the deadline or Ctrl-C ends the wait (torch's store waits in
    # C++, past its timeout too). device_id: NCCL connects now, on this GPU.
    try:
        ThreadPoolExecutor(1).submit(
            dist.init_process_group,
            "nccl" if cuda else "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
            device_id=device if cuda else None,
        ).result(timeout + 2)
    except Exception as e:  # torch's error (C++ adds a stack trace), or our deadline's
        why = str(e).partition("\n")[0] or f"not all of {world} ranks joined within {timeout:g}s"
        raise SetupError(
            "cannot join the process group at env:// at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}: {why}"
        ) from None
    return argparse.Namespace(rank=rank, world_size=world, device=device)  # d


def bind_device(local_rank, local_world):
    """This process's share of the cores for torch's threads; NCCL: its GPU, bound before init."""
    # the cores this process may run on (Linux), shared by the node's ranks
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    # More processes than GPUs: refused, unless one GPU is visible and CUDA_VISIBLE_DEVICES
    # is set (the launcher gave each process its own: srun --gpus-per-task=1)
    if local_world > gpus and (gpus != 1 or "CUDA_VISIBLE_DEVICES" not in os.environ):
        raise SetupError(f"{local_world} processes here, {gpus} GPU(s): NCCL needs a GPU each")
    device = torch.device("cuda", local_rank % gpus)  # GPU ids restart per node
    torch.cuda.set_device(device)  # before init: nothing lands on GPU 0
    return device


# ==== shared plumbing: end =================================================================


if __name__ == "__main__":
    launch(main, build_parser().parse_args())
