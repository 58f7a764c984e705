"""04_checkpoint.py: 03's job plus checkpoints. A run killed at a moment it cannot foresee,
preempted (SIGTERM), or orphaned by its launcher resumes bit for bit; saves are atomic and
run in the background; the folder is locked, checked and read by number."""

from __future__ import annotations

import ast
import fractions
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from launch import (
    FLOAT64,
    REPO,
    Watched,
    forked,
    free_port,
    inserted_copy,
    load_script,
    run,
    stuck_copy,
    stuck_line,
    wait_for_any,
)

SCRIPT = "04_checkpoint.py"
# 03's job at its smallest: 16 px images, 128 of them, batches of 16, 2 epochs. One process
# takes 8 steps an epoch, two take 4; saves every 3 steps and at each epoch's end. The model
# is torchvision's MobileNetV3-small: with dropout, so its random stream must resume too, and
# a 13 MB checkpoint (03's default ResNet-18: 90 MB, in one test below).
SMALL = ["--arch", "mobilenet_v3_small", "--image-size", 16, "--train-size", 128]
SMALL += ["--val-size", 32, "--batch-size", 16]
SMALL += ["--epochs", 2, "--save-every", 3, "--log-every", 100, "--timeout", 60]
VERIFIED = re.compile(
    r"^verified: (\d+) rank\(s\) hold identical parameters and buffers \([\d,]+ values, "
    r"sha256 ([0-9a-f]{16})\)",
    re.M,
)


# 03's smallest runs (tests/test_03_ddp_train.py), here with 04's additions
TINY = ["--arch", "resnet18", "--image-size", 16, "--train-size", 64, "--val-size", 32]
TINY += ["--batch-size", 16, "--epochs", 1, "--timeout", 60]
# GroupNorm and float64: N processes equal one with the whole batch to 1e-9
EQUIV = ["--norm", "group", "--image-size", 16, "--train-size", 12, "--val-size", 0]
EQUIV += ["--epochs", 2, "--lr", 0.01, "--timeout", 60]  # with env=FLOAT64


def final_state(stdout: str) -> str:
    """The sha256 of the final weights and buffers, from the script's verified line."""
    return VERIFIED.search(stdout)[2]


