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

Words (most are columns of the table rank 0 prints)
  world size  how many processes take part in the job (2 nodes x 2 processes = 4).
  rank        a process's id in the job, 0 .. world size - 1; rank 0 is the "master".
  local rank  its id on its own node, 0 .. processes per node - 1; it picks the GPU,
              because GPU numbers restart on every machine (global rank would not).
  node rank   which machine: rank = node rank * per node + local rank, so node rank =
              rank // per node (torchrun also sets it, as GROUP_RANK).
  group       a set of ranks that run collectives together; the default group is all
              of them, dist.new_group() makes smaller ones (here: even and odd ranks).
  backend     the library that moves the tensors: NCCL between GPUs, Gloo on CPUs.
  master address and port
              where rank 0 listens so that the others can find it: MASTER_ADDR and
              MASTER_PORT for env://, or written into tcp://HOST:PORT.

Three ways to meet (--init-method). env:// reads RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from each process's environment: torchrun
sets them all; --spawn N, or a plain run (a world of one), sets them for processes on this
machine; a manual launch sets the first four from --rank, --world-size, --local-rank and
--local-world-size. tcp://HOST:PORT names rank 0's address in the URL instead of
MASTER_ADDR and MASTER_PORT; file:///PATH meets in a file. Under a launcher (torchrun, or
a manual launch) --spawn is ignored: the processes are started already.

Needs torch >= 2.4. Under torchrun --max-restarts, copy 04_checkpoint.py's attempt_store().
"""

import argparse
import atexit
import concurrent.futures
import datetime
import faulthandler
import os
import re
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The shared plumbing is at the bottom of this file, the same in all six scripts (explained
# where it begins): setup() reads the launcher's RANK, WORLD_SIZE and LOCAL_RANK, binds this
# process's device, joins the process group and returns d (rank, world_size, device);
# launch() starts the ranks, and run_rank() ends each with one line (so no
# destroy_process_group: NOTES.md says why); check() and SetupError fail loudly.


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
    # ---- checks: every rank checks the gathered table and four collectives with known answers
    verify_table(rows, d.world_size)
    summary = verify_collectives(d, args.timeout)
    dist.barrier()  # nobody leaves while another rank may still be checking
    if d.rank == 0:
        # torch's FileStore deletes its file when destroyed, but every rank ends with os._exit;
        # past the barrier, no rank needs it any more
        if args.rendezvous_file:
            args.rendezvous_file.unlink(missing_ok=True)
        say(
            f"verified: {d.world_size} rank(s) joined via "
            f"{args.init_method.split('//')[0]}//; {summary}"
        )


def join(args):
    """Join the process group. env:// (torchrun, --spawn, one process) is the shared setup();
    tcp:// and file:// are done here, where each way of meeting can be seen."""
    gloo = args.backend == "gloo"
    if args.init_method == "env://":  # MASTER_ADDR:MASTER_PORT: rank 0's TCP store
        return setup(args.timeout, gloo=gloo)
    # as setup() reads them: set by torchrun, --spawn, or a manual launch from its options
    rank, world, local_rank, local_world = (
        int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    )
    device = bind_device(local_rank, local_world, gloo)
    hint = check_rendezvous_file(args.rendezvous_file, world) if args.rendezvous_file else ""
    # tcp://HOST:PORT: rank 0 listens there, the others connect (torch retries, with delays).
    # file://PATH: every rank writes its address into the file and reads the others'.
    # As in setup() (which knows env:// only), a thread joins and this one waits for it: the
    # deadline, or a signal (Ctrl-C), ends the wait even where torch's own would not end.
    cuda = device.type == "cuda"
    started = time.monotonic()
    joining = concurrent.futures.ThreadPoolExecutor(1).submit(
        dist.init_process_group,
        "nccl" if cuda else "gloo",
        init_method=args.init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
        device_id=device if cuda else None,
    )
    try:
        joining.result(args.timeout + 2)
    except Exception as e:  # torch's error, or at our deadline a TimeoutError, with no text
        why = str(e).partition("\n")[0] or "torch is still waiting"  # (C++ adds a stack trace)
        # Failing after --timeout, a wait ran out (torch's, or ours): ranks are missing.
        # Told by the time, not the text: file://'s own says only "Wait timeout".
        if time.monotonic() - started < args.timeout:
            raise SetupError(
                f"cannot join the process group at {args.init_method}: {why}{hint}"
            ) from e
        raise SetupError(
            f"not all of {world} ranks joined within {args.timeout:g}s ({args.init_method}): "
            f"{why}{hint}"
        ) from e
    return Dist(rank, world, device, args.timeout)


