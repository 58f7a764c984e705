r"""05_eval_gather.py: distributed evaluation whose metrics equal a one-process evaluation.

Run
  torchrun --standalone --nproc_per_node 2 05_eval_gather.py --verify
  python 05_eval_gather.py --spawn 3 --val-size 103 --metrics-json metrics.json
  python 05_eval_gather.py --checkpoint model.pt      # a model saved by 03_ddp_train.py
  python 05_eval_gather.py --checkpoint checkpoints/step-00000096.pt  # or a 04 checkpoint
  # two nodes, 2 processes each: run on both machines
  torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
      --rdzv-endpoint HOST0:29400 --rdzv-id job1 05_eval_gather.py

Each rank evaluates its own part of the validation set; three collectives assemble the
results, each used for what it fits:
  1. all_reduce of sums (correct, count, loss): scalar metrics; per-class counts would be
     a longer vector of sums, reduced the same way;
  2. all_gather of per-sample tensors (index, prediction, label), padded to the largest
     rank's size with rows of index -1, dropped after: every prediction, in dataset order;
  3. all_gather_object of plain Python objects: anything picklable, at a price.
Every sample is evaluated exactly once: rank r takes samples r, r+W, r+2W, ... with no
padding. DistributedSampler would pad the set so all ranks hold the same count, and count
those repeats twice; the script prints that naive figure beside the exact one.
Under torchrun --max-restarts, copy 04_checkpoint.py's attempt_store().
"""

import argparse
import atexit
import json
import math
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

import PIL.Image
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Subset, TensorDataset
from torchvision.datasets.folder import ImageFolder

# The shared plumbing is at the bottom of this file, the same in all six scripts (01 explains
# it): setup() reads the launcher's RANK, WORLD_SIZE and LOCAL_RANK, binds this process's
# device, joins the process group and returns d (rank, world_size, device); launch() starts
# the ranks, and run_rank() ends each with one line (so no destroy_process_group: NOTES.md
# says why); check() and SetupError fail loudly. Read it last, or not at all.


def main(args):
    d = setup(args.timeout)
    if args.verify:
        # On GPUs, IEEE float32 for both evaluations: TF32 convolutions (cuDNN's default on
        # Ampere and later) round to 10 mantissa bits, and could flip a prediction near a
        # tie in one evaluation and not in the other.
        torch.backends.cudnn.allow_tf32 = False
    dataset, num_classes = build_dataset(args)
    # The raw module, no DDP wrapper: there are no gradients to sync, and DDP's forward could
    # broadcast buffers, a collective that ranks with different batch counts would not match.
    model = build_model(args, num_classes, d.device)

    n = len(dataset)
    started = clock()
    mine = torch.arange(d.rank, n, d.world_size)  # each sample exactly once, no padding
    sums, rows = evaluate(model, dataset, mine, args, d.device)
    seconds = clock() - started
    # 1. all_reduce: sums of counts are all a scalar metric needs.
    dist.all_reduce(sums)  # op=SUM, the default
    metrics = metrics_from_sums(sums)
    if not math.isfinite(metrics["loss"]):  # all-reduced: every rank stops here together
        raise SetupError(f"--checkpoint {args.checkpoint}: its weights hold NaN or inf")
    # 2. all_gather of tensors: every prediction, back in dataset order.
    table = gather_rows(rows, d)
    # 3. all_gather_object: any picklable object, here a per-rank report. It pickles,
    # copies through the CPU and unpickles: fine for small things, slow for big tensors,
    # and unpickling runs code, so use it only between processes you trust (your own job).
    report = {"host": socket.gethostname(), "samples": len(mine), "seconds": seconds}
    reports = [None] * d.world_size
    dist.all_gather_object(reports, report)

    # ---- checks: every rank checks the combined results, so all stop together if one fails
    counted = metrics["num_samples"]
    check(counted == n, "each sample once", f"counted {counted} samples of {n}")
    indices = table[:, 0].tolist()
    check(indices == list(range(n)), "every index gathered", "the indices are not 0..N-1")
    hits = table[:, 1] == table[:, 2]  # prediction == label, from the gather
    check(hits.sum() == metrics["correct"], "gather = reduce", "the correct counts differ")
    if args.verify:
        verify_against_one_process(model, dataset, args, d, metrics)
    if d.rank == 0:
        say(f"evaluated {n} samples on {d.world_size} rank(s)")
        for rank, r in enumerate(reports):
            say(f"  rank {rank} on {r['host']}: {r['samples']} samples in {r['seconds']:.3f}s")
        accuracy = f"{metrics['correct']}/{n} = {100 * metrics['accuracy']:.2f}%"
        say(f"exact:  accuracy {accuracy}  loss {metrics['loss']:.6f}")
        padded = math.ceil(n / d.world_size) * d.world_size
        if padded > n:  # DistributedSampler's padding: the first indices again
            naive = int(hits[torch.arange(padded) % n].sum())
            accuracy = f"{naive}/{padded} = {100 * naive / padded:.2f}%"
            say(f"naive:  accuracy {accuracy}  (DistributedSampler pads {padded - n} repeat(s))")
        say(f"verified: {n} samples counted once, all_gather agrees with all_reduce")
        if args.verify:
            say(
                "verified: identical to a one-process evaluation "
                "(counts exact, loss to 1e-6 relative)"
            )
        # rank 0 alone writes: a failed write ends it alone, its line naming the file
        if args.metrics_json:
            write_atomic(args.metrics_json, (json.dumps(metrics, indent=1) + "\n").encode())
        if args.predictions:
            lines = ["index,label,prediction\n"] + [f"{i},{y},{p}\n" for i, p, y in table.tolist()]
            write_atomic(args.predictions, "".join(lines).encode())


