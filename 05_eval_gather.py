"""05_eval_gather.py: distributed evaluation whose metrics equal a one-process evaluation.

Each rank evaluates its own part of the validation set; three collectives assemble the
results, each used for what it fits:
  1. all_reduce of sums (correct, count, loss, per-class counts): scalar metrics;
  2. all_gather of per-sample tensors (index, prediction, label), padded to the largest
     rank's size and trimmed after: the full prediction list, ordered by dataset index;
  3. all_gather_object of plain Python objects: anything picklable, at a price.
Every sample is evaluated exactly once: rank r takes samples r, r+W, r+2W, ... with no
padding. DistributedSampler would pad the set so all ranks hold the same count, and count
those repeats twice; the script prints that naive figure beside the exact one.

Run
  torchrun --standalone --nproc_per_node 2 05_eval_gather.py --verify
  python 05_eval_gather.py --spawn 3 --val-size 103 --metrics-json metrics.json
  python 05_eval_gather.py --checkpoint model.pt      # a model saved by 03_ddp_train.py
  # two nodes: torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
  #     --rdzv-endpoint HOST0:29400 --rdzv-id job1 05_eval_gather.py
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
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Dataset, Subset

# The plumbing used below is defined at the bottom of this file, the same in all six
# scripts: setup() binds this process to its device, joins the process group and returns a
# Dist (rank, local_rank, world_size, device, is_main); check(ok, name, detail) raises
# CheckFailed, SetupError reports a job that cannot run as configured, and both end the rank
# with one line; launch(main, args) runs main on every rank (torchrun, --spawn N, or one
# process); add_launch_args adds --spawn, --backend and --timeout.


# ---- Data and model (the same synthetic set and architectures as 03_ddp_train.py) --------

class SyntheticImages(Dataset):
    """03_ddp_train.py's validation images: class patterns plus noise, from the seed."""

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int):
        patterns = torch.randn(num_classes, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
        patterns = F.interpolate(patterns, size=image_size, mode="bilinear", align_corners=False)
        g = torch.Generator().manual_seed(seed + 2)  # 03's validation split
        self.labels = torch.randint(num_classes, (size,), generator=g)
        self.images = patterns[self.labels] + 1.5 * torch.randn(size, 3, image_size, image_size,
                                                                generator=g)
        self.classes = list(range(num_classes))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], int(self.labels[index])


class Indexed(Dataset):
    """Yields (dataset index, image, label), so predictions can be put back in order."""

    def __init__(self, base):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        image, label = self.base[index]
        return index, image, label


def build_dataset(args: argparse.Namespace):
    if not args.data:
        return SyntheticImages(args.val_size, args.num_classes, args.image_size, args.seed)
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    root = Path(args.data) / "val"
    if not root.is_dir():
        raise SetupError(f"--data {args.data}: expected a folder {root} with one sub-folder "
                         f"per class")
    transform = T.Compose([T.Resize(round(args.image_size * 256 / 224)),
                           T.CenterCrop(args.image_size), T.ToTensor(),
                           T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    try:
        return ImageFolder(root, transform=transform)
    except (FileNotFoundError, RuntimeError) as e:
        raise SetupError(f"--data {args.data}: {e}") from e


def build_model(args: argparse.Namespace, num_classes: int, d: Dist) -> nn.Module:
    kwargs = {"num_classes": num_classes}
    if args.norm == "group":
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(math.gcd(32, channels), channels)
    torch.manual_seed(args.seed)  # without --checkpoint: a fixed, seeded model
    model = torchvision.models.get_model(args.arch, **kwargs)
    if args.checkpoint:
        path = args.checkpoint
        if not path.is_file():
            raise SetupError(f"--checkpoint {path}: no such file")
        try:
            # Onto the CPU: load_state_dict then copies each tensor to the parameter's device.
            # weights_only refuses pickled code: a checkpoint is data, not a program.
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever torch.load raises, name the file
            raise SetupError(f"--checkpoint {path}: torch.load cannot read it "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:120]})") from e
        if isinstance(state, dict) and isinstance(state.get("model"), dict):
            state = state["model"]  # 04's checkpoints keep the weights under "model"
        if not (isinstance(state, dict) and state
                and all(isinstance(v, torch.Tensor) for v in state.values())):
            raise SetupError(f"--checkpoint {path}: not a state_dict (a dict of tensors)")
        state = {k.removeprefix("module."): v for k, v in state.items()}
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise SetupError(f"--checkpoint {path} does not fit --arch {args.arch} with "
                             f"{num_classes} classes: {describe_mismatch(model, state)}") from e
    return model.to(d.device).eval()


def describe_mismatch(model: nn.Module, state: dict) -> str:
    own = model.state_dict()
    shapes = [f"{k} is {tuple(state[k].shape)} in the file, {tuple(v.shape)} in the model"
              for k, v in own.items() if k in state and state[k].shape != v.shape]
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    parts = shapes[:2]
    if missing:
        parts.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
    if extra:
        parts.append(f"{len(extra)} unexpected keys (e.g. {extra[0]})")
    return "; ".join(parts)


