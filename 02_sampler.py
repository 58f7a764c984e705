r"""02_sampler.py: how DistributedSampler splits a dataset across ranks, shown and checked.

Run
  torchrun --standalone --nproc_per_node 3 02_sampler.py --dataset-size 10
  python 02_sampler.py --spawn 4 --dataset-size 10 --drop-last
  python 02_sampler.py --spawn 2 --forget-set-epoch          # the classic bug, shown
  python 02_sampler.py --spawn 2 --workers 2                 # worker seeding
  python 02_sampler.py                                        # world size 1
  # two nodes, 2 processes each: run on both machines
  torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 02_sampler.py

Each rank loads a small dataset whose item i is i, through
DataLoader(sampler=DistributedSampler(...)). Rank 0 prints who got which sample, which
samples were padding repeats (*) and which were dropped; every rank checks what every rank
got against the algorithm below, and that no two ranks, workers or epochs drew the same
random "augmentations".

How DistributedSampler(dataset, num_replicas=W, rank=r, shuffle, seed, drop_last) works,
for a dataset of N samples:
  1. order = torch.randperm(N) seeded with seed + epoch (or 0..N-1 without shuffle);
     every rank computes the same order, because they share seed and epoch. The epoch is
     what sampler.set_epoch(epoch) said last: forget to call it and every epoch repeats
     epoch 0's order.
  2. drop_last=False: repeat the head of the order until its length is a multiple of W
     (ceil(N/W) per rank; some samples are seen twice, and an evaluation over these shards
     would count them twice: 05_eval_gather.py counts each once). drop_last=True: cut the
     tail to a multiple of W (floor(N/W) per rank; N mod W samples are not seen this epoch).
  3. rank r takes order[r], order[r+W], order[r+2W], ...
Every rank therefore yields the same number of samples, which DDP needs: a rank with
fewer batches would stop calling the gradient all-reduce and the others would wait for it.
The sampler's drop_last is not the DataLoader's: DataLoader(drop_last=True) drops a rank's
last, short batch. A training loop with BatchNorm wants that (03_ddp_train.py does it): a
batch of one image fails there ("Expected more than 1 value per channel when training").

Random augmentation in DataLoader workers: worker k seeds its torch RNG with base + k, and
the DataLoader draws base from the torch RNG of the process that iterates it. Seed that by
rank: with one seed on every rank, worker k of every rank makes the same "random" crops.

Needs torch >= 2.4. Under torchrun --max-restarts, copy 04_checkpoint.py's attempt_store().
"""

import argparse
import atexit
import concurrent.futures
import datetime
import faulthandler
import math
import os
import signal
import socket
import sys
import traceback
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# The shared plumbing is at the bottom of this file, the same in all six scripts (01 explains
# it): setup() reads the launcher's RANK, WORLD_SIZE and LOCAL_RANK, binds this process's
# device, joins the process group and returns d (rank, world_size, device); launch() starts
# the ranks, and run_rank() ends each with one line (so no destroy_process_group: NOTES.md
# says why); check() and SetupError fail loudly. Read it last, or not at all.


def main(args):
    d = setup(args.timeout)
    mine = run_epochs(args)  # (this rank's samples in each epoch, its augmentation draws)
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, mine)  # small Python lists: all_gather_object is fine
    if d.rank == 0:
        say(
            f"{args.dataset_size} samples, {d.world_size} rank(s), shuffle={args.shuffle} "
            f"seed={args.seed} drop_last={args.drop_last}, {args.workers} worker(s)"
        )

    # ---- checks: every rank checks the gathered data, so a failed check stops all together
    orders = set()  # each epoch's shards, as text (a list does not hash)
    for epoch in range(args.epochs):
        shards = [samples[epoch] for samples, _ in everyone]
        told = 0 if args.forget_set_epoch else epoch  # the epoch the sampler was last told
        expected = documented_shards(args, d.world_size, told)
        wrong = [r for r in range(d.world_size) if shards[r] != expected[r]]
        check(not wrong, "documented shards", f"epoch {epoch}: ranks {wrong} got other samples")
        orders.add(str(shards))
        if d.rank == 0:
            show(epoch, shards, args.dataset_size)
    draws = [x for _, drawn in everyone for x in drawn]
    repeats = len(draws) - len(set(draws))
    check(repeats == 0, "distinct augmentations", f"{repeats} draws repeat another's")
    checksum = zlib.crc32(str(draws).encode())  # the same on every launch with this --seed
    if d.rank == 0:
        if args.forget_set_epoch:
            say("BUG SHOWN: set_epoch never called, so every epoch repeated epoch 0's order")
        say(
            f"verified: {d.world_size} rank(s) x {len(shards[0])} samples per epoch, as "
            f"documented; {len(orders)} distinct order(s) in {args.epochs} epoch(s)"
        )
        say(f"verified: {len(draws)} augmentation draws, all distinct (checksum {checksum:08x})")


