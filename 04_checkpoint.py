r"""04_checkpoint.py: DDP checkpoints that survive a killed worker and resume exactly.

Run
  # one command shows failure, restart and resume: rank 1 dies at step 50
  torchrun --standalone --nproc_per_node 2 --max-restarts 1 04_checkpoint.py --simulate-failure 50
  python 04_checkpoint.py --spawn 2               # mp.spawn (no restarts: run it again to resume)
  python 04_checkpoint.py                         # one process
  # two nodes: the checkpoint directory must be on storage that both nodes see
  torchrun --nnodes 2 --nproc_per_node 4 --max-restarts 3 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 04_checkpoint.py --checkpoint-dir /shared/ckpt

The training state is one object, TrainState, with state_dict() and load_state_dict(). Rank
0 locks --checkpoint-dir for its job and writes each checkpoint atomically with its sha256
beside it. At start every rank loads the newest one that verifies, before DDP wraps the
model, and carries on with the same data order and random state: bit for bit the weights of
an uninterrupted run, with 1 or 2 processes. Under torchrun --max-restarts the ranks restart
and resume on their own; a run resumes whenever the directory holds checkpoints (start over
in a new one). Small synthetic model and data: the subject is the checkpoint. Torch >= 2.4.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import fcntl
import hashlib
import io
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# setup(), launch(), check() and SetupError are the shared plumbing at the bottom of this file.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --amp none: no autocast
SHAPES_THE_RUN = ("seed", "train_size", "batch_size", "lr", "weight_decay", "amp")  # on resume


def main(args: argparse.Namespace) -> None:
    # bit for bit on GPUs: deterministic cuDNN, a fixed cuBLAS workspace (before cuBLAS starts)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    d = setup(args.timeout, store=attempt_store(args.timeout))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if d.rank == 0:
        print(
            f"{d.world_size} process(es) on {d.device.type}, attempt {restarts + 1} "
            f"(TORCHELASTIC_RESTART_COUNT={restarts}), checkpoints in {args.checkpoint_dir}"
        )
    prepare_directory(args.checkpoint_dir, d)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts too)
    model = build_model().to(d.device)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        weight_decay=args.weight_decay,
        fused=d.device.type == "cuda",
    )  # fp16: GradScaler won't sync
    state = TrainState(
        model,
        optimizer,
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7),
        torch.amp.GradScaler(d.device.type, enabled=args.amp == "fp16"),
        args.train_size,
    )
    torch.manual_seed(args.seed + d.rank)  # then each rank its own dropout stream
    resumed = load_checkpoint(state, args, d)  # before DDP: it loads into the plain model
    ddp_model = DDP(model, device_ids=[d.device] if d.device.type == "cuda" else None)
    dataset = SyntheticPatterns(args.train_size, args.seed)
    sampler = ResumableSampler(dataset, num_replicas=d.world_size, rank=d.rank, seed=args.seed)
    # iter(loader) draws its workers' base seed from generator; from the global RNG, that draw
    # would come once more in a resumed run and shift every random number after it (dropout).
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(args.seed + d.rank),
        pin_memory=d.device.type == "cuda",
    )
    if state.epoch >= args.epochs and d.rank == 0:
        print(f"nothing to do: --epochs {args.epochs} are done; use a new --checkpoint-dir")
    train(ddp_model, loader, state, restarts == 0 and not resumed, args, d)
    # ---- checks: identical replicas, and a checkpoint that loads without DDP ----
    for buffer in model.buffers():  # rank 0's BatchNorm statistics, as saved, on every rank
        dist.broadcast(buffer, src=0)
    verified = verify_replicas_identical(model, d)
    if d.rank == 0:  # the last checkpoint as an inference job loads it: a plain model, no DDP
        path = sorted(args.checkpoint_dir.glob("step-*.pt"))[-1]
        (plain := build_model()).load_state_dict(read_checkpoint(path)["model"])
        same = map(torch.equal, plain.state_dict().values(), model.cpu().state_dict().values())
        check(all(same), "inference copy", f"a plain model from {path.name} has other weights")
        print(
            f"verified: every epoch used each of the {args.train_size} samples once "
            f"(plus the sampler's padding)"
        )
        print(f"verified: {verified}; a plain model loads the same from {path.name}", flush=True)
    dist.barrier()  # the others stay until rank 0 has read the final checkpoint


def attempt_store(timeout: float):
    """Under torchrun --max-restarts, a fresh TCPStore per attempt: the agent's outlives restarts
    with the dead group's keys (pytorch/pytorch#135712), and restart counts differ by node
    (#147064). Rank 0 posts its port in the agent's store; the others use it once it answers.
    No restarts: the agent's, which outlives rank 0 (NCCL's dump signal travels there)."""
    if (
        os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0"
        or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    ):
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


def prepare_directory(directory: Path, d: Dist) -> None:
    """Before training, rank 0 locks the directory for this job (another job there would prune
    and overwrite its checkpoints) and removes a killed save's leftovers; all learn the outcome."""
    error = None
    try:
        if d.rank == 0:  # flock: held until the process ends (the descriptor is never closed)
            directory.mkdir(parents=True, exist_ok=True)
            lock = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT)  # also: can we write?
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for leftover in directory.glob(".step-*.tmp*"):
                leftover.unlink()
    except BlockingIOError:
        error = f"another job holds {directory}/.lock: use another --checkpoint-dir, or wait"
    except OSError as e:
        error = f"checkpoint directory {directory} is not writable: {e}"
    raise_rank0_error(error)


