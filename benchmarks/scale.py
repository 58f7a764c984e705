r"""benchmarks/scale.py: what 04_checkpoint.py costs each rank as the job grows.

  python benchmarks/scale.py                     # world sizes 2, 4, 8 and 16, on Gloo
  python benchmarks/scale.py --sizes 2 4 8 16 32 --files 100000
  SCALE_SCRIPT=old/04_checkpoint.py python benchmarks/scale.py   # another version of 04

For each world size it runs 04's main() twice in a checkpoint folder of its own: a fresh
run of S steps, then a resume of it for one more epoch. Each rank is a process forked from
this one, with the variables torchrun would set, and three instruments that leave 04's code
paths as they are:
- the job's store is a TCPStore wrapped in a dist.Store subclass that counts operations:
  init's rendezvous, Gloo's connections and 04's Phases all go through it;
- the default group's sequence number counts collectives (DDP's gradient all-reduces and
  the stop agreement included), and /proc/self/io's wchar the bytes the process wrote
  (Gloo's sockets and the store's: nothing else writes during a step);
- Phases.enter, wrapped, reads them when each step's first micro-batch starts; and
  read_checkpoint, wrapped, counts the checkpoint files each rank reads.

Per step: the mean over the fresh run's steps after the second (--log-every and
--save-every lie beyond the run: the training step alone; a progress line adds two
collectives, a save one broadcast). Start-up: from the resume's process start to its first
step. The table ends with a least-squares fit a + b*N of each column, evaluated at 1,024
and 8,192 ranks: a column that grows with N shows a b well above zero.

--files N: ImageFolder's walk of N empty images and 04's data_identity() (their names' sha256),
against a stat of each (what settings() did before issue #50).
"""

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
RUN = ["--arch", "shufflenet_v2_x0_5", "--image-size", "32", "--batch-size", "2"]
RUN += ["--val-size", "0", "--log-every", "100000", "--save-every", "100000", "--timeout", "120"]


def load_04(path):
    spec = importlib.util.spec_from_file_location("checkpoint_04", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# before the fork: each rank starts with it imported (SCALE_SCRIPT: another version's, to compare)
SCRIPT_PATH = os.environ.get("SCALE_SCRIPT", REPO / "04_checkpoint.py")
SCRIPT = load_04(SCRIPT_PATH)


class CountingStore(dist.Store):
    """A store that counts the operations that reach it, and passes them on."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.ops = 0

    def count(self, name, *args):
        self.ops += 1
        return getattr(self.inner, name)(*args)

    def set(self, key, value):
        return self.count("set", key, value)

    def get(self, key):
        return self.count("get", key)

    def add(self, key, value):
        return self.count("add", key, value)

    def check(self, keys):
        return self.count("check", keys)

    def multi_get(self, keys):
        return self.count("multi_get", keys)

    def multi_set(self, keys, values):
        return self.count("multi_set", keys, values)

    def compare_set(self, key, expected, desired):
        return self.count("compare_set", key, expected, desired)

    def delete_key(self, key):
        return self.count("delete_key", key)

    def wait(self, keys, timeout=None):
        return self.count("wait", keys) if timeout is None else self.count("wait", keys, timeout)

    def num_keys(self):
        return self.count("num_keys")

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def written():
    """Bytes this process has written so far (files, pipes and sockets)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


def rank_process(rank, world, port, argv, results, started):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CUDA_VISIBLE_DEVICES="",
    )
    torch.set_num_threads(1)  # many ranks share few cores
    limit = datetime.timedelta(seconds=120)
    store = CountingStore(dist.TCPStore("127.0.0.1", port, world, rank == 0, limit))
    SCRIPT.attempt_store = lambda timeout: store
    marks = []  # (step, store operations, collectives, bytes written, seconds)
    reads = []  # the size of each checkpoint file this rank read

    def collectives():
        return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()

    enter = SCRIPT.Phases.enter

    def counted_enter(self, step, phase):
        if phase == "data" and (not marks or marks[-1][0] != step):
            marks.append((step, store.ops, collectives(), written(), time.monotonic() - started))
        enter(self, step, phase)

    read = SCRIPT.read_checkpoint

    def counted_read(path):
        reads.append(path.stat().st_size)
        return read(path)

    SCRIPT.Phases.enter = counted_enter
    SCRIPT.read_checkpoint = counted_read
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            SCRIPT.main(SCRIPT.build_parser().parse_args(argv))
        results.put((rank, marks, reads, None))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        results.put((rank, marks, reads, f"{type(e).__name__}: {e}"))
    results.close()
    results.join_thread()
    os._exit(0)