def check_rendezvous_file(path, world):
    """torch needs a file that is new (or empty) at every init: an earlier job's leftover can
    make Gloo connect to ranks long gone, retrying well past --timeout, or pair up with the
    wrong ranks. Refuse one that is surely stale: no other rank in a world of one, or every
    rank of a job this size has opened it already, so none of this job's is among them. Not
    its age: a live rank 0's file can look old where clocks differ (NFS clients). Else
    return a hint for any failure to join, if the file was there already."""
    if not path.exists():
        return ""  # this rank makes it: a fresh file
    data = path.read_bytes()
    # torch's FileStore file is a list of records (a 4-byte length, then the bytes), key then
    # value; each process that opens it appends the key "refcount/" and the new count.
    _, key, after = data.rpartition(b"refcount/")  # after the last count's key: its record
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
        node_rank=d.rank // int(os.environ["LOCAL_WORLD_SIZE"]),  # rank = node * size + local
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
    # One node never spans two machines (several nodes on one machine are fine: a test's
    # two torchrun agents). A manual launch that leaves out --local-rank and
    # --local-world-size assumes one machine: on two, ranks there would claim node 0.
    machines = sorted({(r["node_rank"], r["host"]) for r in rows})  # (node rank, host) pairs
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

    # Every rank must call new_group for every group, members or not, in the same order.
    # A group's timeout is the backend's default (10 or 30 min), not the default group's.
    halves = [list(range(start, ws, 2)) for start in range(min(ws, 2))]  # even ranks, odd ranks
    limit = datetime.timedelta(seconds=timeout)
    groups = [dist.new_group(ranks, timeout=limit) for ranks in halves]
    members = halves[d.rank % 2]
    s = mine.clone()
    dist.all_reduce(s, group=groups[d.rank % 2])  # only the members of my group take part
    check(s.item() == sum(members), f"all_reduce in group {members}", f"got {s.item()}")
    # (past the barrier in main(), every rank has checked its own group's sum)
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
    # a manual launch, one command per process, says who each process is
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
    if args.rank is not None:  # where does it sit on its machine? Unsaid: one machine holds all
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
    """An argparse type: env://, tcp://HOST:PORT (an IPv6 host in brackets, [::1]) or
    file:///PATH in a folder that exists (torch would wait for it forever)."""
    if text == "env://" or re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):\d+", text):
        return text
    if not (text.startswith("file:///") and Path(text.removeprefix("file://")).parent.is_dir()):
        raise argparse.ArgumentTypeError(
            f"use env://, tcp://HOST:PORT or file:///PATH in a folder every process sees: {text}"
        )
    return text


# The shared plumbing below, in the order a rank meets it:
#   launch()       A process that a launcher started (RANK is set: torchrun, or a manual
#                  launch) runs as its rank, and --spawn is ignored. Else --spawn N starts
#                  N ranks with mp.spawn (N = 0: one per GPU, else 2), and a plain run
#                  is a world of one; launch() sets their variables as torchrun would,
#                  MASTER_ADDR:MASTER_PORT a free port of this machine. Under --spawn it
#                  waits for the ranks and passes on a signal sent to it alone.
#   run_rank()     Runs main() and ends the process (exit hooks, then os._exit):
#                  exit 0; exit 1 after one line, "[rank N] CHECK FAILED: ..." or "[rank N]
#                  error: ..." (a SetupError, or a failed collective: torch.distributed's
#                  error, or Gloo's, whose text names its source files), a bug keeping its
#                  traceback; any of STOP_SIGNALS (every signal torchrun forwards, and
#                  SIGUSR1): "[rank N] stopped by SIGTERM in FUNCTION (line N)", where in
#                  this file the signal found it, exit 128 + the signal's number (a signal
#                  ignored at start, nohup's SIGHUP, stays ignored; a rank already ending on
#                  its own error keeps that line). After a collective timed out
#                  (Gloo), where every rank was at its last beat, if all have beaten: ";
#                  rank by rank: ['step 2, compute', 'step 2, data']" names the rank the
#                  collective waited for (after a lost peer, rank 0 alone reads them).
#   Dist.beat()    A training loop's "I am here": the step and phase ("step 2, data") put
#                  in the job's store, read by run_rank without a collective; and a
#                  faulthandler re-armed: a rank with no beat for --timeout + 5 s dumps
#                  every thread's stack and exits (nothing is left running).
#   setup()        env:// (or a store it is given): checks the four launcher variables,
#                  bind_device(), then joins in a thread and waits for it, until --timeout
#                  + 2 s or a signal: "not all of W ranks joined within Ts (env:// at
#                  HOST:PORT); start the others", or "cannot join the process group at
#                  ...: " + torch's first line.
#   bind_device()  Gives torch's threads this process's share of the cores. gloo=True, or
#                  no CUDA: the CPU. Else cuda:LOCAL_RANK (or the one GPU it sees), set
#                  before init_process_group, which gets it as device_id (NCCL connects now).
#   say()          Rank 0's story; a line stdout cannot take is dropped, not an error.
#   number()       An argparse type: a number in a range (never nan or inf).
#   (03, 04 and 05, which write files, also share output_file(), rank0_writes() and
#   write_atomic(), outside the block: rank 0 writes a file whole, and every rank raises
#   rank 0's error, so none waits for a rank 0 that failed.)
#   check(), CheckFailed, SetupError
#                  A property that did not hold; a job that cannot run as configured.


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
    try:
        print(text, flush=True)
    except OSError:
        pass


