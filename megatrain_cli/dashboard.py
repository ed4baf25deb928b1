"""The live view of a run: a rich dashboard on a terminal, one fixed-width line per step elsewhere.

Modes: 'rich' (Live panels), 'plain' (a header once, then one line per update: greppable, fine in
CI logs and `tee`), 'off' (prints nothing), 'auto' (rich when the console is a terminal, else plain).
Every value comes from a StepMetrics as measured; a None field prints 'n/a', never a made-up number.
With validation on (`val_every`), the plain line gains a 'val loss' column (n/a at the steps without a
pass) and the rich view shows the latest validation loss, the step it was measured at, and its trend.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from megatrain_cli.machine import host_limits
from megatrain_cli.metrics.record import StepMetrics

NA = "n/a"
MODES = ("auto", "rich", "plain", "off")
_SPARK_BLOCKS = "▁▂▃▄▅▆▇█"


# ---------------------------------------------------------------- value formatting
def fmt_num(value: float | None, spec: str) -> str:
    if value is None:
        return NA
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # 'nan' / 'inf': a measured value, shown as it is
    return format(value, spec)


def fmt_pct(fraction: float | None) -> str:
    return fmt_num(fraction, ".1%")


def fmt_tflops(tflops: float | None) -> str:
    # Three significant digits below 10, so a small CPU figure (0.012) never reads as 0.0.
    if tflops is not None and math.isfinite(tflops) and abs(tflops) < 10:
        return format(tflops, ".3g")
    return fmt_num(tflops, ".1f")


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return NA
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return NA
    total = int(round(seconds))
    hours, rest = divmod(total, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def fmt_seconds(seconds: float | None) -> str:
    return NA if seconds is None else f"{fmt_num(seconds, '.3f')} s"


def fmt_gbps(gbps: float | None) -> str:
    return NA if gbps is None else f"{fmt_num(gbps, '.1f')} GB/s"


def fmt_step(m: StepMetrics, total_steps: int = 0) -> str:
    total = m.total_steps or total_steps
    return f"{m.step}/{total}" if total else str(m.step)


def sparkline(values: list[float]) -> str:
    """Unicode block sparkline of the finite values (a NaN step is left out)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo or 1.0
    top = len(_SPARK_BLOCKS) - 1
    return "".join(_SPARK_BLOCKS[round((v - lo) / span * top)] for v in finite)


# ---------------------------------------------------------------- plain lines
# (header, width, value): widths hold every realistic value, so the '|' separators line up.
PlainColumn = tuple[str, int, Callable[[StepMetrics], str]]
PLAIN_COLUMNS: list[PlainColumn] = [
    ("step", 11, lambda m: fmt_step(m)),
    ("loss", 9, lambda m: fmt_num(m.loss, ".4f")),
    ("lr", 8, lambda m: fmt_num(m.lr, ".2e")),
    ("gnorm", 8, lambda m: fmt_num(m.grad_norm, ".4g")),
    ("tok/s", 9, lambda m: fmt_num(m.tokens_per_s, ".0f")),
    ("TFLOPS", 7, lambda m: fmt_tflops(m.model_tflops)),
    ("MFU", 6, lambda m: fmt_pct(m.mfu)),
    ("H2D GB/s", 8, lambda m: fmt_num(m.h2d_gbps, ".1f")),
    ("D2H GB/s", 8, lambda m: fmt_num(m.d2h_gbps, ".1f")),
    ("overlap", 7, lambda m: fmt_pct(m.overlap)),
    ("gpu mem", 10, lambda m: fmt_bytes(m.gpu_mem_bytes)),
    ("host rss", 10, lambda m: fmt_bytes(m.host_rss_bytes)),
    ("skipped", 7, lambda m: str(m.skipped_steps)),
    ("eta", 9, lambda m: fmt_duration(m.eta_s)),
]


