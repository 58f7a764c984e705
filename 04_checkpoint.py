"""04_checkpoint.py: DDP checkpoints that survive a killed worker and resume exactly.

Rank 0 writes each checkpoint atomically (temporary file, fsync, rename) with a sha256 file
beside it. At start every rank loads the newest checkpoint that verifies, before wrapping the
model in DDP, and carries on at the same epoch and step with the same data order and random
state: an interrupted run ends with the same weights as an uninterrupted one, bit for bit
with 1 or 2 processes (with 3 or more, DDP's first backward rounds differently: README).
Under torchrun --max-restarts, one dead worker takes its group down, torchrun starts every
worker again, and they resume from the last checkpoint on their own.

Run
  # one command shows failure, restart and resume: rank 1 dies at step 50
  torchrun --standalone --nproc_per_node 2 --max-restarts 1 04_checkpoint.py --simulate-failure 50
  python 04_checkpoint.py --spawn 2               # mp.spawn (no restarts: run it again to resume)
  python 04_checkpoint.py                         # one process
  # two nodes: the checkpoint directory must be on storage that both nodes see
  torchrun --nnodes 2 --nproc_per_node 4 --max-restarts 3 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 04_checkpoint.py --checkpoint-dir /shared/ckpt

A run resumes whenever --checkpoint-dir holds checkpoints; use a new directory to start
over. The model and data are small and synthetic: the subject is the checkpoint.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import hashlib
import io
import math
import os
import random
import re
import signal
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
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# The plumbing used below is defined at the bottom of this file, the same in all six
# scripts: setup() binds this process to its device, joins the process group and returns a
# Dist (rank, local_rank, world_size, device, is_main); check(ok, name, detail) raises
# CheckFailed, SetupError reports a job that cannot run as configured, and both end the rank
# with one line; launch(main, args) runs main on every rank (torchrun, --spawn N, or one
# process); add_launch_args adds --spawn, --backend and --timeout.


# ---- Data and model: small, synthetic, deterministic -------------------------------------

class SyntheticPatterns(Dataset):
    """3x16x16 images of 10 classes (a fixed pattern per class plus noise). Item i is the same
    on every rank and in every run; it comes with its index, for the coverage check."""

    def __init__(self, size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(10, 3, 16, 16, generator=g)
        self.labels = torch.randint(0, 10, (size,), generator=g)
        self.noise = torch.randn(size, 3, 16, 16, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return i, self.patterns[self.labels[i]] + self.noise[i], self.labels[i]


def build_model() -> nn.Module:
    # BatchNorm buffers and Dropout's random draws are both state a resume must restore.
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, 10))


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way into an epoch.

    DistributedSampler orders the dataset by seed + epoch, pads the order to a multiple of the
    world size with its own first indices, and deals every world_size-th index to each rank.
    After s full steps of batch b on W ranks, that deal has used exactly the first s*b*W
    positions of the order, whichever ranks took them. So a resume skips that many positions
    and deals the rest the same way over the ranks it has now: nothing is loaded again,
    nothing is skipped, and with the same W every rank gets what it would have got."""

    def __init__(self, dataset: Dataset, **kwargs):
        super().__init__(dataset, **kwargs)
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        self.set_epoch(epoch)  # same seed + epoch on every rank: one order they all agree on
        self.start = start

    def _deal(self) -> list[int]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        rest = order[self.start:]
        self.padding = -len(rest) % self.num_replicas
        rest += (order * (self.padding // n + 1))[:self.padding]  # pad with the order's head
        return rest[self.rank::self.num_replicas]

    def __iter__(self):
        indices = self._deal()
        if self.start == 0:  # from the top, this must be exactly what DistributedSampler deals
            check(indices == list(super().__iter__()), "sampler matches DistributedSampler",
                  f"epoch {self.epoch}: the resumable deal differs from the stock one")
        return iter(indices)

    def __len__(self) -> int:
        return math.ceil((len(self.dataset) - self.start) / self.num_replicas)


# ---- Checkpoint files ------------------------------------------------------------------
# step-00000040.pt beside step-00000040.pt.sha256 (the `sha256sum` format).
# The .sha256 file is written last, so it also marks the save as finished.

CHECKPOINT_NAME = re.compile(r"^step-(\d{8})\.pt$")
REQUIRED_KEYS = {"model", "optimizer", "scheduler", "epoch", "position", "global_step",
                 "world_size", "rng", "seen", "args"}
# The arguments that shape the run: a resume with other values would not continue it.
SHAPING_ARGS = ("seed", "train_size", "batch_size", "lr", "weight_decay", "amp")


class Unreadable(Exception):
    """A checkpoint file that cannot be trusted; the message says why."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def list_checkpoints(directory: Path) -> list[Path]:
    """Newest first, by the step in the name."""
    found = [p for p in directory.iterdir() if CHECKPOINT_NAME.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)  # makes the renames themselves survive a power cut
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(state: dict, path: Path, keep: int) -> None:
    """Rank 0 only. Serialise once, hash those bytes, write both files atomically, prune."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    write_atomic(path, data)
    write_atomic(sidecar(path), f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode())
    fsync_directory(path.parent)
    for old in list_checkpoints(path.parent)[keep:]:
        sidecar(old).unlink(missing_ok=True)  # marker first: a half-pruned file is not loaded
        old.unlink(missing_ok=True)


def read_checkpoint(path: Path) -> dict:
    """Verify and load one checkpoint, or raise Unreadable."""
    marker = sidecar(path)
    if not marker.exists():
        raise Unreadable(f"no {marker.name}: the save did not finish")
    data = path.read_bytes()
    expected = (marker.read_text().split() or ["(empty)"])[0]
    if hashlib.sha256(data).hexdigest() != expected:
        raise Unreadable(f"sha256 mismatch ({len(data)} bytes): truncated or corrupted")
    try:
        # Onto the CPU (saved from cuda:0, the tensors would otherwise all land on GPU 0):
        # load_state_dict copies weights and optimizer state to each parameter's device, and
        # AdamW's step counters stay on the CPU as in a fresh run (on the GPU, foreach AdamW
        # reads them back with .item() every step: pytorch/pytorch#128208).
        # weights_only: tensors and plain containers only, no code runs.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means unreadable
        raise Unreadable(f"torch.load failed: {str(e).splitlines()[0]}") from e
    missing = REQUIRED_KEYS - set(state) if isinstance(state, dict) else REQUIRED_KEYS
    if missing:
        raise Unreadable(f"not a checkpoint of this script (no {', '.join(sorted(missing))})")
    return state


def load_newest(directory: Path) -> tuple[dict | None, Path | None, list]:
    """The newest checkpoint that verifies, and the newer ones that did not, with reasons."""
    skipped = []
    candidates = list_checkpoints(directory)
    for path in candidates:
        try:
            return read_checkpoint(path), path, skipped
        except (Unreadable, OSError) as e:
            skipped.append((path, str(e)))
    if candidates:  # never silently start from scratch over checkpoints we could not read
        reasons = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        raise SetupError(f"{directory} holds {len(candidates)} checkpoint(s) and none is "
                         f"readable ({reasons}). Move them away to start over")
    return None, None, skipped


def model_state(state_dict: dict) -> tuple[dict, bool]:
    """Accept weights saved from the DDP wrapper itself (keys "module.conv...") as well."""
    had_prefix = bool(state_dict) and all(k.startswith("module.") for k in state_dict)
    consume_prefix_in_state_dict_if_present(state_dict, "module.")
    return state_dict, had_prefix


# ---- Saving and restoring the whole training state ---------------------------------------

def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())  # RNG states are CPU byte tensors, wherever loaded
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def shaping_args(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in SHAPING_ARGS}


@dataclass
class Progress:
    epoch: int = 0        # the epoch in progress
    position: int = 0     # how much of this epoch's global order is consumed (see the sampler)
    global_step: int = 0  # optimizer steps since the start of the run


def save_checkpoint(model: DDP, optimizer, scheduler, scaler, progress: Progress,
                    seen: torch.Tensor, args, d: Dist) -> Path:
    """Called by every rank: random states and coverage are gathered, then rank 0 writes."""
    rngs = [None] * d.world_size
    dist.all_gather_object(rngs, rng_state(d.device))  # each rank's own streams (dropout...)
    seen_so_far = seen.to(d.device, copy=True)  # NCCL reduces GPU tensors; counts live on CPU
    dist.all_reduce(seen_so_far)
    error, path = None, checkpoint_path(args.checkpoint_dir, progress.global_step)
    if d.is_main:
        state = {
            "model": model.module.state_dict(),  # the inner module: keys without "module."
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epoch": progress.epoch, "position": progress.position,
            "global_step": progress.global_step, "world_size": d.world_size,
            "rng": rngs, "seen": seen_so_far.cpu(), "args": shaping_args(args),
        }
        try:
            write_checkpoint(state, path, args.keep)
        except OSError as e:
            error = f"rank 0 could not write a checkpoint in {args.checkpoint_dir}: {e}"
    # The other ranks wait here until rank 0 has written the file (the barrier of the usual
    # recipe) and learn whether it worked: a failed save stops every rank, not just rank 0,
    # and no rank runs ahead and dies on a step whose checkpoint is not yet on disk.
    share_rank0_outcome(error)
    return path


def share_rank0_outcome(error: str | None) -> None:
    """A collective: every rank raises rank 0's error, or none does."""
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise SetupError(outcome[0])


def prepare_directory(args: argparse.Namespace, d: Dist) -> None:
    """Before training: rank 0 makes sure it can write there; every rank learns the answer."""
    error = None
    if d.is_main:
        directory = args.checkpoint_dir
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for stale in directory.glob(".step-*.tmp*"):  # left by a save that was killed
                stale.unlink()
            write_atomic(directory / ".write-test", b"ok")
            (directory / ".write-test").unlink()
        except OSError as e:
            error = f"checkpoint directory {directory} is not writable: {e}"
    share_rank0_outcome(error)


def resume(model: nn.Module, optimizer, scheduler, scaler, args, d: Dist, say):
    """Load the newest good checkpoint into the unwrapped model, on every rank, before DDP.

    Returns the progress to continue from, the coverage counts of the epoch in progress, and
    whether anything was loaded."""
    state, path, skipped = load_newest(args.checkpoint_dir)
    names = [None] * d.world_size
    dist.all_gather_object(names, path.name if path else None)
    check(len(set(names)) == 1, "every rank resumes from the same checkpoint",
          f"ranks chose {names}; is {args.checkpoint_dir} the same directory on every node?")
    for bad, why in skipped if d.is_main else []:
        print(f"WARNING: {bad.name} is unreadable ({why}); renamed it *.unreadable and "
              f"fell back to an older checkpoint", file=sys.stderr, flush=True)
        bad.rename(bad.with_name(bad.name + ".unreadable"))  # kept, but out of the way
    seen = torch.zeros(args.train_size, dtype=torch.int64)
    if state is None:
        if args.init_from:
            try:
                weights = torch.load(args.init_from, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - whatever the reason, say which file
                raise SetupError(f"--init-from {args.init_from}: cannot load it: "
                                 f"{str(e).splitlines()[0]}") from e
            if not isinstance(weights, dict):
                raise SetupError(f"--init-from {args.init_from}: not a state_dict")
            weights, stripped = model_state(weights.get("model", weights))
            model.load_state_dict(weights)
            say(f"initial weights from {args.init_from}"
                + (' (stripped the "module." prefix of a DDP-wrapped save)' if stripped else ""))
        return Progress(), seen, False
    differing = {k: (v, getattr(args, k)) for k, v in state["args"].items()
                 if getattr(args, k) != v}
    if differing:
        raise SetupError(f"{path} was written with different settings ("
                         + ", ".join(f"--{k.replace('_', '-')} {old} there, {new} here"
                                     for k, (old, new) in differing.items())
                         + "); resume with the same values or use another --checkpoint-dir")
    weights, stripped = model_state(state["model"])
    model.load_state_dict(weights)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    progress = Progress(state["epoch"], state["position"], state["global_step"])
    if state["world_size"] == d.world_size:
        set_rng_state(state["rng"][d.rank], d.device)  # this rank's streams, where they were
    else:
        torch.manual_seed(args.seed + d.rank + 1_000_003 * progress.global_step)
        say(f"world size changed ({state['world_size']} -> {d.world_size}): random streams "
            f"reseeded; weights, optimizer and data position carry on exactly")
    if d.is_main:
        seen = state["seen"].to("cpu", torch.int64)  # rank 0 carries the epoch's coverage
    say(f"resuming from {path}: epoch {progress.epoch} with {progress.position} of its "
        f"{args.train_size} samples done, global step {progress.global_step}"
        + (' (stripped the "module." prefix)' if stripped else ""))
    return progress, seen, True


# ---- Training ----------------------------------------------------------------------------

def simulate_failure(args, d: Dist, progress: Progress, resumed: bool) -> None:
    """One rank dies abruptly (no cleanup, no exception: like a machine that is gone), on the
    first attempt only, so that the restart that follows can succeed."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if (args.simulate_failure == progress.global_step and d.rank == d.world_size - 1
            and restarts == 0 and not resumed):
        print(f"[rank {d.rank}] simulated failure at step {progress.global_step}: "
              f"SIGKILL to myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def train(model: DDP, loader, sampler: ResumableSampler, optimizer, scheduler, scaler,
          progress: Progress, seen: torch.Tensor, resumed: bool, args, d: Dist, say) -> None:
    autocast = (torch.autocast(d.device.type, dtype=torch.bfloat16 if args.amp == "bf16"
                               else torch.float16) if args.amp else nullcontext())
    ones = torch.ones(args.batch_size, dtype=torch.int64)
    while progress.epoch < args.epochs:
        sampler.set_position(progress.epoch, progress.position)
        loss_sum = torch.zeros(2, device=d.device)
        for i, (index, x, y) in enumerate(loader, 1):
            simulate_failure(args, d, progress, resumed)
            x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
            with autocast:
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            seen.index_add_(0, index, ones[:len(index)])
            loss_sum[0] += loss.detach().float() * len(index)  # no host sync per step
            loss_sum[1] += len(index)
            progress.global_step += 1
            progress.position += args.batch_size * d.world_size  # full batches, but the last
            if i == len(loader):
                scheduler.step()  # per epoch, so a change of world size leaves it alone
                check_coverage(seen, sampler, progress.epoch, d)
                progress.epoch, progress.position = progress.epoch + 1, 0
                seen.zero_()
                where = f"end of epoch {progress.epoch - 1}"
            elif progress.global_step % args.save_every == 0:
                where = f"epoch {progress.epoch}, {progress.position}/{args.train_size} samples"
            else:
                continue
            dist.all_reduce(loss_sum)  # the mean loss over every rank's batches since the last save
            path = save_checkpoint(model, optimizer, scheduler, scaler, progress, seen, args, d)
            loss = loss_sum[0].item() / loss_sum[1].item()
            say(f"step {progress.global_step:4d}  loss {loss:.4f}  saved {path.name} ({where})")
            loss_sum.zero_()


def check_coverage(seen: torch.Tensor, sampler: ResumableSampler, epoch: int, d: Dist) -> None:
    """Every sample trained on once this epoch, across ranks and across any resume; only the
    sampler's padding repeats a few."""
    total = seen.to(d.device, copy=True)
    dist.all_reduce(total)
    total = total.cpu()
    n = len(total)
    check(int(total.min()) >= 1 and int(total.sum()) == n + sampler.padding,
          "each sample once per epoch",
          f"epoch {epoch}: {int((total == 0).sum())} samples never seen, "
          f"{int(total.sum())} visits for {n} samples + {sampler.padding} padding")


# ---- Verification after training ---------------------------------------------------------

def digest(tensors) -> str:
    flat = torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def verify_replicas_identical(model: DDP, d: Dist) -> None:
    # Parameters only: BatchNorm's running stats differ after the last forward (each rank
    # saw its own batch); DDP overwrites them with rank 0's at the next forward, and the
    # checkpoint holds rank 0's.
    digests = [None] * d.world_size
    dist.all_gather_object(digests, digest(model.parameters()))
    check(len(set(digests)) == 1, "identical replicas",
          f"ranks hold different parameters: {[h[:12] for h in digests]}")


def verify_inference_copy(model: DDP, dataset: Dataset, args, d: Dist) -> str:
    """Load the final checkpoint the way an inference job would: a plain model, no DDP, no
    process group needed, and compare its outputs with the trained model's."""
    path = list_checkpoints(args.checkpoint_dir)[0]
    state = read_checkpoint(path)
    plain = build_model().to(d.device)
    plain.load_state_dict(model_state(state["model"])[0])
    plain.eval()
    model.module.eval()
    x = torch.stack([dataset[i][1] for i in range(64)]).to(d.device)
    with torch.no_grad():
        same = torch.equal(plain(x), model.module(x))
    check(same, "inference copy", f"a plain model loaded from {path.name} predicts differently")
    return path.name


def main(args: argparse.Namespace) -> None:
    # Bit-for-bit resume on GPUs needs kernels that give the same bits every run: cuDNN's
    # deterministic algorithms, and a fixed cuBLAS workspace (set before cuBLAS starts).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    d = setup(args.backend, args.timeout)

    def say(text: str) -> None:
        if d.is_main:
            print(text, flush=True)

    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    say(f"{d.world_size} process(es), {d.backend} on {d.device.type}, attempt {restarts + 1} "
        f"(TORCHELASTIC_RESTART_COUNT={restarts}), checkpoints in {args.checkpoint_dir} "
        f"(every {args.save_every} steps and at each epoch end, keep {args.keep})")
    prepare_directory(args, d)

    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts anyway)
    model = build_model().to(d.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    scaler = torch.amp.GradScaler("cuda") if args.amp == "fp16" else None
    torch.manual_seed(args.seed + d.rank)  # then each rank its own dropout stream
    progress, seen, resumed = resume(model, optimizer, scheduler, scaler, args, d, say)
    if not resumed:
        say(f"no checkpoint in {args.checkpoint_dir}: starting from step 0")
    model = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)

    dataset = SyntheticPatterns(args.train_size, args.seed)
    sampler = ResumableSampler(dataset, num_replicas=d.world_size, rank=d.rank, seed=args.seed)
    # iter(loader) draws a base seed for its workers from the loader's generator. Left to the
    # global RNG, that draw would happen once more in a resumed run than in the uninterrupted
    # one and shift every random number after it (dropout here). Random augmentation inside
    # workers is not in the checkpoint: make it a function of (seed, epoch, index), as 03 does.
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers,
                        generator=torch.Generator().manual_seed(args.seed + d.rank),
                        pin_memory=d.device.type == "cuda")
    if progress.epoch >= args.epochs:
        say(f"nothing to do: the checkpoint is at the end of epoch {progress.epoch - 1} "
            f"and --epochs is {args.epochs}")
    train(model, loader, sampler, optimizer, scheduler, scaler, progress, seen, resumed,
          args, d, say)

    verify_replicas_identical(model, d)
    if d.is_main:
        name = verify_inference_copy(model, dataset, args, d)
        print(f"verified: every epoch used each of the {args.train_size} samples once "
              f"(plus the sampler's padding)")
        print(f"verified: {d.world_size} rank(s) hold identical parameters; a plain model "
              f"loaded from {name} gives the same outputs")
        # Compare this line between runs: an interrupted and resumed run prints the same.
        print(f"final state sha256 {digest(model.module.state_dict().values())[:16]}",
              flush=True)
    dist.barrier()  # the others stay until rank 0 has read the final checkpoint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    c = parser.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"), metavar="DIR",
                   help="where rank 0 writes and every rank reads; on storage every node "
                        "sees (default: %(default)s)")
    c.add_argument("--save-every", type=positive_int, default=20, metavar="STEPS",
                   help="also save every STEPS optimizer steps, mid-epoch (default: %(default)s)")
    c.add_argument("--keep", type=positive_int, default=3,
                   help="how many of the newest checkpoints to keep (default: %(default)s)")
    c.add_argument("--init-from", type=Path, metavar="FILE",
                   help="weights to start from when there is no checkpoint (a state_dict; "
                        "a DDP-wrapped model's 'module.' keys are accepted)")
    c.add_argument("--simulate-failure", type=positive_int, metavar="STEP",
                   help="the last rank kills itself (SIGKILL) at this global step, "
                        "on the first attempt only")
    t = parser.add_argument_group("training")
    t.add_argument("--epochs", type=positive_int, default=3,
                   help="epochs to train (default: %(default)s)")
    t.add_argument("--train-size", type=positive_int, default=2048,
                   help="synthetic training images (default: %(default)s)")
    t.add_argument("--batch-size", type=positive_int, default=32,
                   help="images per step on each process (default: %(default)s)")
    t.add_argument("--lr", type=positive_float, default=3e-3,
                   help="AdamW learning rate (default: %(default)g)")
    t.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW weight decay (default: %(default)g)")
    t.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                   help="autocast dtype; fp16 (with a GradScaler, saved too) needs CUDA "
                        "(default: %(default)s)")
    t.add_argument("--workers", type=nonnegative_int, default=0,
                   help="DataLoader worker processes per rank (default: %(default)s)")
    t.add_argument("--seed", type=int, default=0,
                   help="seeds the weights, the data and the order (default: %(default)s)")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_launch_args(parser, args)
    if args.amp == "fp16" and not (torch.cuda.is_available() and args.backend != "gloo"):
        parser.error("--amp fp16 needs CUDA (float16 autocast with GradScaler); "
                     "on CPU use --amp bf16")
    if args.init_from and not args.init_from.is_file():
        parser.error(f"--init-from {args.init_from}: no such file")
    args.amp = None if args.amp == "none" else args.amp
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