def run(world, argv, deadline=600):
    """04's main() on world ranks: each rank's (marks, reads), by rank."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    started = time.monotonic()
    ranks = [
        context.Process(target=rank_process, args=(r, world, port, argv, results, started))
        for r in range(world)
    ]
    for process in ranks:
        process.start()
    got = {}
    try:
        for _ in range(world):
            rank, marks, reads, error = results.get(timeout=deadline)
            if error:
                raise RuntimeError(f"rank {rank} of {world}: {error}")
            got[rank] = (marks, reads)
    finally:
        for process in ranks:
            process.join(5)
            if process.exitcode is None:
                process.kill()
                process.join()
    return got


def measure(world, folder, steps=8):
    """Rank-by-rank counts at one world size: a fresh run of steps steps (per step), then
    its resume (start-up)."""
    argv = [*RUN, "--checkpoint-dir", str(folder), "--train-size", str(2 * world * steps)]
    fresh = run(world, [*argv, "--epochs", "1"])
    resumed = run(world, [*argv, "--epochs", "2"])
    per_rank = []
    for rank in range(world):
        marks, _ = fresh[rank]
        first, last = marks[2], marks[-1]  # steps 2 to S-1: after the warm-up
        n = last[0] - first[0]
        window = [b - a for a, b in zip(first[1:], last[1:])]  # over n steps
        store_ops, collectives, wrote, seconds = [value / n for value in window]
        start_marks, reads = resumed[rank]
        _, start_ops, start_collectives, start_wrote, start_seconds = start_marks[0]
        per_rank.append(
            dict(
                steps=n,
                seconds=window[3],
                store_ops=store_ops,
                collectives=collectives,
                kb_written=wrote / 1024,
                ms=seconds * 1000,
                start_store_ops=start_ops,
                start_collectives=start_collectives,
                start_kb_written=start_wrote / 1024,
                checkpoint_reads=len(reads),
                checkpoint_mb_read=sum(reads) / 2**20,
                start_s=start_seconds,
            )
        )
    return per_rank


# (key, title, format, model): "linear" fits a + b*N; "ring" fits a + b*(N-1)/N: what each
# rank sends in a ring all-reduce (2(N-1)/N times the tensor) or, on average, in a broadcast
# ((N-1)/N times it): bounded, where a linear fit would extrapolate growth. "here": no fit.
# A time is this machine's (N ranks share its cores: a step's time grows with N); a step
# makes no store op by design (until session 23 each rank's phase, once a second).
COLUMNS = [
    ("store_ops", "store ops/step", "{:.2f}", "here"),
    ("store_ops_per_s", "store ops/s", "{:.2f}", "here"),
    ("collectives", "collectives/step", "{:.2f}", "linear"),
    ("kb_written", "KB written/step", "{:.0f}", "ring"),
    ("ms", "ms/step", "{:.0f}", "here"),
    ("start_store_ops", "start: store ops", "{:.0f}", "linear"),
    ("start_collectives", "start: collectives", "{:.0f}", "linear"),
    ("start_kb_written", "start: KB written", "{:.0f}", "ring"),
    ("checkpoint_reads", "start: checkpoint files read (all ranks)", "{:.0f}", "linear"),
    ("start_s", "start: s", "{:.1f}", "here"),
]


def fit(xs, values):
    """Least squares a + b*x."""
    mean_x = sum(xs) / len(xs)
    mean_v = sum(values) / len(values)
    var = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (v - mean_v) for x, v in zip(xs, values)) / var if var else 0.0
    return mean_v - b * mean_x, b


def x_of(n, model):
    return n if model == "linear" else (n - 1) / n


def summary(key, ranks):
    """One column's figure over the ranks: the mean; the job's total for the checkpoint
    reads; store ops a second over all ranks' measured steps (none since session 23; the
    phases, written at most once a second before, made a short window hold none or one)."""
    if key == "checkpoint_reads":
        return sum(r[key] for r in ranks)
    if key == "store_ops_per_s":
        return sum(r["store_ops"] * r["steps"] for r in ranks) / sum(r["seconds"] for r in ranks)
    return sum(r[key] for r in ranks) / len(ranks)


def table(rows):
    """rows: {world size: per-rank list}. A start-up cell where ranks differ gives rank 0's
    figure and the others' range; the fit is of the summaries."""
    sizes = sorted(rows)
    lines = ["| ranks | " + " | ".join(title for _, title, _, _ in COLUMNS) + " |"]
    lines.append("|---" * (len(COLUMNS) + 1) + "|")
    figures = {key: [summary(key, rows[n]) for n in sizes] for key, _, _, _ in COLUMNS}
    for i, n in enumerate(sizes):
        cells = []
        for key, _, form, _ in COLUMNS:
            cell = form.format(figures[key][i])
            if key in ("start_kb_written", "start_s"):
                first, others = rows[n][0][key], [r[key] for r in rows[n][1:]]
                low, high = form.format(min(others)), form.format(max(others))
                if (low, high) != (form.format(first),) * 2:
                    span = low if low == high else f"{low}-{high}"
                    cell = f"rank 0: {form.format(first)}, others: {span}"
            cells.append(cell)
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    for target in (1024, 8192):
        cells = []
        for key, _, form, model in COLUMNS:
            if model == "here":
                cells.append("")
                continue
            a, b = fit([x_of(n, model) for n in sizes], figures[key])
            cells.append(form.format(a + b * x_of(target, model)))
        lines.append(f"| fit at {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def files_benchmark(count):
    """ImageFolder's walk and data_identity() over count empty images in 100 class folders,
    and a stat of each for comparison."""
    root = Path(tempfile.mkdtemp(prefix="scale-files-"))
    try:
        for i in range(count):
            folder = root / "train" / f"class{i % 100:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i}.png").touch()
        os.sync()
        args = SCRIPT.build_parser().parse_args(["--data", str(root)])
        started = time.perf_counter()
        train_set = SCRIPT.image_folder(root / "train", None)
        walked = time.perf_counter()
        SCRIPT.data_identity(args, train_set)
        named = time.perf_counter()
        for path, _ in train_set.samples:
            os.path.getsize(path)
        statted = time.perf_counter()
    finally:
        shutil.rmtree(root)
    return walked - started, named - walked, statted - named


def main():
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=16, help="steps in the fresh run")
    parser.add_argument("--files", type=int, default=0, help="also time data_identity() on N files")
    parser.add_argument("--json", type=Path, help="also write every rank's counts here")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        for n in args.sizes:
            began = time.monotonic()
            rows[n] = measure(n, Path(tmp) / str(n), args.steps)
            print(f"{n} ranks: {time.monotonic() - began:.0f} s", file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.files:
        walk, names, stats = files_benchmark(args.files)
        print(
            f"\n{args.files} files: ImageFolder's walk {walk:.2f} s; data_identity() {names:.2f} s;"
            f" a stat of each (before #50) {stats:.2f} s"
        )


if __name__ == "__main__":
    main()
