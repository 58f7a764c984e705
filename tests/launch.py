"""One way to start the scripts under test: as real processes, with a deadline.

Every launch gets a timeout; when it expires the whole process tree (torchrun agent,
its workers, mp.spawn children) is killed with SIGKILL and the test fails, so a hang
costs one test its deadline instead of costing CI its run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@dataclass
class Run:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def __str__(self) -> str:
        return (f"$ {' '.join(self.cmd)}\nexit {self.returncode} after {self.seconds:.1f}s\n"
                f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-4000:]}")

    def ok(self) -> Run:
        assert self.returncode == 0, f"expected success:\n{self}"
        return self

    def failed(self) -> Run:
        assert self.returncode != 0, f"expected a failure:\n{self}"
        return self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    for pid in _descendants(proc.pid) + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"):
        if env is None or name not in env:
            full_env.pop(name, None)  # a test decides the launcher, not the outer shell
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def finish(proc: subprocess.Popen, cmd: list[str], timeout: float, started: float) -> Run:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"launch timed out after {timeout}s and was killed:\n"
                    f"{Run(cmd, -9, out, err, time.monotonic() - started)}")
    finally:
        kill_tree(proc)  # nothing outlives its test, even on success
    return Run(cmd, proc.returncode, out, err, time.monotonic() - started)


def command(script: str, args=(), launcher: str = "single", nproc: int = 2) -> list[str]:
    path = str(REPO / script)
    if launcher == "single":
        return [PYTHON, path, *args]
    if launcher == "spawn":
        return [PYTHON, path, "--spawn", str(nproc), *args]
    if launcher == "torchrun":
        return [PYTHON, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(nproc), path, *args]
    raise ValueError(launcher)


def run(script: str, *args: str, launcher: str = "single", nproc: int = 2,
        timeout: float = 120, env: dict | None = None) -> Run:
    cmd = command(script, [str(a) for a in args], launcher, nproc)
    started = time.monotonic()
    return finish(start(cmd, env), cmd, timeout, started)


def run_many(cmds: list[list[str]], timeout: float = 120, envs=None) -> list[Run]:
    """Start several commands at once (ranks of one job, agents of one rendezvous)."""
    started = time.monotonic()
    procs = [start(c, (envs or [None] * len(cmds))[i]) for i, c in enumerate(cmds)]
    deadline = started + timeout
    runs = []
    for proc, cmd in zip(procs, cmds):
        try:
            runs.append(finish(proc, cmd, max(1.0, deadline - time.monotonic()), started))
        except BaseException:
            for p in procs:
                kill_tree(p)
            raise
    return runs


def load_script(script: str):
    """Import a script as a module (its __main__ block does not run): for argument checks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(script).stem.lstrip("0123456789_"),
                                                  REPO / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
