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
import concurrent.futures
import contextlib
import datetime
import io
import os
import re
import signal
import socket
import sys
import tempfile
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
    if d.rank == 0:
        say(
            f"process group up: init_method={args.init_method} backend={dist.get_backend()} "
            f"world_size={d.world_size}"
        )
        say(rank_table(rows))
    # ---- checks: every rank checks the gathered table and four collectives with known answers
    verify_table(rows, d.world_size)
    summary = verify_collectives(d, args.timeout)
    dist.barrier()  # nobody leaves while another rank may still be checking
    # torch's FileStore deletes its file when destroyed, but every rank ends with os._exit
    if args.rendezvous_file and d.rank == 0:  # past the barrier: no rank needs it any more
        args.rendezvous_file.unlink(missing_ok=True)
    if d.rank == 0:
        say(
            f"verified: {d.world_size} rank(s) joined via {args.init_method.split('//')[0]}//; "
            f"{summary}",
        )


def join(args: argparse.Namespace) -> Dist:
    """Join the process group. env:// (torchrun, --spawn, one process) is the shared setup();
    tcp:// and file:// are done here, where each way of meeting can be seen."""
    if args.init_method == "env://":  # MASTER_ADDR:MASTER_PORT: rank 0's TCP store
        return setup(args.timeout, gloo=args.backend == "gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device = bind_device(local_rank, local_world, args.backend == "gloo")
    hint = ""
    if args.rendezvous_file:
        hint = check_rendezvous_file(args.rendezvous_file, world)
    # tcp://HOST:PORT: rank 0 listens there, the others connect (torch retries, with delays).
    # file://PATH: every rank writes its address into the file and reads the others'.
    # Neither wait can be interrupted, and neither always ends at the timeout: as in setup(),
    # a thread joins and this one waits for it, until the deadline or a signal (Ctrl-C).
    late = f"not all of {world} ranks joined within {args.timeout:g}s ({args.init_method})"
    joining = concurrent.futures.ThreadPoolExecutor(1).submit(
        dist.init_process_group,
        "nccl" if device.type == "cuda" else "gloo",
        init_method=args.init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        joining.result(args.timeout + 2)
    except concurrent.futures.TimeoutError:
        raise SetupError(f"{late}{hint}") from None
    except (dist.DistError, RuntimeError, ValueError, OSError) as e:
        first = str(e).partition("\n")[0]  # torch's C++ errors add a stack trace
        if re.search(r"(?i)time ?out|timed out", first):  # file://'s is "Wait timeout"
            raise SetupError(f"{late}: {first}{hint}") from e
        raise SetupError(
            f"cannot join the process group at {args.init_method}: {first}{hint}"
        ) from e
    return Dist(rank, world, device)


def check_rendezvous_file(path: Path, world: int) -> str:
    """torch needs a file that is new (or empty) at every init: an earlier job's leftover can
    make Gloo connect to ranks long gone, retrying well past --timeout, or pair up with the
    wrong ranks. Refuse one that is surely stale; else return a hint for any failure."""
    if path.exists():
        opened = processes_that_opened(path)
        # Surely stale: no other rank in a world of one; or every rank of a job of this size
        # (or larger) has opened it already, so none of this job's can be among them. Not
        # its age: a live rank 0's file can look old where clocks differ (NFS clients).
        if world == 1 or opened >= world:
            # its age by the file server's clock (a file made now), for the message only
            with tempfile.NamedTemporaryFile(dir=path.parent) as now:
                age = os.stat(now.name).st_mtime - path.stat().st_mtime
            raise SetupError(
                f"{path} is left by an earlier job (opened by {opened} process(es), last "
                f"written {age:.0f}s ago): delete it or use a fresh path"
            )
    earlier = f"{path} may be left by an earlier job: delete it or use a fresh path"
    return f"; if every rank is running, {earlier}"


def processes_that_opened(path: Path) -> int:
    """torch's FileStore file is a list of records (a 4-byte length, then the bytes), key
    then value; each process that opens it appends "refcount/" with the new count (and one
    that closes it cleanly, the count less one). The last count; 0 if there is none."""
    data, at, fields = path.read_bytes(), 0, []
    while at + 4 <= len(data):
        size = int.from_bytes(data[at : at + 4], "little")
        fields.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    pairs = zip(fields[0::2], fields[1::2])
    counts = [int(value) for key, value in pairs if key == b"refcount/" and value.isdigit()]
    return counts[-1] if counts else 0


def describe_rank(d: Dist) -> dict:
    # which machine: torchrun's GROUP_RANK, else the node size says it (rank = node * size + local)
    local_rank, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    node_rank = int(os.environ.get("GROUP_RANK", (d.rank - local_rank) // per_node))
    return dict(
        rank=d.rank,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=dist.get_world_size(),
        host=socket.gethostname(),
        pid=os.getpid(),
        backend=dist.get_backend(),
        device=str(d.device),
    )


def rank_table(rows: list[dict]) -> str:
    lines = [
        f"{'rank':>4} {'local':>5} {'node':>4} {'world':>5}  {'host':<20} {'pid':>7}  "
        f"{'backend':<7} device"
    ]
    for r in rows:
        lines.append(
            f"{r['rank']:>4} {r['local_rank']:>5} {r['node_rank']:>4} "
            f"{r['world_size']:>5}  {r['host'][:20]:<20} {r['pid']:>7}  "
            f"{r['backend']:<7} {r['device']}"
        )
    return "\n".join(lines)


def verify_table(rows: list[dict], world_size: int) -> None:
    check(
        sorted(r["rank"] for r in rows) == list(range(world_size)),
        "ranks",
        f"expected each of 0..{world_size - 1} once, got {[r['rank'] for r in rows]}",
    )
    check(
        all(r["world_size"] == world_size for r in rows),
        "world size",
        f"ranks disagree: {[r['world_size'] for r in rows]}",
    )
    slots = [(r["node_rank"], r["local_rank"]) for r in rows]
    check(
        len(set(slots)) == len(slots),
        "local ranks",
        f"two processes share a (node rank, local rank) slot: {sorted(slots)}",
    )
    # One node never spans two machines (several nodes on one machine are fine: a test's
    # two torchrun agents). A manual launch that leaves out --local-rank and
    # --local-world-size assumes one machine: on two, ranks there would claim node 0.
    machines = {}
    for r in rows:
        machines.setdefault(r["node_rank"], set()).add(r["host"])
    spread = {node: sorted(hosts) for node, hosts in machines.items() if len(hosts) > 1}
    check(
        not spread,
        "nodes",
        f"node rank(s) {spread} span several machines: by hand on several machines, give "
        f"each process --local-rank and --local-world-size",
    )


def verify_collectives(d: Dist, timeout: float) -> str:
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
    # A group's timeout is the backend's default (10 or 30 min), not the default group's.
    limit = datetime.timedelta(seconds=timeout)
    evens, odds = list(range(0, ws, 2)), list(range(1, ws, 2))
    groups = {"even": dist.new_group(evens, timeout=limit)}
    if odds:
        groups["odd"] = dist.new_group(odds, timeout=limit)
    name, members = ("even", evens) if rank % 2 == 0 else ("odd", odds)
    s = torch.tensor([rank], dtype=torch.int64, device=dev)
    dist.all_reduce(s, group=groups[name])  # only the members of my group take part
    check(
        s.item() == sum(members),
        f"all_reduce in the {name} group",
        f"expected {sum(members)} (ranks {members}), got {s.item()}",
    )
    sums = [None] * ws
    dist.all_gather_object(sums, (name, s.item()))
    group_sums = dict(sums)

    return (
        f"all_reduce sum={t.item()}, all_gather={[g[0] for g in got]}, "
        f"broadcast={token.item()}, "
        + ", ".join(
            f"{n} group {m} sum={group_sums[n]}" for n, m in (("even", evens), ("odd", odds)) if m
        )
    )


def build_parser() -> argparse.ArgumentParser:
    run = re.search(r"Run\n.*?(?:\n\n|$)", __doc__, re.S)[0]  # --help ends with the Run block
    parser = argparse.ArgumentParser(description=__doc__.replace(run, ""), epilog=run)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the docstring as written

    def add(group, name: str, what: str, **how) -> None:  # the help states a default once
        if how.get("default") is not None:
            what += " (default: %(default)s)"
        group.add_argument(name, help=what, **how)

    how = "env:// (torchrun, --spawn, one process), tcp://HOST:PORT or file:///PATH"
    add(parser, "--init-method", how, type=init_method, default="env://")
    backends = ["auto", "nccl", "gloo"]
    add(
        parser,
        "--backend",
        "auto: NCCL if a GPU is visible, else Gloo",
        choices=backends,
        default="auto",
    )
    g = parser.add_argument_group("a manual launch (one command per process)")
    add(g, "--rank", "this process's rank", type=number(int, 0))
    add(g, "--world-size", "how many processes in all", type=number(int, 1))
    add(
        g,
        "--local-rank",
        "its index on its machine, picks its GPU (default: --rank)",
        type=number(int, 0),
    )
    add(
        g,
        "--local-world-size",
        "processes on its machine (default: --world-size)",
        type=number(int, 1),
    )
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl needs a CUDA GPU and torch sees none; use --backend gloo")
    manual = args.rank is not None
    if manual != (args.world_size is not None):
        parser.error(
            "--rank and --world-size go together, for a manual launch (--spawn N sets both)"
        )
    if manual and args.spawn is not None:
        parser.error("--spawn assigns ranks itself; drop --rank/--world-size")
    if manual and args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} must be < --world-size {args.world_size}")
    if not manual and (args.local_rank, args.local_world_size) != (None, None):
        parser.error("--local-rank and --local-world-size are for a manual launch with --rank")
    scheme = args.init_method.split("://")[0]
    if scheme != "env" and not manual and args.spawn is None and "RANK" not in os.environ:
        parser.error(f"{scheme}:// needs --rank and --world-size (or --spawn N)")
    if manual:  # where does this process sit on its machine? Unsaid: one machine holds all
        local = args.local_rank if args.local_rank is not None else args.rank
        per_node = args.local_world_size or args.world_size
        if not (local < per_node <= args.world_size and local <= args.rank):
            parser.error(
                f"--local-rank {local} with --local-world-size {per_node} does not fit "
                f"rank {args.rank} of {args.world_size}"
            )
        gpus = torch.cuda.device_count() if args.backend != "gloo" else 0
        if gpus > 1 and per_node > gpus:  # one machine assumed, but this one cannot hold them
            parser.error(
                f"rank {args.rank} of {args.world_size} on a machine with {gpus} GPU(s): on "
                f"several machines give each process --local-rank (its index on its machine) "
                f"and --local-world-size; on one, NCCL needs a GPU per process (or --backend gloo)"
            )
        args.local_rank, args.local_world_size = local, per_node
    args.rendezvous_file = Path(args.init_method[len("file://") :]) if scheme == "file" else None
    return args


def init_method(text: str) -> str:
    """An argparse type: env://, tcp://HOST:PORT (an IPv6 host in brackets, [::1]) or
    file:///PATH in a folder that exists (torch would wait for it forever)."""
    if text == "env://" or re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):\d+", text):
        return text
    if text.startswith("tcp://"):
        raise argparse.ArgumentTypeError(
            f"tcp:// needs HOST:PORT, e.g. tcp://127.0.0.1:29500, got {text}"
        )
    if not text.startswith("file:///"):
        raise argparse.ArgumentTypeError(f"use env://, tcp://HOST:PORT or file:///PATH: {text}")
    if not Path(text[len("file://") :]).parent.is_dir():
        folder = Path(text[len("file://") :]).parent
        raise argparse.ArgumentTypeError(
            f"the folder {folder} does not exist; every process must see it"
        )
    return text


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
    args = parse_args()
    if args.rank is not None:  # started by hand: say who it is, as a launcher would
        os.environ.update(
            RANK=str(args.rank),
            WORLD_SIZE=str(args.world_size),
            LOCAL_RANK=str(args.local_rank),
            LOCAL_WORLD_SIZE=str(args.local_world_size),
        )
    launch(main, args)
