"""02_sampler.py: every rank's indices against the documented DistributedSampler algorithm."""

from __future__ import annotations

import json
import math

import pytest
import torch

from launch import forked, load_script, run

SCRIPT = "02_sampler.py"


def documented_shards(n, w, shuffle, seed, epoch, drop_last) -> list[list[int]]:
    """DistributedSampler as its docs describe it, written out independently."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(n))
    per_rank = n // w if drop_last else math.ceil(n / w)
    total = per_rank * w
    order = order[:total] if drop_last else (order * math.ceil(total / n))[:total]
    return [order[r::w] for r in range(w)]


CASES = [  # launcher, world size, dataset size, shuffle, drop_last, workers, epochs
    ("forked", 1, 7, True, False, 0, 2),
    ("torchrun", 2, 10, True, False, 2, 3),
    ("spawn", 2, 10, True, False, 2, 3),  # the same job as above, other launcher
    ("forked", 3, 10, True, True, 0, 2),
    ("forked", 3, 11, False, False, 0, 2),
    ("forked", 4, 3, True, False, 2, 2),  # fewer samples than ranks
    ("forked", 4, 3, True, True, 0, 2),  # ... with drop_last: nobody gets anything
    ("forked", 3, 1, True, False, 0, 2),  # one sample
]
# "forked": fresh processes forked from a server that has imported torch (launch.forked);
# the launchers themselves are proven by the torchrun and spawn cases.
dumps = {}


def case_args(n, shuffle, drop_last, workers, epochs, path) -> list:
    return [
        "--dataset-size",
        n,
        "--epochs",
        epochs,
        "--workers",
        workers,
        "--batch-size",
        4,
        "--seed",
        7,
        "--dump-indices",
        path,
        "--timeout",
        60,
        "--shuffle" if shuffle else "--no-shuffle",
    ] + (["--drop-last"] if drop_last else [])


@pytest.mark.parametrize("launcher, w, n, shuffle, drop_last, workers, epochs", CASES)
def test_each_rank_gets_the_documented_shard(
    launcher, w, n, shuffle, drop_last, workers, epochs, tmp_path
):
    path = tmp_path / "dump.json"
    args = case_args(n, shuffle, drop_last, workers, epochs, path)
    stdout = run(SCRIPT, *args, launcher=launcher, nproc=w).ok().stdout
    dump = json.loads(path.read_text())
    assert dump["world_size"] == w and dump["dataset_size"] == n
    for epoch in range(epochs):
        expected = documented_shards(n, w, shuffle, 7, epoch, drop_last)
        got = [dump["epochs"][str(epoch)][str(rank)] for rank in range(w)]
        assert got == expected, f"epoch {epoch}"
    per_rank = n // w if drop_last else math.ceil(n / w)
    last = stdout.strip().splitlines()[-1]
    assert last.startswith(f"verified: {w} rank(s) x {per_rank} samples per epoch; ")
    if drop_last:
        dropped = n % w if n >= w else n
        assert f"shards disjoint, {dropped} dropped per epoch" in last
    else:
        assert f"shards cover all {n}, {per_rank * w - n} padding repeat(s)" in last
    if workers and not drop_last:
        dumps[(w, n, epochs)] = dumps.get((w, n, epochs), []) + [dump["draws"]]


def test_augmentation_draws_are_reproducible_across_launchers():
    draws = dumps.get((2, 10, 3))
    if not draws or len(draws) < 2:
        pytest.skip("needs the torchrun and spawn runs of the same job above")
    assert draws[0] == draws[1]  # same --seed: the same draws, whoever launched the job
    streams = [tuple(s) for rank in draws[0].values() for epoch in rank for s in epoch.values()]
    assert len(streams) == 2 * 2 * 3 and len(set(streams)) == len(streams)


def test_table_marks_padding_and_drops():
    padded, dropped = (
        forked(SCRIPT, "--dataset-size", 5, "--no-shuffle", "--epochs", 1, *extra, nproc=3)
        .ok()
        .stdout
        for extra in ([], ["--drop-last"])
    )
    # 5 samples, 3 ranks, no shuffle
    assert "  rank 0: 0 3\n  rank 1: 1 4\n  rank 2: 2 0*\n" in padded
    assert "  rank 0: 0\n  rank 1: 1\n  rank 2: 2\n  dropped: 3 4\n" in dropped


def test_forgetting_set_epoch_repeats_the_order_and_says_so(tmp_path):
    path = tmp_path / "dump.json"
    r = forked(SCRIPT, "--forget-set-epoch", "--epochs", 3, "--dump-indices", path, nproc=2).ok()
    assert "BUG SHOWN: set_epoch was never called, so all 3 epochs used the same order" in r.stdout
    epochs = json.loads(path.read_text())["epochs"]
    assert epochs["0"] == epochs["1"] == epochs["2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset-size", "0"], "--dataset-size: must be >= 1 and < 4294967296, got 0"),
        (["--dataset-size", "-4"], "--dataset-size: must be >= 1 and < 4294967296, got -4"),
        (["--seed", "-1"], "--seed: must be >= 0 and < 4294967296, got -1"),
        (
            ["--seed", str(2**64)],
            f"--seed: must be >= 0 and < 4294967296, got {2**64}",
        ),  # overflowed
    ],
)
def test_out_of_range_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script(SCRIPT).parse_args(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