def image_folder(root) -> None:
    """A small ImageFolder tree of two classes, images of several sizes (so the random
    crops differ), for runs with --data and random augmentation."""
    from PIL import Image

    for split, count in (("train", 16), ("val", 4)):
        for name, rgb in (("red", (200, 40, 40)), ("blue", (40, 40, 200))):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                image = Image.new("RGB", (24 + i % 7, 20 + i % 5), rgb)
                image.putpixel((i % 20, i % 13), (255, 255, 255))
                image.save(root / split / name / f"{i}.png")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    image_folder(root)
    return ["--data", root, "--workers", 2, "--batch-size", 4]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, by (processes, options), with their checkpoint folders; each logs
    its metrics to metrics.jsonl there."""
    done = {}

    def get(nproc: int, *options):
        key = (nproc, *map(str, options))
        if key not in done:
            folder = tmp_path_factory.mktemp("reference")
            args = [*SMALL, *options, "--checkpoint-dir", folder]
            r = forked(SCRIPT, *args, "--metrics", folder / "metrics.jsonl", nproc=nproc).ok()
            done[key] = final_state(r.stdout), folder
        return done[key]

    return get


def last_per_step(log: Path) -> list[dict]:
    """The log as plot_metrics.py reads it (the last line for a step and kind), in step order,
    without the timings (img_s, rank_seconds)."""
    latest = {}
    for line in log.read_text().splitlines():
        fields = json.loads(line)
        fields.pop("img_s", None)
        fields.pop("rank_seconds", None)
        latest[fields["step"], "val_loss" in fields] = fields
    return [latest[key] for key in sorted(latest)]


@pytest.mark.parametrize(
    "nproc, options, fail_at, saved",
    [
        (2, ["--accum-steps", 2], 3, [2]),  # two ranks, accumulation (2 steps an epoch)
        (2, ["data"], 6, [3, 4]),  # ImageFolder, random augmentation, 2 workers per rank
    ],
)
def test_a_killed_run_resumed_ends_bitwise_equal_to_an_uninterrupted_one(
    nproc, options, fail_at, saved, tmp_path, reference, data
):
    # (and the metrics log: the last line for each step is the uninterrupted run's)
    options = [*data] if options == ["data"] else options
    options += ["--log-every", 1]
    expected, whole = reference(nproc, *options)
    log = tmp_path / "metrics.jsonl"
    args = [*SMALL, *options, "--checkpoint-dir", tmp_path, "--simulate-failure", fail_at]
    args += ["--metrics", log]
    crashed = forked(SCRIPT, *args, nproc=nproc).failed()
    assert f"[rank {nproc - 1}] simulated failure at step {fail_at}" in crashed.stdout
    resumed = forked(SCRIPT, *args, nproc=nproc).ok()
    # the newest finished write: a background write under way at the kill is not one
    step = int(re.search(rf"resuming from {tmp_path}/step-(\d+)\.pt: epoch ", resumed.stdout)[1])
    assert step in saved, resumed
    assert "simulated failure" not in resumed.stdout  # only in a run that did not resume
    assert final_state(resumed.stdout) == expected
    assert len(log.read_text().splitlines()) > len(
        (whole / "metrics.jsonl").read_text().splitlines()
    )
    assert last_per_step(log) == last_per_step(whole / "metrics.jsonl")


def slurm_job(tmp_path, folder, script=SCRIPT):
    """The README's batch script, run as SLURM runs it as far as a machine without SLURM
    allows: `srun` runs its command, `scontrol` names this host and records a requeue in
    tmp_path/requeued; the checkpoint folder, the rendezvous port and the script's path are
    this test's."""
    readme = (REPO / "README.md").read_text()
    text = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "#SBATCH" in b)
    text = text.replace("/shared/checkpoints/$SLURM_JOB_ID", str(folder))
    text = text.replace(":29400", f":{free_port()}").replace(SCRIPT, str(REPO / script))
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    scontrol = f'if [ "$1" = show ]; then echo 127.0.0.1; else echo "$@" >> {tmp_path}/requeued; fi'
    for name, body in [
        ("srun", 'exec "$@"'),
        ("scontrol", scontrol),
        ("torchrun", f'exec {sys.executable} -m torch.distributed.run "$@"'),
    ]:
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    job = tmp_path / f"{Path(script).stem}.sh"
    job.write_text(text)
    env = {"PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    env |= {"SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node0"}  # a CPU partition: no GPUs
    return job, env


def slow_disk_copy(tmp_path, seconds) -> Path:
    """04, but each checkpoint's write (write_atomic of a .pt) first takes seconds: a slow
    disk."""
    anchor = '    tmp = path.with_name(f".{path.name[:50]}.tmp{os.getpid()}")'  # write_atomic's
    slow = f'    if path.suffix == ".pt":\n        time.sleep({seconds})  # a slow disk\n'
    return inserted_copy(tmp_path / "slow_disk.py", SCRIPT, anchor, slow)


def requeues(tmp_path) -> int:
    log = tmp_path / "requeued"
    return log.read_text().count("requeue 7") if log.exists() else 0


def test_a_scheduler_retries_each_preemption_and_ends_bitwise_but_not_a_bug(tmp_path, reference):
    # What SLURM and Kubernetes do before they kill a job: SIGTERM. The README's batch script
    # runs 04 under torchrun; SIGTERM reaches torchrun at two moments the script cannot
    # foresee (before the first step, and after a save at every process of the job step, as
    # SLURM's --signal sends it; a stop in validation: the test after this one). Every
    # rank stops at one agreed step after a save and says so; torchrun exits 1, and the
    # script makes it 143 and requeues because 04 marked the folder preempted. A bug in the
    # model exits 1, not requeued (the script removes an old mark first); the final run ends
    # bit for bit as an uninterrupted one, and its metrics log (the last line for each step)
    # as the uninterrupted run's.
    expected, whole = reference(1, "--log-every", 4)
    folder = tmp_path / "ckpt"
    job_sh, env = slurm_job(tmp_path, folder)
    args = [*SMALL, "--log-every", 4, "--workers", 1]  # 1 DataLoader worker: signalled too
    args += ["--metrics", tmp_path / "metrics.jsonl"]
    moments = ["no checkpoint in", "saved step-"]
    stops = []
    for moment in moments:
        job = Watched(job_sh, *args, launcher="bash", env=env)
        job.wait_for(moment)
        [agent] = job.pids_with_cmdline("torch.distributed.run")
        step = {agent}  # as `--signal=TERM` does, the last time: torchrun and every process
        if moment == moments[-1]:  # below it (its worker, the worker's DataLoader worker)
            step |= set(job.pids_with_cmdline(SCRIPT))
        for pid in step:
            os.kill(pid, signal.SIGTERM)
        r = job.finish()
        if r.returncode == 0:  # the signal came after the last step: the job had finished
            break
        assert r.returncode == 143, r
        stopped = re.search(r"^stopping on SIGTERM at step (\d+): run the same", r.stdout, re.M)
        assert stopped and f"saved step-{int(stopped[1]):08d}.pt" in r.stdout, r
        assert [line for line in r.stderr.splitlines() if line.startswith("[rank ")] == [
            "[rank 0] stopped by SIGTERM"
        ], r
        stops.append(int(stopped[1]))
        assert (folder / "preempted").exists() and requeues(tmp_path) == len(stops)
    assert len(stops) >= 2 and stops == sorted(stops), stops
    # a bug: the same script and folder, the model raising in its forward
    buggy = (
        (REPO / SCRIPT)
        .read_text()
        .replace(
            "\n    return model\n",
            "\n    model.register_forward_hook(lambda *_: 1 / 0)  # a bug\n    return model\n",
            1,
        )
    )
    (tmp_path / "buggy.py").write_text(buggy)
    buggy_sh, _ = slurm_job(tmp_path, folder, tmp_path / "buggy.py")
    r = Watched(buggy_sh, *args, launcher="bash", env=env).finish()
    assert r.returncode == 1 and "ZeroDivisionError" in r.stderr, r
    assert not (folder / "preempted").exists() and requeues(tmp_path) == len(stops)
    r = Watched(job_sh, *args, launcher="bash", env=env).finish()
    assert r.returncode == 0, r
    assert final_state(r.stdout) == expected
    # Every step's line as the uninterrupted run's; a validation that a stop cut short is
    # not logged (nor redone after the resume), so the validation lines are a subset.
    got, want = last_per_step(tmp_path / "metrics.jsonl"), last_per_step(whole / "metrics.jsonl")
    assert [x for x in got if "loss" in x] == [x for x in want if "loss" in x]
    assert all(x in want for x in got) and any("val_loss" in x for x in got), got


@pytest.mark.hangs  # about 30 s: two runs, each with a 6 s save
def test_the_batch_script_gives_the_stops_save_the_time_it_asked_for(tmp_path):
    # torchrun SIGKILLs its workers 30 s after it forwards SIGTERM unless told otherwise;
    # README's batch script exports PET_SHUTDOWN_TIMEOUT=270 (read by torch 2.15's torchrun).
    # A save slower than the grace (6 s, where the default's would take 30 s): with the
    # script's own setting it finishes, is marked and requeued; the same script with 2 s
    # loses it, killed mid-write (2.4.1 reads no such variable: 30 s, it finishes too).
    import torch.distributed.run as torchrun

    honoured = "PET_" in Path(torchrun.__file__).with_name("argparse_util.py").read_text()
    honoured = honoured and "--shutdown-timeout" in Path(torchrun.__file__).read_text()
    script = slow_disk_copy(tmp_path, 6)
    args = [*SMALL, "--save-every", 100, "--log-every", 1]
    for grace in (270, 2):
        where = tmp_path / str(grace)
        where.mkdir()
        job_sh, env = slurm_job(where, where / "ckpt", script)
        text = job_sh.read_text().replace("SHUTDOWN_TIMEOUT=270", f"SHUTDOWN_TIMEOUT={grace}")
        job_sh.write_text(text)
        job = Watched(job_sh, *args, launcher="bash", env=env)
        job.wait_for("step     2/16")
        [agent] = job.pids_with_cmdline("torch.distributed.run")
        os.kill(agent, signal.SIGTERM)
        r = job.finish()
        if grace > 6 or not honoured:
            assert r.returncode == 143 and requeues(where) == 1, r
            stopped = re.search(r"^stopping on SIGTERM at step (\d+): run the same", r.stdout, re.M)
            assert stopped and f"saved step-{int(stopped[1]):08d}.pt" in r.stdout, r
        else:  # killed in its save: no mark, no checkpoint, no requeue
            assert r.returncode == 1 and requeues(where) == 0, r
            assert not list((where / "ckpt").glob("step-*.pt")), r
            assert "forcefully exiting via 9" in r.stderr, r  # torchrun's SIGKILL, 2 s on


def test_a_stop_in_validation_under_timeout_ends_in_seconds_with_its_save(tmp_path):
    # GNU timeout relays a SIGTERM to its whole process group, as SLURM signals a job step:
    # here the --spawn launcher and both ranks (the scheduler test above signals DataLoader
    # workers too). The launcher passes it on and waits for the ranks, which cut the epoch's
    # validation short, save, and stop: seconds, where the whole validation takes longer.
    args = [*SMALL, "--val-size", 4096]  # (a stop after the last epoch would let it finish)
    job_sh = tmp_path / "job.sh"
    job_sh.write_text(f'exec timeout 600 {sys.executable} {REPO / SCRIPT} --spawn 2 "$@"\n')
    job = Watched(job_sh, *args, "--log-every", 4, "--checkpoint-dir", tmp_path, launcher="bash")
    job.wait_for("step     4/8")  # the epoch's last step: its validation starts
    signalled = time.monotonic()
    os.kill(job.proc.pid, signal.SIGTERM)  # timeout's: it signals the group
    r = job.finish()
    assert time.monotonic() - signalled < 10, r
    validated = int(re.search(r"val loss \S+ acc \S+ on (\d+) images", r.stdout)[1])
    assert validated < 4096, r  # cut short
    # the stop comes a step late (the agreement is read a step after it was sent): its save too
    assert (
        "saved step-00000004.pt\nsaved step-00000005.pt\nstopping on SIGTERM at step 5" in r.stdout
    )
    ours = sorted(line for line in r.stderr.splitlines() if line.startswith("[rank "))
    assert ours == ["[rank 0] stopped by SIGTERM", "[rank 1] stopped by SIGTERM"], r
    assert "killed by signal" not in r.stderr and (tmp_path / "preempted").exists()


def test_a_stop_before_the_group_is_joined_is_a_preemption_too(tmp_path):
    # A scheduler's SIGTERM in the first seconds (joining the group, reading the data or the
    # checkpoint) ended the rank at once, exit 143 and no mark: the batch script did not
    # requeue it. main() takes the signals first now: the job stops after its first agreed
    # step, saved and marked.
    anchor = "    preemption = Preemption()"
    signal_now = "\n    os.kill(os.getpid(), signal.SIGTERM)  # before setup()"
    script = inserted_copy(tmp_path / "early.py", SCRIPT, anchor, signal_now, after=True)
    r = forked(script, *SMALL, "--checkpoint-dir", tmp_path / "ckpt")
    assert r.returncode == 128 + signal.SIGTERM, r
    assert "saved step-00000002.pt\nstopping on SIGTERM at step 2: run the" in r.stdout, r
    assert r.stderr == "[rank 0] stopped by SIGTERM\n", r
    assert (tmp_path / "ckpt/preempted").exists()


def test_a_stop_in_the_last_validation_lets_it_finish(tmp_path):
    # No stop follows the last epoch: a SIGTERM in its validation cut it short (192 of 8,192
    # images), logged nothing, and a rerun said the run had finished. Now the last epoch's
    # validation runs to its end and is logged, and the job ends as finished.
    anchor = "            val_batches = itertools.takewhile(\n"
    signal_now = "            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's warning\n"
    script = inserted_copy(tmp_path / "stopped.py", SCRIPT, anchor, signal_now)
    metrics = tmp_path / "metrics.jsonl"
    args = [*SMALL, "--epochs", 1, "--val-size", 64, "--checkpoint-dir", tmp_path / "ckpt"]
    r = forked(script, *args, "--metrics", metrics).ok()
    assert "val loss" in r.stdout and " on 64 images" in r.stdout, r
    assert "stopping on" not in r.stdout and VERIFIED.search(r.stdout), r
    [last] = [json.loads(line) for line in metrics.read_text().splitlines() if "val_acc" in line]
    assert last["step"] == 8, last


@pytest.mark.hangs  # about 14 s, 10 of them suspended
def test_a_job_suspended_longer_than_the_watchdog_carries_on(tmp_path):
    # scontrol suspend, gang scheduling and Ctrl-Z/fg stop a job's processes (SIGSTOP) and
    # resume them. 04's watchdog counts its own seconds, not the clock's, so a suspension
    # longer than --timeout + 1 is not a stuck rank (faulthandler's watchdog, before #52,
    # ended the rank on SIGCONT). One process: with peers, a collective under way when the
    # job stops counts wall time in Gloo and NCCL and may time out on SIGCONT (NOTES.md).
    # 10 steps: on a loaded machine (4 busy loops on 2 cores) a step took 6 s, and 32 of
    # them outlasted the launch's 120 s; --timeout 7, so that no phase of a step there is
    # taken for stuck (with --timeout 1 some were, since the watchdog lost its 5 s).
    args = [*SMALL, "--train-size", 160, "--epochs", 1, "--timeout", 7, "--log-every", 1]
    job = Watched(SCRIPT, *args, "--checkpoint-dir", tmp_path)
    job.wait_for("step     2/10")
    job.proc.send_signal(signal.SIGSTOP)
    time.sleep(10)  # the suspension itself: over --timeout + 1 = 8 s
    job.proc.send_signal(signal.SIGCONT)
    r = job.finish()
    assert r.returncode == 0 and "verified: 1 rank(s) hold identical" in r.stdout, r
    assert "stuck for" not in r.stderr and "Timeout" not in r.stderr, r


@pytest.mark.hangs  # about 16 s each, 10 of them in the long phase
@pytest.mark.parametrize("long", ["first step", "first backward", "evaluation"])
def test_a_first_step_or_an_evaluation_longer_than_the_watchdog_is_not_stuck(long, tmp_path):
    # A first step that compiles (torch.compile, max-autotune, cudnn.benchmark) takes as long
    # on every rank: no collective times out, but the watchdog ended the rank. It watches
    # the rest from the first step's end now, and data loading from the start (the next
    # test: a worker blocked in step 0 is still ended). A long evaluation is never watched.
    # The first backward: a second fresh read found that after_step armed the watchdog
    # while the rank was still in that phase, and a tick before the next phase (here a
    # slow 1.5 s after the arming) counted the backward's 8 s and ended the rank: the
    # watchdog counts only while a phase is watched now. --timeout 7 (the long phase: 10 s):
    # on a loaded machine a step's phase took seconds, and --timeout 1 ended some.
    if long == "first step":
        anchor = "                    logits = model(images)\n"
        pause = "                    if state.step == 0:\n"
        pause += "                        time.sleep(10)  # compiling\n"
    elif long == "first backward":
        anchor = "                state.scaler.scale(loss / args.accum_steps).backward()\n"
        pause = "                if state.step == 0:\n"
        pause += "                    time.sleep(10)  # compiling\n"
    else:
        anchor = "            val_loss, val_acc, val_count = evaluate("
        pause = "            time.sleep(10)  # a long validation\n"
    script = inserted_copy(tmp_path / "long.py", SCRIPT, anchor, pause)
    if long == "first backward":
        armed = "        phases.armed = True  # (a first step may compile)\n"
        slow = "        if state.step == 1:\n            time.sleep(1.5)  # a busy host\n"
        script = inserted_copy(tmp_path / "long2.py", script, armed, slow, after=True)
    args = [*SMALL, "--epochs", 1, "--timeout", 7, "--checkpoint-dir", tmp_path / "ckpt"]
    r = run(script, *args, timeout=120)
    assert r.returncode == 0 and "verified: 1 rank(s) hold identical" in r.stdout, r
    assert "stuck for" not in r.stderr, r


@pytest.mark.hangs  # about 10 s
def test_a_rank_stuck_on_its_worker_ends_with_a_line_and_the_worker_too(tmp_path):
    # A FIFO among the images (a file that never finishes: a hung network mount, say): the
    # DataLoader worker blocks reading it, and the rank waits in its data phase. Its
    # watchdog writes its stacks and its line, and kills the worker, which held the pipe
    # this test reads (as `04 ... | tee log`): the run ends, nothing left running.
    image_folder(tmp_path / "images")
    os.mkfifo(tmp_path / "images/train/red/zz.png")  # ImageFolder sorts it last: step 0's
    args = ["--data", tmp_path / "images", "--workers", 1, "--batch-size", 32, "--timeout", 1]
    r = run(SCRIPT, *SMALL[:4], *args, "--checkpoint-dir", tmp_path / "ckpt", timeout=60)
    stacks = tmp_path / "ckpt/stacks_rank_0"
    assert r.returncode == 1 and r.stderr == stuck_line(0, 2, "step 1, data", stacks.parent) + "\n"
    assert "in train_one_epoch" in stacks.read_text()  # the worker's stack is its own, not here
    assert "in load_image" not in stacks.read_text()


@pytest.mark.hangs  # about 18 s and 6 s
@pytest.mark.parametrize("stacks", ["a FIFO", "a folder"])
def test_the_watchdog_ends_a_rank_whose_files_cannot_be_written(stacks, tmp_path):
    # A hung mount: the watchdog's write of its stacks blocks (DIR/stacks_rank_0 is a FIFO
    # with no reader: open() waits), and SIGALRM ends the rank 10 s later, its line out
    # first. A write that fails (a folder in the file's place) ends it at once, exit 1.
    folder = tmp_path / "ckpt"
    folder.mkdir()
    target = folder / "stacks_rank_0"
    os.mkfifo(target) if stacks == "a FIFO" else target.mkdir()
    args = [*STUCK, "--epochs", 1, "--timeout", 1, "--checkpoint-dir", folder]
    r = run(stuck_copy(tmp_path, "data", rank=0), *args, timeout=60)
    assert r.stderr.endswith(stuck_line(0, 2, "step 3, data", folder) + "\n"), r
    assert r.returncode == (-signal.SIGALRM if stacks == "a FIFO" else 1), r


@pytest.mark.hangs  # about 11 s
def test_a_forked_ranks_stuck_worker_shows_its_stack_before_it_is_killed(tmp_path):
    # The harness's side (tests/forked.py): a forked rank's Process.kill first asks the
    # worker for its stacks, so that a worker's hang in a test run says where it was (one
    # was seen twice and not reproduced: tests/README.md). The FIFO above, forked: the
    # worker's stack ends in load_image, reading it. (The watchdog kills the workers last,
    # after its line and its files.)
    image_folder(tmp_path / "images")
    os.mkfifo(tmp_path / "images/train/red/zz.png")
    args = ["--data", tmp_path / "images", "--workers", 1, "--batch-size", 32, "--timeout", 1]
    r = forked(SCRIPT, *SMALL[:4], *args, "--checkpoint-dir", tmp_path / "ckpt", timeout=60)
    line = stuck_line(0, 2, "step 1, data", tmp_path / "ckpt") + "\n"
    assert r.returncode == 1 and r.stderr.startswith(line), r
    assert "in load_image" in r.stderr[len(line) :], r


def test_a_nohup_job_outlives_the_shell_that_started_it(tmp_path, reference):
    # No signal comes: the shell that started `nohup python 04 ... &` exits, and the job's
    # parent changes. It took that for a killed launcher and stopped 4 s later "on SIGTERM"
    # (NOTES.md, "A killed launcher", has what watches the parent, for torchrun's workers).
    expected, _ = reference(1)
    out = tmp_path / "out"
    command = [sys.executable, REPO / SCRIPT, *SMALL, "--checkpoint-dir", tmp_path]
    started = subprocess.run(
        ["bash", "-c", f"nohup {' '.join(map(str, command))} > {out} 2>&1 & echo $!"],
        capture_output=True, text=True, timeout=30, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    pid = int(started.stdout)
    try:
        wait_until_gone([pid], 120, "the nohup job is")  # the shell has exited already
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
    assert final_state(out.read_text()) == expected, out.read_text()


def test_the_data_is_known_by_its_images_not_where_they_lie(tmp_path):
    # A cluster stages the data to another folder for each job: the requeued job went on
    # being refused (--data compared as a path). Now its number of images and its classes
    # are compared, and an option it makes irrelevant (--train-size) no longer matters.
    # --epochs may grow.
    image_folder(tmp_path / "images")
    args = [*SMALL, "--batch-size", 4, "--checkpoint-dir", tmp_path / "ckpt"]
    forked(SCRIPT, *args, "--data", tmp_path / "images", "--epochs", 1).ok()
    staged = tmp_path / "staged"
    shutil.copytree(tmp_path / "images", staged)
    r = forked(SCRIPT, *args, "--data", staged, "--epochs", 2, "--train-size", 64).ok()
    assert "epoch 2 with 0 of its images done, global step 8" in r.stdout, r
    assert "global batch, steps: (4, 8) -> (4, 16)" in r.stdout, r
    assert "epoch 2 done" in r.stdout
    r = forked(SCRIPT, *args, "--data", staged, "--epochs", 1).failed()
    assert "--epochs 1 ends before step-00000016.pt: epoch 3 with 0 of its images done" in r.stderr
    # one more image: refused, naming both (images moved between classes, the same number,
    # are not seen: NOTES.md, "Rare traps")
    shutil.copy(staged / "train/red/0.png", staged / "train/red/extra.png")
    r = forked(SCRIPT, *args, "--data", staged, "--epochs", 3).failed()
    there, here = "32 in classes ['blue', 'red']", "33 in classes ['blue', 'red']"
    assert f"settings: images {there} there, {here} here. Resume with" in r.stderr, r


def test_another_world_size_with_the_global_batch_held_trains_the_same(tmp_path):
    # Stopped on 2 ranks part-way (its step-2 checkpoint), resumed on 1 with --accum-steps 2 and on
    # 4 with --batch-size 2: 8 images a step as before, so the training is the same (float64
    # and GroupNorm: no batch statistics; only the order of additions differs). The data
    # position carries on exactly: a step of other images would end elsewhere.
    base = [*SMALL, "--arch", "resnet18", "--norm", "group", "--train-size", 32]
    base += ["--batch-size", 4, "--epochs", 1, "--val-size", 0]  # 4 steps of 8 images
    whole = tmp_path / "whole"
    forked(SCRIPT, *base, "--checkpoint-dir", whole, "--save-every", 2, nproc=2, env=FLOAT64).ok()
    ended_whole = torch.load(whole / "step-00000004.pt", weights_only=True)["model"]
    for nproc, change in [(1, ["--accum-steps", 2]), (4, ["--batch-size", 2])]:
        folder = tmp_path / f"on{nproc}"  # what a stop after step 2 or 3 leaves: step 2
        shutil.copytree(whole, folder, ignore=shutil.ignore_patterns("step-00000004.pt*"))
        r = forked(SCRIPT, *base, *change, "--checkpoint-dir", folder, nproc=nproc, env=FLOAT64)
        r.ok()
        # the global batch held and the same number of steps: no line on it
        assert "resuming from" in r.stdout and "global batch, steps:" not in r.stdout, r
        ended = torch.load(folder / "step-00000004.pt", weights_only=True)["model"]
        for name, tensor in ended_whole.items():
            assert torch.allclose(ended[name], tensor, rtol=0, atol=1e-9), name


def wait_until_gone(pids: list[int], seconds: float, what: str) -> None:
    """Until none of pids runs (gone, or a zombie nobody has reaped): polling for the
    processes to end, not synchronising with them."""
    deadline = time.monotonic() + seconds
    while any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in pids):
        assert time.monotonic() < deadline, f"{what} still running after {seconds:g} s"
        time.sleep(0.1)


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint(tmp_path, reference):
    # Rank 0's thread writes step-N.pt while training goes on. Killed while that file is
    # only a temporary one: the folder still holds the checkpoint before it, whole, and the
    # rerun resumes from it (or from step N, if the write ended first), bit for bit.
    expected, _ = reference(1)
    job = Watched(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path, launcher="forked")
    job.wait_for("saved step-00000003.pt")
    deadline, writing = time.monotonic() + 60, []
    while not writing:  # a write lasts a few ms; the folder is looked at every ms
        assert time.monotonic() < deadline, "no write after step 3 seen"
        time.sleep(0.001)  # a loop that never slept took a core from the job (6 s, not 0.1 s)
        writing = [int(p.name[6:14]) for p in tmp_path.glob(".step-*.pt.tmp*")]
        writing = [step for step in writing if step > 3]
    os.kill(job.proc.pid, signal.SIGKILL)  # the write is under way
    assert job.finish().returncode == -9
    again = forked(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path).ok()
    resumed = re.search(rf"resuming from {tmp_path}/step-(\d+)\.pt", again.stdout)
    assert resumed and 3 <= int(resumed[1]) <= writing[0], again
    assert not list(tmp_path.glob(".step-*.tmp*"))  # the leftover was removed, under the lock
    assert final_state(again.stdout) == expected


def test_a_write_slower_than_the_timeout_is_named_as_the_save(tmp_path):
    # A slow disk: rank 0's thread takes 8 s to write step 3's checkpoint, --timeout is 2 s.
    # At step 4's save every rank waits for that write (Writer.finish: rank 0 joins its
    # thread, rank 1 waits for rank 0's word) and each rank's watchdog ends it. Both lines
    # say where they were: in the save, not in training (Gloo's "Timed out ... recv" named
    # nothing). The write never finished, and nothing is left under a checkpoint's name.
    script = slow_disk_copy(tmp_path, 8)
    folder = tmp_path / "ckpt"
    args = [*SMALL, "--checkpoint-dir", folder, "--timeout", 2]
    r = forked(script, *args, nproc=2).failed()
    ours = sorted(line for line in r.stderr.splitlines() if line.startswith("[rank "))
    stuck = [stuck_line(i, 3, "step 4, save", folder) for i in (0, 1)]
    assert len(ours) == 2 and ours[0] == stuck[0], r
    # rank 1's own watchdog, or, if rank 0's came first (a busy machine), the lost peer
    lost = re.fullmatch(r"\[rank 1\] error: RuntimeError: .*gloo/.*; in step 4, save", ours[1])
    assert ours[1] == stuck[1] or lost, r
    assert not list(folder.glob("step-*")), r


def test_the_folder_lock_is_not_held_by_a_dead_rank_0s_forked_workers(tmp_path):
    # flock's lock belongs to the open file, which forked DataLoader workers share: a rank 0
    # that died while a worker lived on (workers ignore SIGTERM and end when they notice
    # their parent gone) kept DIR/.lock, and a fast torchrun restart was refused ("another
    # job holds"). lockf's belongs to the process: the restart's rank 0 takes it at once.
    take = (
        f"import sys, pathlib; sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        f"from launch import load_script\n"
        f"load_script({SCRIPT!r}).lock(pathlib.Path({str(tmp_path)!r}))\n"
    )
    dies = take + (  # rank 0 locks, forks a worker that lives on, and ends
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.close(1), os.close(2)\n"
        "    time.sleep(60)\n"
        "print(pid)\n"
    )
    rank0 = subprocess.run([sys.executable, "-c", dies], capture_output=True, text=True, timeout=30)
    worker = int(rank0.stdout)  # alive, asleep, the lock file open
    try:
        load_script(SCRIPT).lock(tmp_path)  # the restart's rank 0 (this process) takes it
    finally:
        os.kill(worker, signal.SIGKILL)


def test_a_checkpoint_being_written_when_a_peer_dies_is_finished(tmp_path):
    # Rank 0's thread takes 2 s to write step 3's checkpoint (a slow disk) and rank 1 dies at
    # step 4. Rank 0's next collective fails and it ends, but it finishes the write first
    # (Writer.join, an exit hook that run_rank runs): a restart resumes from step 3. Until
    # session 22 os._exit cut the thread, leaving a temporary file and no step 3.
    script = slow_disk_copy(tmp_path, 2)
    folder = tmp_path / "ckpt"
    args = [*SMALL, "--checkpoint-dir", folder, "--simulate-failure", 4]
    r = forked(script, *args, nproc=2).failed()
    assert re.search(r"^\[rank 0\] error: .*gloo/", r.stderr, re.M), r
    saved = folder / "step-00000003.pt"
    digest = hashlib.sha256(saved.read_bytes()).hexdigest()
    assert (folder / "step-00000003.pt.sha256").read_text() == f"{digest}  {saved.name}\n", r
    assert not list(folder.glob(".step-*.tmp*")), r


def test_two_nodes_recover_when_only_one_agent_counts_the_restart(tmp_path, reference):
    # Two torchrun agents, one worker each. Rank 1's worker is killed; its agent counts a
    # restart (TORCHELASTIC_RESTART_COUNT=1). Rank 0's worker is frozen meanwhile, so its
    # agent sees a healthy worker and a node waiting to rejoin, and restarts it as a
    # membership change, which is not counted (count 0). Scoping the store by the restart
    # count would then put the two ranks in different scopes: they never meet.
    # Each agent runs on a core of its own, as on two one-core nodes: its rank computes with
    # one thread, as each rank of one 2-process node does (the scripts share a node's cores
    # among its ranks), so the uninterrupted 2-process run is the reference, bit for bit.
    expected, _ = reference(2)
    rdzv = ["--nnodes", 2, "--max-restarts", 1, "--rdzv-backend", "c10d", "--rdzv-id", "job"]
    rdzv += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    args = (*SMALL, "--checkpoint-dir", tmp_path)
    agent = dict(launcher="agent", nproc=1, extra=rdzv, timeout=180, env={"LOGLEVEL": "INFO"})
    cores = sorted(os.sched_getaffinity(0))
    jobs = [Watched(SCRIPT, *args, **agent, cpus={cores[node % len(cores)]}) for node in (0, 1)]
    node0 = wait_for_any(jobs, "saved step-00000003.pt")
    node1 = jobs[1 - jobs.index(node0)]
    [rank0], [rank1] = node0.pids_with_env("RANK", "0"), node1.pids_with_env("RANK", "1")
    os.kill(rank0, signal.SIGSTOP)
    os.kill(rank1, signal.SIGKILL)
    node0.wait_for("new nodes from group_rank", stderr=True)  # a restart it does not count
    os.kill(rank0, signal.SIGCONT)  # its agent is stopping it: SIGTERM is pending
    runs = [job.finish() for job in jobs]
    for r in runs:
        assert r.returncode == 0, f"expected success:\n{r}"
    assert "attempts left; will restart worker group" in runs[jobs.index(node1)].stderr
    out = "".join(r.stdout for r in runs)
    assert re.search(r"resuming from .*step-0000000[3-6]\.pt", out), out
    assert final_state(out) == expected


def test_only_checkpoints_named_by_number_are_loaded_or_pruned(tmp_path, reference):
    # A user's `cp step-00000016.pt step-best.pt` was taken for the newest checkpoint (names
    # were sorted): with --keep 1 every new checkpoint was pruned at once. A copy without its
    # marker (step-final.pt) made a finished job fail. Both are ignored now, and kept.
    expected, finished = reference(1)
    best = (finished / "step-00000016.pt").read_bytes()
    (tmp_path / "step-best.pt").write_bytes(best)
    (tmp_path / "step-best.pt.sha256").write_text(hashlib.sha256(best).hexdigest() + "\n")
    (tmp_path / "step-final.pt").write_bytes(best[:100])
    r = forked(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path, "--keep", 1).ok()
    assert "no checkpoint in" in r.stdout  # a fresh start: neither is a checkpoint
    assert final_state(r.stdout) == expected
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["step-00000016.pt", "step-00000016.pt.sha256", "step-best.pt",
                     "step-best.pt.sha256", "step-final.pt"]  # fmt: skip
    assert (tmp_path / "step-best.pt").read_bytes() == best


def test_the_newest_checkpoint_is_the_highest_step_of_any_length(tmp_path):
    names = ["step-9.pt", "step-10.pt", "step-00000016.pt", "step-123456789012.pt", "step-x.pt"]
    for name in ["step-best.pt", "step-16.pt.unreadable", ".step-20.pt.tmp42", *names]:
        (tmp_path / name).write_bytes(b"")
    found = load_script(SCRIPT).checkpoints_in(tmp_path)
    assert [p.name for p in found] == names[3::-1]


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, reference):
    expected, finished = reference(1)
    folder = tmp_path / "ckpt"
    shutil.copytree(finished, folder)
    names = sorted(p.name for p in folder.glob("step-*"))
    assert names == [f"step-{s:08d}.pt{x}" for s in (12, 15, 16) for x in ("", ".sha256")]
    check = subprocess.run(
        ["sha256sum", "-c", *sorted(p.name for p in folder.glob("*.sha256"))],
        cwd=folder, capture_output=True, text=True,
    )  # fmt: skip
    assert check.stdout.count(": OK") == 3  # the markers are plain sha256sum files
    newest = folder / "step-00000016.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    r = forked(SCRIPT, *SMALL, "--checkpoint-dir", folder).ok()
    assert (
        f"WARNING: step-00000016.pt: sha256 mismatch ({len(data) // 2} bytes): truncated or "
        f"corrupted; renamed it *.unreadable"
    ) in r.stderr
    assert f"resuming from {folder}/step-00000015.pt: epoch 2 with 112 of its" in r.stdout
    assert (folder / "step-00000016.pt.unreadable").exists()
    assert final_state(r.stdout) == expected


