"""How the tests start the scripts: as real processes, with a deadline. run() and Watched
launch them as a user would (torchrun, --spawn, `python script.py`); forked() runs them in
processes forked from a server that has imported torch already (tests/forked.py).

Every launch gets a timeout; when it expires the whole process tree (torchrun agent,
its workers, mp.spawn children) is killed with SIGKILL and the test fails, so a hang
costs one test its deadline instead of costing CI its run.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# what a launcher sets; a test decides the launcher, not the outer shell
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@dataclass
class Run:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    tail: int | None = 4000  # a failure's message shows stderr's last characters (None: all)

    def __str__(self) -> str:
        stderr = self.stderr if self.tail is None else self.stderr[-self.tail :]
        return (
            f"$ {' '.join(self.cmd)}\nexit {self.returncode} after {self.seconds:.1f}s\n"
            f"--- stdout\n{self.stdout}\n--- stderr\n{stderr}"
        )

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


def kill_tree(proc) -> None:
    """SIGKILL a process (a Popen or a multiprocessing Process) and all its descendants."""
    for pid in _descendants(proc.pid) + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# A forked rank past its deadline dumps every thread's stack on this signal (tests/forked.py),
# so that a hang's failure says where each rank and worker was.
STACKS_SIGNAL = signal.SIGUSR2


def dump_stacks(procs, err_files: list[Path]) -> None:
    """Asks each process still running, then each of its descendants that catches
    STACKS_SIGNAL (a forked one: not a process that mp.spawn or torchrun started afresh, which
    it would kill), for its stacks. Two waves, each until the files they write to have stopped
    growing (at most 3 s): a rank's stacks come whole, before its DataLoader workers', which
    write at once (each repeats its rank's frames up to the fork)."""
    ranks = [proc.pid for proc in procs if proc.exitcode is None]
    for wave in (ranks, [pid for rank in ranks for pid in _descendants(rank)]):
        for pid in wave:
            try:
                with open(f"/proc/{pid}/status") as f:
                    caught = next(line for line in f if line.startswith("SigCgt:"))
                if int(caught.split()[1], 16) >> (STACKS_SIGNAL - 1) & 1:
                    os.kill(pid, STACKS_SIGNAL)
            except (OSError, StopIteration):  # gone already
                pass
        sizes = None
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            now = [path.stat().st_size if path.exists() else 0 for path in err_files]
            if now == sizes:
                break
            sizes = now
            time.sleep(0.2)  # (polling the files, not waiting for the processes)


# The signals the scripts end on (their STOP_SIGNALS): every launch, and every forked rank,
# starts with their default action (or ignores those a test names), whatever the session had.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def start(
    cmd: list[str], env: dict | None = None, gpu: bool = False, ignore=(), cpus=None
) -> subprocess.Popen:
    """gpu=False (the CPU lane) hides CUDA from the launch, so --backend auto means Gloo
    even on a machine with GPUs; the GPU lane (tests/test_gpu.py) passes gpu=True. The
    launch starts with the default action for STOP_SIGNALS, whatever the
    test session inherited (a background job of a shell ignores SIGINT), but for the
    signals in ignore, which it ignores (as under nohup). cpus: the cores it may run on."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if not gpu:
        full_env["CUDA_VISIBLE_DEVICES"] = ""
    for name in LAUNCH_VARS:
        if env is None or name not in env:
            full_env.pop(name, None)

    def dispositions() -> None:  # in the child, before exec: not those of a background shell
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig in ignore else signal.SIG_DFL)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return subprocess.Popen(
        cmd,
        preexec_fn=dispositions,
        cwd=REPO,
        env=full_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, cmd: list[str], timeout: float, started: float) -> Run:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(
            f"launch timed out after {timeout}s and was killed:\n"
            f"{Run(cmd, -9, out, err, time.monotonic() - started)}"
        )
    finally:
        kill_tree(proc)  # nothing outlives its test, even on success
    return Run(cmd, proc.returncode, out, err, time.monotonic() - started)


def command(script: str, args=(), launcher: str = "single", nproc: int = 2, extra=()) -> list[str]:
    """extra: options for torchrun itself, such as ("--max-restarts", 1). The "agent"
    launcher is one node's torchrun in a multi-node job: extra names its rendezvous."""
    path = str(REPO / script)
    if launcher == "single":
        return [PYTHON, path, *args]
    if launcher == "spawn":
        return [PYTHON, path, "--spawn", str(nproc), *args]
    if launcher == "torchrun":
        return [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            *map(str, extra),
            path,
            *args,
        ]
    if launcher == "bash":  # script: a shell script (a README's batch script, say)
        return ["bash", path, *args]
    if launcher == "agent":
        return [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            *map(str, extra),
            path,
            *args,
        ]
    raise ValueError(launcher)


