"""02_sampler.py: how DistributedSampler splits a dataset across ranks, shown and checked.

Each rank loads a small dataset whose items are their own indices through
DataLoader(sampler=DistributedSampler(...)); rank 0 gathers what every rank got and prints
who got which sample, which samples were padding repeats and which were dropped, and
checks every claim below at run time.

Run
  torchrun --standalone --nproc_per_node 3 02_sampler.py --dataset-size 10
  python 02_sampler.py --spawn 4 --dataset-size 10 --drop-last
  python 02_sampler.py --spawn 2 --forget-set-epoch          # the classic bug, shown
  python 02_sampler.py --spawn 2 --num-workers 2             # worker seeding
  python 02_sampler.py                                        # world size 1
  # two nodes: torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
  #     --rdzv-endpoint HOST0:29400 --rdzv-id job1 02_sampler.py

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
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import math
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
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler

# The plumbing used below is defined at the bottom of this file, the same in all six
# scripts: setup() binds this process to its device, joins the process group and returns a
# Dist (rank, local_rank, world_size, device, is_main); check(ok, name, detail) raises
# CheckFailed, SetupError reports a job that cannot run as configured, and both end the rank
# with one line; launch(main, args) runs main on every rank (torchrun, --spawn N, or one
# process); add_launch_args adds --spawn, --backend and --timeout.


# ---- The dataset and the loader ----------------------------------------------------------

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


def make_loader(args: argparse.Namespace, d: Dist, rank_seed: int):
    dataset = IndexDataset(args.dataset_size)
    sampler = DistributedSampler(dataset, num_replicas=d.world_size, rank=d.rank,
                                 shuffle=args.shuffle, seed=args.seed, drop_last=args.drop_last)
    # Worker RNGs are seeded from base_seed + worker id, and base_seed is drawn from this
    # generator. Seeded by rank, it differs across ranks (otherwise every rank's worker k
    # would make the same "random" augmentations) yet is reproducible from --seed.
    generator = torch.Generator().manual_seed(rank_seed)
    # Workers start by multiprocessing's default method: fork on Linux under torchrun, but
    # spawn in --spawn's children (started by spawn, they default to it); then each worker
    # imports torch and this script afresh (seconds per worker on a small CPU; once, with
    # persistent_workers) and the dataset must pickle.
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, generator=generator,
                        persistent_workers=args.num_workers > 0,  # no worker restart per epoch
                        pin_memory=d.device.type == "cuda")       # faster host-to-GPU copies
    return loader, sampler


def expected_per_rank(n: int, world_size: int, drop_last: bool) -> int:
    return n // world_size if drop_last else math.ceil(n / world_size)


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


# ---- What rank 0 shows, and what every rank checks ---------------------------------------

def interleave(shards: list[list[int]]) -> list[int]:
    """The epoch's padded order as the sampler built it: position r + j*W is rank r's j-th."""
    return [shards[r][j] for j in range(len(shards[0])) for r in range(len(shards))]


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
    check(all(c == per_rank for c in counts), "equal shard sizes",
          f"expected {per_rank} samples on every rank "
          f"({'floor' if drop_last else 'ceil'}({n}/{w})), got {counts}")
    seen = [x for s in shards for x in s]
    check(all(0 <= x < n for x in seen), "valid indices", f"index outside 0..{n - 1}")
    if drop_last:
        check(len(set(seen)) == len(seen), "disjoint shards",
              f"{len(seen) - len(set(seen))} samples went to more than one rank")
        dropped = sorted(set(range(n)) - set(seen))
        expected = n % w if n >= w else n
        check(len(dropped) == expected, "dropped samples",
              f"expected {expected} ({n} mod {w}) unseen samples, got {len(dropped)}")
        return 0, dropped
    check(set(seen) == set(range(n)), "shards cover the dataset",
          f"missing {sorted(set(range(n)) - set(seen))[:10]}")
    repeats = len(seen) - n
    check(repeats == w * per_rank - n, "padding",
          f"expected {w * per_rank - n} repeated samples, got {repeats}")
    order = interleave(shards)
    check(sorted(order[:n]) == list(range(n)), "one shared order",
          "the first N positions of the interleaved shards are not a permutation: "
          "ranks disagree on the order")
    check(order[n:] == (order[:n] * math.ceil(max(repeats, 1) / n))[:repeats], "padding",
          "the padding is not a repeat of the head of the order")
    return repeats, []


def verify_order(orders: list[list[int]], n: int, args: argparse.Namespace) -> str:
    """With set_epoch the order is randperm seeded with seed + epoch; without, it repeats."""
    if not args.shuffle:
        check(all(o == list(range(len(o))) for o in orders), "unshuffled order",
              "without --shuffle the order should be 0..N-1")
        return "unshuffled: every epoch in index order 0..N-1"
    for epoch, order in enumerate(orders):
        used = epoch if not args.forget_set_epoch else 0
        expected = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + used))
        check(order == expected.tolist()[:len(order)], "order follows seed + epoch",
              f"epoch {epoch}: the order is not randperm({n}) seeded with {args.seed + used}")
    distinct = len({tuple(o) for o in orders})
    if args.forget_set_epoch:
        return (f"BUG SHOWN: set_epoch was never called, so all {len(orders)} epochs used "
                f"the same order (the sampler still thinks it is epoch 0): every epoch sees "
                f"the same samples in the same batches. Call sampler.set_epoch(epoch).")
    return (f"set_epoch: {distinct} distinct orders in {len(orders)} epochs, each "
            f"randperm({n}) seeded with {args.seed} + epoch")


def verify_draws(per_rank_epochs: list[list[dict]]) -> str:
    """Every (rank, worker, epoch) stream of augmentation draws must be its own."""
    firsts = {}
    for rank, epochs in enumerate(per_rank_epochs):
        for epoch, e in enumerate(epochs):
            for worker, draws in e["streams"].items():
                firsts[(rank, int(worker), epoch)] = tuple(draws[:2])
    repeated = len(firsts) - len(set(firsts.values()))
    check(repeated == 0, "distinct augmentation streams",
          f"{repeated} (rank, worker, epoch) streams repeat another's random draws")
    return f"{len(firsts)} (rank, worker, epoch) augmentation streams, all distinct"


def main(args: argparse.Namespace) -> None:
    d = setup(args.backend, args.timeout)
    mine = run_epochs(args, d)
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, mine)  # small Python lists: all_gather_object is fine
    n, w = args.dataset_size, d.world_size
    per_rank = expected_per_rank(n, w, args.drop_last)
    if d.is_main:
        print(f"{n} samples, {w} rank(s), shuffle={args.shuffle} seed={args.seed} "
              f"drop_last={args.drop_last}: {per_rank} per rank per epoch, batches of "
              f"{args.batch_size}, {args.num_workers} worker(s)  (* = padding repeat)")
    # Every rank checks the gathered data, so a failed check stops all ranks together.
    orders, dump = [], {"world_size": w, "dataset_size": n, "epochs": {}}
    for epoch in range(args.epochs):
        shards = [everyone[r][epoch]["indices"] for r in range(w)]
        dump["epochs"][str(epoch)] = {str(r): s for r, s in enumerate(shards)}
        if d.is_main:
            print(f"epoch {epoch}\n{shard_table(shards, n)}")
        repeats, dropped = verify_epoch(shards, n, args.drop_last)
        if d.is_main and dropped:
            print(f"  dropped: {' '.join(map(str, dropped[:16]))}"
                  + (f" ... (+{len(dropped) - 16})" if len(dropped) > 16 else ""))
        orders.append(interleave(shards)[:n])  # with drop_last: the head that was kept
    order_note = verify_order(orders, n, args)
    draws_note = verify_draws(everyone)
    dump["draws"] = {str(r): [{str(k): v for k, v in e["streams"].items()} for e in everyone[r]]
                     for r in range(w)}
    if d.is_main:
        if args.dump_indices:
            write_atomic(args.dump_indices, json.dumps(dump).encode())
        if repeats:
            print(f"note: {repeats} padding repeat(s) per epoch; an evaluation over these "
                  f"shards would count those samples again (05_eval_gather.py counts each once)")
        if per_rank == 0:
            print(f"note: {n} sample(s) for {w} ranks with drop_last: every rank gets nothing")
        print(order_note)
        print(f"verified: {w} rank(s) x {per_rank} samples per epoch; "
              + ("shards disjoint, " + f"{len(dropped)} dropped per epoch"
                 if args.drop_last else f"shards cover all {n}, {repeats} padding repeat(s)")
              + f"; {draws_note}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset-size", type=positive_int, default=10, metavar="N",
                        help="samples in the dataset; item i is i (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=2,
                        help="samples per batch on each rank (default: %(default)s)")
    parser.add_argument("--epochs", type=positive_int, default=2,
                        help="epochs to sample (default: %(default)s)")
    parser.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                        help="a new random order each epoch (set_epoch) or index order")
    parser.add_argument("--seed", type=int, default=0,
                        help="the sampler's seed, the same on every rank (default: %(default)s)")
    parser.add_argument("--drop-last", action="store_true",
                        help="cut the tail to a multiple of the world size instead of padding")
    parser.add_argument("--num-workers", type=nonnegative_int, default=0,
                        help="DataLoader worker processes per rank (default: %(default)s)")
    parser.add_argument("--forget-set-epoch", action="store_true",
                        help="skip sampler.set_epoch(epoch): the classic bug, shown")
    parser.add_argument("--dump-indices", type=output_file, metavar="PATH",
                        help="rank 0 writes every rank's indices per epoch as JSON")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_launch_args(parser, args)
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
    launch(main, parse_args())