def test_a_folder_of_only_unreadable_checkpoints_is_kept_aside_and_the_run_starts_over(tmp_path):
    # Each is renamed *.unreadable with a warning naming it and why, and the run starts from
    # step 0: its own checkpoints are not pruned for those. (Until session 24 a finished one,
    # with its sha256, stopped the run instead: NOTES.md, "Rare traps".)
    (tmp_path / "step-00000010.pt").write_bytes(b"not a zip file")
    (tmp_path / "step-00000010.pt.sha256").write_text("0" * 64 + "  step-00000010.pt\n")
    (tmp_path / "step-00000020.pt").write_bytes(b"a save that never finished")
    foreign = tmp_path / "step-00000030.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    digest = hashlib.sha256(foreign.read_bytes()).hexdigest()
    (tmp_path / "step-00000030.pt.sha256").write_text(f"{digest}  step-00000030.pt\n")
    # a pickle that weights_only refuses (a Fraction): rank 0 ended with a traceback
    refused = tmp_path / "step-00000040.pt"
    torch.save({"args": {}, "lr": fractions.Fraction(1, 3)}, refused)
    digest = hashlib.sha256(refused.read_bytes()).hexdigest()
    (tmp_path / "step-00000040.pt.sha256").write_text(f"{digest}  step-00000040.pt\n")
    r = forked(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path, nproc=2).ok()
    reasons = [
        "step-00000040.pt: not a checkpoint of this script",
        "step-00000030.pt: not a checkpoint of this script",
        "step-00000020.pt: no step-00000020.pt.sha256: the save did not finish",
        "step-00000010.pt: sha256 mismatch (14 bytes): truncated or corrupted",
    ]
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARNING: ")]
    assert warnings == [f"WARNING: {why}; renamed it *.unreadable" for why in reasons], r
    assert f"no checkpoint in {tmp_path}: starting from step 0" in r.stdout, r
    aside = sorted(path.name for path in tmp_path.glob("*.unreadable"))
    assert aside == [f"step-000000{n}0.pt.unreadable" for n in (1, 2, 3, 4)], aside
    assert int(VERIFIED.search(r.stdout)[1]) == 2 and (tmp_path / "step-00000008.pt").exists()