def raise_rank0_error(error: str | None) -> None:  # a collective: all raise rank 0's error
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise SetupError(outcome[0])


def build_model() -> nn.Module:
    # BatchNorm buffers and Dropout's random draws are both state a resume must restore.
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(32, 10),
    )


class TrainState:
    """What a resume needs but the per-rank random streams, with state_dict() and
    load_state_dict() (torch.distributed.checkpoint's Stateful); seen: this rank's visits."""

    KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "position", "step", "seen")

    def __init__(self, model: nn.Module, optimizer, scheduler, scaler, train_size: int):
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.epoch = self.step = 0  # the epoch in progress; optimizer steps since the start
        self.position = 0  # how much of this epoch's global order is consumed (see the sampler)
        self.seen = torch.zeros(train_size, dtype=torch.int64)

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),  # the plain model: keys without "module."
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "position": self.position,
            "step": self.step,
            "seen": self.seen,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])  # a no-op unless --amp fp16
        self.epoch, self.position, self.step = state["epoch"], state["position"], state["step"]
        self.seen = state["seen"].to("cpu", torch.int64)


# ---- checkpoints: step-00000040.pt beside step-00000040.pt.sha256 (sha256sum's format) ----
def load_checkpoint(state: TrainState, args: argparse.Namespace, d: Dist) -> bool:
    """On every rank, before DDP: load the newest checkpoint that verifies into state, falling
    back past unreadable ones (renamed *.unreadable); False if there is none."""
    candidates = sorted(args.checkpoint_dir.glob("step-*.pt"), reverse=True)  # newest first
    saved, path, skipped = None, None, []
    for candidate in candidates:
        try:
            saved, path = read_checkpoint(candidate), candidate
            break
        except (Unreadable, OSError) as e:
            skipped.append((candidate, str(e)))
    names = [None] * d.world_size
    dist.all_gather_object(names, path and path.name)
    check(
        len(set(names)) == 1,
        "every rank resumes from the same checkpoint",
        f"ranks chose {names}; is {args.checkpoint_dir} the same directory on every node?",
    )
    if candidates and not saved:  # never silently start from scratch over checkpoints
        raise SetupError(
            f"{args.checkpoint_dir} holds {len(candidates)} checkpoint(s) and none "
            f"is readable ({'; '.join(f'{p.name}: {why}' for p, why in skipped)})"
            f". Move them away to start over"
        )
    for bad, why in skipped if d.rank == 0 else []:
        print(
            f"WARNING: {bad.name} is unreadable ({why}); renamed it *.unreadable and fell "
            f"back to an older checkpoint",
            file=sys.stderr,
            flush=True,
        )
        bad.rename(bad.with_name(bad.name + ".unreadable"))  # kept, but out of the way
    if not saved:
        if d.rank == 0:
            print(f"no checkpoint in {args.checkpoint_dir}: starting from step 0", flush=True)
        return False
    differing = [
        f"--{k.replace('_', '-')} {v} there, {getattr(args, k)} here"
        for k, v in saved["args"].items()
        if getattr(args, k) != v
    ]
    if differing:
        raise SetupError(
            f"{path} was written with different settings ({', '.join(differing)}"
            f"); resume with the same values or use another --checkpoint-dir"
        )
    state.load_state_dict(saved)
    if not d.rank == 0:
        state.seen.zero_()  # rank 0 carries the epoch's coverage so far
    if saved["world_size"] == d.world_size:
        rng = saved["rng"][d.rank]  # this rank's streams, where they were
        torch.set_rng_state(rng["torch"].cpu())
        if rng["cuda"] is not None and d.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"].cpu(), d.device)
    else:
        torch.manual_seed(args.seed + d.rank + 1_000_003 * state.step)
        if d.rank == 0:
            print(
                f"world size changed ({saved['world_size']} -> {d.world_size}): random streams "
                f"reseeded; weights, optimizer and data position carry on exactly"
            )
    if d.rank == 0:
        print(
            f"resuming from {path}: epoch {state.epoch} with {state.position} of its "
            f"{args.train_size} samples done, global step {state.step}",
            flush=True,
        )
    return True


