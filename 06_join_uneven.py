"""06_join_uneven.py: training when ranks disagree: uneven inputs, a bad step, a mismatch.

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

DDP all-reduces gradients in every backward, so every rank must run the same steps and the
same collectives. When one rank runs out of data first, or calls another collective, the
others wait for it (until --timeout) or, worse, pair the wrong collectives. Each mode shows
one way through, and the script checks it:
  join          DDP's join(): ranks that ran out shadow the others' gradient all-reduces
  join-counter  the generic Join: DDP plus a Joinable of our own (a sample counter)
  throw         join(throw_on_early_termination=True): all ranks stop at the shortest
  no-join       without join: the ranks compare their batch counts first and name an
                uneven split before anyone waits
  mismatch      ranks call collectives that do not match: TORCH_DISTRIBUTED_DEBUG=DETAIL
                names them instead of hanging or mixing the data
With --nonfinite-at R:S rank R's loss at step S is NaN: the gradient all-reduce carries the
NaN to every rank, so every rank sees it and all skip that step together (GradScaler skips
an overflow the same way). The model is a bias-free Linear(1, 1) fed constant inputs (rank
r feeds r + 1), so the gradient of every step has a closed form, and the script checks
every rank's gradients and final weight against it.

Which to use: if inputs can be made even (DistributedSampler with drop_last, a fixed number
of steps), do that: it costs nothing. join() is for inputs uneven by nature (packed
sequences, filtered data) when every rank's data should count. Models with collectives of
their own in forward (SyncBatchNorm) need throw: all ranks then stop at the shortest. Data
of unknown length, without join: before each step all ranks exchange a has-a-batch flag on
a Gloo side group (on NCCL, a barrier could pair with a gradient all-reduce).
Needs torch >= 2.4. Under torchrun --max-restarts, copy 04_checkpoint.py's attempt_store().
"""

import argparse
import atexit
import math
import os
import re
import signal
import socket
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel as DDP

LR = 0.01  # SGD's learning rate

# The shared plumbing is at the bottom of this file, the same in all six scripts (01 explains
# it): setup() reads the launcher's RANK, WORLD_SIZE and LOCAL_RANK, binds this process's
# device, joins the process group and returns d (rank, world_size, device); launch() starts
# the ranks, and run_rank() ends each with one line (so no destroy_process_group: NOTES.md
# says why); check() and SetupError fail loudly. Read it last, or not at all.


def main(args):
    if args.mode == "mismatch":  # before the group exists: DETAIL wraps it in one that checks
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    d = setup(args.timeout)
    counts = batches_per_rank(args, d.world_size)
    if args.mode == "mismatch":  # no DDP model here: see mismatched_collectives
        mismatched_collectives(d, args.timeout)
    if d.rank == 0:
        say(f"mode {args.mode}: batches per rank {counts}")
    result = train(args, d, counts[d.rank])
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, result)
    notes = verify(everyone, counts, args)
    if d.rank == 0:
        say(f"verified: {'; '.join(notes)}")


def batches_per_rank(args, world_size):
    """Each rank's number of batches: --batches-per-rank, or 6, 3, 2, 2, ..."""
    counts = args.batches_per_rank or [max(2, 6 - 3 * r) for r in range(world_size)]
    if len(counts) != world_size:
        raise SetupError(f"--batches-per-rank lists {len(counts)} ranks for {world_size}")
    if args.mode == "mismatch" and world_size < 2:
        raise SetupError("--mode mismatch needs at least 2 ranks")
    if args.nonfinite_at:
        rank, step = args.nonfinite_at
        steps = steps_per_rank(counts, args)
        if rank >= world_size or step >= steps[rank]:
            raise SetupError(f"--nonfinite-at: rank {rank} runs no step {step}")
    return counts


def steps_per_rank(counts, args):
    """With throw every rank stops at the shortest; else each runs all of its batches."""
    if args.mode == "throw":
        return [min(counts)] * len(counts)
    return counts


