r"""06_join_uneven.py: training when ranks disagree: uneven inputs, a bad step, a mismatch.

DDP all-reduces gradients in every backward, so every rank must run the same steps and the
same collectives. When one rank runs out of data first, or skips a step, or calls another
collective, the others wait for it (until --timeout) or, worse, pair the wrong collectives.
Each way through is checked at run time:
  --mode join          DDP's join(): joined ranks shadow the missing all-reduces
  --mode join-counter  the generic Join with DDP plus a second Joinable of our own
  --mode throw         join(throw_on_early_termination=True): all ranks stop together
  --mode no-join       without join: the uneven end found and named before anyone waits
  --mode mismatch      ranks call collectives that do not match: TORCH_DISTRIBUTED_DEBUG=DETAIL
                       names them instead of hanging or mixing the data
  --nonfinite-at R:S   rank R's loss at step S is not finite: every rank skips that step
The model is a bias-free Linear(1, 1) fed constant inputs (rank r feeds r + 1), so the
gradient of every step has a closed form, and the script checks it.

Run
  torchrun --standalone --nproc_per_node 3 06_join_uneven.py --batches-per-rank 6,3,0
  python 06_join_uneven.py --spawn 2 --mode join --no-divide-by-initial-world-size
  python 06_join_uneven.py --spawn 3 --mode join-counter --nonfinite-at 1:2
  python 06_join_uneven.py --spawn 3 --mode throw
  python 06_join_uneven.py --spawn 2 --mode no-join
  python 06_join_uneven.py --spawn 2 --mode mismatch
  # two nodes, 2 processes each: run on both machines
  torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 06_join_uneven.py

Which to use: if inputs can be made even (DistributedSampler with drop_last, a fixed number
of steps), do that: it costs nothing. join() is for inputs uneven by nature (packed
sequences, filtered data) when every rank's data should count. Models with collectives of
their own in forward (SyncBatchNorm) need throw: all ranks then stop at the shortest.
Needs torch >= 2.4. Under torchrun --max-restarts, copy 04_checkpoint.py's attempt_store().
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import datetime
import io
import math
import os
import re
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel as DDP

# setup(), launch(), check() and SetupError are the shared plumbing at the bottom of this file.


def main(args: argparse.Namespace) -> None:
    if args.mode == "mismatch":  # before init_process_group, which wraps the group for it
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    d = setup(args.timeout)
    counts = batches_per_rank(args, d.world_size)
    if args.mode == "mismatch":  # no DDP model here: see mismatched_collectives
        limit = datetime.timedelta(seconds=args.timeout)  # a new group's own: not the default's
        mismatched_collectives(d, dist.new_group(backend="gloo", timeout=limit))
    if d.rank == 0:
        say(
            f"mode {args.mode}: batches per rank {counts}, batch {args.batch_size}, "
            f"divide_by_initial_world_size={args.divide_by_initial}",
        )
    result, module = train(args, d, counts)
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, result)
    notes = verify(everyone, counts, args)
    if args.save_model:  # the plain model: keys without "module."
        rank0_writes(args.save_model, lambda f: torch.save(module.state_dict(), f), d)
        notes.append(f"rank 0 saved the weights to {args.save_model}")
    if d.rank == 0:
        say("steps per rank: " + ", ".join(f"{r}: {e['steps']}" for r, e in enumerate(everyone)))
        say(f"verified: {'; '.join(notes)}")


def batches_per_rank(args: argparse.Namespace, world_size: int) -> list[int]:
    counts = list(args.batches_per_rank or (max(2, 6 - 3 * r) for r in range(world_size)))
    if len(counts) != world_size:
        raise SetupError(f"--batches-per-rank lists {len(counts)} ranks for {world_size}")
    if args.mode == "mismatch" and world_size < 2:
        raise SetupError("--mode mismatch needs at least 2 ranks (--spawn 2, or torchrun)")
    rank, step = args.nonfinite or (0, 0)
    if args.nonfinite and not (rank < world_size and step < counts[rank]):
        raise SetupError(
            f"--nonfinite-at {rank}:{step}: rank {rank} has no step {step} "
            f"(batches per rank {counts}, steps count from 0)"
        )
    return counts


def train(args: argparse.Namespace, d: Dist, counts: list[int]) -> tuple[dict, nn.Module]:
    torch.manual_seed(args.seed)
    layers = [nn.Linear(1, 1, bias=False)]
    if args.mode == "throw":
        layers.insert(0, ScaledByGlobalMean())
    cuda = [d.device] if d.device.type == "cuda" else None  # CPU: None
    model = DDP(nn.Sequential(*layers).to(d.device), device_ids=cuda)
    linear = model.module[-1]
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    x = torch.full((args.batch_size, 1), float(d.rank + 1), device=d.device)
    inputs = [x] * counts[d.rank]  # rank r feeds r + 1: the gradient has a closed form
    counter = SampleCounter(d.device)
    # Every rank creates every group, in the same order, whether it uses it or not.
    limit = datetime.timedelta(seconds=args.timeout)  # a new group's own: not the default's
    side = None
    if args.mode == "no-join" or args.nonfinite:
        side = dist.new_group(backend="gloo", timeout=limit)
    guard = StepGuard(d.device, side) if args.nonfinite else None
    grads = []  # (step, gradient, applied) per step: checked after training

    def one_step(x: torch.Tensor) -> None:
        if guard:
            Join.notify_join_context(guard)  # this rank is still here: from the first Joinable
        loss = model(x).sum()
        if args.nonfinite == (d.rank, len(grads)):
            loss = loss * float("nan")  # as an overflow or a bad sample would make it
        applied = not guard or guard.all_finite(loss)
        if applied:
            loss.backward()
        else:  # every rank skips the update; but DDP's forward has told joined ranks to
            # expect this step's all-reduce (_check_global_requires_backward_grad_sync in
            # torch/nn/parallel/distributed.py), so run it, on zero gradients
            (sum(p.sum() for p in model.parameters()) * 0.0).backward()
        grads.append((len(grads), linear.weight.grad.item(), applied))
        if applied:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.mode == "join-counter":
            counter.step(len(x) if applied else 0)

    if args.mode in ("join", "join-counter"):
        # model.join(...) is Join([model], ...); the generic Join takes DDP and Joinables of
        # our own, and hands the keyword arguments to every one's join hook.
        joinables = [model, counter] if args.mode == "join-counter" else [model]
        if guard:  # first, see StepGuard (DDP, no longer first, divides by all ranks)
            joinables.insert(0, guard)
        with Join(joinables, divide_by_initial_world_size=args.divide_by_initial):
            for x in inputs:
                one_step(x)
    elif args.mode == "throw":
        # Joined ranks can shadow DDP's all-reduces but not ScaledByGlobalMean's; so when
        # one rank runs out, every rank raises and all stop at the shortest length.
        try:
            with model.join(throw_on_early_termination=True):
                for x in inputs:
                    one_step(x)
        except RuntimeError as e:
            if d.rank == 0:
                say(f"rank 0 caught: {e}")
    else:
        find_uneven_end(inputs, one_step, side, d)
    result = dict(steps=len(grads), grads=grads, weight=linear.weight.item(), counter=counter.total)
    return result, model.module


class ScaledByGlobalMean(nn.Module):
    """Divides by the mean of the global batch, found with an all_reduce in forward (as
    SyncBatchNorm does on GPUs): a collective that DDP's join does not know how to shadow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = torch.stack([x.detach().sum(), torch.full((), float(x.numel()), device=x.device)])
        dist.all_reduce(stats)
        return x / (stats[0] / stats[1])