def read_checkpoint(path: Path) -> dict:
    """Verify and load one checkpoint, or raise Unreadable."""
    marker = path.with_name(path.name + ".sha256")
    if not marker.exists():
        raise Unreadable(f"no {marker.name}: the save did not finish")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != (marker.read_text().split() or ["(empty)"])[0]:
        raise Unreadable(f"sha256 mismatch ({len(data)} bytes): truncated or corrupted")
    try:
        # Onto the CPU, not all onto GPU 0: load_state_dict moves each tensor where its parameter
        # is (#128208). weights_only: tensors and plain containers only, no code runs.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means unreadable
        raise Unreadable(f"torch.load failed: {str(e).splitlines()[0]}") from e
    required = {*TrainState.KEYS, "rng", "world_size", "args"}
    missing = required - set(state) if isinstance(state, dict) else required
    if missing:
        raise Unreadable(f"not a checkpoint of this script (no {', '.join(sorted(missing))})")
    return state


class Unreadable(Exception): ...  # a checkpoint file that cannot be trusted: the message says why


# ---- data and training ------------------------------------------------------------------
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


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way into an epoch. DistributedSampler orders
    the dataset by seed + epoch, pads the order to a multiple of the world size with its own
    first indices, and deals every world_size-th index to each rank. After s full steps of
    batch b on W ranks, that deal has used exactly the first s*b*W positions of the order,
    whichever ranks took them. So a resume skips that many positions and deals the rest the
    same way over the ranks it has now: nothing is loaded again, nothing is skipped."""

    start = 0  # positions of this epoch's order already consumed

    def set_position(self, epoch: int, start: int) -> None:
        self.set_epoch(epoch)  # same seed + epoch on every rank: one order they all agree on
        self.start = start

    def __iter__(self):
        n = len(self.dataset)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        rest = order[self.start :]
        self.padding = -len(rest) % self.num_replicas
        rest += (order * (self.padding // n + 1))[: self.padding]  # pad with the order's head
        indices = rest[self.rank :: self.num_replicas]
        if self.start == 0:  # from the top, this must be exactly what DistributedSampler deals
            check(
                indices == list(super().__iter__()),
                "sampler matches DistributedSampler",
                f"epoch {self.epoch}: the resumable deal differs from the stock one",
            )
        return iter(indices)

    def __len__(self) -> int:
        return math.ceil((len(self.dataset) - self.start) / self.num_replicas)


def train(model: DDP, loader: DataLoader, state: TrainState, first_attempt: bool, args, d):
    amp = AMP_DTYPES.get(args.amp)
    while state.epoch < args.epochs:
        loader.sampler.set_position(state.epoch, state.position)
        loss_sum = torch.zeros(2, device=d.device)
        for i, (index, x, y) in enumerate(loader, 1):
            simulate_failure(args, d, state.step, first_attempt)
            x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
            with torch.autocast(d.device.type, dtype=amp, enabled=amp is not None):
                loss = F.cross_entropy(model(x), y)
            state.optimizer.zero_grad(set_to_none=True)
            state.scaler.scale(loss).backward()
            state.scaler.step(state.optimizer)  # optimizer.step(); skipped if fp16 overflowed
            state.scaler.update()
            state.seen.index_add_(0, index, torch.ones_like(index))
            loss_sum += torch.stack(
                [
                    loss.detach().float() * len(index),  # no host sync per step
                    loss_sum.new_tensor(len(index)),
                ]
            )
            state.step += 1
            state.position += args.batch_size * d.world_size  # the last batch may be short
            if i == len(loader):
                state.scheduler.step()  # per epoch, so a change of world size leaves it alone
                check_coverage(state.seen, loader.sampler, state.epoch, d)
                state.epoch, state.position = state.epoch + 1, 0
                state.seen.zero_()
                where = f"end of epoch {state.epoch - 1}"
            elif state.step % args.save_every == 0:
                where = f"epoch {state.epoch}, {state.position}/{args.train_size} samples"
            else:
                continue
            dist.all_reduce(loss_sum)  # the mean loss over every rank's batches since the last save
            weights = [t for t in state.model.state_dict().values() if t.is_floating_point()]
            finite = all(t.isfinite().all() for t in weights)  # parameters and buffers
            if not (finite and torch.isfinite(loss_sum[0])):  # before the save: the last good stays
                raise SetupError(f"loss is not finite at step {state.step}; lower --lr")
            path = save_checkpoint(state, args, d)
            if d.rank == 0:
                print(
                    f"step {state.step:4d}  loss {(loss_sum[0] / loss_sum[1]).item():.4f}  "
                    f"saved {path.name} ({where})",
                    flush=True,
                )
            loss_sum.zero_()


def save_checkpoint(state: TrainState, args: argparse.Namespace, d: Dist) -> Path:
    """Every rank calls it: random states and coverage are gathered; rank 0 writes the file,
    then its sha256 (last: it marks the save finished), and keeps only the newest --keep."""
    rngs = [None] * d.world_size
    dist.all_gather_object(
        rngs,
        {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else None,
        },
    )  # dropout's; add any other you use
    seen = state.seen.to(d.device, copy=True)  # NCCL reduces GPU tensors; counts live on CPU
    dist.all_reduce(seen)
    path, error = args.checkpoint_dir / f"step-{state.step:08d}.pt", None
    if d.rank == 0:
        buffer = io.BytesIO()
        torch.save(
            {
                **state.state_dict(),
                "seen": seen.cpu(),
                "rng": rngs,
                "world_size": d.world_size,
                "args": {k: getattr(args, k) for k in SHAPES_THE_RUN},
            },
            buffer,
        )
        data = buffer.getvalue()
        try:
            for target, payload in (
                (path, data),
                (
                    path.with_name(path.name + ".sha256"),
                    f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode(),
                ),
            ):
                tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
                with open(tmp, "wb") as f:
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())  # on disk before the rename makes it visible
                os.replace(tmp, target)  # a reader sees the old file or the new one, never half
            fd = os.open(args.checkpoint_dir, os.O_RDONLY)
            os.fsync(fd)  # the renames themselves survive a power cut
            os.close(fd)
            for old in sorted(args.checkpoint_dir.glob("step-*.pt"), reverse=True)[args.keep :]:
                for gone in (old.with_name(old.name + ".sha256"), old):  # marker first
                    gone.unlink(missing_ok=True)
        except OSError as e:
            error = f"rank 0 could not write a checkpoint in {args.checkpoint_dir}: {e}"
    raise_rank0_error(error)  # the usual recipe's barrier; a failed save stops every rank
    return path


def simulate_failure(args: argparse.Namespace, d: Dist, step: int, first_attempt: bool):
    """The last rank dies abruptly, like a machine that is gone; on the first attempt only."""
    if args.simulate_failure == step and d.rank == d.world_size - 1 and first_attempt:
        print(f"[rank {d.rank}] simulated failure at step {step}: SIGKILL to myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# ---- checks: each sample once per epoch, identical replicas, a loadable checkpoint ------
def check_coverage(seen: torch.Tensor, sampler: ResumableSampler, epoch: int, d: Dist) -> None:
    """Every sample trained on once this epoch, over all ranks and any resume (+ padding)."""
    total = seen.to(d.device, copy=True)
    dist.all_reduce(total)  # NCCL reduces GPU tensors; the counts live on the CPU
    check(
        int(total.min()) >= 1 and int(total.sum()) == len(total) + sampler.padding,
        "each sample once per epoch",
        f"epoch {epoch}: {int((total == 0).sum())} never seen, "
        f"{int(total.sum())} visits for {len(total)} samples + {sampler.padding} padding",
    )


def verify_replicas_identical(model: nn.Module, d: Dist) -> str:
    """Every rank holds the same parameters and buffers: their sha256, compared across ranks."""
    flat = torch.cat([t.detach().reshape(-1).double().cpu() for t in model.state_dict().values()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    digests = [None] * d.world_size
    dist.all_gather_object(digests, digest)
    check(
        len(set(digests)) == 1,
        "identical replicas",
        f"ranks hold different parameters or buffers: sha256 {[h[:12] for h in digests]}",
    )
    return (
        f"{d.world_size} rank(s) hold identical parameters and buffers "
        f"({flat.numel():,} values, sha256 {digest[:16]})"
    )


def build_parser() -> argparse.ArgumentParser:
    run = re.search(r"Run\n.*?(?:\n\n|$)", __doc__, re.S)[0]  # --help ends with the Run block
    raw = argparse.RawDescriptionHelpFormatter  # the docstring as written
    parser = argparse.ArgumentParser(
        description=__doc__.replace(run, ""), epilog=run, formatter_class=raw
    )

    def add(group, name: str, what: str, **how) -> None:  # the help states a default once
        if how.get("default") is not None:
            what += " (default: %(default)s)"
        group.add_argument(name, help=what, **how)

    c = parser.add_argument_group("checkpoints")
    add(c, "--checkpoint-dir", "on storage every node sees", type=Path, default=Path("checkpoints"))
    add(c, "--save-every", "also save every N steps, mid-epoch", type=number(int, 1), default=20)
    add(c, "--keep", "newest checkpoints kept", type=number(int, 1), default=3)
    what = "the last rank SIGKILLs itself at this global step, first attempt only"
    add(c, "--simulate-failure", what, type=number(int, 1), metavar="STEP")
    t = parser.add_argument_group("training")
    add(t, "--epochs", "epochs to train", type=number(int, 1), default=3)
    add(t, "--train-size", "images", type=number(int, 1), default=2048)
    add(t, "--batch-size", "per process", type=number(int, 1), default=32)
    add(t, "--lr", "AdamW's", type=number(float, 0), default=3e-3)
    add(t, "--weight-decay", "AdamW's", type=number(float, 0), default=0.01)
    add(
        t, "--amp", "autocast dtype; fp16 needs CUDA", default="none", choices=["none", *AMP_DTYPES]
    )
    add(t, "--seed", "weights, data, order", type=number(int, 0), default=0)
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.amp == "fp16" and not torch.cuda.is_available():
        parser.error("--amp fp16 needs CUDA (float16 autocast, GradScaler); on CPU use bf16")
    return args


def number(cast, low: float, high: float = 2**32):
    """An argparse type: a number with low <= value < high, which nan and inf never are."""

    def parse(text: str):
        value = cast(text)
        if not low <= value < high:
            raise argparse.ArgumentTypeError(f"must be >= {low} and < {high}, got {text}")
        return value

    parse.__name__ = cast.__name__  # so that argparse says "invalid int value: 'x'"
    return parse


# ==== shared plumbing: begin ==== the same in all six scripts; 01_init_methods.py explains it


class SetupError(RuntimeError): ...  # the job cannot run as configured: the message says why


class CheckFailed(RuntimeError): ...  # a property this script demonstrates did not hold


def check(ok: bool, name: str, detail: str) -> None:
    if not ok:
        raise CheckFailed(f"{name}: {detail}")


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 4):  # the oldest tested
        parser.error(f"needs torch >= 2.4; torch {torch.__version__} is installed")
    g = parser.add_argument_group("launch (NCCL when CUDA GPUs are visible, else Gloo)")
    spawn = "start N processes with mp.spawn; N left out or 0: one per GPU, else 2"
    g.add_argument("--spawn", nargs="?", const=0, type=number(int, 0), metavar="N", help=spawn)
    wait = "seconds to wait for a peer or a collective (default: %(default)g)"
    g.add_argument("--timeout", type=number(float, 0.1, 1e6), default=300.0, help=wait)


def launch(main, args: argparse.Namespace) -> None:
    """Run main(args) on every rank: under torchrun, with --spawn N, or as one process."""
    if "RANK" in os.environ:  # a launcher started this process and set its variables
        if args.spawn is not None:
            sys.exit("error: --spawn starts processes itself; under a launcher, drop it")
        run_rank(None, main, args)
    n = str(1 if args.spawn is None else args.spawn or torch.cuda.device_count() or 2)
    with socket.create_server(("127.0.0.1", 0)) as s:  # a free port, for a job started here
        port = str(s.getsockname()[1])
    # what torchrun would set; run_rank adds each rank's RANK and LOCAL_RANK
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=n, LOCAL_WORLD_SIZE=n)
    if args.spawn is None:  # no launcher: a world of one, through the same code path
        run_rank(0, main, args)
    try:
        mp.spawn(run_rank, args=(main, args), nprocs=int(n))  # run_rank(i, main, args), i < n
    except mp.ProcessExitedException as e:  # that rank has printed its own reason
        sys.exit(f"error: spawned process {e.error_index} exited with code {e.exit_code}")
    except KeyboardInterrupt:  # Ctrl-C reached every rank too, and each has said so
        sys.exit(128 + signal.SIGINT)


def run_rank(index: int | None, main, args: argparse.Namespace) -> None:
    """Run main(args) and end the process: exit 0, or non-zero after one line naming the rank."""
    if index is not None:  # under --spawn: mp.spawn passes the index
        os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # Ctrl-C, a scheduler, a terminal
        if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (nohup's SIGHUP): it stays so
            signal.signal(sig, stop)
    try:
        main(args)
    except KeyboardInterrupt as e:  # from stop(): unwound, now one line
        end(128 + signal.Signals[str(e)], f"stopped by {e}")
    except (SetupError, CheckFailed, dist.DistError) as e:  # expected: one line says why
        end(1, f"{'CHECK FAILED' if isinstance(e, CheckFailed) else 'error'}: {e}")
    except Exception as e:  # a bug, most likely in code pasted in: keep its traceback
        if not re.search(r"third_party/gloo|pair closure|by peer", str(e)):  # Gloo's: expected
            traceback.print_exc()
        end(1, f"error: {type(e).__name__}: {e}")
    end(0)


def stop(signum: int, frame) -> None:
    # KeyboardInterrupt: the rank unwinds as on Ctrl-C, and DataLoader workers end quietly
    raise KeyboardInterrupt(signal.Signals(signum).name)


def end(code: int, why: str = "") -> None:
    """End the process now: one line naming the rank, the program's exit hooks, os._exit."""
    if why:
        sys.stderr.write(f"[rank {os.environ['RANK']}] {why}\n")  # one write: ranks interleave
    atexit._run_exitfuncs()  # exit hooks (a logger's, say), which os._exit would skip
    with contextlib.suppress(OSError, ValueError):  # stdout closed or broken: the outcome holds
        sys.stdout.flush()
    os._exit(code)  # no interpreter shutdown and no destroy_process_group: NOTES.md says why