def test_a_second_job_in_the_same_checkpoint_dir_is_refused(tmp_path, reference):
    # Two jobs in one folder pruned and overwrote each other's checkpoints, and both ended
    # "verified". Rank 0 holds a lock on DIR/.lock for its job's life.
    first = Watched(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path, launcher="forked")
    first.wait_for("saved step-00000003.pt")  # the first job is under way
    os.kill(first.proc.pid, signal.SIGSTOP)  # and stays so, however fast this machine is
    try:
        second = forked(SCRIPT, *SMALL, "--lr", 0.1, "--checkpoint-dir", tmp_path, nproc=2)
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    for rank in (0, 1):
        assert (
            f"[rank {rank}] error: another job holds {tmp_path}/.lock: use another "
            f"--checkpoint-dir, or wait"
        ) in second.failed().stderr, second
    expected, _ = reference(1)
    assert final_state(first.finish().ok().stdout) == expected  # untouched by the second
    # once the first has ended, the lock is free: the same command finds the run finished,
    # trains nothing, and verifies the same weights
    again = forked(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path).ok()
    assert "the run had finished at step 16: nothing to train" in again.stdout
    assert "saved " not in again.stdout  # nothing trained, nothing saved
    assert final_state(again.stdout) == expected


@pytest.mark.parametrize("size, world", [(128, 3), (10, 4), (7, 2), (3, 4)])
def test_the_sampler_deals_what_distributed_sampler_deals_and_resumes_on_any_world_size(
    size, world
):
    sampler_class = load_script(SCRIPT).ResumableSampler
    dataset = range(size)

    def deals(world_size, start, epoch=5):
        ranks = [sampler_class(dataset, world_size, rank, seed=7) for rank in range(world_size)]
        for sampler in ranks:
            sampler.set_position(epoch, start)
        dealt = [list(sampler) for sampler in ranks]
        # one length, which each rank's deal has: no rank waits for another at the end
        assert {len(sampler) for sampler in ranks} == {len(deal) for deal in dealt}
        return dealt

    # from the top: exactly DistributedSampler's deal, padding included
    stock = [DistributedSampler(dataset, world, rank, seed=7) for rank in range(world)]
    for sampler in stock:
        sampler.set_epoch(5)
    assert deals(world, 0) == [list(sampler) for sampler in stock]
    # part-way (steps of 2 images a rank taken by `world` ranks), on 2 ranks: the rest of the
    # epoch's order, each image once (and the order's head as padding, as at the top)
    start = min(2 * world, size)
    order = torch.randperm(size, generator=torch.Generator().manual_seed(7 + 5)).tolist()
    ranks = deals(2, start)
    dealt = [deal[k] for k in range(len(ranks[0])) for deal in ranks]  # in the order dealt
    assert dealt[: size - start] == order[start:]
    assert dealt[size - start :] == order[: len(dealt) - (size - start)]


