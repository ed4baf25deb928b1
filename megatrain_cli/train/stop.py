"""When a run stops early, and with which exit code: signals and the wall-clock limit, asked once per step.

    signal / limit            what the loop does after the step in flight      exit code
    SIGTERM                   checkpoint, exit                                  0
    SIGINT (Ctrl-C)           checkpoint, exit                                  130
    SIGUSR1 (Slurm's warning) checkpoint, exit: preempted, resumable            75 (EX_TEMPFAIL)
    train.max_wall_time       checkpoint, exit: preempted, resumable            75

`megatrain export` (interruptible) is stopped instead: Ctrl-C and SIGTERM remove its partial folder and exit
130 / 143. A caught signal of the loop is only recorded (the handler does nothing else), so a step is never cut in half. The
record is process-wide, as signals are: a rank installs the handlers as soon as it starts (train/launch.py
starts it with these signals blocked, so one that arrives while it imports waits instead of killing it)
and the loop finds what came meanwhile. The wall clock counts from the start of the loop (building the
store and reading a checkpoint included) and is read after every step: the run stops after the first step
that ends past the limit, so leave a step and a checkpoint's time of margin. Costs: one clock read a step.
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager

from megatrain_cli.recipe import parse_duration
from megatrain_cli.train.errors import EXIT_PREEMPTED, TrainingError

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
WALL_TIME = 1000  # the stop reason of train.max_wall_time: not a signal number, above them all

_caught: list[int] = []
_saved: dict[int, object] = {}  # the handlers before install(); empty: not installed


def parse_wall_time(text: str | None) -> float | None:
    """train.max_wall_time in seconds (recipe.parse_duration: '3h50m', '90s', '1.5h'); None: no limit. The
    recipe's checks refuse a bad value when it is loaded; one that got past them is refused here (exit 2)."""
    if text is None:
        return None
    try:
        seconds = parse_duration(text)
    except ValueError as err:
        raise TrainingError(f"train.max_wall_time: {err}", 2) from None
    if seconds <= 0:
        raise TrainingError(f"train.max_wall_time: must be longer than 0, got {text!r}", 2)
    return seconds


def install() -> None:
    """Record SIGINT, SIGTERM and SIGUSR1 from now on instead of dying (idempotent)."""
    if _saved:
        return
    _caught.clear()
    for s in SIGNALS:
        _saved[s] = signal.signal(s, _record)


def restore() -> None:
    """The handlers from before install(): after the loop a signal acts as it normally does."""
    for s, old in _saved.items():
        signal.signal(s, old)
    _saved.clear()


def unblock() -> None:
    """Let the signals blocked by the launcher through; any that came meanwhile reach _record now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def _record(signum, _frame) -> None:
    _caught.append(signum)


class StopWatch:
    """The loop's question after every step: stop now? (a caught signal, or the wall-clock limit, counted
    from this watch's creation: the start of the loop, before the model is built or a checkpoint read)."""

    def __init__(self, limit_text: str | None):
        self.limit_s = parse_wall_time(limit_text)
        self.t0 = time.monotonic()

    def reason(self) -> int | None:
        """This process's reason to stop: the last signal caught, else WALL_TIME past the limit, else None."""
        if _caught:
            return _caught[-1]
        if self.limit_s is not None and time.monotonic() - self.t0 >= self.limit_s:
            return WALL_TIME
        return None


@contextmanager
def watching():
    """install() for the loop's steps (keeping what a rank caught before), restore() after them."""
    install()
    try:
        yield
    finally:
        restore()


def exit_code(reason: int) -> int:
    if reason == signal.SIGINT:
        return 130
    if reason == signal.SIGTERM:
        return 0
    return EXIT_PREEMPTED  # SIGUSR1, the wall-clock limit


def describe(reason: int, limit_text: str | None = None) -> str:
    if reason == WALL_TIME:
        return f"train.max_wall_time ({limit_text}) reached"
    name = signal.Signals(reason).name
    return f"{name} (preempted)" if reason == signal.SIGUSR1 else name


class Interrupted(BaseException):
    """SIGTERM, raised where the main thread is (interruptible): a one-shot command stops as Ctrl-C stops it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def interruptible():
    """SIGTERM raises Interrupted (Ctrl-C raises KeyboardInterrupt already), so a one-shot command such as
    `megatrain export` unwinds through its cleanup instead of dying with its partial files left; the
    exit code is 128 + the signal (130, 143). The handler before is put back after."""
    def handler(signum, _frame):
        raise Interrupted(signum)

    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)

