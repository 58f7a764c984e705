"""01_init_methods.py: how DDP processes find each other (the process group), checked.

Every process joins one process group, reports who it is, and runs four collectives
whose answers are known in advance; rank 0 prints the table and the checks.

Run
  python 01_init_methods.py                                      # one process, world size 1
  python 01_init_methods.py --spawn 4                            # 4 processes via mp.spawn
  torchrun --standalone --nproc_per_node 2 01_init_methods.py    # 2 processes via torchrun
  # the manual launch: two terminals, the rendezvous is rank 0's TCP port
  python 01_init_methods.py --init-method tcp://127.0.0.1:29500 --rank 0 --world-size 2
  python 01_init_methods.py --init-method tcp://127.0.0.1:29500 --rank 1 --world-size 2
  # the same with a file all processes can see (a fresh path per job)
  python 01_init_methods.py --init-method file:///tmp/ddp_rdzv --rank 0 --world-size 2
  # two nodes, 2 processes each: run this on both machines
  torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 01_init_methods.py

Words (each is a column of the table rank 0 prints)
  world size  how many processes take part in the job (2 nodes x 2 processes = 4).
  rank        a process's id in the job, 0 .. world size - 1; rank 0 is the "master".
  local rank  its id on its own node, 0 .. processes per node - 1; it picks the GPU,
              because GPU numbers restart on every machine (global rank would not).
  node rank   which machine (torchrun's GROUP_RANK); rank = node rank * per node + local.
  group       a set of ranks that run collectives together; the default group is all
              of them, dist.new_group() makes smaller ones (here: even and odd ranks).
  backend     the library that moves the tensors: NCCL between GPUs, Gloo on CPUs.
  master address and port
              where rank 0 listens so that the others can find it: MASTER_ADDR and
              MASTER_PORT for env://, or written into tcp://HOST:PORT.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
# What this script teaches: who is who, and four collectives with known answers.
# ---------------------------------------------------------------------------

def describe_rank(d: Dist) -> dict:
    return dict(rank=d.rank, local_rank=d.local_rank, node_rank=d.node_rank,
                world_size=dist.get_world_size(), host=socket.gethostname(), pid=os.getpid(),
                backend=dist.get_backend(), device=str(d.device))


def rank_table(rows: list[dict]) -> str:
    lines = [f"{'rank':>4} {'local':>5} {'node':>4} {'world':>5}  {'host':<20} {'pid':>7}  "
             f"{'backend':<7} device"]
    for r in rows:
        lines.append(f"{r['rank']:>4} {r['local_rank']:>5} {r['node_rank']:>4} "
                     f"{r['world_size']:>5}  {r['host'][:20]:<20} {r['pid']:>7}  "
                     f"{r['backend']:<7} {r['device']}")
    return "\n".join(lines)


def verify_table(rows: list[dict], world_size: int) -> None:
    check(sorted(r["rank"] for r in rows) == list(range(world_size)), "ranks",
          f"expected each of 0..{world_size - 1} once, got {[r['rank'] for r in rows]}")
    check(all(r["world_size"] == world_size for r in rows), "world size",
          f"ranks disagree: {[r['world_size'] for r in rows]}")
    slots = [(r["node_rank"], r["local_rank"]) for r in rows]
    check(len(set(slots)) == len(slots), "local ranks",
          f"two processes share a (node rank, local rank) slot: {sorted(slots)}")


def verify_collectives(d: Dist) -> str:
    ws, rank, dev = d.world_size, d.rank, d.device

    t = torch.tensor([rank], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # in place: every rank ends with the total
    expected = ws * (ws - 1) // 2
    check(t.item() == expected, "all_reduce", f"sum of ranks should be {expected}, got {t.item()}")

    mine = torch.tensor([rank, rank * rank], dtype=torch.int64, device=dev)
    gathered = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(gathered, mine)  # slot i holds rank i's tensor, on every rank
    got = [g.tolist() for g in gathered]
    check(got == [[r, r * r] for r in range(ws)], "all_gather", f"got {got}")

    token = torch.tensor([1000 + ws if rank == 0 else -1], dtype=torch.int64, device=dev)
    dist.broadcast(token, src=0)  # rank 0's value overwrites everyone's
    check(token.item() == 1000 + ws, "broadcast", f"expected {1000 + ws}, got {token.item()}")

    # Every rank must call new_group for every group, members or not, in the same order.
    evens, odds = list(range(0, ws, 2)), list(range(1, ws, 2))
    groups = {"even": dist.new_group(evens)}
    if odds:
        groups["odd"] = dist.new_group(odds)
    name, members = ("even", evens) if rank % 2 == 0 else ("odd", odds)
    s = torch.tensor([rank], dtype=torch.int64, device=dev)
    dist.all_reduce(s, group=groups[name])  # only the members of my group take part
    check(s.item() == sum(members), f"all_reduce in the {name} group",
          f"expected {sum(members)} (ranks {members}), got {s.item()}")
    sums = [None] * ws
    dist.all_gather_object(sums, (name, s.item()))
    group_sums = dict(sums)

    return (f"all_reduce sum={t.item()}, all_gather={[g[0] for g in got]}, "
            f"broadcast={token.item()}, "
            + ", ".join(f"{n} group {m} sum={group_sums[n]}"
                        for n, m in (("even", evens), ("odd", odds)) if m))


def main(args: argparse.Namespace) -> None:
    d = setup(args.backend, args.timeout, args.init_method)
    rows = [None] * d.world_size
    dist.all_gather_object(rows, describe_rank(d))  # any picklable object, one per rank
    if d.is_main:
        print(f"process group up: init_method={args.init_method} backend={d.backend} "
              f"world_size={d.world_size}")
        print(rank_table(rows), flush=True)
    verify_table(rows, d.world_size)
    summary = verify_collectives(d)
    dist.barrier()  # nobody leaves while another rank may still be checking
    if d.is_main:
        print(f"verified: {d.world_size} rank(s) joined via {args.init_method.split('//')[0]}//; "
              f"{summary}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init-method", default="env://",
                        help="env:// (torchrun, --spawn, single process), tcp://HOST:PORT or "
                             "file:///PATH (default: env://)")
    parser.add_argument("--rank", type=int, help="this process's rank (tcp:// and file://)")
    parser.add_argument("--world-size", type=int, help="number of processes (tcp:// and file://)")
    add_launch_args(parser)
    args = parser.parse_args(argv)
    check_launch_args(parser, args)

    scheme = args.init_method.split("://")[0] if "://" in args.init_method else None
    if scheme not in ("env", "tcp", "file"):
        parser.error(f"--init-method {args.init_method!r}: use env://, tcp://HOST:PORT or file:///PATH")
    if scheme == "tcp" and not re.fullmatch(r"tcp://[^:/]+:\d+", args.init_method):
        parser.error(f"--init-method {args.init_method!r}: tcp:// needs HOST:PORT, "
                     f"e.g. tcp://127.0.0.1:29500")
    if scheme == "file" and not args.init_method.startswith("file:///"):
        parser.error(f"--init-method {args.init_method!r}: file:// needs an absolute path, "
                     f"e.g. file:///tmp/ddp_rdzv")
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.rank is not None:
        if args.rank < 0:
            parser.error(f"--rank must be >= 0, got {args.rank}")
        if args.world_size is None:
            parser.error("--rank needs --world-size")
        if args.rank >= args.world_size:
            parser.error(f"--rank {args.rank} must be < --world-size {args.world_size}")
    elif args.world_size is not None:
        parser.error("--world-size needs --rank (--spawn N sets both itself)")
    if args.spawn is not None and args.rank is not None:
        parser.error("--spawn assigns ranks itself; drop --rank/--world-size")
    if scheme != "env" and args.spawn is None and args.rank is None and "RANK" not in os.environ:
        parser.error(f"{scheme}:// needs --rank and --world-size (or --spawn N)")
    return args


if __name__ == "__main__":
    require_torch()
    args = parse_args()
    if args.rank is not None:
        # A hand-started process: state rank and world size the way a launcher would.
        os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(args.world_size),
                          LOCAL_RANK=os.environ.get("LOCAL_RANK", str(args.rank)),
                          LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", str(args.world_size)))
    launch(main, args)
