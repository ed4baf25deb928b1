"""A run's curves as one hand-written SVG: loss (training and, when the run validated, validation) and
model TFLOPS over steps (no plotting library).

    python -m megatrain_cli.plot RUN_DIR      # reads RUN_DIR/metrics.jsonl, writes RUN_DIR/metrics.svg
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape

# (chart title, its series: (metrics.jsonl key, legend label, sparse)). A series with no value at all
# (TFLOPS of an old log, the validation loss of a run without validation) is skipped, and so is a chart
# left with none. A sparse series is measured at some steps only (validation: every eval.every_n_steps):
# its line joins the steps that have a value; a dense one breaks where a step has none (a skipped step).
CHARTS = [
    ("loss", [("loss", "training", False), ("val_loss", "validation", True)]),
    ("model TFLOPS (recompute not counted)", [("model_tflops", "", False)]),
]
WIDTH, CHART_HEIGHT = 720, 260
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 20, 32, 40
SERIES_COLOURS = ["#1f77b4", "#d62728"]  # each chart's first series
SPARSE_COLOUR = "#ff7f0e"  # the validation loss


# ---------------------------------------------------------------- reading
def read_records(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl, ordered by step, the LAST record of a repeated step kept
    (a resumed run appends the steps after its checkpoint again). A truncated final line -- a crash
    mid-write -- is skipped; any other unreadable line is an error."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; nothing to plot (is logging.jsonl off, or has the run "
                                f"not logged a step yet?)")
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty; nothing to plot")
    by_step: dict[int, dict] = {}
    for index, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError) as err:
            if index == len(lines) - 1 and index > 0:
                break
            raise ValueError(f"{path}:{number}: not a metrics record ({err})") from None
        by_step[step] = record
    return [by_step[step] for step in sorted(by_step)]


def segments(records: list[dict], key: str, sparse: bool = False) -> list[list[tuple[int, float]]]:
    """(step, value) runs of `key`; a step without a finite value ends a run, so gaps show as gaps.
    `sparse`: a step without the key (or with null: not measured there) does not end a run; a
    non-finite value still does."""
    runs: list[list[tuple[int, float]]] = [[]]
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            runs[-1].append((int(record["step"]), float(value)))
        elif runs[-1] and not (sparse and value is None):
            runs.append([])
    return [run for run in runs if run]


# ---------------------------------------------------------------- axes
def nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """About `count` round tick values (1, 2, 2.5 or 5 times a power of ten) covering [lo, hi]."""
    if hi <= lo:  # one value: give it some room
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, count - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(1.0, math.ceil(step))
    first, last = math.floor(lo / step), math.ceil(hi / step)
    return [round(i * step, 12) for i in range(first, last + 1)]


def tick_label(value: float) -> str:
    return f"{value:.6g}"


class Frame:
    """Maps data coordinates to the SVG pixels of one chart's plot area."""

    def __init__(self, top: float, x_range: tuple[float, float], y_range: tuple[float, float]):
        self.left, self.right = MARGIN_LEFT, WIDTH - MARGIN_RIGHT
        self.top, self.bottom = top + MARGIN_TOP, top + CHART_HEIGHT - MARGIN_BOTTOM
        self.x_lo, self.x_hi = x_range
        self.y_lo, self.y_hi = y_range

    def x(self, value: float) -> float:
        return self.left + (value - self.x_lo) / (self.x_hi - self.x_lo) * (self.right - self.left)

    def y(self, value: float) -> float:
        return self.bottom - (value - self.y_lo) / (self.y_hi - self.y_lo) * (self.bottom - self.top)


# ---------------------------------------------------------------- drawing
Series = tuple[str, list[list[tuple[int, float]]], str, bool]  # (legend label, runs, colour, marked points)


