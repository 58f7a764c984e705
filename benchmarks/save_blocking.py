"""How long does a checkpoint save stop training? 04_checkpoint.py's save, inline against
background, on 03's model (ResNet-18 and SGD's momentum: about 90 MB).

  inline:      save() and then writer.finish(): the training thread copies the state, serialises
               it, writes, syncs and renames it, and only then takes its next step
  background:  save() alone: the training thread serialises the state and starts a thread
               that writes it while training goes on (writer.finish() is only waited for at
               the next save, long after)

Both call 04's own save() and Writer in a one-process Gloo group on this machine, into a fresh
folder under --dir (default: a temporary one, on the disk a real job would use if you
pass it). Also measured: training steps (batch --batch-size) while a background write
runs, against the same steps without one, since the writing thread shares the CPU.
Run from the repo root:

  python benchmarks/save_blocking.py
  python benchmarks/save_blocking.py --dir /scratch/ckpt --repeats 10
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


def load_04():
    spec = importlib.util.spec_from_file_location("checkpoint04", REPO / "04_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind (default: 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="for the steps (default: 32)")
    options = parser.parse_args()
    m = load_04()
    folder = Path(tempfile.mkdtemp(dir=options.dir)) / "checkpoints"
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29_000 + os.getpid() % 1000))
    cuda = torch.cuda.is_available()  # on a GPU: the model, its steps and its state there
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(60))
    args = m.build_parser().parse_args(["--checkpoint-dir", str(folder), "--keep", "2"])
    d = argparse.Namespace(rank=0, world_size=1, device=device)  # as 04's setup() returns it
    args.global_batch = d.world_size * args.batch_size * args.accum_steps  # as 04's main() sets it
    shape = {"--arch": args.arch}  # what 04 keeps of the run's settings (any dict will do)
    m.lock(folder)  # as rank 0 does at start: makes the folder, holds its lock
    writer = m.Writer()
    model = m.build_model(args, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, 1000)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    state = m.TrainState(model, optimizer, scheduler, scaler)
    images = torch.randn(options.batch_size, 3, 32, 32, device=device)
    labels = torch.randint(10, (options.batch_size,), device=device)

    def step() -> None:
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        if cuda:
            torch.cuda.synchronize()  # a step is timed until its GPU work has run

    def timed(action) -> float:
        started = time.perf_counter()
        action()
        return time.perf_counter() - started

    for _ in range(3):  # warm-up: allocator, first writes
        step()
    m.save(state, writer, args, d, shape)
    writer.finish()
    inline, background, busy, quiet, cost = [], [], [], [], []
    for _ in range(options.repeats):
        step()
        inline.append(timed(lambda: (m.save(state, writer, args, d, shape), writer.finish())))
        step()
        background.append(timed(lambda: m.save(state, writer, args, d, shape)))
        steps = 0
        started = time.perf_counter()
        while writer.thread.is_alive():  # training goes on while the thread writes
            step()
            steps += 1
        busy.append((time.perf_counter() - started) / max(steps, 1))
        writer.finish()
        quiet.append(statistics.median(timed(step) for _ in range(3)))
        # what the save cost training: its blocking, and the steps it slowed
        cost.append(background[-1] + steps * (busy[-1] - quiet[-1]))
    size = max(folder.glob("step-*.pt")).stat().st_size / 1e6
    inline_s, background_s = statistics.median(inline), statistics.median(background)
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, {torch.cuda.get_device_name(0) if cuda else 'no GPU'}; "
        f"checkpoint {size:.0f} MB in {folder.parent}"
    )
    print(f"inline save blocks     {1000 * inline_s:8.1f} ms  (median of {options.repeats})")
    print(
        f"background save blocks {1000 * background_s:8.1f} ms  = "
        f"{100 * background_s / inline_s:.1f}% of inline"
    )
    print(
        f"a training step: {1000 * statistics.median(quiet):.1f} ms alone, "
        f"{1000 * statistics.median(busy):.1f} ms while the thread writes"
    )
    print(f"a background save costs training {1000 * statistics.median(cost):.1f} ms in all")
    os._exit(0)  # no interpreter shutdown with a process group alive (NOTES.md)


if __name__ == "__main__":
    main()
