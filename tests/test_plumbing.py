"""The shared plumbing's promises about failures and exits, on real launches (forked ranks
for the pasted bug).

A bug in code a user pasted into a script keeps its traceback; an expected failure stays
one line per rank; the program's own exit hooks (atexit) run although every rank ends
with os._exit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from launch import (
    LAUNCH_VARS,
    PYTHON,
    REPO,
    Watched,
    exit_hook_env,
    forked,
    hooks_that_ran,
    inserted_copy,
    stopped,
)

# A model a user pasted into 03: its forward has a shape bug.
PASTED_MODEL = """
class PastedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(x.reshape(len(x), 3, -1))  # BUG: flattened per channel, not per image

"""


# After a clean run the exit hooks ran on every rank: asserted on 01's torchrun launch
# (tests/test_01_init_methods.py), with launch.exit_hook_env.


def test_a_bug_in_pasted_code_keeps_its_traceback_on_every_rank(tmp_path):
    source = (REPO / "03_ddp_train.py").read_text()
    anchor = "def build_model(args, num_classes):\n"
    assert anchor in source
    script = tmp_path / "my_train.py"
    script.write_text(source.replace(anchor, PASTED_MODEL + anchor + "    return PastedModel()\n"))
    bug_line = (
        script.read_text()
        .splitlines()
        .index(
            "        return self.fc(x.reshape(len(x), 3, -1))  # BUG: flattened per channel, "
            "not per image"
        )
        + 1
    )
    # forked ranks (launch.forked) run the edited copy as `python my_train.py` would; the
    # exit hooks after a failure are the next test's
    r = forked(
        script,
        "--image-size",
        16,
        "--train-size",
        32,
        "--val-size",
        0,
        "--batch-size",
        8,
        "--epochs",
        1,
        "--timeout",
        "60",
        nproc=2,
    )
    assert r.returncode == 1, r
    # On each rank (stderr is rank 0's, then rank 1's): the traceback points at the user's
    # line, then one summary line names the rank and the exception type. torch's own words
    # after the type are not asserted: they change between versions (2.15 added "addmm: ").
    user_line = f'File "{script}", line {bug_line}, in forward'
    assert r.stderr.count(user_line) == 2, r
    position = 0
    for rank in (0, 1):
        traceback_at = r.stderr.index(user_line, position)
        summary = re.compile(rf"^\[rank {rank}\] error: [A-Za-z_.]+: \S.*$", re.M)
        line = summary.search(r.stderr, traceback_at)
        assert line, r
        position = line.end()


def test_a_peer_that_crashes_ends_the_other_in_one_line_even_inside_backward(tmp_path):
    # Rank 1 dies (os._exit: an OOM kill, say) as rank 0 runs step 2's backward, where DDP's
    # gradient all-reduce meets the lost peer: Gloo's error surfaces in torch.autograd's
    # frames, not torch.distributed's, and used to keep a traceback as a bug would.
    anchor = "                    logits = model(images)\n"
    crash = "                    if d.rank == 1 and state.step == 2:\n"
    crash += "                        os._exit(9)  # a crash: no line\n"
    script = inserted_copy(tmp_path / "crash.py", "03_ddp_train.py", anchor, crash)
    args = ["--train-size", 384, "--val-size", 0, "--image-size", 16, "--batch-size", 16]
    r = forked(script, *args, "--epochs", 1, "--timeout", 10, nproc=2)
    assert r.returncode == 1, r  # rank 0's (rank 1's 9 comes second)
    [line] = r.stderr.strip().splitlines()
    assert re.fullmatch(r"\[rank 0\] error: RuntimeError: .*gloo.*(peer|Connection).*", line), r


def test_an_expected_failure_stays_one_line_without_a_traceback(tmp_path):
    # rank 0 alone, waiting for 2 more ranks that never come: the process group's own error
    init = f"file://{tmp_path}/rdzv"
    args = ["--init-method", init, "--rank", "0", "--world-size", "3", "--timeout", "1"]
    r = forked("01_init_methods.py", *args, timeout=60, env=exit_hook_env(tmp_path)).failed()
    assert "Traceback" not in r.stderr
    assert re.search(r"^\[rank 0\] error: not all of 3 ranks joined within 1s", r.stderr, re.M), r
    assert hooks_that_ran(tmp_path) == ["rank0"]


def test_an_nccl_error_from_torch_2_15s_engine_is_one_line_without_a_traceback(tmp_path):
    # torch 2.15's NCCL engine (nccl2) raises a plain RuntimeError whose text is the failed
    # call, NCCL's error string, then "\nNCCL Last Error: ..." (NCCLException::what(), in
    # torch/csrc/distributed/c10d/nccl2): a failed collective, not a bug in your code, and
    # one line, the two of its text joined. (Raised here by hand: no GPU on this machine.)
    failed = "NCCL AllReduce failed: unhandled cuda error \\nNCCL Last Error: Cuda failure"
    line = f"    raise RuntimeError('{failed}')  # as nccl2 raises it\n"
    anchor = "    rows = [None] * d.world_size\n"
    script = inserted_copy(tmp_path / "nccl.py", "01_init_methods.py", anchor, line)
    r = forked(script, timeout=60)
    said = "error: RuntimeError: NCCL AllReduce failed: unhandled cuda error NCCL Last Error: "
    assert (r.returncode, r.stderr) == (1, f"[rank 0] {said}Cuda failure\n"), r


def test_a_job_with_stderr_closed_trains_to_the_end(tmp_path):
    # `2>&-` (a daemon, a cron job): Python starts with sys.stderr None. 03 wrote a beat to it
    # each step and could not train at all; now nothing but a rank's last line needs it.
    script = REPO / "03_ddp_train.py"
    args = "--image-size 16 --train-size 32 --val-size 8 --batch-size 16 --epochs 1"
    done = subprocess.run(
        ["bash", "-c", f'exec "$0" {script} {args} 2>&-', PYTHON],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in LAUNCH_VARS},
    )
    assert done.returncode == 0 and "verified: 1 rank(s)" in done.stdout, done


@pytest.mark.hangs  # about 17 s, 15 of them hung
def test_a_forked_run_past_its_deadline_shows_where_each_process_was(tmp_path):
    # The harness's own promise: a hang's failure names where each rank (and each of its
    # DataLoader workers) was, from faulthandler, before the run is killed.
    line = "    time.sleep(600)  # a hang\n"
    anchor = "    rows = [None] * d.world_size\n"
    script = inserted_copy(tmp_path / "hangs.py", "01_init_methods.py", anchor, line)
    script.write_text("import time\n" + script.read_text())
    with pytest.raises(pytest.fail.Exception) as failed:
        forked(script, nproc=2, timeout=15)
    message = str(failed.value)
    assert "timed out after 15s and was killed" in message, message
    # each rank's main thread, where it hung: in the script's main()
    assert len(re.findall(r'hangs\.py", line \d+ in main\n', message)) == 2, message


# A job that trains long enough to be signalled: 03 at its smallest, a progress line per step.
LONG = ["--image-size", 16, "--train-size", 64, "--val-size", 0, "--batch-size", 16]
LONG += ["--epochs", 1000, "--log-every", 1, "--timeout", 60]
STEP_2 = "step     2/"  # in 03's progress line: the job is training


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1])
def test_a_signal_ends_the_rank_at_once_with_one_line(sig, tmp_path):
    # Ctrl-C, a scheduler's stop (SLURM and Kubernetes send SIGTERM; sbatch --signal, SIGUSR1)
    # and a closed terminal (SIGHUP): one line, exit 128 + the signal's number (as a shell
    # reports a signalled process), the exit hooks run; no traceback and no
    # destroy_process_group (on NCCL it could wait for peers). SIGINT and SIGTERM take the
    # same path (STOP_SIGNALS): Ctrl-C under --spawn and torchrun's SIGTERM below. (SIGQUIT,
    # Ctrl-\, keeps its default since session 24: NOTES.md, "Rare traps".)
    job = Watched("03_ddp_train.py", *LONG, launcher="forked", env=exit_hook_env(tmp_path))
    job.wait_for(STEP_2)
    os.kill(job.proc.pid, sig)
    r = job.finish()
    assert r.returncode == 128 + sig, r
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("[rank 0] ") and stopped(line, sig.name), r
    assert hooks_that_ran(tmp_path) == ["rank0"]


@pytest.mark.parametrize("launcher, nproc", [("forked", 1), ("spawn", 2)])
def test_a_signal_that_was_ignored_stays_ignored(launcher, nproc, tmp_path):
    # nohup ignores SIGHUP so that a job outlives its terminal: the script keeps it so, and
    # --spawn's launcher too (it forwarded SIGHUP to its ranks, which then stopped)
    args = [*LONG[:-6], "--epochs", 3, "--timeout", 60]
    job = Watched("03_ddp_train.py", *args, launcher=launcher, nproc=nproc, ignore=[signal.SIGHUP])
    job.wait_for("epoch 1 done")
    if launcher == "spawn":  # a closed terminal's, to the job's process group (its own)
        os.killpg(job.proc.pid, signal.SIGHUP)
    else:
        os.kill(job.proc.pid, signal.SIGHUP)
    r = job.finish()
    assert r.returncode == 0, r
    assert r.stdout.strip().splitlines()[-1].startswith(f"verified: {nproc} rank(s)"), r


def test_ctrl_c_under_spawn_is_one_line_per_rank_without_a_launcher_traceback():
    job = Watched("03_ddp_train.py", *LONG, launcher="spawn", nproc=2)
    job.wait_for(STEP_2)
    os.killpg(job.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
    r = job.finish()
    assert r.returncode == 130, r
    ours = [line for line in r.stderr.splitlines() if not re.match(r"[WE]\d{4} ", line)]
    assert [line[:9] for line in sorted(ours)] == ["[rank 0] ", "[rank 1] "], r
    assert all(stopped(line, "SIGINT") for line in ours), r


def test_when_torchrun_stops_the_other_ranks_each_says_why():
    # A worker killed from outside: the others learn it from Gloo (the connection closed) or
    # from torchrun, which SIGTERMs them; either way each ends with one line (it was none).
    job = Watched("03_ddp_train.py", *LONG, launcher="torchrun", nproc=2)
    job.wait_for(STEP_2)
    [victim] = job.pids_with_env("RANK", "1")
    os.kill(victim, signal.SIGKILL)
    r = job.finish()
    assert r.returncode != 0, r
    # (searched, not matched at line starts: the agent's own log lines share the stream)
    lines = re.findall(r"\[rank 0\] .*", r.stderr)
    assert len(lines) == 1, str(r)
    assert stopped(lines[0], "SIGTERM") or "by peer" in lines[0], str(r)


def test_a_frozen_peer_ends_the_others_after_timeout_in_one_line():
    # A peer stopped with SIGSTOP (a hung machine) under --spawn: the other rank's next
    # collective gives up after --timeout (Gloo's "pair closure"): an expected failure, one
    # line, no traceback (it was DDP's _sync_buffers traceback).
    job = Watched("03_ddp_train.py", *LONG[:-2], "--timeout", 3, launcher="spawn", nproc=2)
    job.wait_for(STEP_2)
    ranks = [pid for pid in job.pids_with_cmdline("spawn_main")]
    assert len(ranks) == 2, ranks
    os.kill(max(ranks), signal.SIGSTOP)  # the later-started rank: 1
    try:
        line = job.wait_for("[rank 0] error: ", stderr=True)
    finally:
        os.kill(max(ranks), signal.SIGCONT)  # so that it can take mp.spawn's SIGTERM
    r = job.finish()
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr
    # Gloo's own words, either where the wait ran out or how the connection ended
    assert re.search(r"Timed out waiting 3000ms|timeout caused pair closure", line), line
    ours = [x for x in r.stderr.splitlines() if not re.match(r"[WE]\d{4} |\s*$", x)]
    # then, once running again, rank 1 may say its own one line before mp.spawn ends it
    assert ours[0] == line.strip() and all(x.startswith("[rank 1] ") for x in ours[1:-1]), r
    assert re.fullmatch(r"error: spawned process [01] exited with code (1|143)", ours[-1]), r


def test_a_job_with_stdout_closed_succeeds_and_says_nothing_else(tmp_path):
    # `python script.py >&-` (a daemon, a cron job): Python starts with sys.stdout None, so
    # print() drops its text; the final flush raised AttributeError and a finished job
    # exited 1, which a scheduler would retry. Every rank's exit hooks still run.
    script = REPO / "01_init_methods.py"
    done = subprocess.run(
        ["bash", "-c", f'exec "$0" {script} --spawn 2 >&-', PYTHON],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in LAUNCH_VARS} | exit_hook_env(tmp_path),
    )
    assert (done.returncode, done.stderr) == (0, ""), done
    assert hooks_that_ran(tmp_path) == ["rank0", "rank1"]


def test_a_job_piped_into_a_reader_that_has_gone_ends_at_its_first_line(tmp_path):
    # `python 03_ddp_train.py | head -1`: once head has exited, rank 0's next line raises
    # BrokenPipeError, which ends the job as Python ends `yes | head` (until session 24 the
    # line was dropped and training went on: NOTES.md, "Rare traps"). Here the reader is gone
    # before the job starts, so the first line meets a broken pipe: no race with head.
    model = tmp_path / "model.pt"
    args = [*LONG[:-6], "--epochs", 2, "--save-model", model]
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [PYTHON, str(REPO / "03_ddp_train.py"), *map(str, args)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if k not in LAUNCH_VARS},
        )
    finally:
        os.close(write)
    assert done.returncode == 1, done
    assert done.stderr.endswith("[rank 0] error: BrokenPipeError: [Errno 32] Broken pipe\n"), done
    assert not model.exists(), done
