"""06_join_uneven.py: training when ranks disagree: uneven inputs, a bad step, a mismatch.

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
  # two nodes: torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
  #     --rdzv-endpoint HOST0:29400 --rdzv-id job1 06_join_uneven.py

Which to use: if inputs can be made even (DistributedSampler with drop_last, or a fixed
number of steps), do that; it costs nothing. join() is for inputs that are uneven by
nature (packed sequences, filtered data), when every rank's data should count. Models
that run their own collectives in forward (SyncBatchNorm) need throw, because join only
shadows DDP's own collectives: every rank then stops at the shortest rank's length.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import io
import math
import os
import re
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel as DDP

# The plumbing used below is defined at the bottom of this file, the same in all six
# scripts: setup() binds this process to its device, joins the process group and returns a
# Dist (rank, local_rank, world_size, device, is_main); check(ok, name, detail) raises
# CheckFailed, SetupError reports a job that cannot run as configured, and both end the rank
# with one line; launch(main, args) runs main on every rank (torchrun, --spawn N, or one
# process); add_launch_args adds --spawn, --backend and --timeout.


# ---- Models, and Joinables of our own ----------------------------------------------------

class ScaledByGlobalMean(nn.Module):
    """Divides by the mean of the global batch, found with an all_reduce in forward (as
    SyncBatchNorm does on GPUs): a collective that DDP's join does not know how to shadow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = torch.stack([x.detach().sum(), torch.full((), float(x.numel()), device=x.device)])
        dist.all_reduce(stats)
        return x / (stats[0] / stats[1])


class SampleCounter(Joinable):
    """Counts samples across ranks with one all_reduce per step."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.total = device, 0

    def step(self, samples: int) -> None:
        Join.notify_join_context(self)  # "I have not joined", before this step's collective
        count = torch.tensor([samples], dtype=torch.int64, device=self.device)
        dist.all_reduce(count)
        self.total += int(count)

    def join_hook(self, **kwargs) -> JoinHook:
        return CounterJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD


class CounterJoinHook(JoinHook):
    def __init__(self, counter: SampleCounter):
        self.counter = counter

    def main_hook(self) -> None:
        # Run by a joined rank once per step of the others: the same all_reduce, with 0.
        zero = torch.zeros(1, dtype=torch.int64, device=self.counter.device)
        dist.all_reduce(zero)
        self.counter.total += int(zero)


class StepGuard(Joinable):
    """Decides with every rank whether a step's loss is finite, before backward.

    A rank that alone skips backward on a bad loss leaves the others waiting in DDP's
    gradient all-reduce (or pairs its next collective with theirs). Here one small
    all-reduce tells every rank how many ranks saw a non-finite loss, so all skip together.
    A joined rank runs its Joinables' hooks in list order, the guard's before DDP's, while
    an active rank's check comes after DDP's forward: so the check has a Gloo side group
    of its own, whose collectives are matched apart from the default group's."""

    def __init__(self, device: torch.device, group):
        super().__init__()
        self.device, self.group, self.skipped = device, group, 0

    def begin_step(self) -> None:
        Join.notify_join_context(self)

    def all_finite(self, loss: torch.Tensor) -> bool:
        bad = (~torch.isfinite(loss.detach())).to(torch.int64).reshape(1).cpu()
        dist.all_reduce(bad, group=self.group)  # ranks with a non-finite loss this step
        return int(bad) == 0

    def join_hook(self, **kwargs) -> JoinHook:
        return GuardJoinHook(self.group)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD  # Join needs one group for all Joinables; see all_finite


