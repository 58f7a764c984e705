"""06_join_uneven.py: training when ranks have different numbers of batches.

DDP all-reduces gradients in every backward, so every rank must run the same number of
steps. When one rank runs out of data first, the others wait for it forever (or, here,
until --timeout). Three ways through, each checked at run time:
  --mode join          with model.join(): joined ranks shadow the missing all-reduces
  --mode join-counter  the generic Join with DDP plus a second Joinable of our own
  --mode throw         join(throw_on_early_termination=True): all ranks stop together
  --mode no-join       the failure: a clear error after --timeout, pointing here
The model is a bias-free Linear(1, 1) fed constant inputs (rank r feeds r + 1), so the
gradient of every step has a closed form, and the script checks it.

Run
  torchrun --standalone --nproc_per_node 3 06_join_uneven.py --batches-per-rank 6,3,0
  python 06_join_uneven.py --spawn 2 --mode join --no-divide-by-initial-world-size
  python 06_join_uneven.py --spawn 3 --mode join-counter
  python 06_join_uneven.py --spawn 3 --mode throw
  python 06_join_uneven.py --spawn 2 --mode no-join --timeout 10
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
import datetime
import math
import os
import re
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel as DDP

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
# Models, and a Joinable of our own.
# ---------------------------------------------------------------------------

class ScaledByGlobalMean(nn.Module):
    """Divides by the mean of the global batch, found with an all_reduce in forward (as
    SyncBatchNorm does on GPUs): a collective that DDP's join does not know how to shadow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = torch.stack([x.detach().sum(), torch.tensor(float(x.numel()), device=x.device)])
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


# ---------------------------------------------------------------------------
# Training with uneven inputs.
# ---------------------------------------------------------------------------

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


def train(args: argparse.Namespace, d: Dist, counts: list[int]) -> dict:
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
    steps, grads_checked = 0, 0

    def one_step(x: torch.Tensor) -> None:
        nonlocal steps, grads_checked
        model(x).sum().backward()
        if args.mode != "no-join":
            want = expected_gradient(steps, counts, args)
            got = linear.weight.grad.item()
            check(math.isclose(got, want, rel_tol=1e-6), "closed-form gradient",
                  f"step {steps}: gradient {got} but the formula gives {want}")
            grads_checked += 1
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.mode == "join-counter":
            counter.step(len(x))
        steps += 1

    if args.mode == "join":
        with model.join(divide_by_initial_world_size=args.divide_by_initial):
            for x in inputs:
                one_step(x)
    elif args.mode == "join-counter":
        # The generic Join: DDP and our counter both joinable; kwargs go to every hook.
        with Join([model, counter], divide_by_initial_world_size=args.divide_by_initial):
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
    else:  # no-join
        try:
            for x in inputs:
                one_step(x)
            dist.barrier()  # a rank that ran out waits here; the others wait in all-reduce
        except (dist.DistError, RuntimeError) as e:
            raise SetupError(
                f"uneven inputs without join: ranks hold {counts} batches, so after "
                f"{min(counts)} steps some ranks wait for an all-reduce the others never "
                f"start; it timed out after {args.timeout:g}s (this rank did {steps} steps). "
                f"Use model.join() (--mode join) or even inputs (drop_last)") from e
    return {"steps": steps, "grads_checked": grads_checked, "weight": linear.weight.item(),
            "counter": counter.total}


def main(args: argparse.Namespace) -> None:
    d = setup(args.backend, args.timeout)
    counts = batches_per_rank(args, d.world_size)
    if d.is_main:
        print(f"mode {args.mode}: batches per rank {counts}, batch {args.batch_size}, "
              f"divide_by_initial_world_size={args.divide_by_initial}", flush=True)
    result = train(args, d, counts)
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, result)
    weights = [r["weight"] for r in everyone]
    check(len(set(weights)) == 1, "identical replicas", f"final weights differ: {weights}")
    notes = [f"{d.world_size} rank(s) hold identical weights ({weights[0]:.6f})"]
    w = initial_weight(args)
    for step in range(min(counts) if args.mode == "throw" else max(counts)):
        w -= args.lr * expected_gradient(step, counts, args)
    check(math.isclose(weights[0], w, rel_tol=1e-5, abs_tol=1e-6), "closed-form weight",
          f"final weight {weights[0]} but the formula gives {w}")
    checked = sum(r["grads_checked"] for r in everyone)
    notes.append(f"{checked} gradients and the final weight match the closed form")
    if args.mode == "throw":
        steps = [r["steps"] for r in everyone]
        check(steps == [min(counts)] * d.world_size, "stop at the shortest",
              f"steps per rank {steps}, expected {min(counts)} on every rank")
        notes.append(f"all ranks stopped after {min(counts)} step(s)")
    if args.mode == "join-counter":
        totals = {r["counter"] for r in everyone}
        expected = sum(counts) * args.batch_size
        check(totals == {expected}, "counter total",
              f"ranks counted {sorted(totals)} samples, expected {expected}")
        notes.append(f"the SampleCounter counted {expected} samples on every rank")
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mode", choices=["join", "join-counter", "throw", "no-join"],
                        default="join")
    parser.add_argument("--batches-per-rank", type=count_list, metavar="N0,N1,...",
                        help="batches on each rank (default: 6, 3, 0, 0, ...)")
    parser.add_argument("--batch-size", type=positive_int, default=2)
    parser.add_argument("--divide-by-initial-world-size", dest="divide_by_initial",
                        action=argparse.BooleanOptionalAction, default=True,
                        help="average gradients over all ranks (True) or over those still "
                             "active (False)")
    parser.add_argument("--lr", type=positive_float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    add_launch_args(parser)
    args = parser.parse_args(argv)
    check_launch_args(parser, args)
    return args


if __name__ == "__main__":
    require_torch()
    launch(main, parse_args())
