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

Each rank loads a dataset whose item i is i, through
DataLoader(sampler=DistributedSampler(...)). Rank 0 prints who got which sample, padding
repeats (*) and dropped samples; every rank checks all ranks' samples against the algorithm
below, and that no two ranks, workers or epochs drew the same random "augmentation".

How DistributedSampler(dataset, num_replicas=W, rank=r, shuffle, seed, drop_last) deals
N samples:
  1. order = torch.randperm(N) seeded with seed + epoch (0..N-1 without shuffle), the same
     on every rank. The epoch is the last sampler.set_epoch(epoch): without that call,
     every epoch repeats epoch 0's order.
  2. drop_last=False: pad with the head of the order to a multiple of W (ceil(N/W) per
     rank; an evaluation would count the repeats twice: 05_eval_gather.py does not).
     drop_last=True: cut the tail to a multiple of W (floor(N/W) per rank; N mod W
     samples go unseen this epoch).
  3. rank r takes order[r], order[r+W], order[r+2W], ...
So all ranks yield the same number of samples, which DDP needs: a rank with fewer
batches would stop joining the gradient all-reduce, and the others would wait for it. The
sampler's drop_last is not the DataLoader's, which drops a rank's last short batch: train
BatchNorm models with that (03_ddp_train.py does), as a batch of one sample fails there.

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
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# The shared plumbing is at the bottom of this file, the same in all six scripts (01 explains
# it): setup() reads the launcher's RANK, WORLD_SIZE and LOCAL_RANK, binds this process's
# device, joins the process group and returns d (rank, world_size, device); launch() starts
# the ranks, and run_rank() ends each with one line; check() and SetupError fail loudly.
# Read it last, or not at all.


def main(args):
    d = setup(args.timeout)
    mine = run_epochs(args)
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, mine)  # small Python lists: all_gather_object is fine
    if d.rank == 0:
        say(
            f"{args.dataset_size} samples, {d.world_size} rank(s), shuffle={args.shuffle} "
            f"seed={args.seed} drop_last={args.drop_last}, {args.workers} worker(s)"
        )

    # ---- checks: every rank checks the gathered data, so a failed check stops all together
    orders = set()  # each epoch's shards, as text
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
    # The sampler's seed is the same on every rank, the augmentations' is not: worker k
    # seeds itself with base + k, base drawn from this RNG, so a seed shared by all ranks
    # gives worker k of each the same "random" crops. (No workers: the rank draws.)
    torch.manual_seed(args.seed + dist.get_rank())
    # Under --spawn, workers start by spawn too: each imports torch and this script (seconds),
    # so they persist across epochs, and the dataset must pickle.
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
    """Item i is (i, a draw from the loading process's torch RNG): a stand-in for a random
    crop."""

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
    launch(main, build_parser().parse_args())
