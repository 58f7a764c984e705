"""06_join_uneven.py: uneven inputs with join, the generic Join, throw, and without join."""

from __future__ import annotations

import re

import pytest
import torch

from launch import run

SCRIPT = "06_join_uneven.py"


def weight(stdout: str) -> float:
    return float(re.search(r"hold identical weights \((-?[\d.]+)\)", stdout)[1])


@pytest.mark.parametrize("launcher, counts, divide", [
    ("torchrun", "6,3,0", "--divide-by-initial-world-size"),
    ("spawn", "2,5", "--no-divide-by-initial-world-size"),
])
def test_join_trains_through_and_gradients_match_the_formula(launcher, counts, divide):
    n = [int(c) for c in counts.split(",")]
    r = run(SCRIPT, "--mode", "join", "--batches-per-rank", counts, divide, "--timeout", 30,
            launcher=launcher, nproc=len(n)).ok()
    assert "steps per rank: " + ", ".join(f"{i}: {c}" for i, c in enumerate(n)) in r.stdout
    assert f"{sum(n)} gradients and the final weight match the closed form" in r.stdout
    # Independently: rank r feeds r + 1, so a step's gradient is the sum of batch * (r + 1)
    # over the active ranks, divided by all ranks or by the active ones.
    torch.manual_seed(0)
    w = torch.nn.Linear(1, 1, bias=False).weight.item()
    for step in range(max(n)):
        active = [rank for rank, c in enumerate(n) if c > step]
        w -= 0.01 * sum(2 * (rank + 1) for rank in active) / (
            len(n) if divide.startswith("--divide") else len(active))
    assert weight(r.stdout) == pytest.approx(w, abs=2e-6)


def test_generic_join_shadows_a_custom_joinable():
    r = run(SCRIPT, "--mode", "join-counter", "--batches-per-rank", "4,1,0", "--batch-size", 3,
            "--timeout", 30, launcher="torchrun", nproc=3).ok()
    assert "the SampleCounter counted 15 samples on every rank" in r.stdout
    assert "5 gradients and the final weight match the closed form" in r.stdout


def test_throw_stops_every_rank_at_the_shortest_length():
    r = run(SCRIPT, "--mode", "throw", "--batches-per-rank", "5,2,4", "--timeout", 30,
            launcher="spawn", nproc=3).ok()
    assert "rank 0 caught: Detected at least one rank that exhausted inputs." in r.stdout
    assert "steps per rank: 0: 2, 1: 2, 2: 2" in r.stdout
    assert r.stdout.strip().endswith("all ranks stopped after 2 step(s)")
    # Inputs divided by their global mean: each of the 2 steps has gradient batch = 2.
    torch.manual_seed(0)
    w = torch.nn.Linear(1, 1, bias=False).weight.item()
    assert weight(r.stdout) == pytest.approx(w - 2 * 0.01 * 2, abs=2e-6)
    assert "6 gradients and the final weight match the closed form" in r.stdout


def test_without_join_uneven_inputs_fail_clearly_within_the_timeout():
    r = run(SCRIPT, "--mode", "no-join", "--batches-per-rank", "4,2", "--timeout", 5,
            launcher="torchrun", nproc=2, timeout=60).failed()
    assert ("error: uneven inputs without join: ranks hold [4, 2] batches, so after 2 steps "
            "some ranks wait for an all-reduce the others never start; it timed out after "
            "5s") in r.stderr
    assert "Use model.join() (--mode join)" in r.stderr
    assert r.seconds < 45  # the process-group timeout ended it, not the test's deadline