def chart(top: float, title: str, series: list[Series]) -> list[str]:
    """One chart: every series on shared axes, a legend when there is more than one."""
    points = [p for _, runs, _, _ in series for run in runs for p in run]
    steps, values = [s for s, _ in points], [v for _, v in points]
    # x spans exactly the logged steps (ticks only inside); y widens to round tick values.
    x_range = (min(steps), max(steps)) if min(steps) < max(steps) else (min(steps) - 1, max(steps) + 1)
    x_ticks = [t for t in nice_ticks(*x_range, count=6, integer=True) if x_range[0] <= t <= x_range[1]]
    y_ticks = nice_ticks(min(values), max(values))
    f = Frame(top, x_range, (y_ticks[0], y_ticks[-1]))
    out = [f'<text x="{f.left}" y="{top + 20}" class="title">{escape(title)}</text>']
    for t in x_ticks:
        x = f.x(t)
        out.append(f'<line x1="{x:.1f}" y1="{f.bottom}" x2="{x:.1f}" y2="{f.bottom + 4}" class="axis"/>')
        out.append(f'<text x="{x:.1f}" y="{f.bottom + 17}" text-anchor="middle">{tick_label(t)}</text>')
    for t in y_ticks:
        y = f.y(t)
        out.append(f'<line x1="{f.left}" y1="{y:.1f}" x2="{f.right}" y2="{y:.1f}" class="grid"/>')
        out.append(f'<text x="{f.left - 6}" y="{y + 4:.1f}" text-anchor="end">{tick_label(t)}</text>')
    out.append(f'<text x="{(f.left + f.right) / 2}" y="{f.bottom + 34}" text-anchor="middle">step</text>')
    # The axes last, so the grid line at the lowest tick does not paint over them.
    out.append(f'<line x1="{f.left}" y1="{f.bottom}" x2="{f.right}" y2="{f.bottom}" class="axis"/>')
    out.append(f'<line x1="{f.left}" y1="{f.top}" x2="{f.left}" y2="{f.bottom}" class="axis"/>')
    for index, (label, runs, colour, marked) in enumerate(series):
        for run in runs:
            coords = " ".join(f"{f.x(s):.1f},{f.y(v):.1f}" for s, v in run)
            out.append(f'<polyline points="{coords}" class="series" stroke="{colour}"/>')
            # A lone point draws no line: mark it; a sparse series marks every measured step.
            for s, v in (run if marked or len(run) == 1 else []):
                out.append(f'<circle cx="{f.x(s):.1f}" cy="{f.y(v):.1f}" r="2.5" fill="{colour}"/>')
        if len(series) > 1:
            x = f.right - 110 * (len(series) - index)
            out.append(f'<line x1="{x}" y1="{top + 16}" x2="{x + 18}" y2="{top + 16}" stroke="{colour}" '
                       f'stroke-width="2"/>')
            out.append(f'<text x="{x + 22}" y="{top + 20}">{escape(label)}</text>')
    return out


def plot_run(run_dir: str) -> Path:
    """Read run_dir/metrics.jsonl, write run_dir/metrics.svg, return its path."""
    source = Path(run_dir) / "metrics.jsonl"
    records = read_records(source)
    drawn = []
    for index, (title, wanted) in enumerate(CHARTS):
        series = [(label, runs, SPARSE_COLOUR if sparse else SERIES_COLOURS[index % len(SERIES_COLOURS)], sparse)
                  for key, label, sparse in wanted if (runs := segments(records, key, sparse))]
        if series:
            drawn.append((title, series))
    if not drawn:
        raise ValueError(f"{source}: no finite loss or TFLOPS value in {len(records)} record(s); nothing to plot")
    height = CHART_HEIGHT * len(drawn)
    body: list[str] = []
    for index, (title, series) in enumerate(drawn):
        body += chart(index * CHART_HEIGHT, title, series)
    svg = "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        "<style>.axis{stroke:#333} .grid{stroke:#ddd} .series{fill:none;stroke-width:1.5} "
        ".title{font-size:13px;font-weight:bold}</style>",
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        *body,
        "</svg>",
    ])
    target = source.with_name("metrics.svg")
    target.write_text(svg + "\n")
    return target


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m megatrain_cli.plot RUN_DIR")
    print(plot_run(sys.argv[1]))
