r"""02_sampler.py: how DistributedSampler splits a dataset across ranks, shown and checked.

Each rank loads a small dataset whose items are their own indices through
DataLoader(sampler=DistributedSampler(...)); rank 0 gathers what every rank got and prints
who got which sample, which samples were padding repeats and which were dropped, and
checks every claim below at run time.

Run
  torchrun --standalone --nproc_per_node 3 02_sampler.py --dataset-size 10
  python 02_sampler.py --spawn 4 --dataset-size 10 --drop-last
  python 02_sampler.py --spawn 2 --forget-set-epoch          # the classic bug, shown
  python 02_sampler.py --spawn 2 --workers 2                 # worker seeding
  python 02_sampler.py                                        # world size 1
  # two nodes, 2 processes each: run on both machines
  torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 02_sampler.py

How DistributedSampler(dataset, num_replicas=W, rank=r, shuffle, seed, drop_last) works,
for a dataset of N samples:
  1. order = torch.randperm(N) seeded with seed + epoch (or 0..N-1 without shuffle);
     every rank computes the same order, because they share seed and epoch.
  2. drop_last=False: repeat the head of the order until its length is a multiple of W
     (ceil(N/W) per rank; some samples are seen twice). drop_last=True: cut the tail to a
     multiple of W (floor(N/W) per rank; N mod W samples are not seen this epoch).
  3. rank r takes order[r], order[r+W], order[r+2W], ...
Every rank therefore yields the same number of samples, which DDP needs: a rank with
fewer batches would stop calling the gradient all-reduce and the others would wait for it.
The sampler's drop_last is not the DataLoader's: DataLoader(drop_last=True) drops a rank's
last, short batch. A training loop with BatchNorm wants that (03_ddp_train.py does it): a
batch of one image fails there ("Expected more than 1 value per channel when training").

Needs torch >= 2.4. Under torchrun --max-restarts, copy 04_checkpoint.py's attempt_store().
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import datetime
import io
import json
import math
import os
import re
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler

# setup(), launch(), check() and SetupError are the shared plumbing at the bottom of this file.


def main(args: argparse.Namespace) -> None:
    d = setup(args.timeout)
    mine = run_epochs(args, d)  # [{"indices": ..., "streams": ...} per epoch], this rank's
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, mine)  # small Python lists: all_gather_object is fine
    n, w = args.dataset_size, d.world_size
    per_rank = expected_per_rank(n, w, args.drop_last)
    if d.rank == 0:
        say(
            f"{n} samples, {w} rank(s), shuffle={args.shuffle} seed={args.seed} "
            f"drop_last={args.drop_last}: {per_rank} per rank per epoch, batches of "
            f"{args.batch_size}, {args.workers} worker(s)  (* = padding repeat)"
        )

    # ---- checks: every rank checks the gathered data, so a failed check stops all together
    orders, dump = [], {"world_size": w, "dataset_size": n, "epochs": {}}
    for epoch in range(args.epochs):
        shards = [everyone[r][epoch]["indices"] for r in range(w)]
        dump["epochs"][str(epoch)] = {str(r): s for r, s in enumerate(shards)}
        if d.rank == 0:
            say(f"epoch {epoch}\n{shard_table(shards, n)}")
        repeats, dropped = verify_epoch(shards, n, args.drop_last)
        if d.rank == 0 and dropped:
            say(
                f"  dropped: {' '.join(map(str, dropped[:16]))}"
                + (f" ... (+{len(dropped) - 16})" if len(dropped) > 16 else "")
            )
        orders.append(interleave(shards)[:n])  # with drop_last: the head that was kept
    order_note = verify_order(orders, n, args)
    draws_note = verify_draws(everyone)
    dump["draws"] = {
        str(r): [{str(k): v for k, v in e["streams"].items()} for e in everyone[r]]
        for r in range(w)
    }
    if d.rank == 0:
        if args.dump_indices:
            write_atomic(args.dump_indices, json.dumps(dump).encode())
        if repeats:
            say(
                f"note: {repeats} padding repeat(s) per epoch; an evaluation over these "
                f"shards would count those samples again (05_eval_gather.py counts each once)"
            )
        if per_rank == 0:
            say(f"note: {n} sample(s) for {w} ranks with drop_last: every rank gets nothing")
        say(order_note)
        say(
            f"verified: {w} rank(s) x {per_rank} samples per epoch; "
            + (
                "shards disjoint, " + f"{len(dropped)} dropped per epoch"
                if args.drop_last
                else f"shards cover all {n}, {repeats} padding repeat(s)"
            )
            + f"; {draws_note}",
        )


def run_epochs(args: argparse.Namespace, d: Dist) -> list[dict]:
    rank_seed = args.seed * 1000 + d.rank  # differs across ranks, fixed by --seed
    loader, sampler = make_loader(args, d, rank_seed)
    torch.manual_seed(rank_seed)  # draws made in this process (num_workers=0)
    epochs = []
    for epoch in range(args.epochs):
        if not args.forget_set_epoch:
            sampler.set_epoch(epoch)  # same seed + epoch on every rank: a new shared order
        indices, streams = [], {}
        for batch_indices, workers, draws in loader:
            indices += batch_indices.tolist()
            for w, x in zip(workers.tolist(), draws.tolist()):
                streams.setdefault(w, []).append(x)
        epochs.append({"indices": indices, "streams": streams})
    return epochs


def make_loader(args: argparse.Namespace, d: Dist, rank_seed: int):
    dataset = IndexDataset(args.dataset_size)
    sampler = DistributedSampler(
        dataset,
        num_replicas=d.world_size,
        rank=d.rank,
        shuffle=args.shuffle,
        seed=args.seed,
        drop_last=args.drop_last,
    )
    # Worker RNGs are seeded from base_seed + worker id, and base_seed is drawn from this
    # generator. Seeded by rank, it differs across ranks (otherwise every rank's worker k
    # would make the same "random" augmentations) yet is reproducible from --seed.
    generator = torch.Generator().manual_seed(rank_seed)
    # Workers start by multiprocessing's default method: fork on Linux under torchrun, but
    # spawn in --spawn's children (started by spawn, they default to it); then each worker
    # imports torch and this script afresh (seconds per worker on a small CPU; once, with
    # persistent_workers) and the dataset must pickle.
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        generator=generator,
        persistent_workers=args.workers > 0,  # no worker restart per epoch
        pin_memory=d.device.type == "cuda",
    )  # faster host-to-GPU copies
    return loader, sampler


class IndexDataset(Dataset):
    """Item i is (i, the loader worker that built it, one random 'augmentation' draw)."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        worker = get_worker_info()
        # A stand-in for a random crop or flip: drawn from this worker's torch RNG.
        draw = int(torch.randint(0, 2**31 - 1, ()))
        return index, (worker.id if worker else -1), draw