def test_a_checkpoint_from_other_settings_or_another_model_is_refused(tmp_path, reference):
    _, finished = reference(1)
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    args = [*SMALL, "--checkpoint-dir", tmp_path]
    r = forked(SCRIPT, *args, "--lr", 0.1, "--train-size", 96).failed()
    assert (
        f"error: {tmp_path}/step-00000016.pt was written with other settings: --lr 0.05 there, "
        f"0.1 here; images 128 synthetic there, 96 synthetic here. Resume with the same ones or "
        f"use another --checkpoint-dir"
    ) in r.stderr
    # a setting that shapes the model: GroupNorm for BatchNorm
    r = forked(SCRIPT, *args, "--norm", "group").failed()
    assert "settings: --norm batch there, group here." in r.stderr
    # the model changed (a layer fewer in the checkpoint), as when build_model is edited:
    # one line, no traceback
    saved = torch.load(tmp_path / "step-00000016.pt", weights_only=True)
    last = next(reversed(saved["model"]))  # the last layer's bias, say
    del saved["model"][last]
    torch.save(saved, tmp_path / "step-00000016.pt")
    digest = hashlib.sha256((tmp_path / "step-00000016.pt").read_bytes()).hexdigest()
    (tmp_path / "step-00000016.pt.sha256").write_text(f"{digest}  step-00000016.pt\n")
    r = forked(SCRIPT, *args).failed()
    line = r.stderr.strip().splitlines()[-1]
    assert line == (  # torch's whole text, which names the key, in one line
        f"[rank 0] error: {tmp_path}/step-00000016.pt does not fit this model or optimizer: "
        f'Error(s) in loading state_dict for MobileNetV3: Missing key(s) in state_dict: "{last}".'
    ), r
    assert "Traceback" not in r.stderr


