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
import datetime
import hashlib
import inspect
import math
import os
import random
import re
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

# ---------------------------------------------------------------------------
# Distributed boilerplate: the same code, in the same order, in all six scripts.
# ---------------------------------------------------------------------------

# torch.amp.GradScaler("cuda"), torchvision's get_model/list_models and
# torch.load(weights_only=True) of optimizer state are all there from 2.4 on.
MIN_TORCH = "2.4"


class SetupError(RuntimeError):
    """The job cannot start as configured; the message says what to change."""


class CheckFailed(RuntimeError):
    """A property this script demonstrates did not hold."""


def check(ok: bool, name: str, detail: str) -> None:
    if not ok:
        raise CheckFailed(f"{name}: {detail}")


def require_torch(minimum: str = MIN_TORCH) -> None:
    if torch.__version__ < minimum:  # TorchVersion compares as a version, not as text
        sys.exit(f"error: these scripts need torch >= {minimum}, found {torch.__version__}")


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("launch")
    g.add_argument("--spawn", nargs="?", type=positive_int, const=0, default=None, metavar="N",
                   help="start N processes with torch.multiprocessing.spawn "
                        "(default N: one per visible GPU, else 2)")
    g.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: NCCL when this process has a CUDA GPU, else Gloo (default: auto)")
    g.add_argument("--timeout", type=positive_float, default=300.0, metavar="SECONDS",
                   help="give up on a missing peer or a stuck collective after this long "
                        "(default: 300)")


def check_launch_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl needs a CUDA GPU and torch sees none; use --backend gloo")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(main, args: argparse.Namespace) -> None:
    """Run main(args) on every rank: under torchrun, under mp.spawn, or as one process."""
    if args.spawn is not None:
        nprocs = args.spawn or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
        port = free_port()  # chosen here, so every child meets at the same place
        try:
            mp.spawn(_spawned, args=(main, args, nprocs, port), nprocs=nprocs, join=True)
        except mp.ProcessExitedException as e:  # the child already printed its reason
            sys.exit(f"error: spawned process {e.error_index} exited with code {e.exit_code}")
        return
    if "RANK" not in os.environ:  # no launcher: a world of one, through the same code path
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run_rank(main, args)


def _spawned(local_rank: int, main, args: argparse.Namespace, nprocs: int, port: int) -> None:
    # mp.spawn passes the process index first; give it the variables torchrun would set.
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run_rank(main, args)


def run_rank(main, args: argparse.Namespace) -> None:
    """Call main(args); on any failure print one line naming this rank and exit 1."""
    rank, code = os.environ.get("RANK", "?"), 0
    try:
        main(args)
    except CheckFailed as e:
        print(f"[rank {rank}] CHECK FAILED: {e}", file=sys.stderr)
        code = 1
    except (SetupError, dist.DistError, RuntimeError, ValueError, OSError) as e:
        print(f"[rank {rank}] error: {describe_error(e)}", file=sys.stderr)
        code = 1
    finally:
        teardown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without the interpreter's shutdown. DDP keeps its process group, and so Gloo's
    # worker threads, alive after destroy_process_group; a worker still releasing the last
    # collective's tensors while Python finalizes aborts the process with "terminate called
    # without an active exception" (pytorch/pytorch#190489). Everything is written by now.
    os._exit(code)


def describe_error(e: BaseException) -> str:
    text = str(e)
    lost = re.search(r"Connection reset by peer|Connection closed by peer|Broken pipe", text)
    if lost:  # what a surviving rank sees when another process dies in the middle of a job
        return (f"a peer process is gone (crashed or killed), so this collective cannot "
                f"finish; that process's own output says why ({text[:lost.end()]})")
    return text


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_backend_and_device(backend: str, local_rank: int, local_world_size: int):
    has_cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if has_cuda else "gloo"
    if backend == "gloo":
        # Gloo here means CPU tensors; spread the cores over the local processes.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // local_world_size))
        return "gloo", torch.device("cpu")
    gpus = torch.cuda.device_count()
    if local_world_size > gpus:
        raise SetupError(f"{local_world_size} processes on this node but only {gpus} GPU(s): "
                         f"start at most {gpus} per node (one process per GPU)")
    # Bind this process to its GPU before init_process_group, by LOCAL rank: GPU ids
    # restart at 0 on every node, so the global rank would point past the last GPU.
    if hasattr(torch, "accelerator"):
        torch.accelerator.set_device_index(local_rank)
    else:
        torch.cuda.set_device(local_rank)
    return "nccl", torch.device("cuda", local_rank)


