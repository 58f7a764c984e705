"""plot_metrics.py: the learning curve of a --metrics log, drawn with the standard library.
The points in the picture are the log's, the last line for a step kept."""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET

from launch import PYTHON, REPO

SVG = "{http://www.w3.org/2000/svg}"


def draw(log, out) -> subprocess.CompletedProcess:
    """`python plot_metrics.py LOG --out OUT`, as a user runs it."""
    return subprocess.run(
        [PYTHON, REPO / "plot_metrics.py", log, "--out", out],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_picture_holds_the_logs_points(tmp_path):
    log = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "lr": 0.1, "loss": 2.5, "acc": 0.1},
        {"step": 2, "lr": 0.2, "loss": 2.0, "acc": 0.3},
        {"step": 2, "lr": 0.2, "val_loss": 2.2, "val_acc": 0.25, "img_s": 100.0},
        {"step": 3, "lr": 0.1, "loss": 9.9, "acc": 0.0},  # a killed run's, logged again below
        {"step": 3, "lr": 0.1, "loss": 1.5, "acc": 0.5},  # the resumed run's: kept
        {"step": 4, "lr": 0.05, "loss": 1.0, "acc": 0.75},
        {"step": 4, "lr": 0.05, "val_loss": 1.25, "val_acc": 0.625, "img_s": 110.0},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    log.write_text(text + '{"step": 5, "lr": 0.0, "lo')  # torn by a crash: skipped
    out = tmp_path / "curve.svg"
    done = draw(log, out)
    assert done.returncode == 0, done
    assert done.stdout == f"{out}: 16 points\n"
    assert drawn_points(out) == {
        "loss": [(1, 2.5), (2, 2.0), (3, 1.5), (4, 1.0)],
        "acc": [(1, 0.1), (2, 0.3), (3, 0.5), (4, 0.75)],
        "val_loss": [(2, 2.2), (4, 1.25)],
        "val_acc": [(2, 0.25), (4, 0.625)],
        "lr": [(1, 0.1), (2, 0.2), (3, 0.1), (4, 0.05)],  # the training lines' alone
    }


def test_a_log_without_points_is_one_line_and_no_picture(tmp_path):
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    out = tmp_path / "curve.svg"
    done = draw(log, out)
    assert (done.returncode, done.stderr) == (1, f"error: cannot draw {log}: no point to draw\n")
    assert not out.exists()


def drawn_points(out) -> dict:
    drawn = {}
    for series in ET.parse(out).getroot().iter(f"{SVG}g"):
        if series.get("class") == "series":
            drawn[series.get("data-field")] = [
                (int(c.get("data-step")), float(c.get("data-value")))
                for c in series.iter(f"{SVG}circle")
            ]
    return drawn


def test_what_is_not_a_finite_number_or_an_integer_step_is_skipped_and_counted(tmp_path):
    # other tools write NaN and inf (Python's json reads them); a line that is not UTF-8 and a
    # step that is text ("2") were a refusal of the whole log and a traceback
    log = tmp_path / "metrics.jsonl"
    lines = [
        b'{"step": 1, "lr": 0.1, "loss": 2.5, "acc": 0.1}',
        b'{"step": 2, "lr": 0.1, "loss": NaN, "acc": 0.3}',
        b'{"step": 3, "lr": 0.1, "loss": Infinity, "acc": -Infinity}',
        b'{"step": "4", "lr": 0.1, "loss": 1.0, "acc": 0.5}',
        b'{"step": 5, "lr": 0.1, "loss": 0.5, "acc": "high"}',
        b'{"step": 6, "lr": 0.1, "loss": 0.25, "acc": "\xff"}',  # not UTF-8: the line goes
    ]
    log.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "curve.svg"
    done = draw(log, out)
    assert done.returncode == 0, done
    assert done.stdout.splitlines() == [
        f"{out}: 8 points",
        "skipped 4 value(s) that are not finite numbers (NaN, inf, text)",
    ], done
    assert drawn_points(out) == {
        "loss": [(1, 2.5), (5, 0.5)],
        "acc": [(1, 0.1), (2, 0.3)],
        "lr": [(1, 0.1), (2, 0.1), (3, 0.1), (5, 0.1)],
    }


