"""04_checkpoint.py: atomic saves, exact resume, fallback, and torchrun's elastic restarts."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess

import pytest
import torch

from launch import Watched, forked, free_port, load_script, run, wait_for_any

SCRIPT = "04_checkpoint.py"
# 512 samples in batches of 16: one process takes 32 steps per epoch, two take 16. Saves come
# every 12 steps and at each epoch's end, so one process saves at 12, 24, 32, 36, 48, 60, 64
# and two at 12, 16, 24, 32.
SMALL = (
    "--train-size",
    512,
    "--batch-size",
    16,
    "--epochs",
    2,
    "--save-every",
    12,
    "--timeout",
    60,
)


def write_sidecar(path) -> None:
    """What the script writes beside a checkpoint: its sha256, in sha256sum's format."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")


def final_state(stdout: str) -> str:
    """The sha256 of the final weights and buffers, from the script's verified line."""
    return re.search(
        r"^verified: \d+ rank\(s\) hold identical parameters and buffers "
        r"\([\d,]+ values, sha256 ([0-9a-f]{16})\)",
        stdout,
        re.M,
    )[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, one per world size, with their checkpoint directories. Forked
    (launch.forked): a world size gives the same final state under every launcher."""
    done = {}

    def get(nproc: int):
        if nproc not in done:
            directory = tmp_path_factory.mktemp(f"reference{nproc}")
            r = forked(SCRIPT, *SMALL, "--checkpoint-dir", directory, nproc=nproc).ok()
            assert "verified: every epoch used each of the 512 samples once" in r.stdout
            done[nproc] = final_state(r.stdout), directory
        return done[nproc]

    return get


@pytest.mark.parametrize(
    "nproc, fail_at, resumed_at, epoch, done",
    [
        (1, 34, 32, 1, 0),  # at an epoch boundary, one process
        (2, 14, 12, 0, 384),  # mid-epoch, two ranks
    ],
)  # and wherever a worker is killed from outside under torchrun, in the next test
def test_a_killed_run_resumed_ends_bitwise_equal_to_an_uninterrupted_one(
    tmp_path, reference, nproc, fail_at, resumed_at, epoch, done
):
    expected, _ = reference(nproc)
    args = (*SMALL, "--checkpoint-dir", tmp_path, "--simulate-failure", fail_at)
    # one process: a real `python 04_checkpoint.py`, killed; two: forked ranks (launch.forked)
    crashed = (run(SCRIPT, *args) if nproc == 1 else forked(SCRIPT, *args, nproc=nproc)).failed()
    assert f"[rank {nproc - 1}] simulated failure at step {fail_at}: SIGKILL" in crashed.stdout
    assert "final state" not in crashed.stdout
    if nproc == 1:
        assert crashed.returncode == -9  # SIGKILL: no cleanup, like a machine that is gone
    resumed = forked(SCRIPT, *args, nproc=nproc).ok()
    assert (
        f"resuming from {tmp_path}/step-{resumed_at:08d}.pt: epoch {epoch} with {done} of "
        f"its 512 samples done, global step {resumed_at}"
    ) in resumed.stdout
    assert "simulated failure" not in resumed.stdout  # the first attempt only
    assert final_state(resumed.stdout) == expected


def test_torchrun_recovers_from_a_worker_killed_from_outside(tmp_path, tmp_path_factory):
    longer = (*SMALL[:4], "--epochs", 3, *SMALL[6:])  # 48 steps: time to kill in between
    ref = forked(SCRIPT, *longer, "--checkpoint-dir", tmp_path_factory.mktemp("ref3"), nproc=2).ok()
    job = Watched(
        SCRIPT,
        *longer,
        "--checkpoint-dir",
        tmp_path,
        launcher="torchrun",
        nproc=2,
        extra=("--max-restarts", 1),
    )
    job.wait_for("saved step-00000012.pt")
    victims = job.pids_with_env("RANK", "1")
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)  # from outside, mid-training: no chance to clean up
    r = job.finish()
    assert r.returncode == 0, f"expected success:\n{r}"
    first, second = r.stdout.split("attempt 2 (TORCHELASTIC_RESTART_COUNT=1)")
    # the newest checkpoint: the last one the first attempt reported, or one it finished
    # writing as it was stopped (saves come at steps 12, 16, 24, 32, 36 and 48)
    saved = [int(s) for s in re.findall(r"saved step-(\d{8})\.pt", first)]
    resumed = int(re.search(r"resuming from .*step-(\d{8})\.pt", second)[1])
    assert resumed >= max(saved) and (resumed % 12 == 0 or resumed % 16 == 0), r
    assert final_state(r.stdout) == final_state(ref.stdout)


def test_two_nodes_recover_when_only_one_agent_counts_the_restart(tmp_path):
    # Two torchrun agents, one worker each. Rank 1's worker is killed; its agent counts a
    # restart (TORCHELASTIC_RESTART_COUNT=1). Rank 0's worker is frozen meanwhile, so its
    # agent sees a healthy worker and a node waiting to rejoin, and restarts it as a
    # membership change, which is not counted (count 0). Scoping the store by the restart
    # count would then put the two ranks in different scopes: they never meet.
    # the uninterrupted reference: 2 ranks as 2 nodes of 1 (each node's ranks share its cores,
    # so the thread count, and with it the float rounding, depends on the node size)
    reference = forked(
        SCRIPT, *SMALL, "--checkpoint-dir", tmp_path / "reference", nproc=2, nnodes=2
    ).ok()
    expected = final_state(reference.stdout)
    rdzv = (
        "--nnodes",
        2,
        "--max-restarts",
        1,
        "--rdzv-backend",
        "c10d",
        "--rdzv-id",
        "job",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
    )
    args = (*SMALL, "--checkpoint-dir", tmp_path / "job")
    jobs = [
        Watched(
            SCRIPT,
            *args,
            launcher="agent",
            nproc=1,
            extra=rdzv,
            timeout=180,
            env={"LOGLEVEL": "INFO"},
        )
        for _ in range(2)
    ]
    node0 = wait_for_any(jobs, "saved step-00000012.pt")
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
    assert re.search(r"resuming from .*step-000000(12|16)\.pt", out), out
    assert final_state(out) == expected


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, reference):
    expected, finished = reference(1)
    directory = tmp_path / "ckpt"
    shutil.copytree(finished, directory)
    names = sorted(p.name for p in directory.glob("step-*"))
    assert names == [f"step-{s:08d}.pt{x}" for s in (48, 60, 64) for x in ("", ".sha256")]
    check = subprocess.run(
        ["sha256sum", "-c", *sorted(p.name for p in directory.glob("*.sha256"))],
        cwd=directory,
        capture_output=True,
        text=True,
    )
    assert check.stdout.count(": OK") == 3  # the sidecars are plain sha256sum files
    newest = directory / "step-00000064.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    r = forked(SCRIPT, *SMALL, "--checkpoint-dir", directory).ok()
    assert (
        f"WARNING: step-00000064.pt is unreadable (sha256 mismatch ({len(data) // 2} bytes): "
        f"truncated or corrupted)"
    ) in r.stderr
    assert f"resuming from {directory}/step-00000060.pt: epoch 1 with 448 of" in r.stdout
    assert (directory / "step-00000064.pt.unreadable").exists()
    assert final_state(r.stdout) == expected


def test_a_directory_of_only_unreadable_checkpoints_stops_the_run(tmp_path):
    (tmp_path / "step-00000010.pt").write_bytes(b"not a zip file")
    (tmp_path / "step-00000010.pt.sha256").write_text("0" * 64 + "  step-00000010.pt\n")
    (tmp_path / "step-00000020.pt").write_bytes(b"a save that never finished")
    foreign = tmp_path / "step-00000030.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    write_sidecar(foreign)
    r = forked(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path, nproc=2).failed()
    reasons = (
        "step-00000030.pt: not a checkpoint of this script (no args, epoch, model, "
        "optimizer, position, rng, scaler, scheduler, seen, step, world_size); "
        "step-00000020.pt: no step-00000020.pt.sha256: the save did not finish; "
        "step-00000010.pt: sha256 mismatch (14 bytes): truncated or corrupted"
    )
    # every rank reaches the same verdict
    assert re.search(r"\[rank 0\] error: ", r.stderr) and re.search(r"\[rank 1\] error: ", r.stderr)
    assert (
        f"] error: {tmp_path} holds 3 checkpoint(s) and none is readable ({reasons}). "
        f"Move them away to start over"
    ) in r.stderr
    assert "step 0" not in r.stdout  # it did not start from scratch


def test_a_second_job_in_the_same_checkpoint_dir_is_refused(tmp_path, reference):
    # Two jobs in one folder pruned and overwrote each other's checkpoints, and both ended
    # "verified". Rank 0 holds a lock on DIR/.lock for its job's life.
    first = Watched(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path)
    first.wait_for("saved step-00000012.pt")  # the first job is under way
    os.kill(first.proc.pid, signal.SIGSTOP)  # and stays so, however fast this machine is
    try:
        second = forked(SCRIPT, *SMALL, "--seed", 1, "--checkpoint-dir", tmp_path, nproc=2)
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    second.failed()
    for rank in (0, 1):
        assert (
            f"[rank {rank}] error: another job holds {tmp_path}/.lock: use another "
            f"--checkpoint-dir, or wait"
        ) in second.stderr, second
    expected, _ = reference(1)
    assert final_state(first.finish().ok().stdout) == expected  # untouched by the second
    # once the first has ended, the lock is free: the same command resumes (nothing to do)
    again = forked(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path).ok()
    assert "nothing to do: --epochs 2 are done" in again.stdout


def test_resuming_on_another_world_size_still_uses_each_sample_once(tmp_path):
    forked(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path, "--simulate-failure", 14, nproc=3).failed()
    # Left: step 12 by three ranks. Epoch 0 took 11 steps (171 = 513 / 3 per rank, one padding
    # repeat); step 12 is epoch 1's first, 48 of 512 samples. Go on with two: 464 left, 232
    # per rank, 15 steps (the last one of 8), so epoch 1 ends at step 27.
    r = run(SCRIPT, *SMALL, "--checkpoint-dir", tmp_path, launcher="spawn", nproc=2).ok()
    assert "world size changed (3 -> 2): random streams reseeded" in r.stdout
    assert "epoch 1 with 48 of its 512 samples done, global step 12" in r.stdout
    assert "step   27  loss" in r.stdout and "step-00000027.pt (end of epoch 1)" in r.stdout
    assert "verified: every epoch used each of the 512 samples once" in r.stdout


def test_a_checkpoint_from_other_settings_is_refused(tmp_path, reference):
    _, finished = reference(1)
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    r = forked(
        SCRIPT, *SMALL[:2], "--batch-size", 8, *SMALL[4:], "--checkpoint-dir", tmp_path
    ).failed()
    assert (
        f"error: {tmp_path}/step-00000064.pt was written with different settings "
        f"(--batch-size 16 there, 8 here); resume with the same values or use another "
        f"--checkpoint-dir"
    ) in r.stderr


def test_an_unwritable_checkpoint_dir_stops_every_rank_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = forked(SCRIPT, *SMALL, "--checkpoint-dir", blocker / "ckpt", nproc=2).failed()
    for rank in (0, 1):
        assert re.search(
            rf"\[rank {rank}\] error: checkpoint directory {blocker}/ckpt is not "
            rf"writable: \[Errno 20\] Not a directory",
            r.stderr,
        ), r
    assert "step " not in r.stdout


def test_bad_arguments_are_usage_errors(capsys):
    module = load_script(SCRIPT)
    for argv, message in [
        (["--save-every", "0"], "--save-every: must be >= 1 and < 4294967296, got 0"),
        (["--keep", "-1"], "--keep: must be >= 1 and < 4294967296, got -1"),
        (["--seed", str(2**64)], f"--seed: must be >= 0 and < 4294967296, got {2**64}"),
        (["--lr", "-1"], "--lr: must be >= 0 and < 4294967296, got -1"),
        (["--weight-decay", "nan"], "--weight-decay: must be >= 0 and < 4294967296, got nan"),
    ]:
        with pytest.raises(SystemExit) as e:
            module.parse_args(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            module.parse_args(["--amp", "fp16"])
        assert "--amp fp16 needs CUDA" in capsys.readouterr().err


def test_a_diverging_run_stops_before_saving_a_non_finite_checkpoint(tmp_path):
    # AdamW at lr 1e9: the loss overflows at once; it is checked where it is all-reduced,
    # before each save, so no checkpoint with NaN weights is written (or prunes a good one)
    r = forked(
        SCRIPT,
        *SMALL[:6],
        "--save-every",
        2,
        "--lr",
        "1e9",
        "--timeout",
        60,
        "--checkpoint-dir",
        tmp_path,
        nproc=2,
    )
    assert r.returncode == 1, r
    for rank in (0, 1):
        assert re.search(
            rf"^\[rank {rank}\] error: loss is not finite at step \d+; lower --lr$", r.stderr, re.M
        ), r
    assert "verified" not in r.stdout
    for saved in tmp_path.glob("step-*.pt"):  # those written before it diverged: finite
        model = torch.load(saved, weights_only=True)["model"]
        assert all(t.isfinite().all() for t in model.values() if t.is_floating_point()), saved


def test_without_restarts_the_agents_store_stays(monkeypatch):
    # torchrun without --max-restarts: no attempt can follow, so the agent's store (which
    # outlives rank 0) stays the group's; NCCL relays its flight-recorder dump signal there
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert load_script(SCRIPT).attempt_store(5) is None