def run(
    script: str,
    *args: str,
    launcher: str = "single",
    nproc: int = 2,
    timeout: float = 120,
    env: dict | None = None,
    extra=(),
    gpu: bool = False,
    file_size_kb: int | None = None,
) -> Run:
    """launcher "forked": forked() below, for tests that try several launchers.
    file_size_kb: ulimit -f for the launch, so a write past it fails part-way as on a full
    disk (Python ignores SIGXFSZ: write() fails with EFBIG where a full disk gives ENOSPC)."""
    if launcher == "forked":
        assert not extra and not gpu, "a forked run is neither"
        return forked(
            script, *args, nproc=nproc, timeout=timeout, env=env, file_size_kb=file_size_kb
        )
    cmd = command(script, [str(a) for a in args], launcher, nproc, extra)
    if file_size_kb:
        cmd = ["bash", "-c", f'ulimit -f {file_size_kb} && exec "$0" "$@"', *cmd]
    started = time.monotonic()
    return finish(start(cmd, env, gpu), cmd, timeout, started)


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


_forkserver = None


def forkserver():
    """A multiprocessing forkserver that has imported tests/forked.py (torch, torchvision and
    what the scripts import), started once per test session, with CUDA hidden: the CPU
    lane. Its imports run in the background: forked() waits for them."""
    global _forkserver
    if _forkserver is None:
        import multiprocessing.forkserver

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["forked"])
        # The server's environment, from its start on: the CPU lane's, and this folder on
        # its path (Python 3.11's forkserver ignores the sys.path it is given).
        server_env = {
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")])
            ),
        }
        saved = {name: os.environ.get(name) for name in server_env}
        os.environ.update(server_env)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
        _forkserver = context
    return _forkserver


def _forked_rank(*args) -> None:
    import forked  # already imported by the forkserver this process was forked from

    forked.child(*args)