def test_a_long_run_is_drawn_from_at_most_max_points_per_series(tmp_path):
    log = tmp_path / "metrics.jsonl"
    steps = 50_001
    with log.open("w") as f:
        for step in range(1, steps + 1):
            print(json.dumps({"step": step, "lr": 0.1, "loss": 1 / step, "acc": 0.5}), file=f)
    out = tmp_path / "curve.svg"
    done = draw(log, out)
    assert done.returncode == 0, done
    drawn = drawn_points(out)
    assert done.stdout == f"{out}: {3 * len(drawn['loss'])} points (of {3 * steps})\n"
    assert 1000 < len(drawn["loss"]) <= 2000  # plot_metrics.MAX_POINTS
    assert drawn["loss"][0] == (1, 1.0) and drawn["loss"][-1] == (steps, 1 / steps)
    assert out.stat().st_size < 800_000  # three series of at most 2,000 points


def test_the_picture_reads_as_a_person_reads_a_curve(tmp_path):
    # Issue #53: the axes showed only their minimum and maximum, a loss falling by orders of
    # magnitude on a linear scale, the legend over the curves, no learning rate. Read back
    # from the SVG (a person looked at it rendered by rsvg-convert; CI has no renderer).
    log = tmp_path / "metrics.jsonl"
    with log.open("w") as f:
        for step in range(1, 401):
            lr = 0.05 * min(step / 120, 1)
            print(json.dumps({"step": step, "lr": lr, "loss": 3 / step, "acc": 0.5}), file=f)
    out = tmp_path / "curve.svg"
    assert draw(log, out).returncode == 0
    root = ET.parse(out).getroot()
    panels = {g.get("data-panel"): g for g in root.iter(f"{SVG}g") if g.get("class") == "panel"}
    assert list(panels) == ["loss", "accuracy", "learning rate"]
    assert [panels[p].get("data-scale") for p in panels] == ["log", "linear", "linear"]

    def ticks(panel, axis):
        marks = panels[panel].iter(f"{SVG}text")
        return [float(t.get("data-value")) for t in marks if t.get("data-axis") == axis]

    assert ticks("loss", "y") == [0.001, 0.01, 0.1, 1.0, 10.0]  # 3/400 to 3: powers of ten
    assert ticks("loss", "x") == [0, 100, 200, 300, 400]  # round steps, the last one's too
    assert ticks("learning rate", "y") == [0.0, 0.01, 0.02, 0.03, 0.04, 0.05]
    assert ticks("accuracy", "y") == [0.45, 0.5, 0.55]  # one value: an axis around it
    for panel in panels.values():  # the legend right of the plot area, clear of every curve
        frame = next(r for r in panel.iter(f"{SVG}rect"))
        right = float(frame.get("x")) + float(frame.get("width"))
        xs = [float(c.get("cx")) for c in panel.iter(f"{SVG}circle")]
        legend = [
            float(line.get("x1"))
            for line in panel.iter(f"{SVG}line")
            if line.get("class") == "legend"
        ]
        assert legend and max(xs) <= right < min(legend), panel.get("data-panel")


def test_where_the_steps_go_back_the_lines_after_belong_to_an_earlier_attempt(tmp_path):
    # Issue #52: a resume with another global batch (a 26-step schedule) left the killed
    # attempt's lines for steps 28 and 30, and the curve ran to step 30; a new run from step 0
    # appended to an old log was drawn as one zig-zag with it.
    log = tmp_path / "metrics.jsonl"
    killed = [{"step": s, "lr": 0.1, "loss": 9.0, "acc": 0.0} for s in (10, 20, 28, 30)]
    resumed = [{"step": s, "lr": 0.1, "loss": 1.0, "acc": 0.5} for s in (22, 24, 26)]
    lines = killed + resumed  # the resume is from the step-20 checkpoint
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "curve.svg"
    assert draw(log, out).returncode == 0
    assert drawn_points(out)["loss"] == [(10, 9.0), (20, 9.0), (22, 1.0), (24, 1.0), (26, 1.0)]
    again = [{"step": s, "lr": 0.1, "loss": 2.0, "acc": 0.2} for s in (1, 2)]  # a new run
    with log.open("a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in again))
    assert draw(log, out).returncode == 0
    assert drawn_points(out)["loss"] == [(1, 2.0), (2, 2.0)]