VAL_COLUMN: PlainColumn = ("val loss", 9, lambda m: fmt_num(m.val_loss, ".4f"))


def _pref(m: StepMetrics, name: str, held_out: bool = False) -> float | None:
    values = m.val_preference if held_out else m.preference
    return (values or {}).get(name)


# A preference method's (train.method): the share of pairs ranked right and the mean reward margin (TRL's names)
PREFERENCE_COLUMNS: list[PlainColumn] = [
    ("acc", 6, lambda m: fmt_num(_pref(m, "rewards/accuracies"), ".3f")),
    ("margin", 8, lambda m: fmt_num(_pref(m, "rewards/margins"), ".4f")),
]
VAL_PREFERENCE_COLUMN: PlainColumn = ("val acc", 7, lambda m: fmt_num(_pref(m, "rewards/accuracies", True), ".3f"))


def _plain_row(cells: list[str], columns: list[PlainColumn] = PLAIN_COLUMNS) -> str:
    return " | ".join(cell.rjust(width) for cell, (_, width, _) in zip(cells, columns))


def plain_header(columns: list[PlainColumn] = PLAIN_COLUMNS) -> str:
    return _plain_row([name for name, _, _ in columns], columns)


# ---------------------------------------------------------------- the dashboard
class Dashboard:
    """Shows StepMetrics as they arrive. Use as a context manager around the training loop."""

    def __init__(self, mode: str = "auto", total_steps: int = 0, title: str = "megatrain",
                 console: Console | None = None, val_every: int | None = None, preference: bool = False):
        if mode not in MODES:
            raise ValueError(f"dashboard mode must be one of {', '.join(MODES)}; got {mode!r}")
        self.console = console if console is not None else Console()
        if mode == "auto":
            mode = "rich" if self.console.is_terminal else "plain"
        self.mode = mode
        self.total_steps = total_steps
        self.title = title
        self.loss_history: deque[float] = deque(maxlen=48)
        # Validation: every `val_every` steps (None: off); (step, loss) of the passes so far.
        self.val_every = val_every
        self.val_history: deque[tuple[int, float]] = deque(maxlen=48)
        # A preference method (train.method): its metrics, and the held-out pairs' accuracy with validation.
        self.preference = preference
        self.columns = PLAIN_COLUMNS[:2] + (PREFERENCE_COLUMNS if preference else []) + PLAIN_COLUMNS[2:] + \
            ([VAL_COLUMN] if val_every else []) + ([VAL_PREFERENCE_COLUMN] if val_every and preference else [])
        self._header_printed = False
        self._live: Live | None = None
        self._progress_shown: dict[str, int] = {}  # a pass's label -> the last tenth a plain line said
        # The smallest ceiling, RAM or a cgroup's (a container's RSS is measured against that); read once.
        self._host_total = min((limit.limit for limit in host_limits()), default=0) or None

    # -------------------------------------------------------- lifecycle
    def __enter__(self) -> "Dashboard":
        if self.mode == "rich":
            self._start_live(_Running(self.title))
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()  # the last frame stays on screen (not transient)
            self._live = None

    def _start_live(self, first: RenderableType) -> None:
        self._live = Live(first, console=self.console, refresh_per_second=4, transient=False)
        self._live.start()

    # -------------------------------------------------------- input
    def update(self, m: StepMetrics) -> None:
        if m.loss is not None:
            self.loss_history.append(m.loss)
        if m.val_loss is not None:
            self.val_history.append((m.step, m.val_loss))
        if self.mode == "plain":
            if not self._header_printed:
                self.console.out(plain_header(self.columns), highlight=False)
                self._header_printed = True
            self.console.out(self.format_plain(m), highlight=False)
        elif self.mode == "rich":
            frame = self.render(m)
            if self._live is None:  # used without `with`: start on the first step
                self._start_live(frame)
            else:
                self._live.update(frame, refresh=True)

    def progress(self, label: str, done: int, total: int) -> None:
        """A pass before the steps (the reference pass): a bar in the rich view, a plain line per tenth."""
        if self.mode == "plain":
            tenth = 10 * done // max(1, total)
            if self._progress_shown.get(label) != tenth:
                self._progress_shown[label] = tenth
                self.console.out(f"{label}: {done}/{total} rows ({done / max(1, total):.0%})", highlight=False)
        elif self.mode == "rich":
            line = Table.grid(expand=True, padding=(0, 2))
            line.add_column(no_wrap=True)
            line.add_column(ratio=1)
            line.add_column(no_wrap=True)
            line.add_row(Text(label, style="bold"), ProgressBar(total=max(1, total), completed=done),
                         Text(f"{done}/{total} rows  {done / max(1, total):.0%}"))
            if self._live is None:
                self._start_live(line)
            else:
                self._live.update(line, refresh=True)

    def log(self, message: str) -> None:
        """A message above the live view (or between plain lines); literal text, no markup."""
        if self.mode in ("rich", "plain"):
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    # -------------------------------------------------------- output
    def format_plain(self, m: StepMetrics) -> str:
        cells = [fn(m) for _, _, fn in self.columns]
        cells[0] = fmt_step(m, self.total_steps)
        return _plain_row(cells, self.columns)

    def render(self, m: StepMetrics) -> RenderableType:
        top = Table.grid(expand=True, padding=(0, 1))
        bottom = Table.grid(expand=True, padding=(0, 1))
        lower = [self._time_panel(m), self._memory_panel(m)] + ([self._preference_panel(m)] if self.preference else [])
        for _ in range(3):
            top.add_column(ratio=1)
        for _ in lower:
            bottom.add_column(ratio=1)
        top.add_row(self._training_panel(m), self._throughput_panel(m), self._transfer_panel(m))
        bottom.add_row(*lower)
        return Group(self._progress_line(m), top, bottom)

    def _progress_line(self, m: StepMetrics) -> Table:
        total = m.total_steps or self.total_steps
        line = Table.grid(expand=True, padding=(0, 2))
        line.add_column(no_wrap=True)
        line.add_column(ratio=1)
        line.add_column(no_wrap=True)
        bar = ProgressBar(total=total or None, completed=m.step, pulse=not total)
        done = f"  {m.step / total:.0%}" if total else ""
        line.add_row(Text(self.title, style="bold"), bar,
                     Text(f"step {fmt_step(m, self.total_steps)}{done}   ETA {fmt_duration(m.eta_s)}"))
        return line

    def _training_panel(self, m: StepMetrics) -> Panel:
        return _panel("training", [
            ("loss", fmt_num(m.loss, ".4f")),
            ("loss trend", sparkline(list(self.loss_history)) if len(self.loss_history) > 1 else "(from step 2)"),
            *self._val_rows(),
            ("lr", fmt_num(m.lr, ".3e")),
            ("grad norm", fmt_num(m.grad_norm, ".4g")),
            ("tokens / step", f"{m.tokens:,} ({m.loss_tokens:,} with loss)"),
            ("skipped steps", str(m.skipped_steps)),
        ])

    def _val_rows(self) -> list[tuple[str, str]]:
        """The latest validation loss and the step it was measured at (validation runs every val_every
        steps, so most frames show an older pass's value, said as such); nothing when validation is off."""
        if not self.val_every:
            return []
        if not self.val_history:
            return [("val loss", f"(every {self.val_every} steps; none yet)")]
        step, value = self.val_history[-1]
        values = [v for _, v in self.val_history]
        trend = sparkline(values) if len(values) > 1 else f"(every {self.val_every} steps)"
        return [("val loss", f"{fmt_num(value, '.4f')}  (step {step})"), ("val trend", trend)]

    def _throughput_panel(self, m: StepMetrics) -> Panel:
        return _panel("throughput", [
            ("tokens/s", fmt_num(m.tokens_per_s, ",.0f")),
            ("model TFLOPS", fmt_tflops(m.model_tflops)),
            ("MFU", fmt_pct(m.mfu)),
            ("executed TFLOPS", _noted(fmt_tflops(m.executed_tflops), "with recompute")),
            ("step time", fmt_seconds(m.step_time_s)),
        ])

    def _transfer_panel(self, m: StepMetrics) -> Panel:
        return _panel("PCIe / overlap", [
            ("H2D", _against_peak(m.h2d_gbps, m.link_peak_gbps)),
            ("D2H", _against_peak(m.d2h_gbps, m.link_peak_gbps)),
            ("link peak", fmt_gbps(m.link_peak_gbps)),
            ("overlap", _noted(fmt_pct(m.overlap), "compute busy")),
        ])

    def _time_panel(self, m: StepMetrics) -> Panel:
        def share(seconds: float | None) -> str:
            if seconds is None:
                return NA
            if m.step_time_s and m.step_time_s > 0:
                return f"{fmt_seconds(seconds)}  {seconds / m.step_time_s:>4.0%}"
            return fmt_seconds(seconds)

        return _panel("step time split", [
            ("forward", share(m.time_forward_s)),
            ("backward", share(m.time_backward_s)),
            ("wait weights", share(m.time_wait_weights_s)),
            ("wait optimizer", share(m.time_wait_optimizer_s)),
            ("optimizer", share(m.time_optimizer_s)),
        ])

    def _preference_panel(self, m: StepMetrics) -> Panel:
        """The step's pairs (TRL's names), and the held-out pairs' accuracy at a validation pass."""
        rows = [(name, fmt_num(_pref(m, name), ".4f")) for name in
                ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
                 "logps/rejected")]
        if m.val_preference:
            rows.append(("held-out accuracies", fmt_num(_pref(m, "rewards/accuracies", True), ".4f")))
        return _panel("preference", rows)

    def _memory_panel(self, m: StepMetrics) -> Panel:
        rss = fmt_bytes(m.host_rss_bytes)
        if m.host_rss_bytes is not None and self._host_total:
            rss += f" of {fmt_bytes(self._host_total)}"
        return _panel("memory", [
            ("GPU memory", fmt_bytes(m.gpu_mem_bytes)),
            ("host RSS", rss),
            ("pinned", fmt_bytes(m.pinned_bytes)),
        ])