class GuardJoinHook(JoinHook):
    """A joined rank's part in the check: 0 bad ranks, posted without waiting. The active
    ranks reach their check only after DDP's forward collectives (a bucket rebuild's
    broadcast, say), which this rank's DDP hook shadows next: waiting here would deadlock."""

    def __init__(self, group):
        self.group, self.pending = group, None

    def main_hook(self) -> None:
        if self.pending:  # the previous step's, long done: the others have stepped since
            self.pending.wait()
        self.pending = dist.all_reduce(torch.zeros(1, dtype=torch.int64), group=self.group,
                                       async_op=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        if self.pending:
            self.pending.wait()


# ---- Training when ranks disagree --------------------------------------------------------

def expected_gradient(step: int, counts: list[int], args: argparse.Namespace) -> float:
    """d/dw of sum(w * x) over the ranks still active at this step, as DDP averages it."""
    batch = args.batch_size
    if args.mode == "throw":
        # Every rank is active (the run stops at the shortest) and x is divided by the
        # global mean m = mean(r + 1): (1/W) * sum over r of batch * (r + 1) / m = batch.
        return float(batch)
    active = [r for r, n in enumerate(counts) if n > step]
    total = sum(batch * (r + 1) for r in active)
    return total / (len(counts) if args.divide_by_initial else len(active))


def train(args: argparse.Namespace, d: Dist, counts: list[int]) -> tuple[dict, nn.Module]:
    torch.manual_seed(args.seed)
    layers = [nn.Linear(1, 1, bias=False)]
    if args.mode == "throw":
        layers.insert(0, ScaledByGlobalMean())
    model = DDP(nn.Sequential(*layers).to(d.device),
                device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    linear = model.module[-1]
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    inputs = [torch.full((args.batch_size, 1), float(d.rank + 1), device=d.device)
              for _ in range(counts[d.rank])]
    counter = SampleCounter(d.device)
    # Every rank creates every group, in the same order, whether it uses it or not.
    side = dist.new_group(backend="gloo") if args.mode == "no-join" or args.nonfinite else None
    guard = StepGuard(d.device, side) if args.nonfinite else None
    steps, grads_checked = 0, 0

    def one_step(x: torch.Tensor) -> None:
        nonlocal steps, grads_checked
        if guard:
            guard.begin_step()  # Join's per-step "still here", from the first Joinable
        loss = model(x).sum()
        if args.nonfinite == (d.rank, steps):
            loss = loss * float("nan")  # as an overflow or a bad sample would make it
        applied = not guard or guard.all_finite(loss)
        if not applied:
            # Every rank skips the update. DDP's forward has already told joined ranks to
            # expect this step's gradient all-reduce (_check_global_requires_backward_grad_sync
            # in torch/nn/parallel/distributed.py), so run it, on zero gradients.
            (sum(p.sum() for p in model.parameters()) * 0.0).backward()
            check(linear.weight.grad.item() == 0.0, "skipped step", f"step {steps}: gradient "
                  f"{linear.weight.grad.item()} reached the weights")
            guard.skipped += 1
        else:
            loss.backward()
            if args.mode != "no-join":
                want = expected_gradient(steps, counts, args)
                got = linear.weight.grad.item()
                check(math.isclose(got, want, rel_tol=1e-6), "closed-form gradient",
                      f"step {steps}: gradient {got} but the formula gives {want}")
                grads_checked += 1
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.mode == "join-counter":
            counter.step(len(x) if applied else 0)
        steps += 1

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
            if d.is_main:
                print(f"rank 0 caught: {e}", flush=True)
    else:
        find_uneven_end(inputs, one_step, side, d)
    return {"steps": steps, "grads_checked": grads_checked, "weight": linear.weight.item(),
            "counter": counter.total, "skipped": guard.skipped if guard else 0}, model.module


def find_uneven_end(inputs: list, one_step, side, d: Dist) -> None:
    """Without join: before each step every rank says whether it still has a batch.

    The flags travel on a Gloo side group, so they can never pair with a gradient bucket
    (a barrier on the default group would: on NCCL the short rank's barrier and the long
    rank's all-reduce are both one-element sums, and NCCL matches them silently)."""
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
                f"model.join() (--mode join) or even inputs (drop_last)")
        one_step(inputs[step])


def mismatched_collectives(d: Dist, side) -> None:
    """Rank 0 all-reduces 3 numbers, the others 2, in the same position of the sequence.

    Without a check, Gloo may mix the data or wait and NCCL may hang or read past a
    buffer. With TORCH_DISTRIBUTED_DEBUG=DETAIL (set in main for this mode), every
    collective is first fingerprinted across ranks, and a mismatch raises on every rank.
    No DDP model is built in this mode: in torch 2.14.1, DDP's constructor under DETAIL
    crashes on Gloo (a segfault in c10d::Logger::set_env_variables; INFO is fine)."""
    x = torch.ones(3 if d.rank == 0 else 2, device=d.device)
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        # Every rank caught it. Each prints torch's report, then all meet once more on the
        # Gloo side group: the first rank to exit has its launcher stop the others.
        sys.stderr.write(f"[rank {d.rank}] {' '.join(str(e).split())[:700]}\n")  # one write
        dist.barrier(group=side)
        raise SetupError("collectives do not match across ranks: torch's report (from "
                         "TORCH_DISTRIBUTED_DEBUG=DETAIL) is above") from e
    raise CheckFailed("mismatch detected: TORCH_DISTRIBUTED_DEBUG=DETAIL let mismatched "
                      "collectives through")


def main(args: argparse.Namespace) -> None:
    if args.mode == "mismatch":  # before init_process_group, which wraps the group for it
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    d = setup(args.backend, args.timeout)
    counts = batches_per_rank(args, d.world_size)
    if args.mode == "mismatch":  # no DDP model here: see mismatched_collectives
        if d.world_size < 2:
            raise SetupError("--mode mismatch needs at least 2 ranks (--spawn 2, or torchrun)")
        mismatched_collectives(d, dist.new_group(backend="gloo"))
    if args.nonfinite and not (args.nonfinite[0] < d.world_size
                               and args.nonfinite[1] < counts[args.nonfinite[0]]):
        raise SetupError(f"--nonfinite-at {args.nonfinite[0]}:{args.nonfinite[1]}: rank "
                         f"{args.nonfinite[0]} has no step {args.nonfinite[1]} "
                         f"(batches per rank {counts}, steps count from 0)")
    if d.is_main:
        print(f"mode {args.mode}: batches per rank {counts}, batch {args.batch_size}, "
              f"divide_by_initial_world_size={args.divide_by_initial}", flush=True)
    result, module = train(args, d, counts)
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, result)
    weights = [r["weight"] for r in everyone]
    check(len(set(weights)) == 1, "identical replicas", f"final weights differ: {weights}")
    notes = [f"{d.world_size} rank(s) hold identical weights ({weights[0]:.6f})"]
    skip = args.nonfinite[1] if args.nonfinite else None
    w = initial_weight(args)
    for step in range(min(counts) if args.mode == "throw" else max(counts)):
        w -= 0 if step == skip else args.lr * expected_gradient(step, counts, args)
    check(math.isclose(weights[0], w, rel_tol=1e-5, abs_tol=1e-6), "closed-form weight",
          f"final weight {weights[0]} but the formula gives {w}")
    checked = sum(r["grads_checked"] for r in everyone)
    notes.append(f"{checked} gradients and the final weight match the closed form")
    if args.nonfinite:
        skipped = [r["skipped"] for r in everyone if r["steps"] > skip]
        check(skipped == [1] * len(skipped), "every rank skips the bad step",
              f"ranks active at step {skip} skipped {skipped} steps")
        notes.append(f"step {skip} (rank {args.nonfinite[0]}'s loss not finite) skipped on "
                     f"all {len(skipped)} active ranks, its update left out")
    if args.mode == "throw":
        steps = [r["steps"] for r in everyone]
        check(steps == [min(counts)] * d.world_size, "stop at the shortest",
              f"steps per rank {steps}, expected {min(counts)} on every rank")
        notes.append(f"all ranks stopped after {min(counts)} step(s)")
    if args.mode == "join-counter":
        totals = {r["counter"] for r in everyone}
        expected = args.batch_size * sum(sum(1 for r in range(d.world_size) if counts[r] > s)
                                         for s in range(max(counts)) if s != skip)
        check(totals == {expected}, "counter total",
              f"ranks counted {sorted(totals)} samples, expected {expected}")
        notes.append(f"the SampleCounter counted {expected} samples on every rank")
    if args.save_model:
        if d.is_main:
            buffer = io.BytesIO()
            torch.save(module.state_dict(), buffer)  # the unwrapped model: no "module."
            write_atomic(args.save_model, buffer.getvalue())
            notes.append(f"rank 0 saved the weights to {args.save_model}")
        dist.barrier()  # nobody exits (or reads the file) before rank 0 has written it
    if d.is_main:
        print("steps per rank: " + ", ".join(f"{r}: {e['steps']}" for r, e in enumerate(everyone)))
        print(f"verified: {'; '.join(notes)}", flush=True)