# who this process is in the job: setup() returns it
Dist = NamedTuple("Dist", [("rank", int), ("world_size", int), ("device", torch.device)])


def setup(timeout: float, store: dist.Store | None = None, backend: str = "auto") -> Dist:
    """Check the launcher's variables, bind this process to its device, join the group."""
    env = [os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")]
    rank, world, local_rank, local_world = (int(v) if v.isdigit() else -1 for v in env)
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise SetupError(f"RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE are {env}: invalid")
    device = bind_device(local_rank, local_world, backend)
    where = f"env:// at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    # torch's store may wait past the timeout (a client retries, and a port held by another
    # program never answers) and cannot be interrupted: this timer ends the process instead.
    late = f"not all of {world} ranks joined within {timeout:g}s ({where}); start the others"
    deadline = threading.Timer(timeout + 2, end, (1, f"error: {late}"))
    deadline.start()
    kind, cuda = ("nccl", device) if device.type == "cuda" else ("gloo", None)
    limit = datetime.timedelta(seconds=timeout)
    try:  # device_id: NCCL connects now, on this process's GPU
        dist.init_process_group(
            kind, rank=rank, world_size=world, timeout=limit, store=store, device_id=cuda
        )
    except (dist.DistError, RuntimeError, ValueError, OSError) as e:
        first = str(e).partition("\n")[0]  # torch's C++ errors add a stack trace
        raise SetupError(f"cannot join the process group at {where}: {first}") from e
    deadline.cancel()  # (after a failure the process ends in run_rank, timer or not)
    return Dist(rank, world, device)


def bind_device(local_rank: int, local_world: int, backend: str = "auto") -> torch.device:
    """NCCL: this process's GPU, bound before init; Gloo: the CPU, its share of the cores."""
    if backend == "gloo" or not (backend == "nccl" or torch.cuda.is_available()):
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else [0]
        torch.set_num_threads(max(1, len(cores) // local_world))
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if gpus != 1 and local_world > gpus:  # one GPU: a launcher gave each process its own
        raise SetupError(f"{local_world} processes here, {gpus} GPU(s): NCCL needs a GPU each")
    device = torch.device("cuda", local_rank if gpus > 1 else 0)  # GPU ids restart per node
    torch.cuda.set_device(device)  # before init, so that nothing lands on GPU 0 by default
    return device


# ==== shared plumbing: end =================================================================


if __name__ == "__main__":
    try:
        launch(main, parse_args())
    except SystemExit as e:  # --spawn: a rank died; its checkpoints stay, so the same command
        sys.exit(f"{e.code}; run the same command to resume" if isinstance(e.code, str) else e.code)
