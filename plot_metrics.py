r"""plot_metrics.py: the learning curve of a --metrics log, as an SVG, with the standard library.

Run
  torchrun --standalone --nproc_per_node 2 03_ddp_train.py --metrics metrics.jsonl
  python plot_metrics.py metrics.jsonl --out curve.svg

03 and 04 append one JSON line per logging step ({"step", "lr", "loss", "acc",
"rank_seconds"}: that step's loss and accuracy over every rank's images, and each rank's
[data, forward] seconds since the last line) and one per epoch ({"step", "lr",
"val_loss", "val_acc", "img_s"}). Two panels, against the global step: loss (training,
validation) and accuracy (training, validation). Each point carries its step and value
(data-step, data-value), so a test, or a person, can read them back.

A log may hold a step twice: 04 appends, so after a resume the steps logged since its
checkpoint come again. The last line for a step is the one kept, the resumed run's, as an
uninterrupted run would have logged it. A line that is not JSON (torn by a crash, or not
UTF-8) or has no integer step is skipped, and so is a value that is not a finite number
(NaN and inf, which other tools write): the count of those is said. A series of more than
MAX_POINTS points is drawn from every k-th (and its last), so a long run's picture stays small.
"""

import argparse
import html
import json
import math
import os
import sys
from pathlib import Path

# (field in the log, label, colour, panel)
SERIES = [
    ("loss", "training loss", "#1f77b4", 0),
    ("val_loss", "validation loss", "#d62728", 0),
    ("acc", "training accuracy", "#1f77b4", 1),
    ("val_acc", "validation accuracy", "#d62728", 1),
]
PANELS = ["loss", "accuracy"]
WIDTH, HEIGHT, MARGIN = 640, 220, 48  # each panel's size and its margin, in pixels
MAX_POINTS = 2000  # drawn per series, at most


def read_log(path):
    """{field: [(step, value), ...]} from the log, by step, the last line for a step kept;
    and how many values were not finite numbers."""
    latest = {}  # (step, "train" or "val"): the values of the last line for it
    names = [name for name, *_ in SERIES]
    with path.open("rb") as f:  # a line at a time: a long run's log is large
        for line in f:
            try:
                fields = json.loads(line)  # (bytes that are not UTF-8: a ValueError)
                step = fields["step"]
                kind = "val" if "val_loss" in fields else "train"
            except (ValueError, KeyError, TypeError):  # torn, or not a line of ours
                continue
            if type(step) is int:  # (not "2", 2.0 or True)
                latest[step, kind] = {name: fields[name] for name in names if name in fields}
    series = {}
    skipped = 0
    for (step, _), fields in sorted(latest.items()):
        for name, value in fields.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(name, []).append((step, float(value)))
            else:
                skipped += 1
    return series, skipped


def thinned(points):
    """At most MAX_POINTS of points: every k-th, and the last."""
    if len(points) <= MAX_POINTS:
        return points
    picked = points[:: math.ceil(len(points) / (MAX_POINTS - 1))]
    if picked[-1] != points[-1]:
        picked.append(points[-1])
    return picked


def svg(series, title):
    """The SVG text: one panel per entry of PANELS, stacked."""
    points = [p for values in series.values() for p in values]
    if not points:
        raise ValueError("no point to draw")
    first, last = min(s for s, _ in points), max(s for s, _ in points)
    span = max(last - first, 1)
    height = len(PANELS) * HEIGHT + MARGIN
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="14">'
        f"{html.escape(title)}</text>",
    ]
    for panel, name in enumerate(PANELS):
        mine = [s for s in SERIES if s[3] == panel and s[0] in series]
        values = [v for s in mine for _, v in series[s[0]]]
        if not values:
            continue
        low, high = min(values), max(values)
        if high == low:
            low, high = low - 0.5, high + 0.5
        top = MARGIN / 2 + panel * HEIGHT + 10
        left, right, bottom = 72, WIDTH - 16, top + HEIGHT - MARGIN  # room for "9.78e-06"

        def x(step, left=left, right=right):
            return left + (step - first) / span * (right - left)

        def y(value, top=top, bottom=bottom, low=low, high=high):
            return bottom - (value - low) / (high - low) * (bottom - top)

        out.append(
            f'<g class="panel" data-panel="{name}">'
            f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>'
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="black"/>'
            f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{high:.3g}</text>'
            f'<text x="{left - 4}" y="{bottom}" text-anchor="end">{low:.3g}</text>'
            f'<text x="{left}" y="{bottom + 16}">step {first}</text>'
            f'<text x="{right}" y="{bottom + 16}" text-anchor="end">step {last}</text>'
            f'<text x="{left + 6}" y="{top + 2}" font-weight="bold">{name}</text>'
        )
        for i, (field, label, colour, _) in enumerate(mine):
            pts = thinned(series[field])
            path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in pts)
            out.append(
                f'<g class="series" data-field="{field}">'
                f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"'
                + (' stroke-dasharray="4 3"' if field.startswith("val_") else "")
                + "/>"
            )
            for s, v in pts:
                out.append(
                    f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colour}" '
                    f'data-step="{s}" data-value="{v!r}"/>'
                )
            out.append(
                f'<text x="{right - 150}" y="{top + 14 + 14 * i}" fill="{colour}">{label}</text>'
                "</g>"
            )
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("log", type=Path, help="a --metrics file of 03 or 04")
    parser.add_argument(
        "--out", type=Path, default=Path("curve.svg"), help="(default: %(default)s)"
    )
    parser.add_argument("--title", help="(default: the log's name)")
    args = parser.parse_args(argv)
    if args.out.resolve() == args.log.resolve():
        parser.error("--out is the log itself")
    try:
        series, skipped = read_log(args.log)
        text = svg(series, args.title or args.log.name)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot draw {args.log}: {e}")
    tmp = args.out.with_name(f".{args.out.name}.tmp{os.getpid()}")
    try:  # the whole picture or none
        tmp.write_text(text)
        os.replace(tmp, args.out)
    except OSError as e:
        sys.exit(f"error: cannot write {args.out}: {e.strerror}")
    finally:
        tmp.unlink(missing_ok=True)
    drawn = sum(len(thinned(points)) for points in series.values())
    logged = sum(map(len, series.values()))
    print(f"{args.out}: {drawn} points" + (f" (of {logged})" if drawn < logged else ""))
    if skipped:
        print(f"skipped {skipped} value(s) that are not finite numbers (NaN, inf, text)")


if __name__ == "__main__":
    main()