def test_an_unwritable_checkpoint_dir_stops_every_rank_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = forked(SCRIPT, *SMALL, "--checkpoint-dir", blocker / "ckpt", nproc=2).failed()
    for rank in (0, 1):
        assert (
            f"[rank {rank}] error: cannot write checkpoints in {blocker}/ckpt: Not a directory"
        ) in r.stderr, r
    assert "step " not in r.stdout


def test_a_read_only_checkpoint_dir_is_refused_before_training(tmp_path):
    # Its .lock file was still writable, so the job trained and lost its work at the first
    # save. As root, file permissions do not stop a write: a read-only bind mount does.
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / ".lock").write_text("")
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "--bind", "-o", "ro", folder, folder],
                                 capture_output=True)  # fmt: skip
        if mounted.returncode != 0:
            pytest.skip("root, and no read-only bind mount here")
    else:
        folder.chmod(0o555)
    try:
        r = forked(SCRIPT, *SMALL, "--checkpoint-dir", folder).failed()
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", folder])
        folder.chmod(0o755)
    assert re.search(rf"\[rank 0\] error: cannot write checkpoints in {folder}: ", r.stderr), r
    assert "step " not in r.stdout


def test_the_flight_recorders_dumps_go_beside_the_checkpoints_unless_told(monkeypatch):
    # NCCL's flight recorder writes each rank's record after a timeout, by default to a
    # folder a container loses; 04 points it at the checkpoint folder before it joins the
    # group (in-process: main stops at attempt_store, the first thing after). Bitwise on
    # NVSwitch nodes too: NCCL's NVLS algorithm is off unless the user chose NCCL_ALGO.
    script = load_script(SCRIPT)

    class Joining(Exception):
        pass

    def attempt_store(timeout):
        raise Joining

    monkeypatch.setattr(script, "attempt_store", attempt_store)
    monkeypatch.setattr(script, "Preemption", lambda: None)  # (pytest keeps its SIGTERM)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "")  # (so that the end restores it)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    monkeypatch.setenv("NCCL_ALGO", "")
    monkeypatch.delenv("NCCL_ALGO")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (main sets them: undone after)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    args = script.build_parser().parse_args(["--checkpoint-dir", "/shared/ckpt"])
    with pytest.raises(Joining):
        script.main(args)
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/shared/ckpt/comm_lib_trace_rank_"
    assert os.environ["NCCL_ALGO"] == "^NVLS"
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/mine/trace_")  # the user's, kept
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    with pytest.raises(Joining):
        script.main(args)
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/mine/trace_"
    assert os.environ["NCCL_ALGO"] == "Ring"


def test_a_compiled_models_state_dict_keeps_plain_keys():
    # 04's advice: compile the module in place (model.compile(), before DDP): its state_dict,
    # and so every checkpoint, keeps the keys of the plain model, which a model compiled or not
    # loads; torch.compile(model) would add "_orig_mod.". (03's equivalence matrix trains a
    # compiled model under DDP; compiling costs seconds a run.)
    import torchvision

    model = torchvision.models.resnet18()
    keys = list(model.state_dict())
    model.compile(backend="aot_eager")
    assert list(model.state_dict()) == keys and "conv1.weight" in keys