def number(cast, low, high=2**32):
    """An argparse type: a number with low <= value < high, which nan and inf never are."""

    def parse(text):
        value = cast(text)
        if not low <= value < high:
            raise argparse.ArgumentTypeError(f"must be >= {low} and < {high}, got {text}")
        return value

    return parse


def add_launch_args(parser):
    parser.add_argument(
        "--spawn",
        type=number(int, 0),
        help="start SPAWN processes with mp.spawn; 0: one per GPU, else 2",
    )
    parser.add_argument(
        "--timeout",
        type=number(float, 0.1, 1e6),
        default=300.0,
        help="seconds to wait for a peer or a collective (default: %(default)g)",
    )


def launch(main, args):
    """Run main(args) on every rank: under torchrun, with --spawn N, or as one process."""
    if "RANK" in os.environ:  # a launcher started this process and set its variables
        run_rank(None, main, args)  # (it never returns: run_rank ends the process)
    # --spawn N (0: one per GPU, else 2); no launcher and no --spawn: a world of one, through
    # the same code path
    n = 1 if args.spawn is None else args.spawn or torch.cuda.device_count() or 2
    with socket.create_server(("127.0.0.1", 0)) as s:  # a free port, for a job started here
        port = s.getsockname()[1]
    # what torchrun would set; run_rank adds each rank's RANK and LOCAL_RANK
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n)
    )
    if args.spawn is None:
        run_rank(0, main, args)  # (never returns)
    ranks = mp.start_processes(run_rank, args=(main, args), nprocs=n, join=False)  # spawned

    # This process waits for its ranks. A signal sent to it alone (Kubernetes signals a
    # container's first process) goes on to each, as torchrun forwards it; Ctrl-C reaches all.
    def forward(signum, frame):
        for p in ranks.processes:
            os.kill(p.pid, signum)

    for sig in STOP_SIGNALS[1:]:
        signal.signal(sig, forward)
    try:
        while not ranks.join():  # True once all have ended; raises when one has failed
            pass
    except mp.ProcessExitedException as e:  # that rank has printed its own reason
        sys.exit(f"error: spawned process {e.error_index} exited with code {e.exit_code}")
    except KeyboardInterrupt:  # Ctrl-C reached every rank too, and each has said so
        sys.exit(130)  # 128 + SIGINT


