"""06_join_uneven.py: uneven inputs with join, the generic Join, throw, and without join; a
NaN loss skipped by every rank; mismatched collectives named."""

from __future__ import annotations

import re

import pytest
import torch

from launch import forked, load_script, run

SCRIPT = "06_join_uneven.py"


def weight(stdout: str) -> float:
    return float(re.search(r"hold identical weights \((-?[\d.]+)\)", stdout)[1])


@pytest.mark.parametrize(
    "launcher, counts, divide",
    [  # forked: launch.forked
        ("forked", "6,3,0", "--divide-by-initial-world-size"),
        ("spawn", "2,5", "--no-divide-by-initial-world-size"),
    ],
)
def test_join_trains_through_and_gradients_match_the_formula(launcher, counts, divide):
    n = [int(c) for c in counts.split(",")]
    stdout = (
        run(
            SCRIPT,
            "--mode",
            "join",
            "--batches-per-rank",
            counts,
            divide,
            "--timeout",
            30,
            launcher=launcher,
            nproc=len(n),
        )
        .ok()
        .stdout
    )
    assert f"steps per rank {n}: their {sum(n)} gradients and the final weight match" in stdout
    # Independently: rank r feeds r + 1, so a step's gradient is the sum of batch * (r + 1)
    # over the active ranks, divided by all ranks or by the active ones.
    torch.manual_seed(0)
    w = torch.nn.Linear(1, 1, bias=False).weight.item()
    for step in range(max(n)):
        active = [rank for rank, c in enumerate(n) if c > step]
        w -= (
            0.01
            * sum(2 * (rank + 1) for rank in active)
            / (len(n) if divide.startswith("--divide") else len(active))
        )
    assert weight(stdout) == pytest.approx(w, abs=2e-6)


def test_generic_join_shadows_a_custom_joinable():
    stdout = (
        forked(
            SCRIPT,
            "--mode",
            "join-counter",
            "--batches-per-rank",
            "4,1,0",
            "--batch-size",
            3,
            "--timeout",
            30,
            nproc=3,
        )
        .ok()
        .stdout
    )
    assert "the SampleCounter counted 15 samples on every rank" in stdout
    assert "5 gradients and the final weight match the closed form" in stdout


def test_throw_stops_every_rank_at_the_shortest_length():
    r = forked(
        SCRIPT, "--mode", "throw", "--batches-per-rank", "5,2,4", "--timeout", 30, nproc=3
    ).ok()
    assert "rank 0 caught: Detected at least one rank that exhausted inputs." in r.stdout
    assert "steps per rank [2, 2, 2]: their 6 gradients and the final weight match" in r.stdout
    # Inputs divided by their global mean: each of the 2 steps has gradient batch = 2.
    torch.manual_seed(0)
    w = torch.nn.Linear(1, 1, bias=False).weight.item()
    assert weight(r.stdout) == pytest.approx(w - 2 * 0.01 * 2, abs=2e-6)


@pytest.mark.parametrize(
    "mode, counts, bad",
    [
        ("join", "5,2,4", "2:1"),  # rank 2's loss at step 1, while all three are active
        ("join-counter", "2,5,0,4", "1:3"),  # at step 3: ranks 1, 3 active, 0 and 2 joined
    ],
)
def test_a_nonfinite_loss_is_skipped_by_every_rank_together(mode, counts, bad):
    n = [int(c) for c in counts.split(",")]
    bad_rank, bad_step = map(int, bad.split(":"))
    stdout = (
        forked(
            SCRIPT,
            "--mode",
            mode,
            "--batches-per-rank",
            counts,
            "--nonfinite-at",
            bad,
            "--timeout",
            30,
            nproc=len(n),
        )
        .ok()
        .stdout
    )
    active = [rank for rank, c in enumerate(n) if c > bad_step]
    assert (
        f"step {bad_step} (rank {bad_rank}'s loss not finite) skipped on all "
        f"{len(active)} active ranks, its update left out"
    ) in stdout
    # every gradient checked, the bad step's NaN on every active rank included
    assert f"their {sum(n)} gradients and the final weight match" in stdout
    torch.manual_seed(0)
    w = torch.nn.Linear(1, 1, bias=False).weight.item()
    for step in range(max(n)):
        if step != bad_step:
            w -= 0.01 * sum(2 * (rank + 1) for rank, c in enumerate(n) if c > step) / len(n)
    assert weight(stdout) == pytest.approx(w, abs=2e-6)
    if mode == "join-counter":  # the bad step's samples were seen too
        assert f"the SampleCounter counted {2 * sum(n)} samples on every rank" in stdout


