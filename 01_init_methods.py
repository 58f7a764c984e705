r"""01_init_methods.py: how DDP processes find each other (the process group), checked.

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

Every process joins one process group, reports who it is, and runs four collectives
whose answers are known in advance; rank 0 prints the table and the checks.

Words (most are columns of rank 0's table)
  world size  processes in the job (2 nodes x 2 processes = 4).
  rank        a process's id in the job, 0 .. world size - 1; rank 0 is the "master".
  local rank  its id on its node; it picks the GPU (GPU numbers restart on every machine).
  node rank   which machine: rank = node rank * processes per node + local rank.
  group       ranks that run collectives together: all of them, or dist.new_group()'s.
  backend     what moves the tensors: NCCL between GPUs, Gloo on CPUs.

Three ways to meet (--init-method). env:// reads RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE and MASTER_ADDR:MASTER_PORT (where rank 0 listens) from the environment:
torchrun, --spawn and a plain run set them all, a manual launch the first four from its
options. tcp://HOST:PORT names rank 0's address in the URL; file:///PATH meets in a file.

Under torchrun --max-restarts, copy 04_checkpoint.py's attempt_store().
"""

import argparse
import atexit
import os
import re
import signal
import socket
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The shared plumbing is at the bottom of this file, the same in all six scripts (explained
# where it begins); setup() returns d: rank, world_size, device.


def main(args):
    d = join(args)  # the process group, with every rank in it
    rows = [None] * d.world_size
    dist.all_gather_object(rows, describe_rank(d))  # any picklable object, one per rank
    if d.rank == 0:
        say(
            f"process group up: init_method={args.init_method} backend={dist.get_backend()} "
            f"world_size={d.world_size}"
        )
        say(rank_table(rows))
    # ---- checks, on every rank: the table, and four collectives with known answers
    verify_table(rows, d.world_size)
    summary = verify_collectives(d, args.timeout)
    dist.barrier()  # nobody leaves while another rank may still be checking
    if d.rank == 0:
        # ranks end with os._exit, so torch never deletes the file; now none needs it
        if args.rendezvous_file:
            args.rendezvous_file.unlink(missing_ok=True)
        say(
            f"verified: {d.world_size} rank(s) joined via "
            f"{args.init_method.split('//')[0]}//; {summary}"
        )


def join(args):
    """Join the process group: env:// in the shared setup(); tcp:// and file:// here, where
    each way of meeting can be seen."""
    if args.backend == "gloo":  # on a machine with GPUs too: hide them before CUDA starts
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.init_method == "env://":  # MASTER_ADDR:MASTER_PORT: rank 0's store
        return setup(args.timeout)
    rank, world, local_rank, local_world = (
        int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    )
    device = bind_device(local_rank, local_world)
    hint = check_rendezvous_file(args.rendezvous_file, world) if args.rendezvous_file else ""
    # tcp://: rank 0 listens on HOST:PORT, the others connect; file://: each rank writes its
    # address into the file. As in setup(), a thread joins: the deadline or Ctrl-C ends the wait.
    cuda = device.type == "cuda"
    started = time.monotonic()
    joining = ThreadPoolExecutor(1).submit(
        dist.init_process_group,
        "nccl" if cuda else "gloo",
        init_method=args.init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=args.timeout),
        device_id=device if cuda else None,
    )
    try:
        joining.result(args.timeout + 2)
    except Exception as e:  # torch's error (C++ adds a stack trace), or our deadline's
        why = str(e).partition("\n")[0] or "torch is still waiting"
        # after --timeout, a wait ran out: ranks are missing (file:// says only "Wait timeout")
        if time.monotonic() - started < args.timeout:
            raise SetupError(
                f"cannot join the process group at {args.init_method}: {why}{hint}"
            ) from e
        raise SetupError(
            f"not all of {world} ranks joined within {args.timeout:g}s ({args.init_method}): "
            f"{why}{hint}"
        ) from e
    return argparse.Namespace(rank=rank, world_size=world, device=device)  # as setup()


def check_rendezvous_file(path, world):
    """Refuse a file surely left by an earlier job (torch needs a fresh one, or pairs ranks
    with ones long gone): in a world of one, or once every rank of a job this size opened it.
    Not by age: clocks differ between machines. Else a hint for a failure to join."""
    if not path.exists():
        return ""  # this rank makes it: a fresh file
    data = path.read_bytes()
    # records of a 4-byte length and bytes, key then value; each process that opens the
    # file appends "refcount/" and the new count
    _, key, after = data.rpartition(b"refcount/")
    size = int.from_bytes(after[:4], "little")
    opened = int(after[4 : 4 + size] or 0) if key else 0
    if world == 1 or opened >= world:
        raise SetupError(
            f"{path} is left by an earlier job (opened by {opened} process(es)): delete it or "
            f"use a fresh path"
        )
    return f"; if every rank is running, {path} may be left by an earlier job"


def describe_rank(d):
    return dict(
        rank=d.rank,
        local_rank=int(os.environ["LOCAL_RANK"]),
        node_rank=d.rank // int(os.environ["LOCAL_WORLD_SIZE"]),
        world_size=dist.get_world_size(),
        host=socket.gethostname(),
        pid=os.getpid(),
        backend=dist.get_backend(),
        device=d.device,
    )


def rank_table(rows):
    lines = [
        f"{'rank':>4} {'local':>5} {'node':>4} {'world':>5}  {'host':<20} {'pid':>7}  "
        f"{'backend':<7} device"
    ]
    for r in rows:
        lines.append(
            f"{r['rank']:>4} {r['local_rank']:>5} {r['node_rank']:>4} {r['world_size']:>5}  "
            f"{r['host'][:20]:<20} {r['pid']:>7}  {r['backend']:<7} {r['device']}"
        )
    return "\n".join(lines)


