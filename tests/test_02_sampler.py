"""02_sampler.py: every rank's indices against the documented DistributedSampler algorithm.

The script checks, on every rank, that what each rank's DataLoader yielded equals its
documented_shards() and that no two augmentation draws repeat, and says `verified:` when
both hold. These tests prove the three links: documented_shards() is what torch's
DistributedSampler does (in-process, over many shapes); each check fails when what it checks
is broken (an edited copy of the script); and real launches end in `verified:`."""

from __future__ import annotations

import argparse
import math
import re

import pytest
from torch.utils.data.distributed import DistributedSampler

from launch import REPO, forked, load_script, run

SCRIPT = "02_sampler.py"


def torch_shards(n, w, shuffle, drop_last, epoch, seed=7) -> list[list[int]]:
    """What torch's own DistributedSampler gives each of w ranks in that epoch."""
    shards = []
    for rank in range(w):
        sampler = DistributedSampler(
            range(n), num_replicas=w, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_documented_algorithm_is_what_torch_does(shuffle, drop_last):
    documented_shards = load_script(SCRIPT).documented_shards
    for n in range(1, 14):
        for w in range(1, 6):
            args = argparse.Namespace(dataset_size=n, shuffle=shuffle, seed=7, drop_last=drop_last)
            for epoch in range(3):
                expected = torch_shards(n, w, shuffle, drop_last, epoch)
                assert documented_shards(args, w, epoch) == expected, (n, w, epoch)


CASES = [  # launcher, world size, dataset size, shuffle, drop_last, workers, epochs
    ("forked", 1, 7, True, False, 0, 2),
    ("forked", 2, 10, True, False, 1, 3),  # as torchrun's workers, and, the same job:
    ("spawn", 2, 10, True, False, 1, 3),
    ("forked", 3, 10, True, True, 0, 2),
    ("forked", 3, 11, False, False, 0, 2),
    ("forked", 4, 3, True, False, 2, 2),  # fewer samples than ranks
    ("forked", 4, 3, True, True, 0, 2),  # ... with drop_last: nobody gets anything
    ("forked", 3, 1, True, False, 0, 2),  # one sample
]
# "forked": fresh processes forked from a server that has imported torch (launch.forked), with
# the variables torchrun gives its workers; spawn is 02's own launch (its ranks re-import 02).
# torchrun itself is proven by 01's and 03's tests: the plumbing is one text in all six.
checksums = {}


@pytest.mark.parametrize("launcher, w, n, shuffle, drop_last, workers, epochs", CASES)
def test_each_rank_gets_the_documented_shard(launcher, w, n, shuffle, drop_last, workers, epochs):
    args = ["--dataset-size", n, "--epochs", epochs, "--workers", workers, "--seed", 7]
    args += ["--timeout", 60]
    if not shuffle:
        args.append("--no-shuffle")
    if drop_last:
        args.append("--drop-last")
    stdout = run(SCRIPT, *args, launcher=launcher, nproc=w).ok().stdout
    per_rank = n // w if drop_last else math.ceil(n / w)
    orders = {str(torch_shards(n, w, shuffle, drop_last, epoch)) for epoch in range(epochs)}
    shards, draws = stdout.strip().splitlines()[-2:]
    assert shards == (
        f"verified: {w} rank(s) x {per_rank} samples per epoch, as documented; "
        f"{len(orders)} distinct order(s) in {epochs} epoch(s)"
    )
    found = re.fullmatch(
        r"verified: (\d+) augmentation draws, all distinct \(checksum (\w+)\)", draws
    )
    assert found and int(found[1]) == w * per_rank * epochs, draws
    if (w, n, workers, epochs) == (2, 10, 1, 3):
        checksums[launcher] = found[2]


def test_augmentation_draws_are_reproducible_across_launchers():
    if len(checksums) < 2:
        pytest.skip("needs the forked and spawn runs of the same job above")
    assert checksums["forked"] == checksums["spawn"]  # same --seed, same draws


# Each check fails when what it checks breaks: an edited copy of the script, run on 2 ranks.
BROKEN = [
    # the classic seeding bug: one seed on every rank, so worker k of each makes the same draws
    (
        "torch.manual_seed(args.seed + dist.get_rank())",
        "torch.manual_seed(args.seed)",
        "CHECK FAILED: distinct augmentations: 10 draws repeat another's",
    ),
    # the sampler is told epoch 0 every epoch while the script believes set_epoch(epoch)
    (
        "sampler.set_epoch(epoch)  #",
        "sampler.set_epoch(0)  #",
        "CHECK FAILED: documented shards: epoch 1: ranks [0, 1] got other samples",
    ),
]


@pytest.mark.parametrize("anchor, edit, message", BROKEN, ids=["seed", "set_epoch"])
def test_each_check_fails_when_its_property_breaks(anchor, edit, message, tmp_path):
    source = (REPO / SCRIPT).read_text()
    assert source.count(anchor) == 1
    script = tmp_path / "broken_sampler.py"
    script.write_text(source.replace(anchor, edit))
    r = forked(script, "--workers", 2, "--timeout", 60, nproc=2)
    assert r.returncode == 1, r
    assert f"[rank 0] {message}\n" in r.stderr and f"[rank 1] {message}\n" in r.stderr, r


def test_table_marks_padding_and_drops():
    common = ["--dataset-size", 5, "--no-shuffle", "--epochs", 1]
    padded = forked(SCRIPT, *common, nproc=3).ok().stdout
    dropped = forked(SCRIPT, *common, "--drop-last", nproc=3).ok().stdout
    # 5 samples, 3 ranks, no shuffle
    assert "  rank 0: 0 3\n  rank 1: 1 4\n  rank 2: 2 0*\n" in padded
    assert "  rank 0: 0\n  rank 1: 1\n  rank 2: 2\n  dropped: 3 4\n" in dropped


def test_forgetting_set_epoch_repeats_the_order_and_says_so():
    r = forked(SCRIPT, "--forget-set-epoch", "--epochs", 3, nproc=2).ok()
    assert "BUG SHOWN: set_epoch never called, so every epoch repeated epoch 0's order" in r.stdout
    assert "1 distinct order(s) in 3 epoch(s)" in r.stdout


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
        load_script(SCRIPT).build_parser().parse_args(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