def build_dataset(args):
    """03's validation set and its number of classes."""
    if not args.data:  # 03's validation images: the same --val-size and --image-size
        return synthetic_images(args.val_size, args.image_size, split=1), 10
    T = torchvision.transforms
    size = args.image_size
    # 03's validation transform: a centre crop, 224 of 256
    centre = T.Compose([T.Resize(size * 8 // 7), T.CenterCrop(size), T.ToTensor()])
    val_set = image_folder(args.data / "val", centre)
    return val_set, len(val_set.classes)


def image_folder(root, transform):
    """torchvision's ImageFolder: root/CLASS/IMAGE, each image read by load_image."""
    try:
        return ImageFolder(root, transform, loader=load_image)
    except (OSError, RuntimeError) as e:  # not a folder, no class folders, or no images
        raise SetupError(f"--data {root}: {e}") from e


def load_image(path):
    """The image at path in RGB, or a SetupError naming the file (truncated, not an image)."""
    try:
        image = PIL.Image.open(path)
        if image.mode == "I;16":  # 16-bit greyscale: to 8 bits, or RGB clips it to white
            image = image.point(lambda value: value / 256)
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise SetupError(f"cannot read image {path}: {e}") from None


def synthetic_images(count, size, split):
    """Learnable and deterministic: class c is a fixed random 8x8 colour pattern, upsampled,
    plus noise; split 0 (train) and 1 (val) draw different images."""
    g = torch.Generator().manual_seed(0)
    patterns = F.interpolate(torch.randn(10, 3, 8, 8, generator=g), size=size, mode="bilinear")
    g.manual_seed(1 + split)
    labels = torch.randint(10, (count,), generator=g)
    noise = torch.randn(count, 3, size, size, generator=g)
    return TensorDataset(patterns[labels] + 1.5 * noise, labels)


def build_model(args, num_classes, device):
    kwargs = {}
    if args.norm == "group":  # as 03 --norm group builds it
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(32, channels)
    torch.manual_seed(0)  # without --checkpoint: a fixed, seeded model
    model = torchvision.models.get_model(args.arch, num_classes=num_classes, **kwargs)
    if args.checkpoint:
        model.load_state_dict(read_weights(args.checkpoint, model, args.arch))
    return model.to(device).eval()


def read_weights(path, model, arch):
    """The state_dict in path (03 --save-model's, or the model in a 04 checkpoint), checked
    to fit model, or a SetupError naming the first tensor that does not."""
    try:
        # Onto the CPU: load_state_dict then copies each tensor to the parameter's device.
        # weights_only refuses pickled code: a checkpoint is data, not a program.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - no such file, not a checkpoint, pickled code
        first = str(e).partition("\n")[0]  # torch's own message can run to paragraphs
        raise SetupError(f"--checkpoint {path}: torch.load cannot read it ({first})") from e
    if not isinstance(state, dict):
        raise SetupError(f"--checkpoint {path}: not a state_dict (03 --save-model) or 04's")
    state = state.get("model", state)  # 04's: the model in the training state
    ours = {k: v.shape for k, v in model.state_dict().items()}
    theirs = {k: getattr(v, "shape", "not a tensor") for k, v in state.items()}
    # the file's keys first: a DDP wrapper's state_dict shows as "module.conv1.weight is ...
    # in the file, None in the model" (save the plain module's, as 03 and 04 do)
    for k in theirs | ours:
        if ours.get(k) != theirs.get(k):  # None: no such key
            why = f"{k} is {theirs.get(k)} in the file, {ours.get(k)} in the model"
            raise SetupError(f"--checkpoint {path} does not fit --arch {arch}: {why}")
    return state


def clock():
    if torch.cuda.is_available():  # this rank's GPU (setup() made it the current one)
        torch.cuda.synchronize()  # its work is queued: time what has finished
    return time.perf_counter()


@torch.inference_mode()
def evaluate(model, dataset, indices, args, device):
    """Evaluate dataset[i] for i in indices (a tensor). Returns the sums (correct, count,
    loss) and one row (index, prediction, label) per sample, in the order of indices."""
    loader = DataLoader(
        Subset(dataset, indices.tolist()),
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
    )
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    results = [torch.zeros(0, 2, dtype=torch.long, device=device)]  # a shard may be empty
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        logits = model(images)
        predictions = logits.argmax(1)
        sums[0] += (predictions == labels).sum()
        sums[1] += len(labels)
        sums[2] += F.cross_entropy(logits.double(), labels, reduction="sum")
        results.append(torch.stack([predictions, labels], 1))
    rows = torch.cat(results)
    return sums, torch.column_stack([indices.to(device), rows])


def metrics_from_sums(sums):
    correct, count, loss = sums.tolist()
    return {
        "num_samples": int(count),
        "correct": int(correct),
        "accuracy": correct / count,
        "loss": loss / count,
    }


def gather_rows(rows, d):
    """Every rank's rows on every rank, ordered by dataset index, on the CPU."""
    # all_gather needs one shape on every rank: pad to the largest with rows of index -1
    largest = torch.tensor(len(rows), device=d.device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    padded = rows.new_full((int(largest), 3), -1)
    padded[: len(rows)] = rows
    gathered = [torch.empty_like(padded) for _ in range(d.world_size)]
    dist.all_gather(gathered, padded)
    table = torch.cat(gathered).cpu()
    table = table[table[:, 0] >= 0]  # without the padding
    return table[table[:, 0].argsort()]


def verify_against_one_process(model, dataset, args, d, metrics):
    """Every rank evaluates the whole set alone and compares."""
    # Counts must match exactly; the loss closely, not bit for bit: one process runs other
    # batch shapes than the shards did, and kernels may order a sum differently per shape
    # (on CPUs and, even with TF32 off, on GPUs).
    # Every rank does it, each on its own device or share of the cores, in the time one
    # would take. Rank 0 alone would keep the others waiting in a collective: past
    # --timeout if its evaluation is long, and for --timeout again if it fails.
    sums, _ = evaluate(model, dataset, torch.arange(len(dataset)), args, d.device)
    alone = metrics_from_sums(sums)
    close = math.isclose(alone["loss"], metrics["loss"], rel_tol=1e-6, abs_tol=1e-9)
    same = alone["correct"] == metrics["correct"] and close
    check(same, "equal to one process", f"{metrics} on {d.world_size} ranks, {alone} alone")


def write_atomic(path, data):
    """The whole file or nothing: written beside it, synced, renamed over it; an error names
    the file."""
    tmp = path.with_name(f".{path.name[:50]}.tmp{os.getpid()}")  # (a name has 255 bytes)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, path)  # a reader sees the old file or the new one
    except OSError as e:
        raise SetupError(f"cannot write {path}: {e.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)  # after a failure, nothing is left


def build_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    positive = number(int, 1)
    add(
        "--checkpoint",
        type=Path,
        metavar="PATH",
        help="weights of --arch, as 03 --save-model writes them (default: a seeded model)",
    )
    add(
        "--arch",
        default="resnet18",
        choices=torchvision.models.list_models(module=torchvision.models),
        metavar="A",
        help="any torchvision classifier (default: %(default)s)",
    )
    add(
        "--norm",
        default="batch",
        choices=["batch", "group"],
        help="group: as 03 --norm group (default: %(default)s)",
    )
    add("--data", type=Path, metavar="DIR", help="an ImageFolder tree; DIR/val is evaluated")
    add(
        "--val-size",
        type=positive,
        default=1024,
        help="synthetic validation images (default: %(default)s)",
    )
    add(
        "--image-size",
        type=positive,
        default=32,
        help="image side in pixels (default: %(default)s)",
    )
    add(
        "--batch-size",
        type=positive,
        default=64,
        help="images per batch on each rank (default: %(default)s)",
    )
    add(
        "--workers",
        type=number(int, 0),
        default=0,
        help="DataLoader workers per rank (default: %(default)s)",
    )
    add("--verify", action="store_true", help="every rank also evaluates the whole set alone")
    add("--metrics-json", type=output_file, metavar="PATH", help="rank 0 writes the metrics there")
    add(
        "--predictions",
        type=output_file,
        metavar="PATH",
        help="rank 0 writes a CSV there: index,label,prediction",
    )
    add_launch_args(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    # An output that is the checkpoint would overwrite it; resolve() sees through ./ and
    # symbolic links (hard links: NOTES.md).
    named = [args.checkpoint, args.metrics_json, args.predictions]
    files = [path.resolve() for path in named if path]
    if len(set(files)) < len(files):
        parser.error("--checkpoint, --metrics-json and --predictions: one file named twice")
    return args


def output_file(text):
    """An argparse type for a file the job writes: not a folder, and in a folder it may write
    in, so that a bad path ends the run before any work is done."""
    path = Path(text)
    if path.is_dir() or not os.access(path.parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: not a file in a writable folder")
    return path


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
    launch(main, parse_args())
