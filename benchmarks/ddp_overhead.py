"""What does DDP cost? Training images/s of 03_ddp_train.py against its own upper bound.

  (a) bound:    the same model and per-process batch, N processes, gradient sync switched
                off, one batch already in memory (no sampler, loader or logging)
  (b) default:  03_ddp_train.py's default configuration, end to end
  (c) accum 4:  the same with --accum-steps 4 (one all-reduce per 4 micro-batches)
  (d) 1 proc:   03_ddp_train.py as a single process (all cores, batch --batch-size)

Ratios b/a and c/a say how much of the bound DDP plus the script's data and logging path
keep. Every clock is read after the GPU has finished its queued work (a synchronize in the
bound, and in 03 after each epoch's first step and at its end), and 03's training set grows
with the process count (16 steps per epoch, or as many as --seconds of the bound's work
where that is more: on a GPU), so the ratios mean the same at 2 processes or 8. The bound
uses 03's optimizer (SGD with momentum and weight decay) and, like 03 on GPUs,
cudnn.benchmark.

It also times what 04's forensics add to each micro-batch (issues #38, #49), measured alone
in the bound's processes, against the bound's step: its own Phases.enter() three times (a
clock read and a few assignments; the watchdog is its thread's, once a
second), and the same with Phases.slowest() (an all-reduce of a world-size x 2 table)
every 10 (the default --log-every).
Run from the repo root:

  python benchmarks/ddp_overhead.py                 # 2 processes on CPU (Gloo)
  python benchmarks/ddp_overhead.py --nproc 8       # one node of 8 GPUs (NCCL)

Results go to stdout and to benchmarks/results.json (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"summary: \d+ steps, ([\d.]+) img/s")


def bound_worker(args: argparse.Namespace) -> None:
    """Run under torchrun: local training only, no gradient all-reduce, data in memory."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torchvision

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # as 03 does on GPUs: fixed shapes, fastest kernels
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.arch, num_classes=10).to(device)
    # 03's optimizer: SGD with momentum, weight decay as 03's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(10, (args.batch_size,), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    def timed(steps: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()  # GPU work is queued: time what has finished
        dist.barrier()
        return time.perf_counter() - start

    timed(3)  # warm-up: allocations, cuDNN's algorithm search
    steps = args.steps
    if not steps:  # enough steps for --seconds of work (20 steps are 0.1 s on a fast GPU)
        per_step = timed(5) / 5
        wanted = torch.tensor([max(20, math.ceil(args.seconds / per_step))], device=device)
        dist.all_reduce(wanted, op=dist.ReduceOp.MAX)  # the same count on every rank
        steps = int(wanted)
    seconds = timed(steps)
    phases, lines = forensics(rank, device, 2000)
    if rank == 0:
        images = steps * args.batch_size * dist.get_world_size()
        print(f"bound: {images / seconds:.1f} img/s ({steps} steps in {seconds:.2f} s)")
        share = phases / (seconds / steps)
        print(f"phases: {phases * 1e6:.1f} us a micro-batch, {share:.3%} of a step")
        share = lines / (seconds / steps)
        print(f"with lines: {lines * 1e6:.1f} us a micro-batch, {share:.3%} of a step")
    dist.destroy_process_group()


