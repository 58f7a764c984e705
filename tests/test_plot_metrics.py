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
    assert done.stdout == f"{out}: 12 points\n"
    drawn = {}
    for series in ET.parse(out).getroot().iter(f"{SVG}g"):
        if series.get("class") == "series":
            drawn[series.get("data-field")] = [
                (int(c.get("data-step")), float(c.get("data-value")))
                for c in series.iter(f"{SVG}circle")
            ]
    assert drawn == {
        "loss": [(1, 2.5), (2, 2.0), (3, 1.5), (4, 1.0)],
        "acc": [(1, 0.1), (2, 0.3), (3, 0.5), (4, 0.75)],
        "val_loss": [(2, 2.2), (4, 1.25)],
        "val_acc": [(2, 0.25), (4, 0.625)],
    }


def test_a_log_without_points_is_one_line_and_no_picture(tmp_path):
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    out = tmp_path / "curve.svg"
    done = draw(log, out)
    assert (done.returncode, done.stderr) == (1, f"error: cannot draw {log}: no point to draw\n")
    assert not out.exists()