def forked(
    script: str,
    *args,
    nproc: int = 1,
    nnodes: int = 1,
    timeout: float = 120,
    env: dict | None = None,
    file_size_kb: int | None = None,
) -> Run:
    """Run the script in nproc fresh processes forked from one that has imported torch,
    torchvision and the scripts (tests/forked.py says why): with nproc 1 as `python script`
    would, else as torchrun's workers would, on env:// (as nnodes nodes of nproc / nnodes
    processes, local ranks and node ranks included). Every rank runs to its own end (a
    rank whose peer failed ends in its own error, or at its --timeout); the returncode is the
    first non-zero exit code in rank order, else 0. stdout and stderr are every rank's, in
    rank order. file_size_kb: as run()'s."""
    context = forkserver()
    argv = [str(a) for a in args]
    cmd = [f"forked x{nproc}:", str(script), *argv]
    ranks, port = {}, str(free_port())
    if nproc > 1:  # one process: no launcher's variables, as for `python script.py`
        per_node = nproc // nnodes
        ranks = {
            rank: dict(
                RANK=str(rank),
                LOCAL_RANK=str(rank % per_node),
                GROUP_RANK=str(rank // per_node),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(per_node),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
            for rank in range(nproc)
        }
    base = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARS}
    base.update(CUDA_VISIBLE_DEVICES="", **(env or {}))
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        folder = Path(tmp)
        procs = [
            context.Process(
                target=_forked_rank,
                args=(
                    script,
                    argv,
                    {**base, **ranks.get(rank, {})},
                    str(folder / f"{rank}.out"),
                    str(folder / f"{rank}.err"),
                    file_size_kb,
                ),
            )
            for rank in range(nproc)
        ]
        started = time.monotonic()

        def result(code: int) -> Run:
            read = lambda suffix: "".join(
                (folder / f"{rank}.{suffix}").read_text()
                for rank in range(nproc)
                if (folder / f"{rank}.{suffix}").exists()
            )
            return Run(cmd, code, read("out"), read("err"), time.monotonic() - started)

        try:
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(max(0.0, started + timeout - time.monotonic()))
            if any(proc.exitcode is None for proc in procs):
                dump_stacks(procs, [folder / f"{rank}.err" for rank in range(nproc)])
                hung = result(-9)
                hung.tail = None  # all of stderr: each rank's stacks, then its workers'
                pytest.fail(f"forked run timed out after {timeout}s and was killed:\n{hung}")
        finally:  # killed at the deadline, or if starting one of them failed
            for proc in procs:
                if proc.pid is not None and proc.exitcode is None:
                    kill_tree(proc)
                    proc.join()
        return result(next((proc.exitcode for proc in procs if proc.exitcode != 0), 0))


class Watched:
    """A launch whose output the test reads while it runs, to act at a given moment (kill a
    worker after a checkpoint, say). It has a deadline like any other launch."""

    def __init__(
        self,
        script: str,
        *args,
        launcher: str = "single",
        nproc: int = 2,
        timeout: float = 120,
        env: dict | None = None,
        extra=(),
        ignore=(),
        cpus=None,
    ):
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        if launcher == "forked":  # one process, as `python script` (forked(): no import wait)
            assert not extra and cpus is None, "a forked watch is one process, no launcher"
            self.cmd = ["forked x1:", str(script), *map(str, args)]
            self.proc = _ForkedProcess(script, [str(a) for a in args], env, ignore)
        else:
            self.cmd = command(script, [str(a) for a in args], launcher, nproc, extra)
            self.proc = start(self.cmd, env, ignore=ignore, cpus=cpus)
        self.lines: queue.Queue = queue.Queue()
        self.err_lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(
                target=self._read, args=(self.proc.stdout, self.out, self.lines), daemon=True
            ),
            threading.Thread(
                target=self._read, args=(self.proc.stderr, self.err, self.err_lines), daemon=True
            ),
        ]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, into: list, lines) -> None:
        for line in stream:
            into.append(line)
            lines.put(line)
        lines.put(None)

    def _run(self, returncode: int) -> Run:
        return Run(
            self.cmd,
            returncode,
            "".join(self.out),
            "".join(self.err),
            time.monotonic() - self.started,
        )

    def wait_for(self, text: str, stderr: bool = False) -> str:
        """Block until a stdout (or stderr) line contains text; fail at the deadline or exit."""
        lines = self.err_lines if stderr else self.lines
        while True:
            try:
                line = lines.get(timeout=max(0.0, self.deadline - time.monotonic()))
            except queue.Empty:
                kill_tree(self.proc)
                pytest.fail(f"no line with {text!r} before the deadline:\n{self._run(-9)}")
            if line is None:
                self.proc.wait()
                pytest.fail(f"exited before printing {text!r}:\n{self._run(self.proc.returncode)}")
            if text in line:
                return line

    def pids_with_env(self, name: str, value: str) -> list[int]:
        """Descendant processes whose environment has name=value (a worker by its RANK)."""
        wanted, found = f"{name}={value}".encode(), []
        for pid in _descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if wanted in f.read().split(b"\0"):
                        found.append(pid)
            except OSError:
                continue
        return found

    def pids_with_cmdline(self, text: str) -> list[int]:
        """Descendant processes whose command line contains text (mp.spawn's: "spawn_main")."""
        found = []
        for pid in _descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(pid)
            except OSError:
                continue
        return found

    def finish(self) -> Run:
        try:
            self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            self.proc.wait()
            pytest.fail(f"launch timed out and was killed:\n{self._run(-9)}")
        finally:
            kill_tree(self.proc)
        for reader in self.readers:
            reader.join(timeout=10)
        return self._run(self.proc.returncode)