def setup(backend: str, timeout: float, init_method: str = "env://") -> Dist:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend, device = pick_backend_and_device(backend, local_rank, local_world_size)
    try:
        if not init_method.startswith("env://"):
            # tcp:// and file:// name only the meeting point: each process must also say
            # who it is and how many to wait for. env:// reads both from RANK and WORLD_SIZE.
            kwargs = dict(init_method=init_method, rank=rank, world_size=world_size)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # under torchrun
            kwargs = dict(store=torchrun_attempt_store(timeout), rank=rank, world_size=world_size)
        else:
            kwargs = dict(init_method=init_method)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **kwargs)
    except (dist.DistError, RuntimeError) as e:
        raise SetupError(explain_init_failure(str(e), init_method, world_size, timeout)) from e
    return Dist(rank, local_rank, world_size, local_world_size,
                int(os.environ.get("GROUP_RANK", 0)), backend, device)


def torchrun_attempt_store(timeout: float):
    """The store torchrun's agent hosts at MASTER_ADDR:MASTER_PORT, scoped to this attempt.

    The agent keeps one store for all the restarts that --max-restarts allows. Without a
    scope, a restarted group can read the addresses the previous, dead group left there and
    connect to nothing (pytorch/pytorch#135712). Every worker of an attempt shares its count."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt_{attempt}/", store)


def explain_init_failure(message: str, init_method: str, world_size: int, timeout: float) -> str:
    where = init_method if not init_method.startswith("env://") else \
        f"env:// at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if "EADDRINUSE" in message or "address already in use" in message:
        return f"the rendezvous port is already in use ({where}); choose another port"
    joined = re.search(r"(\d+)/(\d+) clients joined", message)
    if joined:
        return (f"only {joined[1]} of {joined[2]} ranks joined within {timeout:g}s ({where}); "
                f"start the missing ranks or lower the world size")
    if "timeout" in message.lower() or "timed out" in message.lower():
        return (f"not all {world_size} ranks joined within {timeout:g}s ({where}); "
                f"start the missing ranks or lower the world size")
    return f"init_process_group failed ({where}): {message}"


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Data: a synthetic set that needs no download, ImageFolder, or CIFAR-10.
# ---------------------------------------------------------------------------

class SyntheticImages(Dataset):
    """Images that are learnable and deterministic from the seed, built in memory.

    Class c is a fixed random 8x8 colour pattern, upsampled; every image is its class's
    pattern plus Gaussian noise. Training images are also shifted and flipped at random.
    """

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int, train: bool):
        patterns = torch.randn(num_classes, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
        patterns = F.interpolate(patterns, size=image_size, mode="bilinear", align_corners=False)
        g = torch.Generator().manual_seed(seed + (1 if train else 2))  # train and val differ
        self.labels = torch.randint(num_classes, (size,), generator=g)
        self.images = patterns[self.labels] + 1.5 * torch.randn(size, 3, image_size, image_size,
                                                                generator=g)
        self.seed, self.train, self.classes = seed, train, list(range(num_classes))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, item):
        index, epoch = item if isinstance(item, tuple) else (item, None)
        image = self.images[index]
        if self.train and epoch is not None:
            # The augmentation is a function of (seed, epoch, sample) alone, never of the
            # rank, the worker or the world size: that keeps N processes equal to one.
            rng = random.Random(f"{self.seed}/{epoch}/{index}")
            image = torch.roll(image, (rng.randint(-3, 3), rng.randint(-3, 3)), dims=(1, 2))
            if rng.random() < 0.5:
                image = image.flip(2)
        return image, int(self.labels[index])


class FolderImages(Dataset):
    """A torchvision dataset (ImageFolder, CIFAR-10) behind the same (index, epoch) keys."""

    def __init__(self, base):
        self.base, self.classes = base, base.classes

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, item):
        # torchvision's random transforms draw from the loader worker's RNG, which
        # DataLoader seeds differently in every worker, epoch and rank.
        return self.base[item[0] if isinstance(item, tuple) else item]


class EpochSampler(DistributedSampler):
    """DistributedSampler that hands each sample index its epoch as well."""

    def __iter__(self):
        return ((index, self.epoch) for index in super().__iter__())


def build_datasets(args: argparse.Namespace, d: Dist):
    if args.data:
        from torchvision.datasets import ImageFolder

        root = Path(args.data)
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise SetupError(f"--data {root}: expected folders {root}/train and {root}/val "
                                 f"(one sub-folder per class), {root / split} is missing")
        try:
            train = ImageFolder(root / "train", transform=image_transform(args, train=True))
            val = ImageFolder(root / "val", transform=image_transform(args, train=False))
        except (FileNotFoundError, RuntimeError) as e:  # no class folders, or no images
            raise SetupError(f"--data {root}: {e}") from e
        return FolderImages(train), FolderImages(val)
    if args.dataset == "cifar10":
        from torchvision.datasets import CIFAR10

        if args.download:
            # One download per node, by its local rank 0; the others wait at the barrier.
            if d.local_rank == 0:
                CIFAR10(args.data_root, train=True, download=True)
                CIFAR10(args.data_root, train=False, download=True)
            dist.barrier()
        try:
            train = CIFAR10(args.data_root, train=True, transform=image_transform(args, True))
            val = CIFAR10(args.data_root, train=False, transform=image_transform(args, False))
        except RuntimeError as e:
            raise SetupError(f"CIFAR-10 not found under {args.data_root}: add --download") from e
        return FolderImages(train), FolderImages(val)
    return (SyntheticImages(args.train_size, args.num_classes, args.image_size, args.seed, True),
            SyntheticImages(args.val_size, args.num_classes, args.image_size, args.seed, False))


def image_transform(args: argparse.Namespace, train: bool):
    from torchvision import transforms as T

    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    if train:
        return T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(),
                          T.ToTensor(), normalize])
    return T.Compose([T.Resize(round(args.image_size * 256 / 224)), T.CenterCrop(args.image_size),
                      T.ToTensor(), normalize])


def make_loaders(args, d: Dist, train_set, val_set):
    workers = args.workers
    if workers is None:
        # On CPU the cores are busy training (and the synthetic set is in memory); on a GPU
        # the workers decode and augment while the GPU computes.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        workers = 0 if d.device.type == "cpu" else min(8, max(1, cores // d.local_world_size))
    common = dict(num_workers=workers,
                  pin_memory=d.device.type == "cuda",  # page-locked: async copies to the GPU
                  persistent_workers=workers > 0)      # keep workers alive across epochs
    sampler = EpochSampler(train_set, num_replicas=d.world_size, rank=d.rank, shuffle=True,
                           seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, **common)
    # Validation: rank r takes samples r, r+W, r+2W, ... with no padding, so every sample
    # counts exactly once (DistributedSampler would pad; 05_eval_gather.py shows why it matters).
    val_shard = Subset(val_set, range(d.rank, len(val_set), d.world_size))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, **common)
    return train_loader, sampler, val_loader


# ---------------------------------------------------------------------------
# Model: any torchvision classifier, wrapped in DistributedDataParallel.
# ---------------------------------------------------------------------------



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
    if args.sync_bn:
        # BatchNorm statistics over the global batch instead of each rank's shard.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def wrap_ddp(model: nn.Module, args: argparse.Namespace, d: Dist) -> DDP:
    knobs = {}
    if args.no_broadcast_buffers:  # each rank keeps its own buffers (BN running stats)
        # torch 2.14 renamed broadcast_buffers (the old name still works but warns)
        new_name = "forward_sync_buffers" in inspect.signature(DDP).parameters
        knobs["forward_sync_buffers" if new_name else "broadcast_buffers"] = False
    return DDP(
        model,
        device_ids=[d.local_rank] if d.device.type == "cuda" else None,  # CPU: None
        bucket_cap_mb=args.bucket_cap_mb,     # gradients all-reduce in buckets of this size
        find_unused_parameters=args.find_unused_parameters,  # only if some params get no grad
        static_graph=args.static_graph,       # same graph every step: DDP can plan ahead
        gradient_as_bucket_view=args.gradient_as_bucket_view,  # grads live in the buckets
        **knobs,
    )


# ---------------------------------------------------------------------------
# Training and evaluation.
# ---------------------------------------------------------------------------

@dataclass
class Progress:
    step: int = 0               # optimizer steps taken
    mark: float = 0.0           # when the last step (or this epoch) started the clock
    train_seconds: float = 0.0  # time in training steps, from the end of step 1 on
    timed_images: int = 0       # images, all ranks, trained in that time


def train_one_epoch(model: DDP, loader, optimizer, scheduler, scaler, args, d: Dist,
                    epoch: int, steps_per_epoch: int, total_steps: int, p: Progress) -> dict:
    model.train()
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    sums = torch.zeros(3, dtype=torch.float64, device=d.device)  # loss sum, correct, count
    epoch_sums = torch.zeros_like(sums)
    window_start, window_images, window_steps, group_images = time.perf_counter(), 0, 0, 0
    p.mark = time.perf_counter()
    micro_steps = steps_per_epoch * args.accum_steps  # a partial accumulation group is dropped
    for i, (images, labels) in enumerate(loader):
        if i == micro_steps or p.step == total_steps:
            break
        images = images.to(d.device, dtype=args.dtype, non_blocking=True)
        labels = labels.to(d.device, non_blocking=True)
        sync = (i + 1) % args.accum_steps == 0
        # no_sync: the first K-1 micro-steps only accumulate gradients locally; the K-th
        # backward all-reduces the accumulated sum once.
        with nullcontext() if sync else model.no_sync():
            with torch.autocast(d.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(images)
                loss = F.cross_entropy(logits, labels)  # mean over this rank's batch
            scaler.scale(loss / args.accum_steps).backward()
        with torch.no_grad():  # running sums stay on the device: no sync with the host
            sums[0] += loss.detach() * len(labels)
            sums[1] += (logits.argmax(1) == labels).sum()
            sums[2] += len(labels)
        group_images += len(labels)
        if not sync:
            continue
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        p.step += 1
        now = time.perf_counter()
        if p.step > 1:  # step 1 pays one-off costs (allocations, DDP's bucket rebuild)
            p.train_seconds += now - p.mark
            p.timed_images += group_images * d.world_size
        p.mark, window_images, window_steps = now, window_images + group_images, window_steps + 1
        group_images = 0
        if p.step % args.log_every == 0 or p.step == total_steps:
            elapsed = now - window_start
            epoch_sums += sums
            line = log_line(sums, epoch, args.epochs, p.step, total_steps,
                            window_images * d.world_size / elapsed, elapsed / window_steps,
                            scheduler.get_last_lr()[0])
            if d.is_main:
                print(line, flush=True)
            sums.zero_()
            window_start, window_images, window_steps = time.perf_counter(), 0, 0
    epoch_sums += sums
    dist.all_reduce(epoch_sums)
    loss_sum, correct, count = epoch_sums.tolist()
    return {"loss": loss_sum / max(count, 1), "acc": correct / max(count, 1)}


def log_line(sums, epoch, epochs, step, total_steps, images_per_s, step_seconds, lr) -> str:
    # Every rank logs at the same steps, so this all_reduce is matched on all of them.
    window = sums.clone()
    dist.all_reduce(window)  # summed over ranks: the loss of the whole global batch
    loss_sum, correct, count = window.tolist()
    eta = datetime.timedelta(seconds=round((total_steps - step) * step_seconds))
    return (f"epoch {epoch + 1}/{epochs}  step {step:>5}/{total_steps}  "
            f"loss {loss_sum / count:.4f}  acc {100 * correct / count:5.1f}%  lr {lr:.4f}  "
            f"{images_per_s:8.1f} img/s  eta {eta}")


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


# ---------------------------------------------------------------------------
# Verification: all replicas must end identical.
# ---------------------------------------------------------------------------

def parameter_digest(model: nn.Module) -> tuple[str, int]:
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest(), flat.numel()


def verify_replicas_identical(model: nn.Module, d: Dist) -> str:
    digest, count = parameter_digest(model)
    digests = [None] * d.world_size
    dist.all_gather_object(digests, digest)
    differing = [r for r, h in enumerate(digests) if h != digests[0]]
    check(not differing, "identical replicas",
          f"ranks {differing} hold parameters different from rank 0 "
          f"({[h[:12] for h in digests]})")
    return (f"{d.world_size} rank(s) hold identical parameters "
            f"({count:,} values, sha256 {digest[:16]})")


def save_model(model: nn.Module, path: str, d: Dist) -> None:
    if d.is_main:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        torch.save(model.state_dict(), tmp)  # the raw module: keys without "module."
        os.replace(tmp, target)              # atomic: the file is whole or absent
    dist.barrier()  # nobody exits (or reads the file) before rank 0 has written it


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

def main(args: argparse.Namespace) -> None:
    d = setup(args.backend, args.timeout)
    train_set, val_set = build_datasets(args, d)
    if len(train_set) == 0:
        raise SetupError("the training set is empty")
    train_loader, sampler, val_loader = make_loaders(args, d, train_set, val_set)
    per_rank = math.ceil(len(train_set) / d.world_size)
    steps_per_epoch = len(train_loader) // args.accum_steps
    if steps_per_epoch == 0:
        raise SetupError(f"--accum-steps {args.accum_steps} needs at least {args.accum_steps} "
                         f"batches per rank per epoch, but each rank has {len(train_loader)}")
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    # The same initial weights on every rank (DDP also broadcasts rank 0's at wrap time).
    torch.manual_seed(args.seed)
    model = build_model(args, len(train_set.classes)).to(d.device, args.dtype)
    ddp_model = wrap_ddp(model, args, d)
    torch.manual_seed(args.seed + d.rank)  # but different dropout masks on each rank
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=total_steps)
    scaler = torch.amp.GradScaler(d.device.type, enabled=args.amp == "fp16")

    if d.is_main:
        global_batch = d.world_size * args.batch_size * args.accum_steps
        print(f"training {args.arch} ({sum(p.numel() for p in model.parameters()):,} params, "
              f"{len(train_set.classes)} classes) on {d.world_size} x {d.device.type} "
              f"({d.backend}); {len(train_set)} train / {len(val_set)} val images; "
              f"global batch {global_batch} = {d.world_size} ranks x {args.batch_size}"
              f" x {args.accum_steps} accum; {total_steps} steps", flush=True)
        if per_rank < args.batch_size:
            print(f"note: {len(train_set)} images over {d.world_size} ranks leave each rank "
                  f"{per_rank} per epoch, fewer than --batch-size {args.batch_size}: "
                  f"one short batch per epoch", flush=True)

    p = Progress()
    history = []
    epoch = 0
    while p.step < total_steps:
        sampler.set_epoch(epoch)  # same seed + epoch on every rank: a new shared permutation
        train = train_one_epoch(ddp_model, train_loader, optimizer, scheduler, scaler, args, d,
                                epoch, steps_per_epoch, total_steps, p)
        val = evaluate(model, val_loader, d, args.dtype) if len(val_set) else None
        history.append((train, val))
        if d.is_main:
            print(f"epoch {epoch + 1} done: train loss {train['loss']:.4f} acc "
                  f"{100 * train['acc']:.1f}%" + (f" | val loss {val['loss']:.4f} acc "
                  f"{100 * val['acc']:.1f}% on {val['n']} images" if val else ""), flush=True)
        epoch += 1

    verified = verify_replicas_identical(model, d)
    if args.save_model:
        save_model(model, args.save_model, d)
    if d.is_main:
        (first, _), (last, last_val) = history[0], history[-1]
        speed = f"{p.timed_images / p.train_seconds:.1f}" if p.train_seconds else "n/a"
        print(f"summary: {total_steps} steps, {speed} img/s on {d.world_size} rank(s) "
              f"(steps 2..{total_steps}); train loss "
              f"{first['loss']:.4f} -> {last['loss']:.4f}, acc {100 * first['acc']:.1f}% -> "
              f"{100 * last['acc']:.1f}%" + (f"; val acc {100 * last_val['acc']:.1f}%"
                                              if last_val else ""))
        if args.save_model:
            print(f"saved model.module.state_dict() to {args.save_model}")
        print(f"verified: {verified}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = parser.add_argument_group("model")
    m.add_argument("--arch", default="resnet18", choices=ARCHS, metavar="ARCH",
                   help="any torchvision classification model")
    m.add_argument("--norm", choices=["batch", "group"], default="batch",
                   help="group: GroupNorm instead of BatchNorm (resnet family)")
    m.add_argument("--sync-bn", action="store_true",
                   help="SyncBatchNorm: BN statistics over the global batch (GPUs only)")
    data = parser.add_argument_group("data")
    data.add_argument("--data", metavar="DIR", help="ImageFolder tree with DIR/train and DIR/val")
    data.add_argument("--dataset", choices=["synthetic", "cifar10"], default="synthetic")
    data.add_argument("--download", action="store_true", help="download CIFAR-10 if missing")
    data.add_argument("--data-root", default="./data", help="where CIFAR-10 lives")
    data.add_argument("--train-size", type=positive_int, default=4096, help="synthetic images")
    data.add_argument("--val-size", type=nonnegative_int, default=1024, help="0: no evaluation")
    data.add_argument("--num-classes", type=positive_int, default=10, help="synthetic classes")
    data.add_argument("--image-size", type=positive_int, default=32)
    data.add_argument("--workers", type=nonnegative_int, default=None,
                      help="DataLoader workers per process (default: 0 on CPU, else up to 8)")
    t = parser.add_argument_group("training")
    t.add_argument("--epochs", type=positive_int, default=3)
    t.add_argument("--max-steps", type=positive_int, default=None, help="stop after this many")
    t.add_argument("--batch-size", type=positive_int, default=128, help="per process")
    t.add_argument("--accum-steps", type=positive_int, default=1,
                   help="micro-batches per optimizer step (gradient accumulation with no_sync)")
    t.add_argument("--lr", type=positive_float, default=0.05, help="peak of the one-cycle schedule")
    t.add_argument("--weight-decay", type=float, default=5e-4)
    t.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                   help="autocast dtype; fp16 (with GradScaler) needs CUDA")
    t.add_argument("--float64", action="store_true",
                   help="train in double precision: slow, but rounding noise all but vanishes, "
                        "which makes equivalence checks sharp")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log-every", type=positive_int, default=10, help="optimizer steps")
    t.add_argument("--save-model", metavar="PATH", help="rank 0 saves model.module.state_dict()")
    k = parser.add_argument_group("DDP knobs")
    k.add_argument("--bucket-cap-mb", type=positive_float, default=25.0,
                   help="bigger: fewer, larger all-reduces; smaller: earlier overlap")
    k.add_argument("--find-unused-parameters", action="store_true",
                   help="needed when some parameters get no gradient in a step (costs a "
                        "graph walk each step)")
    k.add_argument("--static-graph", action="store_true",
                   help="the set of used parameters never changes: lets DDP optimise")
    k.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="grads are views into the all-reduce buckets: saves memory and a copy")
    k.add_argument("--no-broadcast-buffers", action="store_true",
                   help="keep each rank's own buffers (BN stats) instead of rank 0's each forward")
    add_launch_args(parser)
    args = parser.parse_args(argv)
    check_launch_args(parser, args)
    gpu = torch.cuda.is_available() and args.backend != "gloo"
    if args.amp == "fp16" and not gpu:
        parser.error("--amp fp16 needs CUDA (float16 autocast with GradScaler); "
                     "on CPU use --amp bf16")
    if args.sync_bn and not gpu:
        parser.error("--sync-bn needs CUDA GPUs: SyncBatchNorm does not run on CPU with Gloo; "
                     "on CPU use --norm group for batch-independent normalisation")
    if args.sync_bn and args.norm == "group":
        parser.error("--sync-bn converts BatchNorm layers; --norm group has none")
    if args.data and args.dataset != "synthetic":
        parser.error("use either --data DIR or --dataset cifar10, not both")
    if args.float64 and args.amp != "none":
        parser.error("--float64 and --amp pick opposite precisions; use one")
    args.amp = None if args.amp == "none" else args.amp
    args.dtype = torch.float64 if args.float64 else torch.float32
    return args


if __name__ == "__main__":
    require_torch()
    launch(main, parse_args())