def train(args, d, batches):
    """Returns this rank's gradient at every step, its final weight and sample count."""
    torch.manual_seed(0)  # the same initial weight on every rank (DDP broadcasts rank 0's too)
    model = nn.Sequential(nn.Linear(1, 1, bias=False))
    if args.mode == "throw":
        model.insert(0, ScaledByGlobalMean())
    ddp_model = DDP(model.to(d.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.full((args.batch_size, 1), d.rank + 1.0, device=d.device)
    counter = SampleCounter(d.device)
    grads = []

    def step():
        loss = ddp_model(x).sum()
        if args.nonfinite_at == [d.rank, len(grads)]:
            loss = loss * math.nan  # as an overflow or a bad sample would make it
        # Every rank runs backward, always: its all-reduce carries one rank's NaN to all, so
        # all see the same gradients and make the same choice, with no collective of ours.
        loss.backward()
        grads.append(model[-1].weight.grad.item())
        # the norm of all gradients, not clipped here (max_norm inf); a job that clips has it
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), math.inf)
        if grad_norm.isfinite():
            optimizer.step()
        optimizer.zero_grad()
        if args.mode == "join-counter":
            counter.step(len(x))

    divide = args.divide_by_initial_world_size
    if args.mode == "join":
        with ddp_model.join(divide_by_initial_world_size=divide):
            for _ in range(batches):
                step()
    if args.mode == "join-counter":  # ddp_model.join(...) is Join([ddp_model], ...)
        with Join([ddp_model, counter], divide_by_initial_world_size=divide):
            for _ in range(batches):
                step()
    if args.mode == "throw":
        # Ranks that ran out could shadow DDP's all-reduces but not ScaledByGlobalMean's:
        # so when one rank runs out, every rank raises, and all stop at the shortest.
        try:
            with ddp_model.join(throw_on_early_termination=True):
                for _ in range(batches):
                    step()
        except RuntimeError as e:
            if d.rank == 0:
                say(f"rank 0 caught: {e}")
    if args.mode == "no-join":
        check_even(batches, d)
        for _ in range(batches):
            step()
    return dict(grads=grads, weight=model[-1].weight.item(), samples=counter.total)


class ScaledByGlobalMean(nn.Module):
    """Divides by the mean of all ranks' inputs, found with an all_reduce in forward (as
    SyncBatchNorm does on GPUs): a collective that DDP's join cannot shadow."""

    def forward(self, x):
        mean = x.detach().mean()
        dist.all_reduce(mean)  # the sum of the ranks' means: every batch is the same size
        return x / (mean / dist.get_world_size())


class SampleCounter(Joinable, JoinHook):
    """Counts all ranks' samples with an all_reduce per step; it is its own join hook."""

    def __init__(self, device):
        super().__init__()
        self.device = device
        self.total = 0

    def step(self, samples):
        Join.notify_join_context(self)  # "I have not joined", before this step's collective
        self.add(samples)

    def main_hook(self):
        """A joined rank runs this once per step of the others: the same all_reduce, with 0."""
        self.add(0)

    def add(self, samples):
        count = torch.tensor([samples], device=self.device)
        dist.all_reduce(count)
        self.total += count.item()

    def join_hook(self, **kwargs):
        return self

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD


def check_even(batches, d):
    """Without join: every rank learns every rank's number of batches before training, so
    an uneven split is named at once, not after --timeout in an all-reduce that the ranks
    that ran out never start."""
    counts = [None] * d.world_size
    dist.all_gather_object(counts, batches)
    shortest = min(counts)
    if shortest < max(counts):
        done = [r for r, n in enumerate(counts) if n == shortest]
        training = [r for r, n in enumerate(counts) if n > shortest]
        raise SetupError(
            f"uneven inputs without join: at step {shortest} ranks {done} have no batch left "
            f"and ranks {training} are still training: use model.join() (--mode join) or "
            f"even inputs (drop_last)"
        )


def mismatched_collectives(d, timeout):
    """Rank 0 all-reduces 3 numbers, the others 2. Unchecked, Gloo may mix the data and NCCL
    may hang; TORCH_DISTRIBUTED_DEBUG=DETAIL compares every collective across ranks first.
    (No DDP model here: DETAIL crashes its constructor on Gloo, as parse_args says.)"""
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    x = torch.ones(3 if d.rank == 0 else 2, device=d.device)
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        report = " ".join(str(e).split())  # torch's report, on one line
        sys.stderr.write(f"[rank {d.rank}] {report}\n")
        # every rank has written its report before any exits (a launcher stops all at the first)
        dist.barrier(group=side)
        raise SetupError("collectives do not match across ranks: torch's report is above") from e
    raise CheckFailed("DETAIL let mismatched collectives through")