class _ForkedProcess:
    """A Watched launch's process, forked from the forkserver as forked() forks a rank, with
    what Watched uses of a Popen: pid, wait(), poll(), returncode, and stdout and stderr to read
    line by line (FIFOs: the child opens them as its files 1 and 2)."""

    def __init__(self, script: str, argv: list[str], env: dict | None, ignore) -> None:
        folder = Path(tempfile.mkdtemp(prefix="forked-watch-"))
        fifos = [folder / "out", folder / "err"]
        for fifo in fifos:
            os.mkfifo(fifo)
        base = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARS}
        base.update(CUDA_VISIBLE_DEVICES="", **(env or {}))
        self.process = forkserver().Process(
            target=_forked_rank,
            args=(script, argv, base, str(fifos[0]), str(fifos[1]), None, tuple(ignore)),
        )
        self.process.start()
        self.stdout, self.stderr = map(_fifo_lines, fifos)  # read by Watched's threads

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("forked run", timeout)
        return self.process.exitcode


def _fifo_lines(fifo: Path):
    """The lines written into fifo; its open waits for the writer's (in a reader thread)."""
    with open(fifo, encoding="utf-8") as f:
        fifo.unlink(missing_ok=True)  # both ends are open: the name is not needed
        with contextlib.suppress(OSError):  # the second of the two empties the folder
            fifo.parent.rmdir()
        yield from f


def wait_for_any(jobs: list[Watched], text: str) -> Watched:
    """The first of several launches whose stdout shows text (say, the node rank 0 is on)."""
    deadline = min(job.deadline for job in jobs)
    while time.monotonic() < deadline:
        for job in jobs:
            try:
                line = job.lines.get(timeout=0.05)
            except queue.Empty:
                continue
            if line is None:
                job.proc.wait()
                pytest.fail(f"exited before printing {text!r}:\n{job._run(job.proc.returncode)}")
            if text in line:
                return job
    for job in jobs:
        kill_tree(job.proc)
    pytest.fail(f"no launch printed {text!r} before the deadline")


# Edits a user makes to 03 (edited_copy): a layer, a compiled model, SyncBatchNorm, DDP's knobs
UNUSED, COMPILE, SYNC_BN = "unused layer", "compiled", "SyncBatchNorm"
# float64 in every rank of a run (the scripts take torch's default dtype): env=FLOAT64
FLOAT64 = {"PYTHONPATH": str(REPO / "tests" / "float64")}
STATIC, FIND = "static_graph=True", "find_unused_parameters=True"
VIEW, SMALL_BUCKETS = "gradient_as_bucket_view=True", "bucket_cap_mb=1"
DDP_ARGUMENT = "\n        # DDP's knobs, none passed"  # 03 lists them there
STATIC_FIRST_STEP = [  # (03's line, NOTES.md's)
    ("for _ in range(steps):", "for i in range(steps):"),
    (
        "sync = k == args.accum_steps - 1\n",
        "sync = k == args.accum_steps - 1 or (model.static_graph and i == 0)\n",
    ),
]


def edited_copy(folder: Path, *edits: str) -> Path:
    """A copy of 03_ddp_train.py in folder, edited as a user would edit it: UNUSED adds a
    layer that forward never calls (its parameters never get a gradient), COMPILE compiles
    the model before DDP (aot_eager: no C compiler needed), where 03's main marks the place,
    SYNC_BN takes the line 03's build_model() shows as a comment (GPUs only); any other edit
    is an argument of DDP's (STATIC, say), where 03 lists them. STATIC also takes NOTES.md's
    condition for it: the first step's micro-batches all sync."""
    script = "03_ddp_train.py"
    source = (REPO / script).read_text()
    lines = {
        UNUSED: ("\n    return model\n", "\n    model.unused_layer = nn.Linear(8, 8)"),
        SYNC_BN: (
            "\n    return model\n",
            "\n    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)",
        ),
        COMPILE: (
            "\n    # torch.compile: model.compile() here",
            '\n    model.compile(backend="aot_eager")',
        ),
    }
    for edit in edits:
        anchor, line = lines.get(edit, (DDP_ARGUMENT, f"\n        {edit},"))
        assert source.count(anchor) == 1, anchor
        source = source.replace(anchor, line + anchor)
    if STATIC in edits:  # and NOTES.md's lines for it ("static_graph with no_sync")
        for anchor, line in STATIC_FIRST_STEP:
            assert source.count(anchor) == 1, anchor
            source = source.replace(anchor, line)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / script).write_text(source)
    return folder / script