def test_a_diverging_run_ends_on_its_first_non_finite_loss(tmp_path):
    # --lr 1e6: the first progress line's loss is not finite, and every rank ends there. (A
    # save between progress lines may hold the diverged weights: the check before each
    # save left in session 24, NOTES.md, "Rare traps".)
    args = [*SMALL[:-6], "--log-every", 1, "--lr", "1e6", "--timeout", 60]
    r = forked(SCRIPT, *args, "--checkpoint-dir", tmp_path, nproc=2)
    assert r.returncode == 1, r
    for rank in (0, 1):
        finite = rf"^\[rank {rank}\] CHECK FAILED: finite loss: the loss is (nan|inf): lower --lr$"
        assert re.search(finite, r.stderr, re.M), r
    assert "verified" not in r.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--save-every", "0"], "--save-every: must be >= 1 and < 4294967296, got 0"),
        (["--metrics", "/tmp"], "--metrics: cannot write /tmp: not a file in a writable folder"),
        (["--keep", "-1"], "--keep: must be >= 1 and < 4294967296, got -1"),
        (["--lr", "-1"], "--lr: must be >= 0 and < 4294967296, got -1"),
        (["--lr", "nan"], "--lr: must be >= 0 and < 4294967296, got nan"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        load_script(SCRIPT).build_parser().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_where_torchrun_keeps_its_store_to_itself_04_uses_inits(monkeypatch):
    # torch 2.4.1's torchrun (TORCHELASTIC_USE_AGENT_STORE=False), --spawn and plain runs:
    # init's store is rank 0's already, and 04 adds none (2.15's torchrun: the test above)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert load_script(SCRIPT).attempt_store(5) is None


def test_04_is_03_plus_the_checkpoint_lesson():
    # Teach by diff: every function and class 04 shares with 03 is the same text, but those
    # the checkpoint lesson changes; `diff 03_ddp_train.py 04_checkpoint.py` shows the lesson.

    changed = {"main", "make_loaders", "TrainState", "train_one_epoch", "build_parser"}

    def definitions(name: str) -> dict:
        text = (REPO / name).read_text()
        return {node.name: ast.get_source_segment(text, node) for node in ast.parse(text).body
                if isinstance(node, (ast.FunctionDef, ast.ClassDef))}  # fmt: skip

    ours, theirs = definitions("03_ddp_train.py"), definitions(SCRIPT)
    assert set(ours) <= set(theirs), set(ours) - set(theirs)
    differ = {name for name in ours if ours[name] != theirs[name]}
    assert differ == changed, differ


# --- moved from 03: the metrics log, seeded augmentation -----------------------------------
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_metrics_log_that_cannot_be_written_ends_the_job_with_its_oserror(tmp_path):
    # A full disk (/dev/full: every write fails with ENOSPC) under the log: Python's error,
    # with its traceback (the one line that named the file left in session 24: NOTES.md)
    args = [*SMALL, "--log-every", 2, "--checkpoint-dir", tmp_path]
    r = forked(SCRIPT, *args, "--metrics", "/dev/full").failed()
    last = "[rank 0] error: OSError: [Errno 28] No space left on device"
    assert r.stderr.splitlines()[-1] == last and "Traceback" in r.stderr, r


def test_the_metrics_log_holds_each_progress_line_and_epoch(tmp_path):
    # --metrics: rank 0 appends a JSON line per progress line (that step's loss and accuracy,
    # over both ranks' images) and one per epoch (validation, speed): the figures printed.
    log = tmp_path / "metrics.jsonl"
    args = [*TINY, "--epochs", 2, "--log-every", 1, "--metrics", log]
    args += ["--checkpoint-dir", tmp_path / "ckpt"]
    r = forked(SCRIPT, *args, nproc=2).ok()  # 2 steps an epoch
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["step"], "val_loss" in x) for x in lines] == [
        (1, False), (2, False), (2, True), (3, False), (4, False), (4, True)
    ]  # fmt: skip
    progress = re.findall(
        r"^epoch \d  step\s+(\d+)/4  loss ([\d.]+)  acc\s+([\d.]+)%(?:  slowest: .*)?$",
        r.stdout,
        re.M,
    )
    steps = [x for x in lines if "loss" in x]
    assert [(str(x["step"]), f"{x['loss']:.4f}", f"{x['acc']:.1%}"[:-1]) for x in steps] == progress
    val = re.findall(r"^  val loss ([\d.]+) acc ([\d.]+)% on 32 images$", r.stdout, re.M)
    epochs = [x for x in lines if "val_loss" in x]
    assert [(f"{x['val_loss']:.4f}", f"{x['val_acc']:.1%}"[:-1]) for x in epochs] == val
    assert all(x["lr"] > 0 for x in lines) and all(x["img_s"] > 0 for x in epochs)
    # each progress line: the slowest rank's [data, forward] seconds since the last
    for x in steps:
        [(rank, seconds)] = x["rank_seconds"].items()
        assert rank in ("0", "1") and len(seconds) == 2 and min(seconds) > 0, x


def test_random_augmentation_on_two_ranks_with_workers_equals_one_process(tmp_path):
    # Each image's random crop and flip come from its own seed (run, epoch, index), not from
    # the stream of the worker or rank that loads it: so N processes train on exactly what one
    # would, with --data and DataLoader workers too (GroupNorm, float64: the sums are exact).
    from PIL import Image

    for split, count in (("train", 6), ("val", 2)):
        for name, rgb in (("red", (200, 40, 40)), ("blue", (40, 40, 200))):
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(count):
                image = Image.new("RGB", (24 + 3 * i, 20 + 2 * i), rgb)
                image.putpixel((i, i), (255, 255, 255))
                image.save(tmp_path / split / name / f"{i}.png")
    models = {}
    for nproc in (1, 2):
        path = tmp_path / f"{nproc}.pt"
        args = [*EQUIV, "--data", tmp_path, "--workers", 2]
        args += ["--checkpoint-dir", tmp_path / f"ckpt{nproc}"]
        args += ["--batch-size", 6 // nproc, "--save-model", path]
        r = forked(SCRIPT, *args, nproc=nproc, env=FLOAT64)
        assert "12 train / 4 val images" in r.ok().stdout
        models[nproc] = torch.load(path, weights_only=True)
    diff = max((models[2][k] - models[1][k]).abs().max().item() for k in models[1])
    assert diff < 1e-9, diff


def test_seeded_augmentation_leaves_the_gpus_random_stream_alone(monkeypatch):
    # With --workers 0 the main process loads the images: reseeding the GPU's generator
    # there (torch.manual_seed does) would set dropout's masks from the last image's seed.
    # Checked without a GPU: torch.manual_seed reaches the GPUs through this function.
    script = load_script(SCRIPT)
    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", calls.append)
    torch.manual_seed(0)
    assert calls == [0]  # (the path a GPU's reseeding takes)
    data = script.SeededAugmentation(script.synthetic_images(4, 8, split=0))
    before = torch.random.get_rng_state()
    first = data[1]
    assert calls == [0], calls  # no reseeding of the GPUs
    assert torch.equal(torch.random.get_rng_state(), before)  # nor of this process's stream
    assert torch.equal(data[1][0], first[0])


# --- forensics: the slowest rank, a stuck rank, a rank that skips collectives ---------------
@pytest.mark.parametrize("phase", ["none", "data", "forward"])
def test_a_slow_rank_is_named_in_the_progress_line(phase, tmp_path):
    # 3 ranks, a line every 4 steps; rank 2 spends 200 ms more in each step's data loading
    # (or forward) than its peers, who wait for it in the gradient all-reduce: every line
    # after the first names it and the phase (the first may not: its interval holds the
    # first step's one-off costs). No one is slower: no line names anyone. (50 ms went
    # unnamed in one run of three on a busy machine, load 4 on 2 cores: there a step's own
    # data and forward take 3-5 times as long, and the median rank's with them.)
    anchor = {"data": "images, labels = next(batches)\n", "forward": "logits = model(images)\n"}
    script = SCRIPT
    if phase != "none":  # the line after the phase is entered
        indent = " " * 12 if phase == "data" else " " * 20
        slow = f"{indent}if d.rank == 2:\n{indent}    time.sleep(0.2)\n"
        script = inserted_copy(tmp_path / "slow.py", SCRIPT, indent + anchor[phase], slow)
    args = ["--train-size", 384, "--val-size", 0, "--image-size", 16, "--batch-size", 16]
    args += ["--epochs", 1, "--log-every", 4, "--checkpoint-dir", tmp_path / "ckpt"]
    r = forked(script, *args, nproc=3).ok()
    lines = [line for line in r.stdout.splitlines() if line.startswith("epoch 1  step")]
    assert len(lines) == 2, r  # 8 steps
    slowest = r"  slowest: rank (\d) \((\w+) \+(\d+\.\d\d)s\)$"
    named = [m.groups() if (m := re.search(slowest, x)) else None for x in lines]
    if phase == "none":
        assert named == [None, None], r
    else:
        assert named[1] and named[1][:2] == ("2", phase), r
        assert float(named[1][2]) >= 0.4, r  # 4 steps of 200 ms, less what the others lost
        assert not named[0] or named[0][:2] == ("2", phase), r


def test_the_save_benchmark_runs_04s_own_save(tmp_path):
    # benchmarks/save_blocking.py calls 04's save() and Writer: it broke unnoticed when 04's
    # setup() stopped returning a Dist (found in session 23). One save of each kind, on 03's
    # model with SGD's momentum: 2 x 11.2 M float32 values, a 90 MB checkpoint.
    r = run("benchmarks/save_blocking.py", "--repeats", 1, "--dir", tmp_path, timeout=120).ok()
    assert "checkpoint 90 MB in" in r.stdout, r
    assert re.search(r"background save blocks +[\d.]+ ms", r.stdout), r
    assert re.search(r"a background save costs training -?[\d.]+ ms in all", r.stdout), r


def test_what_a_rank_pays_per_step_does_not_grow_with_the_world(tmp_path):
    # Issue #50, with benchmarks/scale.py's instruments (a counting store, the default
    # group's sequence number, /proc/self/io), at 2 and 4 ranks: per step, each rank makes
    # the same collectives (DDP's two gradient buckets and the stop agreement), writes
    # nothing to the store, and sends what a ring all-reduce sends
    # (2(N-1)/N times the gradients: 1.5 times at 4 ranks what it sends at 2). At start-up a
    # resume reads the checkpoint file once in the job (rank 0), whatever its size.
    out = tmp_path / "counts.json"
    args = ["--sizes", 2, 4, "--steps", 6, "--json", out]
    run("benchmarks/scale.py", *args, timeout=120).ok()
    counts = {int(n): ranks for n, ranks in json.loads(out.read_text()).items()}
    for n, ranks in counts.items():
        assert [r["collectives"] for r in ranks] == [3.0] * n, counts
        assert [r["store_ops"] for r in ranks] == [0] * n, counts
        assert [r["checkpoint_reads"] for r in ranks] == [1] + [0] * (n - 1), counts
    two = sum(r["kb_written"] for r in counts[2]) / 2
    four = sum(r["kb_written"] for r in counts[4]) / 4
    assert 1.4 < four / two < 1.6, counts


# The hang cases under every launcher: `python -m pytest -m hangs` runs the cells the
# default run leaves out (about 15 s of CPU each under torchrun or --spawn: 3 ranks importing
# torch, and the launcher). The default run holds each case once, forked (the frozen rank
# under --spawn: test_plumbing, on 03: a lost peer, named by Gloo alone); torchrun and
# --spawn are in the matrix (the forward case under torchrun left the default run in #50's
# session: 16 s of its 300).
HANGS = pytest.mark.hangs
STUCK = ("--train-size", 384, "--val-size", 0, "--image-size", 16, "--batch-size", 32)


@pytest.mark.parametrize(
    "case, launcher",
    [
        ("data", "forked"),
        pytest.param("forward", "forked", marks=HANGS),  # (the default suite's time)
        pytest.param("forward", "torchrun", marks=HANGS),
        pytest.param("data", "torchrun", marks=HANGS),
        pytest.param("data", "spawn", marks=HANGS),
        pytest.param("forward", "spawn", marks=HANGS),
        pytest.param("frozen", "torchrun", marks=HANGS),
        pytest.param("frozen", "spawn", marks=HANGS),
    ],
)
def test_a_stuck_rank_names_itself_and_leaves_its_stack(case, launcher, tmp_path):
    # 3 ranks, 4 steps each; rank 2 never finishes step 3's data loading (or forward), or
    # stops whole in its data phase (SIGSTOP): the others wait in step 3's gradient
    # all-reduce (their backward phase). Each rank's watchdog ends it --timeout + 1 of its
    # seconds after it entered its phase, before the group's own timeout (10 s later), with
    # its line, its stacks and its flight recorder's record in the checkpoint folder. A
    # launcher's SIGTERM only asks 04 to stop at the end of a step, which no rank reaches. A
    # stopped rank cannot run its watchdog: the launcher SIGKILLs it after its 30 s grace.
    timeout = 2 if launcher == "forked" else 3  # torchrun's ranks start seconds apart
    folder = tmp_path / "ckpt"
    r = run(
        stuck_copy(tmp_path, case),
        *STUCK,
        "--epochs",
        1,
        "--timeout",
        timeout,
        "--checkpoint-dir",
        folder,
        launcher=launcher,
        nproc=3,
        timeout=90,
    ).failed()
    ours = sorted(line for line in r.stderr.splitlines() if line.startswith("[rank "))
    phases = ["backward", "backward", "data" if case == "frozen" else case]
    stuck = [
        stuck_line(i, timeout + 1, f"step 3, {phase}", folder) for i, phase in enumerate(phases)
    ]
    if case == "frozen":  # killed while stopped: no word from it, the launcher names it
        assert len(ours) == 2 and re.search(r"SIGKILL|via 9|code -9", r.stderr), r
    else:
        assert ours[2] == stuck[2], r
    # The ranks' watchdog threads tick about together (each started as the group was
    # joined): a waiting rank ends on its own watchdog, or, where a peer's came first (a
    # busy machine), on Gloo's lost connection, its line naming the same phase.
    lost = re.compile(r"\[rank [01]\] error: RuntimeError: .*gloo/.*; in step 3, backward")
    assert all(line == stuck[i] or lost.fullmatch(line) for i, line in enumerate(ours[:2])), r
    assert r.stderr.count("Traceback") == (launcher == "torchrun"), r  # the agent's own
    ended = [i for i, line in enumerate(ours) if line == stuck[i]]  # by their watchdogs
    for rank in ended:  # every thread's stack, in a file
        assert "in train_one_epoch" in (folder / f"stacks_rank_{rank}").read_text(), r
    if hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):  # torch 2.15, not 2.4.1
        # each rank's record of its collectives: ranks 0 and 1 have queued step 3's gradient
        # buckets, which rank 2 never reached
        status = {rank: fr_status(folder / f"comm_lib_trace_rank_{rank}") for rank in ended}
        for rank, (queued, done) in status.items():
            assert (queued > done) == (rank < 2), status  # 0 and 1 wait, 2 has none in flight
        if 2 in status:  # and it never queued what they wait in (a frozen rank: no record)
            assert all(status[2][0] < q for q, d in status.values() if q > d), status