def forensics(rank: int, device, micro_batches: int) -> tuple[float, float]:
    """Seconds a micro-batch spends in 04's forensics (its own Phases): the three enter()
    calls of each micro-batch (memory only; its thread watches once a second),
    and the same plus every 10th micro-batch its slowest() (an all-reduce of the world-size x
    2 table, at a progress line); the median of 5 timings each."""
    import argparse
    import faulthandler
    import importlib.util
    import statistics

    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("checkpoint", REPO / "04_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # (its dataclasses look their module up there)
    spec.loader.exec_module(script)  # the definitions only: no __main__ block
    d = argparse.Namespace(rank=rank, world_size=dist.get_world_size(), device=device)
    phases = script.Phases(d, timeout=3600.0)
    now = time.perf_counter

    def median_seconds(micro_batch) -> float:
        timings = []
        for _ in range(5):
            start = now()
            for i in range(micro_batches):
                micro_batch(i)
            timings.append((now() - start) / micro_batches)
        return statistics.median(timings)

    def enters(i: int) -> None:
        phases.enter(i, "data")
        phases.enter(i, "forward")
        phases.enter(i, "backward")

    def with_lines(i: int) -> None:
        enters(i)
        if i % 10 == 9:  # a progress line: every rank gathers the table
            phases.slowest()

    phase = median_seconds(enters)
    lines = median_seconds(with_lines)
    phases.done = True  # its thread ends, and with it the watchdog
    faulthandler.cancel_dump_traceback_later()
    return phase, lines


def run(cmd: list[str]) -> str:
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"benchmark step failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=0, help="timed steps of the bound (0: auto)")
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="auto: timed work per measurement, at least"
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results.json"))
    parser.add_argument("--bound-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bound_worker:
        return bound_worker(args)

    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
    ]
    shape = [
        "--arch",
        args.arch,
        "--image-size",
        str(args.image_size),
        "--batch-size",
        str(args.batch_size),
    ]
    timing = ["--steps", str(args.steps), "--seconds", str(args.seconds)]
    out = run(torchrun + [__file__, "--bound-worker"] + timing + shape)
    results = {"a_bound": float(re.search(r"bound: ([\d.]+) img/s", out)[1])}
    found = re.search(r"phases: ([\d.]+) us a micro-batch, ([\d.]+)% of a step", out)
    phases_us, phases_share = float(found[1]), float(found[2]) / 100
    found = re.search(r"with lines: ([\d.]+) us a micro-batch, ([\d.]+)% of a step", out)
    lines_us, lines_share = float(found[1]), float(found[2]) / 100
    # 03's epochs: 16 steps, or more where the bound shows that 16 take under --seconds (a
    # GPU), so that 03's own clock also measures seconds, not milliseconds
    global_batch = args.batch_size * args.nproc
    steps = max(16, math.ceil(args.seconds * results["a_bound"] / global_batch))
    data = ["--train-size", str(steps * global_batch)]
    for key, extra in (("b_default", []), ("c_accum4", ["--accum-steps", "4"])):
        out = run(torchrun + [str(REPO / "03_ddp_train.py")] + shape + data + extra)
        results[key] = float(SUMMARY.search(out)[1])
    out = run([sys.executable, str(REPO / "03_ddp_train.py")] + shape + data)
    results["d_one_process"] = float(SUMMARY.search(out)[1])
    results["b_over_a"] = round(results["b_default"] / results["a_bound"], 3)
    results["c_over_a"] = round(results["c_accum4"] / results["a_bound"], 3)

    import torch

    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, "
        + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
        + f", torch {torch.__version__}"
    )
    record = {
        "machine": machine,
        "nproc": args.nproc,
        "arch": args.arch,
        "image_size": args.image_size,
        "batch_size_per_process": args.batch_size,
        "images_per_s": results,
        "phases_us_per_micro_batch": phases_us,
        "phases_share_of_a_bound_step": phases_share,
        "with_lines_us_per_micro_batch": lines_us,
        "with_lines_share_of_a_bound_step": lines_share,
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"\n{machine}; {args.nproc} processes, {args.arch} {args.image_size}px, "
        f"batch {args.batch_size} per process"
    )
    for label, key in (
        ("(a) bound, no gradient sync", "a_bound"),
        ("(b) 03 default", "b_default"),
        ("(c) 03 --accum-steps 4", "c_accum4"),
        ("(d) 03 one process", "d_one_process"),
    ):
        print(f"  {label:<30} {results[key]:8.1f} img/s")
    print(f"  b/a = {results['b_over_a']:.3f}   c/a = {results['c_over_a']:.3f}")
    print(f"  phases: {phases_us:.1f} us a micro-batch, {phases_share:.3%} of a bound step")
    print(f"  with lines: {lines_us:.1f} us a micro-batch, {lines_share:.3%} of a bound step")
    print(f"(written to {args.out})")


if __name__ == "__main__":
    main()