# The signals that end a rank with one line: Ctrl-C, a scheduler's warning (SIGTERM; SIGUSR1
# from sbatch --signal), a closed terminal, and SIGQUIT, which torchrun forwards too.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def run_rank(index, main, args):
    """Run main(args) and end the process: exit 0, or non-zero after one line naming the rank;
    then the program's exit hooks and os._exit."""
    if index is not None:  # under --spawn: mp.spawn passes the index
        os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (nohup's SIGHUP): it stays so
            signal.signal(sig, stop)
    code = 1  # unless main returns
    why = ""
    try:
        try:
            main(args)
            code = 0
        except CheckFailed as e:
            why = f"CHECK FAILED: {e}"
        except (SetupError, dist.DistError) as e:  # expected: one line says why
            # (a DataLoader worker's SetupError comes back as torch's text, ours at its end)
            why = "error: " + str(e).strip().rpartition("SetupError: ")[2]
        except Exception as e:
            why = f"error: {type(e).__name__}: {e}"
            # Gloo's errors name its source files (".../gloo/transport/tcp/pair.cc"): a
            # collective failed (a peer is gone, or a wait timed out), wherever it surfaced
            # (in DDP's all-reduce inside backward, say), and the message says so. (NCCL's are
            # DistErrors.) Anything else is a bug: keep its traceback.
            if "gloo/" not in why:
                traceback.print_exc()
            else:
                # A failed collective: where each rank was at its last beat (Dist.beat), if
                # every rank has beaten, from the job's store: "; rank by rank: ['step 2,
                # compute', 'step 2, data']". After a timeout (Gloo's words), every rank;
                # after a lost peer, rank 0 alone: the store's host is rank 0 or torchrun's
                # agent (one node), and a peer's read would fail if rank 0 is the peer that
                # was lost (with a C++ warning, breaking the one line).
                try:
                    store = dist.distributed_c10d._get_default_store()
                    keys = [f"beat {rank}" for rank in range(dist.get_world_size())]
                    read = "Timed out" in why or dist.get_rank() == 0
                    if read and store.check(keys):  # get() will not wait
                        beats = [store.get(key).decode() for key in keys]
                        why += f"; rank by rank: {beats}"
                except Exception:  # the store unreachable: nothing to add
                    pass
        finally:
            # Ending already: a signal from now on could only garble the line. One that
            # arrives before this loop is done is caught below, like one arriving in the
            # handlers above; after it, none can escape (an unhandled KeyboardInterrupt ends
            # Python by SIGINT, with no line: torchrun's SIGTERM did so to a rank ending on
            # its own error, about one run in six here).
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
    # from stop() (the signal's number, and where it found this rank): unwound, now one line.
    # A rank already ending on an error of its own when the signal came (torchrun's SIGTERM
    # to the others, say) keeps that error's line and exit code.
    except KeyboardInterrupt as e:
        if not why:
            code = 128 + e.args[0]
            why = f"stopped by {signal.Signals(e.args[0]).name}{e.args[1]}"
    # The end, out of the except blocks: their exception held the frames it passed through,
    # and what those held is released now (DataLoader workers end), before the exit hooks.
    if why:
        sys.stderr.write(f"[rank {os.environ['RANK']}] {why}\n")  # one write: one whole line
    atexit._run_exitfuncs()  # exit hooks (a logger's, say), which os._exit would skip
    try:
        sys.stdout.flush()
    except Exception:  # stdout closed or broken: nothing more to say
        pass
    os._exit(code)  # no interpreter shutdown and no destroy_process_group: NOTES.md says why


def stop(signum, frame):
    # KeyboardInterrupt: the rank unwinds as on Ctrl-C, and DataLoader workers end quietly.
    # Its line says where the signal found it: the innermost frame of this file (run_rank's
    # at least), so a rank stuck in torch's code or a library's names the line here that
    # called it.
    while frame.f_code.co_filename != __file__:
        frame = frame.f_back
    raise KeyboardInterrupt(signum, f" in {frame.f_code.co_name} (line {frame.f_lineno})")


class Dist(NamedTuple):
    """Who this process is in the job: setup() returns it."""

    rank: int
    world_size: int
    device: torch.device
    timeout: float

    def beat(self, where):
        """Where this rank is, in the job's store, read without a collective: a rank whose
        collective fails names where every rank was (run_rank). A rank that
        makes no progress, no beat within --timeout + 5 s, dumps its stacks and exits."""
        faulthandler.dump_traceback_later(self.timeout + 5, exit=True)
        dist.distributed_c10d._get_default_store().set(f"beat {self.rank}", where)


def setup(timeout, store=None, gloo=False):
    """Check the launcher's variables, bind this process to its device, join the group."""
    # set by the launcher
    env = {
        name: os.environ.get(name, "")
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    # missing or not a number: -1
    rank, world, local_rank, local_world = [int(v) if v.isdigit() else -1 for v in env.values()]
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise SetupError(f"the launcher's variables are invalid: {env}")
    device = bind_device(local_rank, local_world, gloo)
    cuda = device.type == "cuda"
    # A thread joins and this one waits for it: torch's store waits in C++, where a signal
    # (Ctrl-C) cannot end it, and may wait past the timeout (a client retries, and a port held
    # by another program never answers); this wait ends at either. device_id: NCCL connects
    # now, on this process's GPU.
    where = f"env:// at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        concurrent.futures.ThreadPoolExecutor(1).submit(
            dist.init_process_group,
            "nccl" if cuda else "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
            device_id=device if cuda else None,
        ).result(timeout + 2)
    except concurrent.futures.TimeoutError:  # (before OSError: on Python >= 3.11 it is one)
        raise SetupError(
            f"not all of {world} ranks joined within {timeout:g}s ({where}); start the others"
        ) from None
    except Exception as e:
        first = str(e).partition("\n")[0]  # torch's C++ errors add a stack trace
        raise SetupError(f"cannot join the process group at {where}: {first}") from e
    return Dist(rank, world, device, timeout)


def bind_device(local_rank, local_world, gloo):
    """This process's share of the cores for torch's threads; NCCL: its GPU, bound before init."""
    # the cores this process may run on (Linux), shared by the node's ranks
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
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
        for name in ("rank", "world_size", "local_rank", "local_world_size"):
            os.environ[name.upper()] = str(getattr(args, name))  # RANK=..., WORLD_SIZE=...
    launch(main, args)