class _Running:
    """The rich view until the first metrics arrive. Steps may already be running (metrics come every
    logging.every_n_steps steps), so it says how long the run has been going, not that it waits; Live
    re-renders it at each refresh, so the clock moves."""

    def __init__(self, title: str):
        self.title = title
        self.started = time.monotonic()

    def __rich__(self) -> Text:
        return Text(f"{self.title}: running for {fmt_duration(time.monotonic() - self.started)}; the first "
                    f"metrics show at the first logged step (logging.every_n_steps)", style="dim")


def _noted(value: str, note: str) -> str:
    return value if value == NA else f"{value}  ({note})"


def _against_peak(gbps: float | None, peak: float | None) -> str:
    if gbps is None:
        return NA
    if peak is None or peak <= 0:
        return f"{fmt_gbps(gbps)}  (peak unknown)"
    return f"{fmt_gbps(gbps)} of {peak:.1f}  {gbps / peak:.0%}"


def _panel(title: str, rows: list[tuple[str, str]]) -> Panel:
    grid = Table.grid(padding=(0, 2))
    # Labels never shrink; a value too long for a narrow terminal wraps rather than losing digits.
    grid.add_column(style="dim", no_wrap=True, min_width=max(len(label) for label, _ in rows))
    grid.add_column(overflow="fold")
    for label, value in rows:
        grid.add_row(label, Text(value, style="dim" if value == NA else ""))
    return Panel(grid, title=title, title_align="left", border_style="blue")