def expected_per_rank(n: int, world_size: int, drop_last: bool) -> int:
    return n // world_size if drop_last else math.ceil(n / world_size)


# ---- checks: what rank 0 shows, and what every rank checks ------------------------------


def shard_table(shards: list[list[int]], n: int, limit: int = 16) -> str:
    w = len(shards)
    lines = []
    for r, shard in enumerate(shards):
        # Position r + j*W of the padded order is a repeat of the head when it is >= N.
        cells = [f"{x}*" if r + j * w >= n else str(x) for j, x in enumerate(shard[:limit])]
        more = f" ... (+{len(shard) - limit})" if len(shard) > limit else ""
        lines.append(f"  rank {r}: {' '.join(cells) if cells else '(nothing)'}{more}")
    return "\n".join(lines)


def verify_epoch(shards: list[list[int]], n: int, drop_last: bool) -> tuple[int, list[int]]:
    """Check one epoch's shards; return (padding repeats, dropped samples)."""
    w = len(shards)
    per_rank = expected_per_rank(n, w, drop_last)
    counts = [len(s) for s in shards]
    check(
        all(c == per_rank for c in counts),
        "equal shard sizes",
        f"expected {per_rank} samples on every rank "
        f"({'floor' if drop_last else 'ceil'}({n}/{w})), got {counts}",
    )
    seen = [x for s in shards for x in s]
    check(all(0 <= x < n for x in seen), "valid indices", f"index outside 0..{n - 1}")
    if drop_last:
        check(
            len(set(seen)) == len(seen),
            "disjoint shards",
            f"{len(seen) - len(set(seen))} samples went to more than one rank",
        )
        dropped = sorted(set(range(n)) - set(seen))
        expected = n % w if n >= w else n
        check(
            len(dropped) == expected,
            "dropped samples",
            f"expected {expected} ({n} mod {w}) unseen samples, got {len(dropped)}",
        )
        return 0, dropped
    check(
        set(seen) == set(range(n)),
        "shards cover the dataset",
        f"missing {sorted(set(range(n)) - set(seen))[:10]}",
    )
    repeats = len(seen) - n
    check(
        repeats == w * per_rank - n,
        "padding",
        f"expected {w * per_rank - n} repeated samples, got {repeats}",
    )
    order = interleave(shards)
    check(
        sorted(order[:n]) == list(range(n)),
        "one shared order",
        "the first N positions of the interleaved shards are not a permutation: "
        "ranks disagree on the order",
    )
    check(
        order[n:] == (order[:n] * math.ceil(max(repeats, 1) / n))[:repeats],
        "padding",
        "the padding is not a repeat of the head of the order",
    )
    return repeats, []


