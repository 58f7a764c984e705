r"""03_ddp_train.py: train a torchvision classifier with DistributedDataParallel.

Run
  torchrun --standalone --nproc_per_node 2 03_ddp_train.py        # 2 processes (GPUs or CPU)
  python 03_ddp_train.py --spawn 2                                 # the same via mp.spawn
  python 03_ddp_train.py                                           # one process
  python 03_ddp_train.py --data /data/imagenette --arch resnet50 --image-size 224 --amp bf16
  # two nodes, 4 GPUs each: run on both machines
  torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 03_ddp_train.py --epochs 10

Every process holds a replica of the model and trains on its own shard of each global
batch; DDP averages the gradients during backward, so the replicas stay equal (checked at
the end) and N processes with batch b take the steps one process with batch N*b would (but
for BatchNorm's per-rank statistics, which --norm group removes, and dropout's random
numbers). The global batch is
world size x --batch-size x --accum-steps: keep it to train the same.

Your own model and data: replace build_model() and build_datasets(). A job that must
survive restarts and preemption: 04_checkpoint.py is this file plus what it needs.
"""

from __future__ import annotations  # (unevaluated: an old torch reaches launch()'s check)

import argparse
import atexit
import contextlib
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
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset
from torchvision.datasets.folder import ImageFolder

# The shared plumbing is at the bottom of this file, the same in all six scripts: setup()
# joins the process group and returns d (rank, world_size, device). Read it last, or not
# at all.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --amp's choices


def main(args):
    d = setup(args.timeout)
    # GPUs: cuDNN times its algorithms once per input shape, keeps the fastest
    torch.backends.cudnn.benchmark = True
    train_set, val_set, num_classes = build_datasets(args)
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
    torch.manual_seed(d.rank)  # but each rank its own dropout (the sampler seeds its shuffle)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, args.lr, steps_per_epoch * args.epochs
    )
    scaler = torch.amp.GradScaler(d.device.type, enabled=args.amp == "fp16")
    state = TrainState(model, optimizer, scheduler, scaler)
    if d.rank == 0:
        say(f"{args.arch} on {d.world_size} x {d.device.type} ({dist.get_backend()})")
        say(f"{len(train_set)} train / {len(val_set)} val images, {num_classes} classes")
        say(
            f"{state.scheduler.total_steps} steps of {args.batch_size} images x "
            f"{args.accum_steps} accum per rank"
        )
    losses = []
    while state.epoch < args.epochs:
        train_loader.sampler.set_epoch(state.epoch)  # one new shuffle for all ranks; each its shard
        loss, acc, speed = train_one_epoch(ddp_model, train_loader, state, args, d)
        losses.append(loss)
        # each rank's BatchNorm statistics followed its own shard: all take rank 0's
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        val_loss, val_acc, val_count = evaluate(model, val_loader, d.device)
        if d.rank == 0:
            say(f"epoch {state.epoch + 1} done: train loss {loss:.4f} acc {acc:.1%}")
            say(f"  val loss {val_loss:.4f} acc {val_acc:.1%} on {val_count:.0f} images")
        state.epoch += 1

    # ---- after training: the replica check, the saved model, the summary ----------------
    verified = verify_replicas_identical(model, d)
    if d.rank == 0:
        if args.save_model:  # the plain model: its keys have no "module."
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)
            write_atomic(args.save_model, buffer.getvalue())
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
        train_set,
        args.batch_size,
        # this rank's shard of a shuffled order, padded: every rank gets as many batches, as
        # DDP needs (each all-reduce waits for every rank)
        sampler=DistributedSampler(train_set),
        num_workers=workers,
        pin_memory=cuda,  # page-locked: copies to the GPU run async
        drop_last=True,  # full batches only (a batch of one image can fail BatchNorm)
    )
    # Validation: rank r takes samples r, r+W, r+2W, ...: each counts once (DistributedSampler
    # would repeat some: 05_eval_gather.py)
    val_shard = Subset(val_set, range(d.rank, len(val_set), d.world_size))
    val_loader = DataLoader(val_shard, args.batch_size, num_workers=workers, pin_memory=cuda)
    return train_loader, val_loader


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
    """What training changes as it goes, in one place: 04_checkpoint.py saves it."""

    model: nn.Module  # not the DDP wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # one-cycle: it steps with every step
    scaler: torch.amp.GradScaler  # fp16's loss scale; a no-op unless --amp fp16
    epoch: int = 0  # the epoch in progress
    step: int = 0  # optimizer steps taken: the global step


def train_one_epoch(model, loader, state, args, d):
    """One pass over this rank's shard (model: the DDP wrapper): the epoch's loss and accuracy
    over all ranks, and its images per second."""
    model.train()
    amp = AMP_DTYPES.get(args.amp)
    started = time.perf_counter()
    sums = torch.zeros(3, device=d.device)  # loss sum, correct, images
    batches = iter(loader)
    steps = len(loader) // args.accum_steps  # whole steps: a partial one's gradients never sync
    for _ in range(steps):
        step_sums = sums.new_zeros(3)  # the same, for this step alone
        for k in range(args.accum_steps):
            images, labels = next(batches)
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

        # the progress line: this step's loss and accuracy over every rank's images
        if state.step % args.log_every == 0:
            step_loss, step_acc, _ = all_reduce_metrics(step_sums)  # every rank
            if d.rank == 0:
                say(
                    f"epoch {state.epoch + 1}  step {state.step:>5}/{state.scheduler.total_steps}"
                    f"  loss {step_loss:.4f}  acc {step_acc:6.1%}"
                )
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