def test_without_join_the_uneven_end_is_named_on_every_rank():
    r = forked(
        SCRIPT, "--mode", "no-join", "--batches-per-rank", "4,2,4", "--timeout", 30, nproc=3
    ).failed()
    for rank in range(3):
        assert re.search(
            rf"^\[rank {rank}\] error: uneven inputs without join: at step 2 ranks "
            r"\[1\] have no batch left and ranks \[0, 2\] are still training: "
            r"use model\.join\(\) \(--mode join\) or even inputs \(drop_last\)$",
            r.stderr,
            re.M,
        ), r
    assert r.seconds < 20  # named at once, not after --timeout


def test_mismatched_collectives_are_reported_on_every_rank():
    r = forked(SCRIPT, "--mode", "mismatch", "--timeout", 30, nproc=3).failed()
    for rank in range(3):
        report = re.search(
            rf"^\[rank {rank}\] Detected mismatch between collectives on ranks\. "
            rf"Rank {rank} is running collective: .*$",
            r.stderr,
            re.M,
        )
        assert report, r
        assert "OpType=ALLREDUCE" in report[0]
        assert ("TensorShape=[3]" if rank == 0 else "TensorShape=[2]") in report[0]
    assert "error: collectives do not match across ranks: torch's report" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nonfinite-at", "1"], "error: --nonfinite-at: expected RANK:STEP"),
        (["--nonfinite-at", "1:x"], "--nonfinite-at: invalid integers value: '1:x'"),
        (
            ["--batches-per-rank", "6,-1"],
            "--batches-per-rank: must be >= 0 and < 4294967296, got -1",
        ),
        (["--batch-size", "0"], "--batch-size: must be >= 1 and < 4294967296, got 0"),
    ],
)
def test_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script(SCRIPT).parse_args(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "mode, counts, bad, message",
    [
        ("join", "5,3", "1:3", "--nonfinite-at: rank 1 runs no step 3"),
        ("throw", "5,2", "0:3", "--nonfinite-at: rank 0 runs no step 3"),  # throw stops at 2
        ("join", "5,3", "2:0", "--nonfinite-at: rank 2 runs no step 0"),
    ],
)
def test_a_nonfinite_step_that_never_runs_is_refused_before_training(mode, counts, bad, message):
    r = forked(SCRIPT, "--mode", mode, "--batches-per-rank", counts, "--nonfinite-at", bad, nproc=2)
    ranks = sorted(line for line in r.failed().stderr.splitlines() if line.startswith("[rank "))
    assert ranks == [f"[rank {i}] error: {message}" for i in (0, 1)], r


def test_debug_detail_is_refused_where_it_crashes_ddp_on_gloo():
    # torch 2.14.1 and 2.15.0: DDP's constructor segfaults under DETAIL on Gloo (exit -11,
    # no line); 2.4.1 trains. Refused at parse time where torch is affected, naming it.
    r = forked(SCRIPT, "--batches-per-rank", "2", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    if torch.__version__ >= (2, 14):
        assert r.returncode == 2, r
        assert r.stderr.strip().splitlines()[-1] == (
            "06_join_uneven.py: error: TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DDP on Gloo in "
            f"torch {torch.__version__}: use INFO"
        ), r
    else:
        assert "verified: 1 rank(s) hold identical weights" in r.ok().stdout, r
