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
  # by hand on two machines, 2 processes each: also say where each process sits on its node
  python 01_init_methods.py --init-method tcp://HOST0:29500 --world-size 4 --rank 2 \
      --local-rank 0 --local-world-size 2      # the first process of the second machine
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
import atexit
import datetime
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

# The plumbing used below is defined at the bottom of this file, the same in all six
# scripts: setup() binds this process to its device, joins the process group and returns a
# Dist (rank, local_rank, world_size, device, is_main); check(ok, name, detail) raises
# CheckFailed, SetupError reports a job that cannot run as configured, and both end the rank
# with one line; launch(main, args) runs main on every rank (torchrun, --spawn N, or one
# process); add_launch_args adds --spawn, --backend and --timeout.


# ---- What this script teaches: who is who, and four collectives with known answers -------

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init-method", default="env://",
                        help="env:// (torchrun, --spawn, one process), tcp://HOST:PORT or "
                             "file:///PATH (default: %(default)s)")
    parser.add_argument("--rank", type=int,
                        help="this process's rank, for a manual tcp:// or file:// launch")
    parser.add_argument("--world-size", type=int,
                        help="how many processes, for a manual tcp:// or file:// launch")
    parser.add_argument("--local-rank", type=nonnegative_int,
                        help="a manual launch's index on its own node, which picks its GPU "
                             "(default: $LOCAL_RANK, else --rank: one node)")
    parser.add_argument("--local-world-size", type=positive_int, metavar="N",
                        help="processes per node in a manual launch (default: "
                             "$LOCAL_WORLD_SIZE, else --world-size: one node)")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
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
    if args.rank is not None:  # a manual launch: where does this process sit on its node?
        local = args.local_rank if args.local_rank is not None else \
            int(os.environ.get("LOCAL_RANK", args.rank))
        per_node = args.local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE",
                                                               args.world_size))
        if not (local < per_node <= args.world_size and local <= args.rank):
            parser.error(f"--local-rank {local} with --local-world-size {per_node} does not fit "
                         f"rank {args.rank} of {args.world_size}")
        args.local_rank, args.local_world_size = local, per_node
    elif args.local_rank is not None or args.local_world_size is not None:
        parser.error("--local-rank and --local-world-size are for a manual launch with --rank")
    folder = Path(args.init_method[len("file://"):]).parent  # torch waits forever if absent
    if scheme == "file" and not folder.is_dir():
        parser.error(f"--init-method {args.init_method!r}: the folder {folder} does not exist; "
                     f"every process must see it")
    if args.spawn is not None and args.rank is not None:
        parser.error("--spawn assigns ranks itself; drop --rank/--world-size")
    if scheme != "env" and args.spawn is None and args.rank is None and "RANK" not in os.environ:
        parser.error(f"{scheme}:// needs --rank and --world-size (or --spawn N)")
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
    args = parse_args()
    if args.rank is not None:  # started by hand: say who it is, as a launcher would
        os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(args.world_size),
                          LOCAL_RANK=str(args.local_rank),
                          LOCAL_WORLD_SIZE=str(args.local_world_size))
    launch(main, args)
