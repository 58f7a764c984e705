r"""05_eval_gather.py: distributed evaluation whose metrics equal a one-process evaluation.

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
  python 05_eval_gather.py --checkpoint checkpoints/step-00000096.pt  # or a 04 checkpoint
  # two nodes, 2 processes each: run on both machines
  torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 05_eval_gather.py

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
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import PIL.Image
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.datasets.folder import IMG_EXTENSIONS, ImageFolder

# setup(), launch(), check() and SetupError are the shared plumbing at the bottom of this file.


def main(args: argparse.Namespace) -> None:
    d = setup(args.timeout)
    if args.verify:  # on GPUs: IEEE float32 and deterministic cuDNN for both evaluations
        # (TF32 convolutions, cuDNN's default on Ampere and later, round to 10 mantissa bits)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    dataset = build_dataset(args)
    if len(dataset) == 0:
        raise SetupError("the validation set is empty")
    num_classes = len(dataset.classes)
    # The raw module, no DDP wrapper: there are no gradients to sync, and DDP's forward could
    # broadcast buffers, a collective that ranks with different batch counts would not match.
    model = build_model(args, num_classes, d)

    started = clock(d)
    mine = range(d.rank, len(dataset), d.world_size)  # each sample exactly once, no padding
    sums, rows = evaluate_shard(model, dataset, mine, args, d, num_classes)
    seconds = clock(d) - started
    # 1. all_reduce: sums of counts are all a scalar metric needs.
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    metrics = metrics_from_sums(sums, num_classes)
    if not math.isfinite(metrics["loss"]):  # all-reduced: every rank stops here together
        weights = args.checkpoint or "the seeded model"
        raise SetupError(f"the loss is not finite: the model's weights hold NaN or inf ({weights})")
    # 2. all_gather of tensors: every prediction, back in dataset order.
    table = gather_predictions(rows, d)
    # 3. all_gather_object: any picklable object, here a per-rank report. It pickles,
    # copies through the CPU and unpickles: fine for small things, slow for big tensors,
    # and unpickling runs code, so use it only between processes you trust (your own job).
    report = dict(rank=d.rank, host=socket.gethostname(), samples=len(mine), seconds=seconds)
    reports = [None] * d.world_size
    dist.all_gather_object(reports, report)

    # ---- checks: every rank checks the combined results, so all stop together if one fails
    n = len(dataset)
    counted = f"counted {metrics['num_samples']} samples, the set has {n}"
    check(metrics["num_samples"] == n, "each sample once", counted)
    indices = "the gathered predictions are not exactly the indices 0..N-1"
    check(table[:, 0].tolist() == list(range(n)), "every index gathered", indices)
    correct = int((table[:, 1] == table[:, 2]).sum())  # prediction == label, from the gather
    disagree = "correct counts from all_gather and all_reduce disagree"
    check(correct == metrics["correct"], "gather = reduce", disagree)
    check(sum(r["samples"] for r in reports) == n, "reports", "per-rank sample counts")
    if d.rank == 0:
        per_rank = ", ".join(
            f"rank {r['rank']}: {r['samples']} in {r['seconds']:.3f}s" for r in reports
        )
        say(f"evaluated {n} samples on {d.world_size} rank(s) ({per_rank})")
        say(
            f"exact:  accuracy {metrics['correct']}/{n} = {100 * metrics['accuracy']:.2f}%  "
            f"loss {metrics['loss']:.6f}"
        )
        naive_correct, naive_n = naive_padded_metrics(table, n, d.world_size)
        if naive_n != n:
            say(
                f"naive:  accuracy {naive_correct}/{naive_n} = "
                f"{100 * naive_correct / naive_n:.2f}%  (DistributedSampler pads {naive_n - n}"
                f" repeat(s) so every rank holds {naive_n // d.world_size}; they count twice)"
            )
    if args.metrics_json:
        text = json.dumps(metrics, indent=1) + "\n"
        rank0_writes(args.metrics_json, lambda f: f.write(text.encode()), d)
    if args.predictions:

        def write_csv(f) -> None:  # called on rank 0 alone: the others do not format the table
            f.write(b"index,label,prediction\n")
            f.write("".join(f"{i},{y},{p}\n" for i, p, y in table.tolist()).encode())

        rank0_writes(args.predictions, write_csv, d)
    verified = f"{n} samples counted once, all_gather agrees with all_reduce"
    if args.verify:
        verified += "; " + verify_against_one_process(model, dataset, args, d, metrics)
    if d.rank == 0:
        say(f"verified: {verified}")


def build_dataset(args: argparse.Namespace):
    if not args.data:
        return SyntheticImages(
            args.val_size, args.num_classes, args.image_size, args.seed, train=False
        )  # 03's validation images
    root = args.data / "val"  # one sub-folder per class
    # 03's validation transform: resize, centre crop, ImageNet's normalisation
    T = torchvision.transforms
    norm = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    resize = round(args.image_size * 256 / 224)
    transform = T.Compose([T.Resize(resize), T.CenterCrop(args.image_size), T.ToTensor(), norm])
    dataset = image_folder(root, transform)
    train = sorted(p.name for p in (root.parent / "train").glob("*") if p.is_dir())
    if train and train != dataset.classes:  # labels are class indices: the lists must agree
        raise SetupError(
            f"--data {args.data}: the val folder's classes {dataset.classes} "
            f"differ from train's {train}, so its labels do not match a model's"
        )
    return dataset


def image_folder(root, transform):
    """torchvision's ImageFolder (root/CLASS/IMAGE), without hidden files: macOS's ._x.png
    are not images. 03, 04 and 05 read --data with it."""

    def is_image(path):
        name = os.path.basename(path)
        return name.lower().endswith(IMG_EXTENSIONS) and not name.startswith(".")

    try:
        return ImageFolder(root, transform, loader=load_image, is_valid_file=is_image)
    except (FileNotFoundError, RuntimeError) as e:  # no class folders, or no images in them
        raise SetupError(f"--data {root.parent}: {e}") from e


def load_image(path):
    """The image at path in RGB, or a SetupError naming the file. 16-bit greyscale (common in
    scientific and medical imaging) is scaled to 8 bits: converted as it is, it saturates."""
    try:
        image = PIL.Image.open(path)
        if image.mode.startswith("I"):  # "I;16" and kin: values up to 65535
            image = image.convert("I").point(lambda value: value / 256)  # (I;16B has no point)
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:  # truncated, or not an image at all
        raise SetupError(f"cannot read image {path}: {e}") from None


class SyntheticImages(Dataset):
    """Learnable and deterministic: class c is a fixed random 8x8 colour pattern, upsampled,
    plus noise. Nothing random at load time, so N processes see exactly what one would."""

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int, train: bool):
        patterns = torch.randn(num_classes, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
        patterns = F.interpolate(patterns, size=image_size, mode="bilinear", align_corners=False)
        g = torch.Generator().manual_seed(seed + (1 if train else 2))  # train and val differ
        self.labels = torch.randint(num_classes, (size,), generator=g)
        noise = torch.randn(size, 3, image_size, image_size, generator=g)
        self.images = patterns[self.labels] + 1.5 * noise
        self.classes = list(range(num_classes))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], int(self.labels[index])


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
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            raise SetupError(f"--checkpoint {path}: torch.load cannot read it ({why})") from e
        if isinstance(state, dict) and {"model", "optimizer", "step"} <= state.keys():
            state = state["model"]  # a 04_checkpoint.py checkpoint: the model in the state
        tensors = isinstance(state, dict) and all(torch.is_tensor(v) for v in state.values())
        if not (tensors and state):
            why = "not a model's state_dict (03 --save-model) or a 04 checkpoint"
            raise SetupError(f"--checkpoint {path}: {why}")
        state = {k.removeprefix("module."): v for k, v in state.items()}
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            misfit = f"does not fit --arch {args.arch} with {num_classes} classes"
            raise SetupError(
                f"--checkpoint {path} {misfit}: {describe_mismatch(model, state)}"
            ) from e
    return model.to(d.device).eval()


def describe_mismatch(model: nn.Module, state: dict) -> str:
    own = model.state_dict()
    shapes = [
        f"{k} is {tuple(state[k].shape)} in the file, {tuple(v.shape)} in the model"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    parts = shapes[:2]
    if missing:
        parts.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
    if extra:
        parts.append(f"{len(extra)} unexpected keys (e.g. {extra[0]})")
    return "; ".join(parts)


def clock(d: Dist) -> float:
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)  # GPU work is queued: time what has finished
    return time.perf_counter()


@torch.inference_mode()
def evaluate_shard(model: nn.Module, dataset, indices, args, d: Dist, num_classes: int):
    """Evaluate the given dataset indices; return sums and per-sample results."""
    loader = DataLoader(
        Subset(Indexed(dataset), indices),
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=d.device.type == "cuda",
    )
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
        sums[3 : 3 + num_classes].index_add_(0, labels, hit)
        sums[3 + num_classes :].index_add_(0, labels, torch.ones_like(hit))
        rows.append(torch.stack([index.to(d.device, non_blocking=True), predictions, labels], 1))
    rows = torch.cat(rows) if rows else torch.zeros(0, 3, dtype=torch.int64, device=d.device)
    return sums, rows


class Indexed(Dataset):
    """Yields (dataset index, image, label), so predictions can be put back in order."""

    def __init__(self, base):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        image, label = self.base[index]
        return index, image, label


def metrics_from_sums(sums: torch.Tensor, num_classes: int) -> dict:
    s = sums.tolist()
    n = int(s[1])
    return {
        "num_samples": n,
        "correct": int(s[0]),
        "accuracy": s[0] / n if n else 0.0,
        "loss": s[2] / n if n else 0.0,
        "per_class_correct": [int(x) for x in s[3 : 3 + num_classes]],
        "per_class_total": [int(x) for x in s[3 + num_classes :]],
    }


def gather_predictions(rows: torch.Tensor, d: Dist) -> torch.Tensor:
    """all_gather needs equal shapes: gather sizes, pad to the largest, gather, trim."""
    size = torch.tensor([len(rows)], device=d.device)
    sizes = [torch.zeros_like(size) for _ in range(d.world_size)]
    dist.all_gather(sizes, size)
    largest = max(int(s) for s in sizes)
    padded = torch.full((largest, 3), -1, dtype=rows.dtype, device=d.device)
    padded[: len(rows)] = rows
    gathered = [torch.empty_like(padded) for _ in range(d.world_size)]
    dist.all_gather(gathered, padded)
    table = torch.cat([g[: int(s)] for g, s in zip(gathered, sizes)])
    return table[table[:, 0].argsort()]  # ordered by dataset index


# ---- checks -------------------------------------------------------------------------------


def naive_padded_metrics(table: torch.Tensor, n: int, world_size: int) -> tuple[int, int]:
    """What a DistributedSampler(drop_last=False) evaluation would have counted."""
    per_rank = math.ceil(n / world_size)
    padded = list(range(n)) + list(range(n)) * math.ceil(per_rank * world_size / n)
    used = padded[: per_rank * world_size]  # every index the padded ranks would evaluate
    hits = (table[:, 1] == table[:, 2]).long()
    return int(hits[used].sum()), len(used)


def verify_against_one_process(model, dataset, args, d: Dist, metrics: dict) -> str:
    """Every rank evaluates the whole set alone and compares."""
    # Counts must match exactly; the loss closely, not bit for bit: one process runs other
    # batch shapes than the shards did, and kernels may order a sum differently per shape
    # (on CPUs and, even with TF32 off and deterministic cuDNN, on GPUs).
    # Every rank does it, each on its own device or share of the cores, in the time one
    # would take. Rank 0 alone would keep the others waiting in a collective: past
    # --timeout if its evaluation is long, and for --timeout again if it fails.
    num_classes = len(dataset.classes)
    sums, _ = evaluate_shard(model, dataset, range(len(dataset)), args, d, num_classes)
    alone = metrics_from_sums(sums, num_classes)
    for key in ("num_samples", "correct", "per_class_correct", "per_class_total"):
        differ = f"{key}: {metrics[key]} on {d.world_size} ranks, {alone[key]} alone"
        check(alone[key] == metrics[key], "equal to one process", differ)
    close = math.isclose(alone["loss"], metrics["loss"], rel_tol=1e-6, abs_tol=1e-9)
    differ = f"loss {metrics['loss']:.9f} on {d.world_size} ranks, {alone['loss']:.9f} alone"
    check(close, "equal to one process", differ)
    return "identical to a one-process evaluation (counts exact, loss to 1e-6 relative)"


def build_parser() -> argparse.ArgumentParser:
    run = re.search(r"Run\n.*?(?:\n\n|$)", __doc__, re.S)[0]  # --help ends with the Run block
    parser = argparse.ArgumentParser(description=__doc__.replace(run, ""), epilog=run)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the docstring as written

    def add(group, name: str, what: str, **how) -> None:  # the help states a default once
        if how.get("default") is not None:
            what += " (default: %(default)s)"
        group.add_argument(name, help=what, **how)

    what = "weights of --arch, as 03 --save-model writes them (default: a seeded model)"
    add(parser, "--checkpoint", what, type=Path, metavar="PATH")
    models = sorted(torchvision.models.list_models(module=torchvision.models))
    add(parser, "--arch", "any torchvision classifier", default="resnet18", choices=models)
    what = "group: the GroupNorm variant of 03 --norm group"
    add(parser, "--norm", what, choices=["batch", "group"], default="batch")
    add(parser, "--data", "an ImageFolder tree; DIR/val is evaluated", type=Path, metavar="DIR")
    add(parser, "--val-size", "synthetic validation images", type=number(int, 1), default=1024)
    add(parser, "--num-classes", "synthetic classes", type=number(int, 2), default=10)
    add(parser, "--image-size", "image side in pixels", type=number(int, 1), default=32)
    add(parser, "--batch-size", "images per batch on each rank", type=number(int, 1), default=64)
    add(parser, "--workers", "DataLoader workers per rank", type=number(int, 0), default=0)
    add(parser, "--seed", "seeds the synthetic set and the model", type=number(int, 0), default=0)
    what = "rank 0 also evaluates the whole set alone and compares"
    add(parser, "--verify", what, action="store_true")
    what = "rank 0 writes the metrics there as JSON"
    add(parser, "--metrics-json", what, type=output_file, metavar="PATH")
    what = "rank 0 writes a CSV there: index,label,prediction"
    add(parser, "--predictions", what, type=output_file, metavar="PATH")
    add_launch_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    outputs = [("--metrics-json", args.metrics_json), ("--predictions", args.predictions)]
    files = [(name, path) for name, path in outputs if path]
    for i, (name, path) in enumerate(files):  # no output may be an input, or another output
        for other, earlier in [("--checkpoint", args.checkpoint), *files[:i]]:
            if earlier and same_file(path, earlier):
                parser.error(f"{name} {path} is the file {other} names: it would be overwritten")
    return args


def same_file(a: Path, b: Path) -> bool:
    """The same file, whatever the spelling: ./x, a symbolic link to it, a hard link."""
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


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
