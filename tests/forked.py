"""The far side of launch.forked(): imported once, by a multiprocessing forkserver that the
test session starts; every forked run's processes are copies of it.

Importing it pays the start-up a fresh launch pays every time (about 5 s of `import torch,
torchvision` per process on a 2-core CPU, more than most runs' work): torch, torchvision and
what the six scripts import are loaded here, once. child() is then what each forked rank
runs: the script itself, as `python script.py ARGS` would run it (runpy, as __main__), in a
fresh process whose stdout and stderr go to files. How processes are started is what the
launcher tests prove (real torchrun, mp.spawn and plain `python script.py` launches); a
forked rank is a real, separate process with its own process group over env://, like a
torchrun worker.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing
import os
import resource
import runpy
import signal
import sys
import time

import torch  # noqa: F401  (imported here so that no forked run pays for it)
import torch.distributed as dist
import torchvision  # noqa: F401  (imported here so that no forked run pays for it)

from launch import REPO, STACKS_SIGNAL, STOP_SIGNALS, load_script

for path in sorted(REPO.glob("0*.py")):
    load_script(path.name)  # what the scripts import is imported now, once


def child(
    script: str, argv: list[str], env: dict, out: str, err: str, file_size_kb=None, ignore=()
) -> None:
    """script: a path, relative to the repository or absolute (a test's edited copy).
    file_size_kb: as launch.run's (ulimit -f); ignore: signals ignored, as launch.start's."""
    if file_size_kb:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_kb * 1024,) * 2)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    # as PYTHONUNBUFFERED=1 does for a launch: a rank that is killed has written its lines
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)
    # the default action for these, whatever the test session inherited (a background job
    # of a shell ignores SIGINT), as launch.start() gives a launch
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN if sig in ignore else signal.SIG_DFL)
    # a run past its deadline is asked for every thread's stack, this rank's and its DataLoader
    # workers' (they inherit the handler), before it is killed: launch.STACKS_SIGNAL
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    os.environ.clear()  # the environment a launch from the test would have, not the server's
    os.environ.update(env)
    # a sitecustomize on the run's PYTHONPATH (a test's exit hooks), as a fresh interpreter
    # would import it at start-up
    for folder in env.get("PYTHONPATH", "").split(os.pathsep):
        if folder and os.path.exists(os.path.join(folder, "sitecustomize.py")):
            runpy.run_path(os.path.join(folder, "sitecustomize.py"))
            break
    # multiprocessing's default start method (DataLoader workers use it), not the inherited
    # forkserver's
    multiprocessing.set_start_method(None, force=True)
    # 04's watchdog kills a stuck rank's DataLoader workers: each shows its stacks first, so
    # that a hang in a worker says where (tests/README.md: a worker's hang seen twice)
    multiprocessing.process.BaseProcess.kill = kill_after_stacks
    # what a fresh process reads from its environment on import, read again from the run's
    dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG
    sys.argv = [str(REPO / script), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")  # its __main__ block ends the process


KILL = multiprocessing.process.BaseProcess.kill


def kill_after_stacks(process) -> None:
    """Process.kill, after the process has had a second to write every thread's stack (it
    inherited the STACKS_SIGNAL handler from its forked rank)."""
    try:
        os.kill(process.pid, STACKS_SIGNAL)
        time.sleep(1)
    except OSError:  # gone already
        pass
    KILL(process)