def interleave(shards: list[list[int]]) -> list[int]:
    """The epoch's padded order as the sampler built it: position r + j*W is rank r's j-th."""
    return [shards[r][j] for j in range(len(shards[0])) for r in range(len(shards))]


def verify_order(orders: list[list[int]], n: int, args: argparse.Namespace) -> str:
    """With set_epoch the order is randperm seeded with seed + epoch; without, it repeats."""
    if not args.shuffle:
        check(
            all(o == list(range(len(o))) for o in orders),
            "unshuffled order",
            "without --shuffle the order should be 0..N-1",
        )
        return "unshuffled: every epoch in index order 0..N-1"
    for epoch, order in enumerate(orders):
        used = epoch if not args.forget_set_epoch else 0
        expected = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + used))
        check(
            order == expected.tolist()[: len(order)],
            "order follows seed + epoch",
            f"epoch {epoch}: the order is not randperm({n}) seeded with {args.seed + used}",
        )
    distinct = len({tuple(o) for o in orders})
    if args.forget_set_epoch:
        return (
            f"BUG SHOWN: set_epoch was never called, so all {len(orders)} epochs used "
            f"the same order (the sampler still thinks it is epoch 0): every epoch sees "
            f"the same samples in the same batches. Call sampler.set_epoch(epoch)."
        )
    return (
        f"set_epoch: {distinct} distinct orders in {len(orders)} epochs, each "
        f"randperm({n}) seeded with {args.seed} + epoch"
    )


def verify_draws(per_rank_epochs: list[list[dict]]) -> str:
    """Every (rank, worker, epoch) stream of augmentation draws must be its own."""
    firsts = {}
    for rank, epochs in enumerate(per_rank_epochs):
        for epoch, e in enumerate(epochs):
            for worker, draws in e["streams"].items():
                firsts[(rank, int(worker), epoch)] = tuple(draws[:2])
    repeated = len(firsts) - len(set(firsts.values()))
    check(
        repeated == 0,
        "distinct augmentation streams",
        f"{repeated} (rank, worker, epoch) streams repeat another's random draws",
    )
    return f"{len(firsts)} (rank, worker, epoch) augmentation streams, all distinct"


def build_parser() -> argparse.ArgumentParser:
    run = re.search(r"Run\n.*?(?:\n\n|$)", __doc__, re.S)[0]  # --help ends with the Run block
    parser = argparse.ArgumentParser(description=__doc__.replace(run, ""), epilog=run)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the docstring as written

    def add(group, name: str, what: str, **how) -> None:  # the help states a default once
        if how.get("default") is not None:
            what += " (default: %(default)s)"
        group.add_argument(name, help=what, **how)

    add(parser, "--dataset-size", "samples; item i is i", type=number(int, 1), default=10)
    add(parser, "--batch-size", "samples per batch on each rank", type=number(int, 1), default=2)
    add(parser, "--epochs", "epochs to sample", type=number(int, 1), default=2)
    what = "a new random order each epoch (set_epoch), or index order"
    add(parser, "--shuffle", what, action=argparse.BooleanOptionalAction, default=True)
    add(parser, "--seed", "the sampler's seed, on every rank", type=number(int, 0), default=0)
    what = "cut the tail to a multiple of the world size instead of padding"
    add(parser, "--drop-last", what, action="store_true")
    add(parser, "--workers", "DataLoader workers per rank", type=number(int, 0), default=0)
    add(parser, "--forget-set-epoch", "skip set_epoch: the classic bug, shown", action="store_true")
    what = "rank 0 writes every rank's indices per epoch as JSON"
    add(parser, "--dump-indices", what, type=output_file, metavar="PATH")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


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
    launch(main, parse_args())