def fr_status(path: Path) -> tuple[int, int]:
    """A flight recorder's dump: the default group's last queued and last completed
    collective (their sequence numbers), once its last entry is seen to carry the Python
    stack that queued it."""
    import pickle

    record = pickle.loads(path.read_bytes())
    # each entry with the Python stack that queued it (DDP's buckets: the backward's)
    assert "train_one_epoch" in [frame["name"] for frame in record["entries"][-1]["frames"]]
    [status] = record["pg_status"].values()
    return status["last_enqueued_collective"], status["last_completed_collective"]


def test_an_nccl_error_on_rank_0_says_where_it_was(tmp_path):
    # torch 2.15's NCCL engine raises a failed collective as a RuntimeError ending "NCCL Last
    # Error: ..." (raised here by hand in rank 0's step 3 forward; no GPU here). Rank 0's
    # line is one line and ends with its phase, as after Gloo's errors; rank 1, in its
    # backward, loses its peer.
    failed = "NCCL AllReduce failed: unhandled cuda error \\nNCCL Last Error: Cuda failure"
    indent = " " * 20
    line = f"{indent}if d.rank == 0 and state.step == 2:\n"
    line += f"{indent}    raise RuntimeError('{failed}')\n"
    script = inserted_copy(tmp_path / "nccl.py", SCRIPT, indent + "logits = model(images)\n", line)
    r = forked(script, *STUCK, "--epochs", 1, "--checkpoint-dir", tmp_path / "ckpt", nproc=2)
    r = r.failed()
    ours = sorted(line for line in r.stderr.splitlines() if line.startswith("[rank "))
    said = "[rank 0] error: RuntimeError: NCCL AllReduce failed: unhandled cuda error NCCL Last"
    assert ours[0] == said + " Error: Cuda failure; in step 3, forward", r
    assert "gloo/" in ours[1] and ours[1].endswith("; in step 3, backward"), r
    assert "Traceback" not in r.stderr, r


@pytest.mark.parametrize(
    "launcher",
    ["forked", pytest.param("torchrun", marks=HANGS), pytest.param("spawn", marks=HANGS)],
)
def test_a_rank_that_skips_collectives_stands_out_by_its_phase(launcher, tmp_path):
    # Rank 2 skips step 2's progress line and its collectives: its next collective, the stop
    # agreement's one-flag all-reduce, meets the others' three-float one. The rank that
    # receives the wrong size (rank 1, by Gloo's ring) aborts in Gloo's C++ with no line of
    # ours, but its stacks; rank 0 and rank 2 lose a peer, and their lines say where they
    # were: rank 2 ahead, in step 3's backward (the agreement does not wait for its own
    # all-reduce: the gradients' is its first wait). (In 03 the same, with no phases.)
    r = run(
        stuck_copy(tmp_path, "skip"),
        *STUCK,
        "--epochs",
        1,
        "--log-every",
        2,
        "--timeout",
        4,
        "--checkpoint-dir",
        tmp_path / "ckpt",
        launcher=launcher,
        nproc=3,
        timeout=60,
    ).failed()
    ours = sorted(line for line in r.stderr.splitlines() if line.startswith("[rank "))
    assert [line[:8] for line in ours] == ["[rank 0]", "[rank 2]"], r
    assert "op.preamble.length <= op.nbytes. 8 vs 4" in r.stderr, r  # Gloo's, 2.4.1 and 2.15.0
    assert ours[0].startswith("[rank 0] error: RuntimeError: [") and "gloo/" in ours[1], r
    assert ours[0].endswith("; in step 2, progress line"), r
    assert ours[1].endswith("; in step 3, backward"), r
    assert r.stderr.count("Traceback") == (launcher == "torchrun"), r  # the agent's own
    # rank 1's stacks, from faulthandler, which NCCL's watchdog's abort also meets (#51)
    assert "Fatal Python error: Aborted" in r.stderr and "in train_one_epoch" in r.stderr, r
