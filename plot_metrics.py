r"""plot_metrics.py: the learning curve of a --metrics log, as an SVG, with the standard library.

Run
  torchrun --standalone --nproc_per_node 2 04_checkpoint.py --metrics metrics.jsonl
  python plot_metrics.py metrics.jsonl --out curve.svg

04_checkpoint.py appends one JSON line per logging step ({"step", "lr", "loss", "acc",
"rank_seconds"}: that step's loss and accuracy over every rank's images, and the slowest
rank's [data, forward] seconds since the last line) and one per epoch ({"step", "lr",
"val_loss", "val_acc", "img_s"}). Three panels, against the global step: loss (training,
validation; on a log scale when it spans more than a decade), accuracy (training,
validation) and the learning rate (the next step's, from the training lines). Axes are
ticked at round values; the legend stands right of the panels, clear of the curves. Each
point carries its step and value (data-step, data-value), so a test, or a person, can read
them back.

A log may hold a step twice: 04 appends, so after a resume the steps logged since its
checkpoint come again. Where the steps go back, a run started again there: the lines before
it for that step and later ones are dropped (the killed attempt's, which a resume with
another schedule may not reach again; or an earlier run's, when a new run from step 0 was
appended to its log), so what is drawn is what an uninterrupted run would have logged. A
line that is not JSON (torn by a crash, or not UTF-8) or has no integer step is skipped, and
so is a value that is not a finite number (NaN and inf, which other tools write): the count
of those is said. A series of more than MAX_POINTS points is drawn from every k-th (and its
last), so a long run's picture stays small.
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
    ("loss", "training", "#1f77b4", 0),
    ("val_loss", "validation", "#d62728", 0),
    ("acc", "training", "#1f77b4", 1),
    ("val_acc", "validation", "#d62728", 1),
    ("lr", "learning rate", "#2ca02c", 2),
]
PANELS = ["loss", "accuracy", "learning rate"]
WIDTH, HEIGHT = 760, 200  # the picture's width, and each panel's height, in pixels
LEFT, RIGHT = 64, 600  # a panel's plot area, left to right; the legend is right of it
MAX_POINTS = 2000  # drawn per series, at most


def read_log(path):
    """{field: [(step, value), ...]} from the log, by step, the last run's lines kept where
    the steps go back; and how many values were not finite numbers."""
    latest = {}  # (step, "train" or "val"): the values of the last line for it
    newest = 0  # the step of the last line read
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
                if step < newest:  # a run that starts again here: the lines after go
                    latest = {key: kept for key, kept in latest.items() if key[0] < step}
                newest = step
                latest[step, kind] = {name: fields[name] for name in names if name in fields}
                if kind == "val":  # its lr is the training line's, drawn once
                    latest[step, kind].pop("lr", None)
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


def ticks(low, high, log=False, least=0.0):
    """Round values from low to high for an axis: 1, 2 or 5 times a power of ten apart, at
    least least (on a log scale, the powers of ten). Returns (ticks, the axis's low, its
    high): the axis ends on a tick at each side."""
    if log:
        first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
        return [10.0**k for k in range(first, last + 1)], 10.0**first, 10.0**last
    if high == low:  # one value: an axis around it
        low, high = low - (abs(low) / 10 or 0.5), high + (abs(high) / 10 or 0.5)
    raw = (high - low) / 5
    power = 10 ** math.floor(math.log10(raw))
    step = max(least, next(k * power for k in (1, 2, 5, 10) if k * power >= raw))
    first, last = math.floor(low / step), math.ceil(high / step)
    values = [round(k * step, 12) for k in range(first, last + 1)]
    return values, values[0], values[-1]


def svg(series, title):
    """The SVG text: one panel per entry of PANELS that has points, stacked."""
    points = [p for values in series.values() for p in values]
    if not points:
        raise ValueError("no point to draw")
    steps, _, _ = ticks(min(s for s, _ in points), max(s for s, _ in points), least=1)
    first, last = steps[0], steps[-1]
    panels = [i for i in range(len(PANELS)) if any(s[3] == i and s[0] in series for s in SERIES)]
    height = 30 + len(panels) * HEIGHT
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="14">'
        f"{html.escape(title)}</text>",
    ]
    for row, panel in enumerate(panels):
        mine = [s for s in SERIES if s[3] == panel and s[0] in series]
        values = [v for s in mine for _, v in series[s[0]]]
        low, high = min(values), max(values)
        log = panel == 0 and low > 0 and high / low > 10  # the loss over more than a decade
        marks, low, high = ticks(low, high, log)
        scale = math.log10 if log else float
        top = 40 + row * HEIGHT
        bottom = top + HEIGHT - 50

        def x(step):
            return LEFT + (step - first) / (last - first) * (RIGHT - LEFT)

        axis = scale(low), scale(high)

        def y(value, top=top, bottom=bottom, axis=axis, scale=scale):
            return bottom - (scale(value) - axis[0]) / (axis[1] - axis[0]) * (bottom - top)

        kind = "log" if log else "linear"
        out.append(
            f'<g class="panel" data-panel="{PANELS[panel]}" data-scale="{kind}">'
            f'<text x="{LEFT}" y="{top - 6}" font-weight="bold">{PANELS[panel]}'
            + (" (log scale)" if log else "")
            + "</text>"
        )
        for value in marks:  # the value axis: a grid line and a label at each tick
            out.append(
                f'<line x1="{LEFT}" y1="{y(value):.1f}" x2="{RIGHT}" y2="{y(value):.1f}" '
                f'stroke="#ddd"/><text class="tick" data-axis="y" data-value="{value!r}" '
                f'x="{LEFT - 4}" y="{y(value) + 4:.1f}" text-anchor="end">{value:g}</text>'
            )
        for step in steps:  # the step axis
            out.append(
                f'<line x1="{x(step):.1f}" y1="{top}" x2="{x(step):.1f}" y2="{bottom}" '
                f'stroke="#eee"/><text class="tick" data-axis="x" data-value="{step!r}" '
                f'x="{x(step):.1f}" y="{bottom + 14}" text-anchor="middle">{step:g}</text>'
            )
        out.append(
            f'<rect x="{LEFT}" y="{top}" width="{RIGHT - LEFT}" height="{bottom - top}" '
            f'fill="none" stroke="black"/>'
            f'<text x="{(LEFT + RIGHT) / 2}" y="{bottom + 30}" text-anchor="middle">step</text>'
        )
        for i, (field, label, colour, _) in enumerate(mine):
            pts = thinned(series[field])
            path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in pts)
            dashes = ' stroke-dasharray="4 3"' if field.startswith("val_") else ""
            out.append(
                f'<g class="series" data-field="{field}">'
                f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"'
                f"{dashes}/>"
            )
            for s, v in pts:
                out.append(
                    f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colour}" '
                    f'data-step="{s}" data-value="{v!r}"/>'
                )
            legend = top + 10 + 18 * i  # right of the plot area: never over a curve
            out.append(
                f'<line class="legend" x1="{RIGHT + 12}" y1="{legend}" x2="{RIGHT + 36}" '
                f'y2="{legend}" stroke="{colour}" stroke-width="2"{dashes}/>'
                f'<text x="{RIGHT + 42}" y="{legend + 4}" fill="{colour}">{label}</text></g>'
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