def verify_table(rows, world_size):
    ranks = [r["rank"] for r in rows]
    check(ranks == list(range(world_size)), "ranks", f"expected 0..{world_size - 1}, got {ranks}")
    slots = [(r["node_rank"], r["local_rank"]) for r in rows]
    check(len(set(slots)) == len(slots), "local ranks", f"two processes share a slot: {slots}")
    # a node is on one machine (a machine may hold several nodes)
    machines = sorted({(r["node_rank"], r["host"]) for r in rows})
    check(
        len(machines) == len({node for node, _ in machines}),
        "nodes",
        f"a node rank on several machines, in {machines}: by hand on several machines, give "
        f"each process --local-rank and --local-world-size",
    )


def verify_collectives(d, timeout):
    ws = d.world_size
    mine = torch.tensor([d.rank], device=d.device)

    total = mine.clone()
    dist.all_reduce(total)  # a SUM, in place: every rank ends with the total
    check(total.item() == sum(range(ws)), "all_reduce", f"sum of ranks: {total.item()}")

    gathered = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(gathered, mine)  # slot i holds rank i's tensor, on every rank
    got = torch.cat(gathered).tolist()
    check(got == list(range(ws)), "all_gather", f"got {got}")

    token = mine + 1000  # 1000 + my rank
    dist.broadcast(token, src=0)  # rank 0's value overwrites everyone's
    check(token.item() == 1000, "broadcast", f"expected rank 0's 1000, got {token.item()}")

    # Every rank calls new_group for every group, members or not, in the same order. Pass
    # timeout: a group's default is the backend's (10 or 30 min), not the default group's.
    halves = [list(range(start, ws, 2)) for start in range(min(ws, 2))]  # even ranks, odd ranks
    limit = timedelta(seconds=timeout)
    groups = [dist.new_group(ranks, timeout=limit) for ranks in halves]
    members = halves[d.rank % 2]
    s = mine.clone()
    dist.all_reduce(s, group=groups[d.rank % 2])  # only the members of my group take part
    check(s.item() == sum(members), f"all_reduce in group {members}", f"got {s.item()}")
    return (
        f"all_reduce sum={total.item()}, all_gather={got}, broadcast={token.item()}, "
        f"all_reduce in groups {halves}: sums {[sum(ranks) for ranks in halves]}"
    )


def build_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--init-method",
        type=init_method,
        default="env://",
        help="env://, tcp://HOST:PORT or file:///PATH (default: %(default)s)",
    )
    parser.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="auto: NCCL if a GPU is visible, else Gloo (default: %(default)s)",
    )
    # a manual launch says who each process is
    parser.add_argument("--rank", type=number(int, 0), help="by hand: this process's rank")
    parser.add_argument("--world-size", type=number(int, 1), help="by hand: processes in all")
    parser.add_argument(
        "--local-rank",
        type=number(int, 0),
        help="by hand: its index on its machine, picks its GPU (default: --rank)",
    )
    parser.add_argument(
        "--local-world-size",
        type=number(int, 1),
        help="by hand: processes on its machine (default: --world-size)",
    )
    add_launch_args(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl needs a CUDA GPU and torch sees none; use --backend gloo")
    if (args.rank is None) != (args.world_size is None):
        parser.error(
            "--rank and --world-size go together, for a manual launch (--spawn N sets both)"
        )
    if args.rank is not None:  # its place on its machine; unsaid: one machine holds all
        if args.local_rank is None:
            args.local_rank = args.rank
        args.local_world_size = args.local_world_size or args.world_size
        if not (
            args.local_rank <= args.rank < args.world_size
            and args.local_rank < args.local_world_size <= args.world_size
        ):
            parser.error(
                f"--rank {args.rank}, --world-size {args.world_size}, --local-rank "
                f"{args.local_rank}, --local-world-size {args.local_world_size}: needs rank < "
                f"world size, local rank <= rank, local rank < local world size <= world size"
            )
    file = args.init_method.startswith("file://")
    args.rendezvous_file = Path(args.init_method.removeprefix("file://")) if file else None
    return args


def init_method(text):
    """An argparse type: env://, tcp://HOST:PORT (IPv6 in brackets: [::1]) or file:///PATH
    in a folder that exists (torch would wait for it forever)."""
    if text == "env://" or re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):\d+", text):
        return text
    if not (text.startswith("file:///") and Path(text.removeprefix("file://")).parent.is_dir()):
        raise argparse.ArgumentTypeError(
            f"use env://, tcp://HOST:PORT or file:///PATH in a folder every process sees: {text}"
        )
    return text


# The shared plumbing below, in the order a rank meets it:
#   launch()       under a launcher (RANK set: torchrun, a manual launch) runs this process
#                  as its rank; else starts --spawn N ranks, or one, with torchrun's
#                  variables and a free port, and passes signals on.
#   run_rank()     runs main(), then ends the process (exit hooks, os._exit): exit 0, or
#                  one line, "[rank N] CHECK FAILED: ...", "[rank N] error: ..." (a bug also
#                  keeps its traceback) or "[rank N] stopped by SIGTERM" (exit 128 + signal).
#   setup()        env://: checks the launcher's variables, binds the device, then joins in
#                  a thread, so that --timeout + 2 s or Ctrl-C ends the wait.
#   bind_device()  this process's share of the cores; with CUDA, its GPU, set before init.
#   say(), number(), check(): rank 0's story, an argparse range, a property that must hold.


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
    args = parse_args()
    if args.rank is not None:  # started by hand: say who it is, as a launcher would
        for name in ("rank", "world_size", "local_rank", "local_world_size"):
            os.environ[name.upper()] = str(getattr(args, name))  # RANK=..., WORLD_SIZE=...
    launch(main, args)
