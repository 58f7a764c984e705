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
Needs torch >= 2.4. Under torchrun --max-restarts, copy 04_checkpoint.py's attempt_store().
"""

import argparse
import atexit
import concurrent.futures
import datetime
import faulthandler
import io
import json
import math
import os
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
from torch.utils.data import DataLoader, Subset, TensorDataset
from torchvision.datasets.folder import IMG_EXTENSIONS, ImageFolder

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
    started = clock(d.device)
    mine = torch.arange(d.rank, n, d.world_size)  # each sample exactly once, no padding
    sums, rows = evaluate(model, dataset, mine, args, d, "evaluation")
    seconds = clock(d.device) - started
    # Where this rank is, for the line that names who is behind if a collective times out
    # (Dist.beat, the shared plumbing: its evaluation's batch, then here).
    d.beat("gather")
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
        if padded > n:  # DistributedSampler repeats the first indices: they count twice
            naive = int(hits[torch.arange(padded) % n].sum())
            accuracy = f"{naive}/{padded} = {100 * naive / padded:.2f}%"
            say(f"naive:  accuracy {accuracy}  (DistributedSampler pads {padded - n} repeat(s))")
        say(f"verified: {n} samples counted once, all_gather agrees with all_reduce")
        if args.verify:
            say(
                "verified: identical to a one-process evaluation "
                "(counts exact, loss to 1e-6 relative)"
            )
    if args.metrics_json:
        data = (json.dumps(metrics, indent=1) + "\n").encode()
        rank0_writes(args.metrics_json, lambda f: f.write(data), d)
    if args.predictions:

        def write_csv(f):  # called on rank 0 alone: the others do not format the table
            f.write(b"index,label,prediction\n")
            for i, p, y in table.tolist():
                f.write(f"{i},{y},{p}\n".encode())

        rank0_writes(args.predictions, write_csv, d)


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
    """torchvision's ImageFolder (root/CLASS/IMAGE), without hidden files (macOS's ._x.png
    are not images) or hidden folders (file browsers' .thumbnails/ are not training data).
    03, 04 and 05 read --data with it."""

    def is_image(path):
        inside = os.path.relpath(path, root)  # CLASS/IMAGE, or deeper
        return inside.lower().endswith(IMG_EXTENSIONS) and "/." not in f"/{inside}"

    try:
        return ImageFolder(root, transform, loader=load_image, is_valid_file=is_image)
    except (FileNotFoundError, RuntimeError) as e:  # no class folders, or no images in them
        raise SetupError(f"--data {root}: {e}") from e  # names the split


def load_image(path):
    """The image at path in RGB, or a SetupError naming the file. (16-bit greyscale, common in
    scientific and medical imaging, saturates in RGB: NOTES.md says how to scale it.)"""
    try:
        return PIL.Image.open(path).convert("RGB")
    # truncated, not an image at all, or a decompression bomb: a header claiming more than
    # twice PIL.Image.MAX_IMAGE_PIXELS (about 179 megapixels), refused before decoding
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as e:
        raise SetupError(f"cannot read image {path}: {e}") from None


def synthetic_images(count, size, split):
    """Learnable and deterministic: class c is a fixed random 8x8 colour pattern, upsampled,
    plus noise; split 0 (train) and 1 (val) draw different images of the same classes."""
    g = torch.Generator().manual_seed(0)
    patterns = F.interpolate(torch.randn(10, 3, 8, 8, generator=g), size=size, mode="bilinear")
    g.manual_seed(1 + split)
    labels = torch.randint(10, (count,), generator=g)
    noise = torch.randn(count, 3, size, size, generator=g)
    return TensorDataset(patterns[labels] + 1.5 * noise, labels)


def build_model(args, num_classes, device):
    kwargs = {}
    if args.norm == "group":  # as 03 --norm group builds it
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(math.gcd(32, channels), channels)
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
    # A DDP wrapper's own state_dict has "module." before every key
    state = {k.removeprefix("module."): v for k, v in state.items()}
    ours = {k: v.shape for k, v in model.state_dict().items()}
    theirs = {k: getattr(v, "shape", "not a tensor") for k, v in state.items()}
    for k in ours | theirs:
        if ours.get(k) != theirs.get(k):  # None: no such key
            why = f"{k} is {theirs.get(k)} in the file, {ours.get(k)} in the model"
            raise SetupError(f"--checkpoint {path} does not fit --arch {arch}: {why}")
    return state


def clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU work is queued: time what has finished
    return time.perf_counter()


@torch.inference_mode()
def evaluate(model, dataset, indices, args, d, where):
    """Evaluate dataset[i] for i in indices (a tensor). Returns the sums (correct, count,
    loss) and one row (index, prediction, label) per sample, in the order of indices.
    where: the phase each batch beats (Dist.beat); None: no beats."""
    device = d.device
    loader = DataLoader(
        Subset(dataset, indices.tolist()),
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
    )
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    results = [torch.zeros(0, 2, dtype=torch.long, device=device)]  # a shard may be empty
    for i, (images, labels) in enumerate(loader):
        if where:  # (in the job's store: no collective)
            d.beat(f"{where}, batch {i}")
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
    # No collective waits on it, so no beats (rank 0, the store's host, may have ended) and
    # no watchdog (it would end a check that takes longer than --timeout + 5 s).
    faulthandler.cancel_dump_traceback_later()
    everything = torch.arange(len(dataset))
    sums, _ = evaluate(model, dataset, everything, args, d, None)
    alone = metrics_from_sums(sums)
    close = math.isclose(alone["loss"], metrics["loss"], rel_tol=1e-6, abs_tol=1e-9)
    same = alone["correct"] == metrics["correct"] and close
    check(same, "equal to one process", f"{metrics} on {d.world_size} ranks, {alone} alone")


def rank0_writes(path, save, d):
    """Rank 0 runs save(file) into memory and writes the result to path whole; then every
    rank raises rank 0's error, if any. The others wait for that outcome, not in a barrier,
    where a rank 0 that failed would leave them waiting (on NCCL, for --timeout)."""
    error = [None]
    if d.rank == 0:
        buffer = io.BytesIO()
        save(buffer)  # into memory first: torch.save's own failed write names no cause
        try:
            write_atomic(path, buffer.getvalue())
        except OSError as e:  # a full disk, say: name the file, not a traceback
            error = [f"cannot write {path}: {e.strerror}"]
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
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; after a failure, nothing is left


def build_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        metavar="PATH",
        help="weights of --arch, as 03 --save-model writes them (default: a seeded model)",
    )
    parser.add_argument(
        "--arch",
        default="resnet18",
        choices=torchvision.models.list_models(module=torchvision.models),
        metavar="A",
        help="any torchvision classifier (default: %(default)s)",
    )
    parser.add_argument(
        "--norm",
        default="batch",
        choices=["batch", "group"],
        help="group: as 03 --norm group (default: %(default)s)",
    )
    parser.add_argument(
        "--data", type=Path, metavar="DIR", help="an ImageFolder tree; DIR/val is evaluated"
    )
    parser.add_argument(
        "--val-size",
        type=number(int, 1),
        default=1024,
        help="synthetic validation images (default: %(default)s)",
    )
    parser.add_argument(
        "--image-size",
        type=number(int, 1),
        default=32,
        help="image side in pixels (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=number(int, 1),
        default=64,
        help="images per batch on each rank (default: %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=number(int, 0),
        default=0,
        help="DataLoader workers per rank (default: %(default)s)",
    )
    parser.add_argument(
        "--verify", action="store_true", help="every rank also evaluates the whole set alone"
    )
    parser.add_argument(
        "--metrics-json", type=output_file, metavar="PATH", help="rank 0 writes the metrics there"
    )
    parser.add_argument(
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
    # An output that is the checkpoint would overwrite it (a 44.8 MB model became a 461-byte
    # CSV, and the run said "verified"); resolve() sees through ./ and symbolic links.
    named = [args.checkpoint, args.metrics_json, args.predictions]
    files = [path.resolve() for path in named if path]
    if len(set(files)) < len(files):
        parser.error("--checkpoint, --metrics-json and --predictions: one file named twice")
    return args


def output_file(text):
    """An argparse type for a file the job writes: not a folder, and in a folder it can
    create files in (write and search permission), so that a bad path ends the run before
    any work is done."""
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
    launch(main, parse_args())