def inserted_copy(path: Path, script: str, anchor: str, lines: str, after: bool = False):
    """A copy of script at path, lines inserted before anchor (after it, with after=True),
    which must occur once: a test's edit of a script (a sleep, a stuck rank)."""
    source = (REPO / script).read_text()
    assert source.count(anchor) == 1, anchor
    path.write_text(source.replace(anchor, anchor + lines if after else lines + anchor))
    return path


def stuck_copy(tmp_path: Path, case: str, rank: int = 2) -> Path:
    """04, but one rank goes wrong at step 2 (state.step 2: its third step, or the progress
    line after its second), as the issue's hang cases:
    - "data", "forward": it never returns from its data loading, or its forward (after it
      entered that phase), as a rank blocked on a file or a lock;
    - "frozen": it stops whole (SIGSTOP, after it entered its data phase), as a hung machine;
    - "skip": it skips the progress line after step 2 and its collectives, as a rank whose
      code takes another branch."""
    script = "04_checkpoint.py"
    if case == "skip":
        line = "if state.step % args.log_every == 0:\n"  # (-> elif)
        skip = f"if d.rank == {rank} and state.step == 2:\n            pass\n        el"
        return inserted_copy(tmp_path / "stuck.py", script, line, skip)
    source = (REPO / script).read_text()
    phase = "data" if case == "frozen" else case
    enter = re.search(rf'\n( +)phases\.enter\(step, "{phase}"\).*\n', source)
    indent = enter[1]
    stop = "os.kill(os.getpid(), signal.SIGSTOP)" if case == "frozen" else "time.sleep(120)"
    stuck = f"{indent}if d.rank == {rank} and state.step == 2:\n{indent}    {stop}\n"
    return inserted_copy(tmp_path / "stuck.py", script, enter[0], stuck, after=True)


def stuck_line(rank: int, seconds: int, where: str, folder: Path) -> str:
    """The line 04's watchdog writes for a rank it ends: the phase the rank stayed in, and the
    file in the checkpoint folder that holds its stacks."""
    return f"[rank {rank}] stuck for {seconds} s in {where} ({folder}/stacks_rank_{rank})"


def stopped(line: str, sig: str) -> bool:
    """Whether line is run_rank's for a rank that sig ended through stop()."""
    return re.fullmatch(rf"\[rank \d+\] stopped by {sig}", line) is not None


def load_script(script: str):
    """Import a script as a module (its __main__ block does not run): for argument checks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        Path(script).stem.lstrip("0123456789_"), REPO / script
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# For the plumbing's promise that exit hooks run although every rank ends with os._exit:
# imported by every Python process started with PYTHONPATH pointing at its folder, each
# rank (RANK is set by then) writes a file from an atexit hook, as a logger's finish would.
EXIT_HOOK = """
import atexit, os

def _finish():
    if "RANK" in os.environ:
        with open(os.path.join(os.environ["EXIT_HOOK_DIR"], "rank" + os.environ["RANK"]), "w") as f:
            f.write("finished")

atexit.register(_finish)
"""


def exit_hook_env(folder) -> dict:
    (folder / "sitecustomize.py").write_text(EXIT_HOOK)
    return {"PYTHONPATH": str(folder), "EXIT_HOOK_DIR": str(folder)}


def hooks_that_ran(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("rank*") if p.read_text() == "finished")