def run_epochs(args):
    """Iterate this rank's DataLoader; return (its samples in each epoch, its draws)."""
    dataset = IndexDataset(args.dataset_size)
    # num_replicas and rank: by default the process group's world size and this rank
    sampler = DistributedSampler(
        dataset, shuffle=args.shuffle, seed=args.seed, drop_last=args.drop_last
    )
    # The sampler's seed is the same on every rank; the augmentations' differs by rank (the
    # docstring says why), and is reproducible from --seed. Without workers the dataset
    # draws from this RNG itself.
    torch.manual_seed(args.seed + dist.get_rank())
    # Workers start by multiprocessing's default method: fork on Linux under torchrun, but
    # spawn in --spawn's children; then each worker imports torch and this script afresh
    # (seconds on a small CPU), once with persistent_workers, and the dataset must pickle.
    loader = DataLoader(
        dataset,
        batch_size=4,  # batches split a rank's shard; they never change who gets what
        sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    samples = []
    draws = []
    for epoch in range(args.epochs):
        if not args.forget_set_epoch:
            sampler.set_epoch(epoch)  # same seed + epoch on every rank: a new shared order
        samples.append([])
        for indices, batch_draws in loader:
            samples[-1] += indices.tolist()
            draws += batch_draws.tolist()
    return samples, draws


class IndexDataset(Dataset):
    """Item i is (i, one random draw): a stand-in for a random crop, from the torch RNG of the
    process that loads it (a DataLoader worker, or the rank itself without workers)."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return index, torch.randint(2**62, ()).item()  # 62 bits: no repeats by chance


def documented_shards(args, world_size, epoch):
    """Each rank's samples in that epoch, by the three steps in this file's docstring."""
    n = args.dataset_size
    order = list(range(n))
    if args.shuffle:
        generator = torch.Generator().manual_seed(args.seed + epoch)
        order = torch.randperm(n, generator=generator).tolist()
    if args.drop_last:
        order = order[: n - n % world_size]
    else:
        order = (order * world_size)[: math.ceil(n / world_size) * world_size]
    return [order[r::world_size] for r in range(world_size)]


def show(epoch, shards, n, limit=16):
    """Print each rank's samples; * marks a padding repeat, a position r + j*W >= N."""
    w = len(shards)
    say(f"epoch {epoch}")
    for r, shard in enumerate(shards):
        cells = [f"{x}*" if r + j * w >= n else str(x) for j, x in enumerate(shard)]
        more = " ..." if len(cells) > limit else ""
        say(f"  rank {r}: {' '.join(cells[:limit])}{more}")
    dropped = set(range(n)).difference(*shards)
    if dropped:
        say(f"  dropped: {' '.join(map(str, sorted(dropped)))}")


def build_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dataset-size", type=number(int, 1), default=10, help="samples (default: %(default)s)"
    )
    parser.add_argument(
        "--epochs", type=number(int, 1), default=2, help="epochs to sample (default: %(default)s)"
    )
    parser.add_argument(
        "--no-shuffle",
        dest="shuffle",
        action="store_false",
        help="index order 0..N-1 every epoch, not a new random order",
    )
    parser.add_argument(
        "--seed", type=number(int, 0), default=0, help="the sampler's seed (default: %(default)s)"
    )
    parser.add_argument(
        "--drop-last", action="store_true", help="cut the tail instead of padding with the head"
    )
    parser.add_argument(
        "--workers",
        type=number(int, 0),
        default=0,
        help="DataLoader workers per rank (default: %(default)s)",
    )
    parser.add_argument(
        "--forget-set-epoch", action="store_true", help="skip set_epoch: the classic bug"
    )
    add_launch_args(parser)
    return parser


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
    launch(main, build_parser().parse_args())