# ---- checks: every rank's gradients and the final weight against the closed form -------
def verify(everyone, counts, args):
    """Checks the results that every rank gathered; returns what it checked, as notes."""
    weights = [r["weight"] for r in everyone]
    check(len(set(weights)) == 1, "identical replicas", f"final weights differ: {weights}")
    steps = steps_per_rank(counts, args)
    want = [expected_gradient(s, counts, args) for s in range(max(steps))]
    for rank, result in enumerate(everyone):
        got = result["grads"]
        expected = want[: steps[rank]]
        same = len(got) == len(expected) and torch.allclose(
            torch.tensor(got), torch.tensor(expected), equal_nan=True
        )
        check(same, "closed-form gradients", f"rank {rank}: {got}, the formula: {expected}")
    torch.manual_seed(0)
    w = nn.Linear(1, 1, bias=False).weight.item()  # the initial weight, as train() made it
    for g in want:
        if math.isfinite(g):  # training skips a step whose gradient is not finite
            w -= LR * g
    ok = math.isclose(weights[0], w, rel_tol=1e-5, abs_tol=1e-6)
    check(ok, "closed-form weight", f"final weight {weights[0]}, the formula: {w}")
    notes = [
        f"{len(everyone)} rank(s) hold identical weights ({weights[0]:.6f})",
        f"steps per rank {steps}: their {sum(steps)} gradients and the final weight match "
        f"the closed form",
    ]
    if args.nonfinite_at:
        rank, step = args.nonfinite_at
        active = sum(n > step for n in steps)
        notes.append(
            f"step {step} (rank {rank}'s loss not finite) skipped on all {active} active "
            f"ranks, its update left out"
        )
    if args.mode == "join-counter":
        samples = [r["samples"] for r in everyone]
        total = args.batch_size * sum(counts)
        check(samples == [total] * len(counts), "counter total", f"{samples}, not {total}")
        notes.append(f"the SampleCounter counted {total} samples on every rank")
    return notes


def expected_gradient(step, counts, args):
    """d/dw of sum(w * x) over the ranks still active at this step, as DDP averages it;
    NaN at --nonfinite-at's step. With throw every rank is active and x is divided by the
    global mean m = mean(r + 1), so the gradient is (1/W) * sum over r of batch * (r + 1) / m
    = batch."""
    if args.nonfinite_at and step == args.nonfinite_at[1]:
        return math.nan
    if args.mode == "throw":
        return float(args.batch_size)
    active = [r for r, n in enumerate(counts) if n > step]
    total = sum(args.batch_size * (r + 1) for r in active)
    if args.divide_by_initial_world_size:
        return total / len(counts)
    return total / len(active)


def build_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mode",
        choices=["join", "join-counter", "throw", "no-join", "mismatch"],
        default="join",
        help="which case to run, each described above (default: %(default)s)",
    )
    parser.add_argument(
        "--batches-per-rank",
        type=numbers(","),
        metavar="N0,N1,...",
        help="batches on each rank (default: 6, 3, 2, 2, ...)",
    )
    parser.add_argument(
        "--batch-size",
        type=number(int, 1),
        default=2,
        help="samples per batch (default: %(default)s)",
    )
    parser.add_argument(
        "--divide-by-initial-world-size",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="average gradients over all ranks, or over those still active (default: %(default)s)",
    )
    parser.add_argument(
        "--nonfinite-at",
        type=numbers(":"),
        metavar="RANK:STEP",
        help="make that rank's loss NaN at that step (from 0)",
    )
    add_launch_args(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    # DDP's constructor segfaults under DETAIL on Gloo in these versions (NOTES.md)
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL and args.mode != "mismatch"
    if detail and torch.__version__ >= (2, 14) and not torch.cuda.is_available():
        parser.error(
            "TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DDP on Gloo in "
            f"torch {torch.__version__}: use INFO"
        )
    if args.nonfinite_at and len(args.nonfinite_at) != 2:
        parser.error("--nonfinite-at: expected RANK:STEP")
    return args


def numbers(separator):
    """An argparse type: whole numbers joined by separator, as a list."""

    def integers(text):
        return [number(int, 0)(n) for n in text.split(separator)]

    return integers


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
    launch(main, parse_args())