# ---- Evaluation: each sample once, then three ways to combine ----------------------------

@torch.inference_mode()
def evaluate_shard(model: nn.Module, dataset, indices, args, d: Dist, num_classes: int):
    """Evaluate the given dataset indices; return sums and per-sample results."""
    loader = DataLoader(Subset(Indexed(dataset), indices), batch_size=args.batch_size,
                        num_workers=args.workers, pin_memory=d.device.type == "cuda")
    # sums: correct, count, loss sum, then per-class correct and per-class total
    sums = torch.zeros(3 + 2 * num_classes, dtype=torch.float64, device=d.device)
    rows = []
    for index, images, labels in loader:
        images = images.to(d.device, non_blocking=True)
        labels = labels.to(d.device, non_blocking=True)
        logits = model(images)
        predictions = logits.argmax(1)
        hit = (predictions == labels).double()
        sums[0] += hit.sum()
        sums[1] += len(labels)
        sums[2] += F.cross_entropy(logits.double(), labels, reduction="sum")
        sums[3:3 + num_classes].index_add_(0, labels, hit)
        sums[3 + num_classes:].index_add_(0, labels, torch.ones_like(hit))
        rows.append(torch.stack([index.to(d.device, non_blocking=True), predictions, labels], 1))
    rows = torch.cat(rows) if rows else torch.zeros(0, 3, dtype=torch.int64, device=d.device)
    return sums, rows


def metrics_from_sums(sums: torch.Tensor, num_classes: int) -> dict:
    s = sums.tolist()
    n = int(s[1])
    return {"num_samples": n, "correct": int(s[0]), "accuracy": s[0] / n if n else 0.0,
            "loss": s[2] / n if n else 0.0,
            "per_class_correct": [int(x) for x in s[3:3 + num_classes]],
            "per_class_total": [int(x) for x in s[3 + num_classes:]]}


def gather_predictions(rows: torch.Tensor, d: Dist) -> torch.Tensor:
    """all_gather needs equal shapes: gather sizes, pad to the largest, gather, trim."""
    size = torch.tensor([len(rows)], device=d.device)
    sizes = [torch.zeros_like(size) for _ in range(d.world_size)]
    dist.all_gather(sizes, size)
    largest = max(int(s) for s in sizes)
    padded = torch.full((largest, 3), -1, dtype=rows.dtype, device=d.device)
    padded[:len(rows)] = rows
    gathered = [torch.empty_like(padded) for _ in range(d.world_size)]
    dist.all_gather(gathered, padded)
    table = torch.cat([g[:int(s)] for g, s in zip(gathered, sizes)])
    return table[table[:, 0].argsort()]  # ordered by dataset index


def naive_padded_metrics(table: torch.Tensor, n: int, world_size: int) -> tuple[int, int]:
    """What a DistributedSampler(drop_last=False) evaluation would have counted."""
    per_rank = math.ceil(n / world_size)
    padded = list(range(n)) + list(range(n)) * math.ceil(per_rank * world_size / n)
    used = padded[:per_rank * world_size]  # every index the padded ranks would evaluate
    hits = (table[:, 1] == table[:, 2]).long()
    return int(hits[used].sum()), len(used)