class SampleCounter(Joinable, JoinHook):
    """Counts samples across ranks with one all_reduce per step; it is its own join hook."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.total = device, 0

    def step(self, samples: int) -> None:
        Join.notify_join_context(self)  # "I have not joined", before this step's collective
        count = torch.tensor([samples], dtype=torch.int64, device=self.device)
        dist.all_reduce(count)
        self.total += int(count)

    def main_hook(self) -> None:
        """Run by a joined rank once per step of the others: the same all_reduce, with 0."""
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.all_reduce(count)  # the others' samples: this rank's total keeps up
        self.total += int(count)

    def join_hook(self, **kwargs) -> JoinHook:
        return self

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD


class StepGuard(Joinable, JoinHook):
    """Every rank learns, before backward, how many ranks saw a non-finite loss, so that all
    skip the step together (a rank that skipped alone would leave the others waiting in
    DDP's all-reduce). A joined rank runs its Joinables' hooks in list order, the guard's
    before DDP's, while an active rank's check comes after DDP's forward: so the check has
    a Gloo side group, whose collectives are matched apart from the default group's."""

    def __init__(self, device: torch.device, group):
        super().__init__()
        self.device, self.group, self.pending = device, group, None

    def all_finite(self, loss: torch.Tensor) -> bool:
        bad = (~torch.isfinite(loss.detach())).to(torch.int64).reshape(1).cpu()
        dist.all_reduce(bad, group=self.group)  # ranks with a non-finite loss this step
        return int(bad) == 0

    def main_hook(self) -> None:
        """A joined rank's part in the check: 0 bad ranks, posted without waiting (the active
        ranks reach it only after DDP's forward collectives, which this rank shadows next)."""
        if self.pending:  # the previous step's, long done: the others have stepped since
            self.pending.wait()
        none_bad = torch.zeros(1, dtype=torch.int64)
        self.pending = dist.all_reduce(none_bad, group=self.group, async_op=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        if self.pending:
            self.pending.wait()

    def join_hook(self, **kwargs) -> JoinHook:
        return self

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD  # Join needs one group for all Joinables; see all_finite


def find_uneven_end(inputs: list, one_step, side, d: Dist) -> None:
    """Without join: before each step every rank says whether it still has a batch, on a
    Gloo side group (on NCCL, a barrier could silently pair with a gradient all-reduce)."""
    for step in range(len(inputs) + 1):  # at len(inputs) this rank's own flag is 0
        mine = torch.tensor([int(step < len(inputs))])
        flags = [torch.zeros_like(mine) for _ in range(d.world_size)]
        dist.all_gather(flags, mine, group=side)
        finished = [r for r, f in enumerate(flags) if not f]
        if len(finished) == d.world_size:
            return
        if finished:
            training = [r for r, f in enumerate(flags) if f]
            raise SetupError(
                f"uneven inputs without join: at step {step} ranks {finished} have no batch "
                f"left and ranks {training} are still training; those would wait in a "
                f"gradient all-reduce that the others never start (until --timeout). Use "
                f"model.join() (--mode join) or even inputs (drop_last)"
            )
        one_step(inputs[step])


def mismatched_collectives(d: Dist, side) -> None:
    """Rank 0 all-reduces 3 numbers, the others 2. Unchecked, Gloo may mix the data and NCCL
    may hang; TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective's shape across ranks
    (no DDP model here: its constructor segfaults under DETAIL on Gloo in torch 2.14.1)."""
    x = torch.ones(3 if d.rank == 0 else 2, device=d.device)
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        # every rank prints torch's report, then all meet: a launcher stops all at the first exit
        sys.stderr.write(f"[rank {d.rank}] {' '.join(str(e).split())[:700]}\n")  # one write
        dist.barrier(group=side)
        # (torch's report comes from TORCH_DISTRIBUTED_DEBUG=DETAIL)
        raise SetupError("collectives do not match across ranks: torch's report is above") from e
    raise CheckFailed("mismatch detected: DETAIL let mismatched collectives through")


# ---- checks: every rank's steps and weight against the closed form ---------------------
def verify(everyone: list[dict], counts: list[int], args: argparse.Namespace) -> list[str]:
    weights = [r["weight"] for r in everyone]
    check(len(set(weights)) == 1, "identical replicas", f"final weights differ: {weights}")
    notes = [f"{len(everyone)} rank(s) hold identical weights ({weights[0]:.6f})"]
    checked = 0
    for rank, result in enumerate(everyone if args.mode != "no-join" else []):
        for step, got, applied in result["grads"]:  # applied: a skipped step has gradient 0
            want = expected_gradient(step, counts, args) if applied else 0.0
            detail = f"rank {rank} step {step}: gradient {got} but the formula gives {want}"
            check(math.isclose(got, want, rel_tol=1e-6), "closed-form gradient", detail)
            checked += applied
    torch.manual_seed(args.seed)
    w = nn.Linear(1, 1, bias=False).weight.item()  # the initial weight, as train() made it
    skip = args.nonfinite[1] if args.nonfinite else None
    for step in range(min(counts) if args.mode == "throw" else max(counts)):
        w -= 0 if step == skip else args.lr * expected_gradient(step, counts, args)
    detail = f"final weight {weights[0]} but the formula gives {w}"
    check(math.isclose(weights[0], w, rel_tol=1e-5, abs_tol=1e-6), "closed-form weight", detail)
    notes.append(f"{checked} gradients and the final weight match the closed form")
    if args.nonfinite:
        active = [r for r in everyone if r["steps"] > skip]
        skipped = [sum(not applied for *_, applied in r["grads"]) for r in active]
        detail = f"ranks active at step {skip} skipped {skipped} steps"
        check(skipped == [1] * len(skipped), "every rank skips the bad step", detail)
        notes.append(
            f"step {skip} (rank {args.nonfinite[0]}'s loss not finite) skipped on "
            f"all {len(skipped)} active ranks, its update left out"
        )
    if args.mode == "throw":
        steps = [r["steps"] for r in everyone]
        detail = f"steps per rank {steps}, expected {min(counts)} on every rank"
        check(steps == [min(counts)] * len(everyone), "stop at the shortest", detail)
        notes.append(f"all ranks stopped after {min(counts)} step(s)")
    if args.mode == "join-counter":
        totals = {r["counter"] for r in everyone}
        steps = [s for s in range(max(counts)) if s != skip]  # each rank active: a batch
        expected = args.batch_size * sum(sum(1 for n in counts if n > s) for s in steps)
        detail = f"ranks counted {sorted(totals)} samples, expected {expected}"
        check(totals == {expected}, "counter total", detail)
        notes.append(f"the SampleCounter counted {expected} samples on every rank")
    return notes


def expected_gradient(step: int, counts: list[int], args: argparse.Namespace) -> float:
    """d/dw of sum(w * x) over the ranks still active at this step, as DDP averages it. With
    throw every rank is active and x is divided by the global mean m = mean(r + 1), so the
    gradient is (1/W) * sum over r of batch * (r + 1) / m = batch."""
    if args.mode == "throw":
        return float(args.batch_size)
    active = [r for r, n in enumerate(counts) if n > step]
    total = sum(args.batch_size * (r + 1) for r in active)
    return total / (len(counts) if args.divide_by_initial else len(active))


def build_parser() -> argparse.ArgumentParser:
    run = re.search(r"Run\n.*?(?:\n\n|$)", __doc__, re.S)[0]  # --help ends with the Run block
    parser = argparse.ArgumentParser(description=__doc__.replace(run, ""), epilog=run)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the docstring as written

    def add(group, name: str, what: str, **how) -> None:  # the help states a default once
        if how.get("default") is not None:
            what += " (default: %(default)s)"
        group.add_argument(name, help=what, **how)

    modes = ["join", "join-counter", "throw", "no-join", "mismatch"]
    add(parser, "--mode", "which case to run, each described above", choices=modes, default="join")
    counts = "batches on each rank, at most 10000 (default: 6, 3, 2, 2, ...)"
    add(parser, "--batches-per-rank", counts, type=numbers(","), metavar="N0,N1,...")
    add(parser, "--batch-size", "samples per batch", type=number(int, 1), default=2)
    what = "average gradients over all ranks, or over those still active"
    how = dict(dest="divide_by_initial", default=True, action=argparse.BooleanOptionalAction)
    add(parser, "--divide-by-initial-world-size", what, **how)
    what = "make that rank's loss NaN at that step (from 0); join modes"
    add(parser, "--nonfinite-at", what, type=numbers(":"), dest="nonfinite", metavar="RANK:STEP")
    add(parser, "--lr", "SGD's learning rate", type=number(float, 0), default=0.01)
    add(parser, "--seed", "the initial weight's", type=number(int, 0), default=0)
    add(parser, "--save-model", "rank 0 saves the weights there", type=output_file, metavar="PATH")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # DETAIL: DDP's constructor segfaults on Gloo in torch 2.14.1 and 2.15.0, not 2.4.1 (NOTES.md)
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL and torch.__version__ >= (2, 14)
    if detail and not torch.cuda.is_available() and args.mode != "mismatch":  # no DDP there
        v = torch.__version__  # TorchVersion: compared as numbers above
        parser.error(f"TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DDP on Gloo in torch {v}: use INFO")
    if args.nonfinite and args.mode not in ("join", "join-counter"):
        parser.error("--nonfinite-at works with --mode join or join-counter")
    if args.nonfinite and len(args.nonfinite) != 2:
        parser.error(
            f"--nonfinite-at: expected RANK:STEP, got {':'.join(map(str, args.nonfinite))}"
        )
    if args.nonfinite and not args.divide_by_initial:
        parser.error(
            "--nonfinite-at needs --divide-by-initial-world-size: its check is first "
            "in Join, and only the first Joinable tells DDP how many ranks are active"
        )
    return args


def numbers(separator: str):
    """An argparse type: whole numbers from 0 to 10000 joined by separator, as a tuple (each
    rank holds its batches in memory: a larger count would only exhaust it)."""

    def parse(text: str) -> tuple[int, ...]:
        if not re.fullmatch(rf"\d+({separator}\d+)*", text):
            raise argparse.ArgumentTypeError(f"expected numbers joined by {separator}, got {text}")
        return tuple(number(int, 0, 10001)(x) for x in text.split(separator))

    return parse


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
