r"""01_init_methods.py: how DDP processes find each other (the process group), checked.

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

Needs torch >= 2.4. Under torchrun --max-restarts, copy 04_checkpoint.py's attempt_store().
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import re
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

# setup(), launch(), check() and SetupError are the shared plumbing at the bottom of this file.


def main(args: argparse.Namespace) -> None:
    d = join(args)  # the process group, with every rank in it
    rows = [None] * d.world_size
    dist.all_gather_object(rows, describe_rank(d))  # any picklable object, one per rank
    if d.is_main:
        print(f"process group up: init_method={args.init_method} backend={dist.get_backend()} "
              f"world_size={d.world_size}")
        print(rank_table(rows), flush=True)
    # ---- checks: every rank checks the gathered table and four collectives with known answers
    verify_table(rows, d.world_size)
    summary = verify_collectives(d)
    dist.barrier()  # nobody leaves while another rank may still be checking
    # torch's FileStore deletes its file when destroyed, but every rank ends with os._exit
    if args.rendezvous_file and d.is_main:  # past the barrier: no rank needs it any more
        args.rendezvous_file.unlink(missing_ok=True)
    if d.is_main:
        print(f"verified: {d.world_size} rank(s) joined via {args.init_method.split('//')[0]}//; "
              f"{summary}", flush=True)


def join(args: argparse.Namespace) -> Dist:
    """setup(), and for file:// what torch cannot tell: torch needs a file that is new (or
    empty) at every init. An earlier job's leftover file can make Gloo connect to addresses
    of ranks long gone, retrying well past --timeout, or even pair up with the wrong ranks."""
    if not args.rendezvous_file:
        return setup(args.timeout, args.backend, args.init_method)
    path, world = args.rendezvous_file, int(os.environ["WORLD_SIZE"])
    age = time.time() - path.stat().st_mtime if path.exists() else None
    # Sure to be stale: no other rank in a world of one; or older than --timeout (plus a
    # margin), by when every rank of this job that wrote it has joined or given up.
    if age is not None and (world == 1 or age > args.timeout + 5):
        raise SetupError(f"{path} is left by an earlier job (last written {age:.0f}s ago): "
                         f"delete it or use a fresh path")
    hint = (f"; if every rank is running, {path} may be left by an earlier job: delete it or "
            f"use a fresh path")

    def give_up() -> None:  # init_process_group cannot be interrupted: end the process
        sys.stderr.write(f"[rank {os.environ['RANK']}] error: not all of {world} ranks joined "
                         f"within {args.timeout:g}s ({args.init_method}){hint}\n")
        sys.stderr.flush()
        os._exit(1)

    deadline = threading.Timer(args.timeout + 2, give_up)
    deadline.start()
    try:
        return setup(args.timeout, args.backend, args.init_method)
    except SetupError as e:
        raise SetupError(f"{e}{hint}") from e
    finally:
        deadline.cancel()


def describe_rank(d: Dist) -> dict:
    # which machine: torchrun's GROUP_RANK, else the node size says it (rank = node * size + local)
    local_rank, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    node_rank = int(os.environ.get("GROUP_RANK", (d.rank - local_rank) // per_node))
    return dict(rank=d.rank, local_rank=local_rank, node_rank=node_rank,
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


def build_parser() -> argparse.ArgumentParser:
    run = re.search(r"Run\n.*?(?:\n\n|$)", __doc__, re.S)[0]  # --help ends with the Run block
    parser = argparse.ArgumentParser(description=__doc__.replace(run, ""), epilog=run,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init-method", default="env://",
                        help="env:// (torchrun, --spawn, one process), tcp://HOST:PORT or "
                             "file:///PATH (default: %(default)s)")
    parser.add_argument("--rank", type=int,
                        help="this process's rank, for a manual tcp:// or file:// launch")
    parser.add_argument("--world-size", type=int,
                        help="how many processes, for a manual tcp:// or file:// launch")
    parser.add_argument("--local-rank", type=int,
                        help="a manual launch's index on its own node, which picks its GPU "
                             "(default: $LOCAL_RANK, else --rank: one node)")
    parser.add_argument("--local-world-size", type=int, metavar="N",
                        help="processes per node in a manual launch (default: "
                             "$LOCAL_WORLD_SIZE, else --world-size: one node)")
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                        help="the library that moves tensors; auto: NCCL when a CUDA GPU is "
                             "visible, else Gloo (default: auto)")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_launch_args(parser, args)
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl needs a CUDA GPU and torch sees none; use --backend gloo")
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
        if not (0 <= local < per_node <= args.world_size and local <= args.rank):
            parser.error(f"--local-rank {local} with --local-world-size {per_node} does not fit "
                         f"rank {args.rank} of {args.world_size}")
        gpus = torch.cuda.device_count() if args.backend != "gloo" else 0
        if gpus > 1 and per_node > gpus:  # one node assumed, but this one cannot hold them
            parser.error(f"rank {args.rank} of {args.world_size} on a machine with {gpus} GPU(s): "
                         f"on several machines give each process --local-rank (its index on "
                         f"its machine) and --local-world-size; on one, NCCL needs a GPU per "
                         f"process (or use --backend gloo)")
        args.local_rank, args.local_world_size = local, per_node
    elif args.local_rank is not None or args.local_world_size is not None:
        parser.error("--local-rank and --local-world-size are for a manual launch with --rank")
    args.rendezvous_file = Path(args.init_method[len("file://"):]) if scheme == "file" else None
    if args.rendezvous_file and not args.rendezvous_file.parent.is_dir():  # torch'd wait forever
        parser.error(f"--init-method {args.init_method!r}: the folder "
                     f"{args.rendezvous_file.parent} does not exist; every process must see it")
    if args.spawn is not None and args.rank is not None:
        parser.error("--spawn assigns ranks itself; drop --rank/--world-size")
    if scheme != "env" and args.spawn is None and args.rank is None and "RANK" not in os.environ:
        parser.error(f"{scheme}:// needs --rank and --world-size (or --spawn N)")
    return args


# ==== shared plumbing: begin ==== the same in all six scripts; 01_init_methods.py explains it


class SetupError(RuntimeError): ...  # the job cannot run as configured: the message says why


class CheckFailed(RuntimeError): ...  # a property this script demonstrates did not hold


def check(ok: bool, name: str, detail: str) -> None:
    if not ok:
        raise CheckFailed(f"{name}: {detail}")


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("launch (NCCL when CUDA GPUs are visible, else Gloo)")
    g.add_argument("--spawn", nargs="?", type=int, const=0, metavar="N",
                   help="start N processes with mp.spawn; N left out or 0: one per GPU, else 2")
    g.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="wait for a peer or a collective, at most 1e6 (default: %(default)g)")


def check_launch_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 4):  # oldest tested
        parser.error(f"needs torch >= 2.4; torch {torch.__version__} is installed")
    if args.spawn is not None and (args.spawn < 0 or "RANK" in os.environ):
        parser.error("--spawn N needs N >= 0 and no launcher (under torchrun, drop --spawn)")
    if not 0 < args.timeout <= 1e6:
        parser.error(f"--timeout: must be > 0 and <= 1e6 seconds, got {args.timeout:g}")


def launch(main, args: argparse.Namespace) -> None:
    """Run main(args) on every rank: under torchrun, with --spawn N, or as one process."""
    if args.spawn is None and "RANK" in os.environ:  # a launcher started this process
        run_rank(None, main, args)
    n = 1 if args.spawn is None else args.spawn or torch.cuda.device_count() or 2
    with socket.create_server(("127.0.0.1", 0)) as s:  # a free port, for a job started here
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]),
                          WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))  # as torchrun sets them
    if args.spawn is None:  # no launcher: a world of one, through the same code path
        run_rank(0, main, args)
    try:
        mp.spawn(run_rank, args=(main, args), nprocs=n)  # run_rank(i, main, args), i < n
    except mp.ProcessExitedException as e:  # that rank has printed its own reason
        sys.exit(f"error: spawned process {e.error_index} exited with code {e.exit_code}")
    except KeyboardInterrupt:  # Ctrl-C reached every rank too, and each has said so
        sys.exit(1)


def run_rank(index: int | None, main, args: argparse.Namespace) -> None:
    """Run main(args), then end the process: exit 0, or 1 after one line naming the rank."""
    if index is not None:  # under --spawn: mp.spawn passes the index
        os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    rank, code = os.environ["RANK"], 1
    try:
        main(args)
        code = 0
    except KeyboardInterrupt:
        sys.stderr.write(f"[rank {rank}] interrupted\n")
    except Exception as e:  # expected: ours, or the process group's (a timeout, a lost peer)
        expected = isinstance(e, (SetupError, CheckFailed, dist.DistError)) or \
            re.search(r"third_party/gloo|pair closure|by peer", str(e))
        if not expected:  # a bug, most likely in code pasted in: keep its traceback
            traceback.print_exc()
        tag = "CHECK FAILED" if isinstance(e, CheckFailed) else "error"  # one write: ranks
        sys.stderr.write(f"[rank {rank}] {tag}: {'' if expected else type(e).__name__ + ': '}{e}\n")
    atexit._run_exitfuncs(), sys.stdout.flush(), sys.stderr.flush()  # exit hooks (a logger's)
    os._exit(code)  # no interpreter shutdown (Gloo aborts it, #190489), no destroy: NOTES.md


class Dist(NamedTuple):  # who this process is in the job; setup() returns it
    rank: int
    world_size: int
    device: torch.device
    is_main: bool  # rank 0: it prints and saves


def setup(timeout: float, backend: str = "auto", init_method: str = "env://", store=None) -> Dist:
    """Check the launcher's variables, bind this process to its device, join the group."""
    env = [os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")]
    rank, world, local_rank, local_world = (int(v) if v.isdigit() else -1 for v in env)
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise SetupError(f"RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE are {env}: a launcher "
                         f"sets whole numbers, each rank below its size, the node's <= the world's")
    if backend == "nccl" or backend == "auto" and torch.cuda.is_available():
        if (gpus := torch.cuda.device_count()) != 1 and local_world > gpus:  # 1: its own
            raise SetupError(f"{local_world} processes here, {gpus} GPU(s): NCCL needs a GPU each")
        device = torch.device("cuda", local_rank if gpus > 1 else 0)  # ids restart per node
        torch.cuda.set_device(device)  # before init, so nothing lands on GPU 0 by default
    else:  # Gloo: CPU tensors, and the node's cores shared among its processes
        device = torch.device("cpu")
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else [0]
        torch.set_num_threads(max(1, len(cores) // local_world))
    where = init_method if init_method != "env://" else \
        f"env:// at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    address = re.fullmatch(r"(?:env:// at |tcp://)(.+):(\d+)", where)  # rank 0's TCP store
    deadline = time.monotonic() + timeout  # one deadline, where torch's own client would retry
    while address and not store:  # after a random delay: up to twice the timeout (TCPStore.cpp)
        try:  # the host must resolve; every other rank waits until rank 0 listens there
            socket.create_connection(address.groups(), 5).close() if rank else \
                socket.getaddrinfo(*address.groups())
            break
        except socket.gaierror as e:
            raise SetupError(f"cannot resolve the host of {where}: {e.strerror}") from e
        except OSError:
            if time.monotonic() > deadline:
                raise SetupError(f"rank 0 is not listening at {where} after {timeout:g}s") from None
            time.sleep(0.1)
    try:  # device_id (NCCL): connect now, on this GPU; barriers and new_group use it too
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout),
                                store=store, init_method=None if store else init_method,
                                device_id=device if device.type == "cuda" else None)
    except (dist.DistError, RuntimeError, ValueError, OSError) as e:
        late = re.match(r"(?is)(?=.*?(\d+)/\d+ clients joined)|(?=.*?timeout|.*?timed out)", str(e))
        raise SetupError(f"{f'only {late[1]}' if late[1] else 'not all'} of {world} ranks joined "
                         f"within {timeout:g}s ({where}); start the missing ones" if late else
                         f"cannot join the process group at {where}: {e}") from e
    return Dist(rank, world, device, rank == 0)
# ==== shared plumbing: end =================================================================


if __name__ == "__main__":
    args = parse_args()
    if args.rank is not None:  # started by hand: say who it is, as a launcher would
        os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(args.world_size),
                          LOCAL_RANK=str(args.local_rank),
                          LOCAL_WORLD_SIZE=str(args.local_world_size))
    launch(main, args)