def main(args: argparse.Namespace) -> None:
    d = setup(args.backend, args.timeout)
    if args.verify:  # on GPUs: IEEE float32 and deterministic cuDNN for both evaluations
        # (TF32 convolutions, cuDNN's default on Ampere and later, round to 10 mantissa bits)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    dataset = build_dataset(args)
    if len(dataset) == 0:
        raise SetupError("the validation set is empty")
    num_classes = len(dataset.classes)
    model = build_model(args, num_classes, d)  # the raw module: evaluation needs no DDP
    # wrapper (no gradients to sync), and DDP's forward could broadcast buffers, a
    # collective that ranks with different batch counts would not match.

    started = time.perf_counter()
    mine = range(d.rank, len(dataset), d.world_size)  # each sample exactly once, no padding
    sums, rows = evaluate_shard(model, dataset, mine, args, d, num_classes)
    seconds = time.perf_counter() - started

    # 1. all_reduce: sums of counts are all a scalar metric needs.
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    metrics = metrics_from_sums(sums, num_classes)
    # 2. all_gather of tensors: every prediction, back in dataset order.
    table = gather_predictions(rows, d)
    # 3. all_gather_object: any picklable object, here a per-rank report. It pickles,
    # copies through the CPU and unpickles: fine for small things, slow for big tensors,
    # and unpickling runs code, so use it only between processes you trust (your own job).
    reports = [None] * d.world_size
    dist.all_gather_object(reports, {"rank": d.rank, "host": socket.gethostname(),
                                     "samples": len(mine), "seconds": round(seconds, 3)})

    # Every rank checks the combined results, so all stop together if one fails.
    n = len(dataset)
    check(metrics["num_samples"] == n, "each sample once",
          f"counted {metrics['num_samples']} samples, the set has {n}")
    check(table[:, 0].tolist() == list(range(n)), "every index gathered",
          "the gathered predictions are not exactly the indices 0..N-1")
    check(int((table[:, 1] == table[:, 2]).sum()) == metrics["correct"], "gather = reduce",
          "correct counts from all_gather and all_reduce disagree")
    check(sum(r["samples"] for r in reports) == n, "reports", "per-rank sample counts")

    if d.is_main:
        per_rank = ", ".join(f"rank {r['rank']}: {r['samples']} in {r['seconds']}s"
                             for r in reports)
        print(f"evaluated {n} samples on {d.world_size} rank(s) ({per_rank})")
        print(f"exact:  accuracy {metrics['correct']}/{n} = {100 * metrics['accuracy']:.2f}%  "
              f"loss {metrics['loss']:.6f}")
        naive_correct, naive_n = naive_padded_metrics(table, n, d.world_size)
        if naive_n != n:
            print(f"naive:  accuracy {naive_correct}/{naive_n} = "
                  f"{100 * naive_correct / naive_n:.2f}%  (DistributedSampler pads {naive_n - n}"
                  f" repeat(s) so every rank holds {naive_n // d.world_size}; they count twice)")
        if args.metrics_json:
            Path(args.metrics_json).write_text(json.dumps(metrics, indent=1) + "\n")
        if args.predictions:
            Path(args.predictions).write_text(
                "index,label,prediction\n"
                + "".join(f"{i},{y},{p}\n" for i, p, y in table.tolist()))
    verified = f"{n} samples counted once, all_gather agrees with all_reduce"
    if args.verify:
        verified += "; " + verify_against_one_process(model, dataset, args, d, num_classes,
                                                      metrics)
    dist.barrier()
    if d.is_main:
        print(f"verified: {verified}", flush=True)


def verify_against_one_process(model, dataset, args, d: Dist, num_classes, metrics) -> str:
    """Rank 0 evaluates the whole set alone and compares."""
    # Counts must match exactly; the loss within 1e-6, not bit for bit: rank 0 alone runs
    # other batch shapes than the shards did, and kernels may order a sum differently per
    # shape (on CPUs and, even with TF32 off and deterministic cuDNN, on GPUs).
    # Only rank 0 works here; the others wait in the barrier below, which is the right
    # place to wait. Evaluating on rank 0 alone while the others are already inside a
    # collective (an all_reduce of their results, say) is the classic evaluation hang.
    if d.is_main:
        sums, _ = evaluate_shard(model, dataset, range(len(dataset)), args, d, num_classes)
        alone = metrics_from_sums(sums, num_classes)
        for key in ("num_samples", "correct", "per_class_correct", "per_class_total"):
            check(alone[key] == metrics[key], "equal to one process",
                  f"{key}: {metrics[key]} on {d.world_size} ranks, {alone[key]} alone")
        check(abs(alone["loss"] - metrics["loss"]) < 1e-6, "equal to one process",
              f"loss {metrics['loss']:.9f} on {d.world_size} ranks, {alone['loss']:.9f} alone")
    dist.barrier()
    return "identical to a one-process evaluation (counts exact, loss within 1e-6)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, metavar="PATH",
                        help="weights saved by 03 (--save-model) or 04 (default: a fixed "
                             "model seeded by --seed)")
    parser.add_argument("--arch", default="resnet18", metavar="ARCH",
                        choices=sorted(torchvision.models.list_models(module=torchvision.models)),
                        help="any torchvision classification model (default: %(default)s)")
    parser.add_argument("--norm", choices=["batch", "group"], default="batch",
                        help="group: the GroupNorm variant 03 trains with --norm group "
                             "(default: %(default)s)")
    parser.add_argument("--data", metavar="DIR",
                        help="an ImageFolder tree; DIR/val is evaluated (default: synthetic)")
    parser.add_argument("--val-size", type=positive_int, default=1024,
                        help="synthetic validation images (default: %(default)s)")
    parser.add_argument("--num-classes", type=positive_int, default=10,
                        help="synthetic classes (default: %(default)s)")
    parser.add_argument("--image-size", type=positive_int, default=32,
                        help="image side in pixels (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=64,
                        help="images per batch on each rank (default: %(default)s)")
    parser.add_argument("--workers", type=nonnegative_int, default=0,
                        help="DataLoader worker processes per rank (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the synthetic set and the model (default: %(default)s)")
    parser.add_argument("--verify", action="store_true",
                        help="rank 0 also evaluates the whole set alone and compares")
    parser.add_argument("--metrics-json", type=output_file, metavar="PATH",
                        help="rank 0 writes the metrics as JSON")
    parser.add_argument("--predictions", type=output_file, metavar="PATH",
                        help="rank 0 writes a CSV: index,label,prediction")
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