def initial_weight(args: argparse.Namespace) -> float:
    torch.manual_seed(args.seed)
    return nn.Linear(1, 1, bias=False).weight.item()


def batches_per_rank(args: argparse.Namespace, world_size: int) -> list[int]:
    if args.batches_per_rank is None:
        return [max(0, 6 - 3 * r) for r in range(world_size)]  # 6, 3, 0, 0, ...
    if len(args.batches_per_rank) != world_size:
        raise SetupError(f"--batches-per-rank lists {len(args.batches_per_rank)} ranks, "
                         f"the world has {world_size}")
    return args.batches_per_rank


def count_list(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 6,3,0, got {text!r}") from None
    if any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"counts must be >= 0, got {text!r}")
    return counts


def rank_and_step(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+):(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP like 1:2, got {text!r}")
    return int(match[1]), int(match[2])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="join",
                        choices=["join", "join-counter", "throw", "no-join", "mismatch"],
                        help="which case to run (see above; default: %(default)s)")
    parser.add_argument("--batches-per-rank", type=count_list, metavar="N0,N1,...",
                        help="batches on each rank (default: 6, 3, 0, 0, ...)")
    parser.add_argument("--batch-size", type=positive_int, default=2,
                        help="samples per batch (default: %(default)s)")
    parser.add_argument("--divide-by-initial-world-size", dest="divide_by_initial",
                        action=argparse.BooleanOptionalAction, default=True,
                        help="average gradients over all ranks, or over those still active")
    parser.add_argument("--nonfinite-at", dest="nonfinite", type=rank_and_step,
                        metavar="RANK:STEP", help="make that rank's loss NaN at that step "
                                                  "(from 0); join and join-counter modes")
    parser.add_argument("--lr", type=positive_float, default=0.01,
                        help="SGD learning rate (default: %(default)g)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the initial weight (default: %(default)s)")
    parser.add_argument("--save-model", type=output_file, metavar="PATH",
                        help="rank 0 saves model.module.state_dict() there at the end")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_launch_args(parser, args)
    if args.nonfinite and args.mode not in ("join", "join-counter"):
        parser.error("--nonfinite-at works with --mode join or join-counter")
    if args.nonfinite and not args.divide_by_initial:
        parser.error("--nonfinite-at needs --divide-by-initial-world-size: its check comes "
                     "first in Join, and only the first Joinable tells DDP how many ranks "
                     "are still active")
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
