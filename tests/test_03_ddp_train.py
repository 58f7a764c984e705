"""03_ddp_train.py: it trains, replicas end identical, and N processes equal one."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from launch import (
    COMPILE,
    FIND,
    FLOAT64,
    SMALL_BUCKETS,
    STATIC,
    SYNC_BN,
    UNUSED,
    VIEW,
    edited_copy,
    forked,
    inserted_copy,
    load_script,
    run,
)

SCRIPT = "03_ddp_train.py"
SUMMARY = re.compile(r"^summary: \d+ steps, [\d.]+ img/s.*\ntrain loss ([\d.]+) -> ([\d.]+)$", re.M)
EPOCH = re.compile(r"^epoch \d+ done: train loss ([\d.]+) acc ([\d.]+)%", re.M)
VERIFIED = re.compile(
    r"^verified: (\d+) rank\(s\) hold identical parameters and buffers "
    r"\(([\d,]+) values, sha256 ([0-9a-f]{16})\)",
    re.M,
)
SHORT = [
    "--train-size",
    "384",
    "--val-size",
    "128",
    "--batch-size",
    "32",
    "--epochs",
    "2",
    "--image-size",
    "16",
    "--log-every",
    "3",
    "--timeout",
    "60",
]
TINY = [
    "--arch",
    "resnet18",
    "--image-size",
    "16",
    "--train-size",
    "64",
    "--val-size",
    "32",
    "--batch-size",
    "16",
    "--epochs",
    "1",
    "--timeout",
    "60",
]


def assert_trained(stdout: str, ranks: int) -> None:
    first_loss, last_loss = map(float, SUMMARY.search(stdout).groups())
    epochs = EPOCH.findall(stdout)  # each epoch's line: its loss and accuracy
    assert float(epochs[0][0]) == first_loss and float(epochs[-1][0]) == last_loss, stdout
    first_acc, last_acc = float(epochs[0][1]), float(epochs[-1][1])
    assert last_loss < 0.7 * first_loss, stdout
    assert last_acc > first_acc + 10, stdout
    verified = VERIFIED.search(stdout)
    assert verified and int(verified[1]) == ranks, stdout
    assert stdout.strip().splitlines()[-1].startswith("verified:")
    assert re.search(r"^epoch 1  step\s+3/12\s+loss [\d.]+\s+acc\s+[\d.]+%$", stdout, re.M)


def test_default_training_under_torchrun_learns_and_replicas_match():
    r = run(SCRIPT, *SHORT, launcher="torchrun", nproc=2).ok()
    assert "on 2 x cpu (gloo)" in r.stdout
    assert "12 steps of 32 images x 1 accum per rank" in r.stdout
    assert_trained(r.stdout, 2)
    val = re.findall(r"val loss [\d.]+ acc ([\d.]+)% on 128 images", r.stdout)
    assert len(val) == 2  # every validation image counted once, across both ranks


def test_a_bfloat16_model_is_verified_and_saved(tmp_path):
    # A model in bfloat16 (model.to(torch.bfloat16), as fine-tuning often casts it): the
    # replica check hashed each tensor's .numpy(), which NumPy refuses for bfloat16, so the
    # run ended with a traceback after training and before --save-model. (Cast here after
    # training, where the check begins.) Its values are hashed as float64, exactly.
    anchor = "    verified = verify_replicas_identical(model, d)\n"
    cast = "    model.to(torch.bfloat16)\n"
    script = inserted_copy(tmp_path / "bf16.py", SCRIPT, anchor, cast)
    saved = tmp_path / "model.pt"
    r = forked(script, *TINY, "--save-model", saved, nproc=2).ok()
    assert r.stdout.splitlines()[-1].startswith("verified: 2 rank(s) hold identical"), r
    weights = torch.load(saved, weights_only=True)
    assert weights["fc.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("nproc, images", [(2, 66), (1, 33)])
def test_a_last_batch_of_one_image_is_dropped_not_a_crash(nproc, images):
    # (03's own --spawn launches are test_plumbing's Ctrl-C and frozen-peer jobs)
    # 33 images per rank in batches of 32: the last batch would hold one image, and BatchNorm
    # fails on it in training ("Expected more than 1 value per channel"). Full batches only.
    r = run(
        SCRIPT,
        *TINY[:-4],
        "--train-size",
        images,
        "--batch-size",
        "32",
        "--epochs",
        "2",
        launcher="forked",
        nproc=nproc,
    ).ok()
    assert f"on {nproc} x cpu (gloo)" in r.stdout
    assert "2 steps of 32 images x 1 accum per rank" in r.stdout
    assert re.search(r"^summary: 2 steps, ", r.stdout, re.M)
    assert int(VERIFIED.search(r.stdout)[1]) == nproc


# --- N processes with batch b == one process with batch N*b, over DDP's knobs ----------------
# resnet18 with GroupNorm (no batch statistics, no dropout), 12 images = 2 global batches of 6
# per epoch, 2 epochs: 4 optimizer steps, or 2 with --accum-steps 2. In float64 (env=FLOAT64:
# torch's default dtype, in every rank): in float32 the step-1 weights agree to 1e-10, but
# over many steps a ReLU network amplifies the rounding of a 6-sample mean vs. a mean of 3-
# or 2-sample means into differences up to 1e-2.
EQUIV = [
    "--arch",
    "resnet18",
    "--norm",
    "group",
    "--image-size",
    "16",
    "--train-size",
    "12",
    "--val-size",
    "0",
    "--epochs",
    "2",
    "--lr",
    "0.01",
    "--timeout",
    "60",
]
GLOBAL_BATCH = 6
# The knobs that interact, each pair of them in at least one cell (pairwise coverage): DDP's
# reducer takes all of them, and each changes when or where gradients are all-reduced. Every
# cell must match one process to 1e-9. An unused layer (one forward never calls) rides with
# find_unused_parameters and with static_graph, the two settings that let DDP train it. The
# knobs are not options: each is an edit of a copy of 03 (launch.edited_copy), as a user sets
# them in the DDP(...) call, like the unused layer and the compiled model.
MATRIX = {  # name: (processes, accumulation steps, knobs)
    "static+view": (2, 1, [STATIC, VIEW]),
    "static+accum+unused": (2, 2, [STATIC, UNUSED]),  # pytorch/pytorch#143580
    "static+accum+small_buckets": (2, 2, [STATIC, SMALL_BUCKETS]),
    "find+unused+view": (3, 1, [FIND, UNUSED, VIEW]),
    "find+accum+small_buckets": (3, 2, [FIND, SMALL_BUCKETS]),
    "small_buckets+accum+view": (3, 2, [SMALL_BUCKETS, VIEW]),
    # model.compile() before DDP (aot_eager: no C compiler needed): DDPOptimizer splits the
    # graph at the buckets, and the result is still one process's
    "compile+accum": (2, 2, [COMPILE]),
}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """One process: the references (accumulation 1 and 2); then the cells. Each run is its
    own processes, forked (launch.forked): the launchers are proven by the tests above."""
    folder = tmp_path_factory.mktemp("matrix")
    results = {}
    for accum in (1, 2):
        r = forked(
            SCRIPT,
            *EQUIV,
            "--batch-size",
            GLOBAL_BATCH,
            "--accum-steps",
            accum,
            "--save-model",
            folder / f"ref{accum}.pt",
            env=FLOAT64,
        ).ok()
        results[f"ref{accum}"] = (
            r.stdout,
            torch.load(folder / f"ref{accum}.pt", weights_only=True),
        )
    for name, (nproc, accum, knobs) in MATRIX.items():
        r = forked(
            edited_copy(folder / name, *knobs),
            *EQUIV,
            "--batch-size",
            GLOBAL_BATCH // nproc,
            "--accum-steps",
            accum,
            "--save-model",
            folder / f"{name}.pt",
            nproc=nproc,
            env=FLOAT64,
        ).ok()
        assert "FutureWarning" not in r.stderr  # e.g. a renamed argument
        results[name] = (r.stdout, torch.load(folder / f"{name}.pt", weights_only=True))
    return results


@pytest.mark.parametrize("name", MATRIX)
def test_knob_combinations_train_like_one_process_with_the_whole_batch(name, matrix):
    nproc, accum, knobs = MATRIX[name]
    out, distributed = matrix[name]
    _, reference = matrix[f"ref{accum}"]
    assert f"on {nproc} x cpu (gloo)" in out
    assert f"{4 // accum} steps of {GLOBAL_BATCH // nproc} images x {accum} accum per rank" in out
    assert int(VERIFIED.search(out)[1]) == nproc  # the script's own replica check
    if UNUSED in knobs:  # no gradient, ever; the replica check covers it too
        assert distributed.pop("unused_layer.weight").shape == (8, 8)
        distributed.pop("unused_layer.bias")
    assert not any(k.startswith("module.") for k in distributed)  # saved from model.module
    assert distributed.keys() == reference.keys()
    diff = max((distributed[k] - reference[k]).abs().max().item() for k in reference)
    print(f"{name}: max abs difference from one process: {diff:.3g}")
    assert diff < 1e-9, f"{name}: {diff:.3g} from one process with the whole batch"


def test_bf16_autocast_on_cpu_trains_and_replicas_match():
    # This tests the script's bf16 path, not oneDNN's kernels. On the 2-core x86 VM we run
    # on, oneDNN's AVX-512/AMX bf16 kernels give different gradients for the same batch
    # from call to call (resnet18 at 16 px, 40 backwards: up to 0.07 apart by default,
    # 9e20 with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16; once a suite run ended with a loss
    # that was not a number). With AVX2 the 40 are identical.
    # bf16 without AVX-512 is emulated: 10 s per step of 16 images at 16 px, so 4 per step
    r = forked(
        SCRIPT,
        *TINY,
        "--amp",
        "bf16",
        "--train-size",
        16,
        "--batch-size",
        4,
        "--val-size",
        8,
        nproc=2,
        env={"ONEDNN_MAX_CPU_ISA": "AVX2"},
    ).ok()
    assert re.search(r"^summary: 2 steps, ", r.stdout, re.M) and SUMMARY.search(r.stdout)
    assert int(VERIFIED.search(r.stdout)[1]) == 2


def test_image_folder_training(tmp_path):
    from PIL import Image

    colours = {"red": (220, 30, 30), "blue": (30, 30, 220)}
    for split, count in (("train", 8), ("val", 3)):
        for name, rgb in colours.items():
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (40 + i, 36), rgb).save(tmp_path / split / name / f"{i}.png")
    r = forked(
        SCRIPT,
        "--data",
        tmp_path,
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--epochs",
        "2",
        "--timeout",
        "60",
        nproc=2,
    ).ok()
    assert "16 train / 6 val images, 2 classes" in r.stdout
    assert len(re.findall(r"on 6 images", r.stdout)) == 2
    assert int(VERIFIED.search(r.stdout)[1]) == 2


def test_train_and_val_with_different_classes_are_refused(tmp_path):
    # ImageFolder numbers each split's own folders: without val/b, val's "c" would be label 1
    from PIL import Image

    for split, names in (("train", "abc"), ("val", "ac")):
        for name in names:
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("RGB", (8, 8), (9, 9, 9)).save(tmp_path / split / name / "0.png")
    r = forked(SCRIPT, "--data", tmp_path, "--image-size", "8", "--timeout", "30").failed()
    assert (
        f"[rank 0] error: --data {tmp_path}: train and val hold different class folders"
    ) in r.stderr, r
    assert "Traceback" not in r.stderr


def test_unusable_data_is_a_clear_error(tmp_path):
    from PIL import Image

    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    # a class with images in train and none in val: the message names the split
    split = tmp_path / "split"
    for folder in ("train/a", "train/b", "val/a", "val/b"):
        (split / folder).mkdir(parents=True)
    for folder in ("train/a", "train/b", "val/a"):
        Image.new("RGB", (8, 8)).save(split / folder / "0.png")
    for args, message in [
        (
            ["--train-size", "64", "--batch-size", "32", "--accum-steps", "4"],
            "each rank has 2 full batch(es) of 32 images; a step takes 4",
        ),
        (
            ["--train-size", "64", "--batch-size", "200000"],  # was "global batch 200000"
            "each rank has 0 full batch(es) of 200000 images; a step takes 1",
        ),
        (["--train-size", "1"], "each rank has 0 full batch(es) of 128 images"),
        (
            ["--data", tmp_path],
            f"--data {tmp_path}/train: Couldn't find any class folder in {tmp_path}/train",
        ),
        (
            ["--data", "/nonexistent/imagenet"],
            "--data /nonexistent/imagenet/train: [Errno 2] No such file or directory: "
            "'/nonexistent/imagenet/train'",
        ),
        (["--data", split], f"--data {split}/val: Found no valid file for the classes b."),
        (  # a file, not a folder
            ["--data", split / "train/a/0.png"],
            f"--data {split}/train/a/0.png/train: [Errno 20] Not a directory: "
            f"'{split}/train/a/0.png/train'",
        ),
    ]:
        r = forked(SCRIPT, *args, "--timeout", "30").failed()
        assert f"[rank 0] error: {message}" in r.stderr
        assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--save-model", "/proc/version/model.pt"],
            "--save-model: cannot write /proc/version/model.pt: not a file in a writable folder",
        ),
        (
            ["--save-model", "/proc/no/such/model.pt"],  # refused as root too, where os.access lies
            "--save-model: cannot write /proc/no/such/model.pt: not a file in a writable folder",
        ),
        (
            ["--save-model", "/tmp"],
            "--save-model: cannot write /tmp: not a file in a writable folder",
        ),
        (["--batch-size", "0"], "--batch-size: must be >= 1 and < 4294967296, got 0"),
        (["--accum-steps", "0"], "--accum-steps: must be >= 1 and < 4294967296, got 0"),
        (["--val-size", "-1"], "--val-size: must be >= 0 and < 4294967296, got -1"),
        (["--image-size", "0"], "--image-size: must be >= 1 and < 4294967296, got 0"),
        (["--lr", "nan"], "--lr: must be >= 0 and < 4294967296, got nan"),
        (["--lr", "inf"], "--lr: must be >= 0 and < 4294967296, got inf"),  # trained to -inf
        (["--lr", "-1"], "--lr: must be >= 0 and < 4294967296, got -1"),
        (["--arch", "resnet1000"], "invalid choice: 'resnet1000' (choose from "),
        (["--amp", "fp32"], "invalid choice: 'fp32' (choose from "),
    ],
)
def test_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script(SCRIPT).build_parser().parse_args(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if args[0] == "--arch":
        assert "resnet18" in err and "vit_b_16" in err  # the error lists the choices


def test_a_diverging_run_stops_before_it_saves_anything(tmp_path):
    # --lr 1e6: the loss overflows within a few steps; the all-reduced loss is checked where
    # the log and the epoch end already reduce it, so every rank stops, before any save
    model = tmp_path / "model.pt"
    r = forked(
        SCRIPT,
        *TINY,
        "--train-size",
        "256",
        "--lr",
        "1e6",
        "--log-every",
        "2",
        "--save-model",
        model,
        nproc=2,
    )  # 8 steps
    assert r.returncode == 1, r
    for rank in (0, 1):
        assert re.search(
            rf"^\[rank {rank}\] CHECK FAILED: finite loss: the loss is (nan|-?inf): lower --lr$",
            r.stderr,
            re.M,
        ), r
    assert "verified:" not in r.stdout and not model.exists()


def test_a_save_that_fails_part_way_keeps_the_old_file_and_names_the_new_one(tmp_path):
    # A write that fails part-way, as on a full disk: here a 1 MB file-size limit (launch.run).
    # torch.save straight to the file failed with a RuntimeError traceback naming no file.
    model = tmp_path / "model.pt"
    model.write_bytes(b"an earlier run's weights")
    # Two ranks: rank 0 writes alone, after the last collective, and ends with its line; the
    # other has nothing left to do and ends as it would
    r = forked(SCRIPT, *TINY, "--save-model", model, nproc=2, file_size_kb=1024).failed()
    ranks = sorted(line for line in r.stderr.splitlines() if line.startswith("[rank "))
    assert ranks == [f"[rank 0] error: cannot write {model}: File too large"], r
    assert "epoch 1 done: " in r.stdout and "verified:" not in r.stdout, r  # (said after it)
    assert model.read_bytes() == b"an earlier run's weights"
    # no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_an_output_with_the_longest_name_a_folder_takes_is_written(tmp_path):
    # A name of 244-255 bytes passed --save-model's check and failed after training: the
    # temporary file beside it, ".NAME.tmpPID", was too long. Its name now takes 50 characters.
    script = load_script(SCRIPT)
    longest = tmp_path / ("m" * 252 + ".pt")
    script.write_atomic(longest, b"weights")
    assert longest.read_bytes() == b"weights"
    assert [p.name for p in tmp_path.iterdir()] == [longest.name]


def test_16_bit_greyscale_images_are_scaled_not_clipped_to_white(tmp_path):
    # PIL's convert("RGB") clips a 16-bit image's values to 255: a 16-bit copy of an 8-bit
    # dataset trained on white (5% accuracy, where the 8-bit one reached 32%). Now each pixel
    # is its 8-bit value, as the 8-bit copy's.
    from PIL import Image

    ramp = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16  # 0 .. 65520
    Image.fromarray(ramp).save(tmp_path / "16.png")
    Image.fromarray((ramp // 256).astype(np.uint8)).save(tmp_path / "8.png")
    script = load_script(SCRIPT)
    assert Image.open(tmp_path / "16.png").mode == "I;16"
    wide = np.asarray(script.load_image(tmp_path / "16.png"), dtype=int)
    narrow = np.asarray(script.load_image(tmp_path / "8.png"), dtype=int)
    assert wide.shape == narrow.shape == (64, 64, 3)
    assert np.abs(wide - narrow).max() <= 1 and narrow.max() == 255 and wide.mean() < 128


def test_an_unused_layer_fails_and_torch_distributed_debug_names_it(tmp_path):
    # The most common DDP error, in a copy of 03 with a layer forward never calls.
    # TORCH_DISTRIBUTED_DEBUG=INFO adds the parameters' names; find_unused_parameters=True
    # and static_graph=True fix it (the matrix above trains with both). Each rank fails at its
    # second forward; one that ends first may leave the other a lost peer instead.
    script = edited_copy(tmp_path, UNUSED)
    r = forked(script, *TINY, nproc=2, env={"TORCH_DISTRIBUTED_DEBUG": "INFO"}).failed()
    failed = {
        rank: re.search(
            rf"^\[rank {rank}\] error: RuntimeError: Expected to have finished "
            r"reduction in the prior iteration before starting a new one",
            r.stderr,
            re.M,
        )
        for rank in (0, 1)
    }
    assert any(failed.values()), r
    for rank, line in failed.items():
        if line:
            assert (
                f"Parameters which did not receive grad for rank {rank}: unused_layer.bias, "
                f"unused_layer.weight"
            ) in r.stderr, r
        else:  # its peer ended first (rank 0, the store's host: then its next beat fails)
            lost = rf"^\[rank {rank}\] error: .*(peer|Connection|Broken pipe)"
            assert re.search(lost, r.stderr, re.M), r


def test_sync_batchnorm_is_a_line_for_gpus_that_ddp_refuses_on_the_cpu(tmp_path):
    # 03 shows the conversion as a comment in build_model(); the GPU lane trains the copy that
    # takes it (test_gpu). On the CPU, DDP's constructor refuses it: every rank, one line.
    r = forked(edited_copy(tmp_path, SYNC_BN), *TINY, nproc=2).failed()
    ours = sorted(line for line in r.stderr.splitlines() if line.startswith("[rank "))
    refusal = "error: ValueError: SyncBatchNorm layers only work with GPU modules"
    assert ours == [f"[rank {rank}] {refusal}" for rank in (0, 1)], r


def image_tree(root, classes=("a", "b"), per_class=4, size=(20, 20)) -> None:
    """root/{train,val}/CLASS/i.png: class a 8-bit greyscale (a ramp), the others 8-bit RGB."""
    from PIL import Image

    ramp = np.arange(size[0] * size[1]).reshape(size) * 255 // (size[0] * size[1] - 1)
    for split in ("train", "val"):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                if c == 0:
                    Image.fromarray(ramp.astype(np.uint8)).save(folder / f"{i}.png")
                else:
                    Image.new("RGB", size, (30 * c, 200, 90)).save(folder / f"{i}.png")


def test_an_image_folder_of_greyscale_and_rgb_images_trains(tmp_path):
    # greyscale images come out as RGB (each channel the grey), and both ranks train on the
    # folder tree. (Hidden files, macOS's ._x.png, are no longer skipped: NOTES.md, "Rare
    # traps"; one is named like any unreadable image: the test below.)
    image_tree(tmp_path)
    script = load_script(SCRIPT)
    to_tensor = script.torchvision.transforms.PILToTensor()
    train = script.image_folder(tmp_path / "train", to_tensor)
    assert len(train) == 8
    pixels, label = train[0]  # class a's first: the greyscale ramp, in each RGB channel
    assert label == 0 and pixels.dtype == torch.uint8 and pixels.shape == (3, 20, 20)
    assert torch.equal(pixels[0], torch.arange(400).reshape(20, 20) * 255 // 399)
    r = forked(SCRIPT, "--data", tmp_path, "--image-size", 16, "--batch-size", 4, nproc=2).ok()
    assert "8 train / 8 val images" in r.stdout and int(VERIFIED.search(r.stdout)[1]) == 2, r


@pytest.mark.parametrize("workers, name", [(0, "9.jpg"), (1, "9.jpg"), (0, "._9.png")])
def test_an_unreadable_image_is_named_in_one_line_on_every_rank(workers, name, tmp_path):
    # a truncated JPEG in val/: it was a raw OSError traceback naming no file; read in a
    # DataLoader worker (--workers 1), torch re-raises it holding the worker's traceback.
    # macOS's resource fork ._9.png is not an image either (ImageFolder takes it for one).
    from PIL import Image

    image_tree(tmp_path)
    bad = tmp_path / "val" / "b" / name
    if name == "9.jpg":
        Image.new("RGB", (64, 64), (1, 2, 3)).save(bad, quality=95)
        bad.write_bytes(bad.read_bytes()[:300])
    else:
        bad.write_bytes(b"\x00\x05\x16\x07 Mac OS X resource fork")
    args = ["--data", tmp_path, "--image-size", 16, "--batch-size", 4, "--workers", workers]
    r = forked(SCRIPT, *args, "--timeout", 30, nproc=2)
    assert r.returncode == 1, r
    # The rank whose shard holds it names it. The other learns it from Gloo (the connection
    # closed) or, under a launcher, from its SIGTERM: one line either way.
    ours = [line for line in r.stderr.splitlines() if line.startswith("[rank")]
    file = re.compile(rf"\[rank ([01])\] error: cannot read image {re.escape(str(bad))}: .+")
    [named] = [line for line in ours if file.fullmatch(line)]
    other = [line for line in ours if line != named]
    assert [line[:8] for line in other] == [f"[rank {1 - int(file.fullmatch(named)[1])}]"], r
    # (Gloo words a lost peer as a closed connection or, where a read or write was under
    # way, a reset one or a broken pipe)
    lost = ("] stopped by SIGTERM", "Connection closed by peer", "Connection reset by peer")
    lost += ("error: Broken pipe",)
    assert any(cause in other[0] for cause in lost), r
    assert "Traceback" not in r.stderr, r
