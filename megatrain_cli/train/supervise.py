"""The `--gpus N` launcher and its ranks as one unit: no rank outlives the launcher, no rank runs on alone.
`spawn_ranks` is the one launcher: `train --gpus N` (train/launch.py) and `bench --gpus N` (bench/ranks.py).

    a signal to the launcher      SIGINT, SIGTERM, SIGUSR1 are forwarded to every rank; training ranks agree
                                  on it after the step in flight (train/rank.py), checkpoint and exit with
                                  its code (train/stop.py), which the launcher returns; bench ranks end
                                  at once, killed by it (the launcher returns 128 + its number)
    the launcher dies (SIGKILL)   each rank gets SIGTERM from the kernel (prctl PR_SET_PDEATHSIG, Linux) or
                                  from its own watch thread (the parent pid changed; polled twice a
                                  second): the same checkpoint and exit; an orphan still alive
                                  ORPHAN_GRACE_S later kills itself
    a rank dies or fails          the launcher names it and its exit code, gives the others GRACE_S to end
                                  on their own (gloo's collectives fail as soon as a peer is gone) and
                                  kills the rest; no checkpoint can be written without every rank, the
                                  last complete one stays

Costs: the launcher wakes twice a second; each rank keeps one sleeping thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import wait
from pathlib import Path

from megatrain_cli.train.stop import SIGNALS

POLL_S = 0.5
GRACE_S = 3.0  # after a rank failed: how long the others may take to end by themselves
ORPHAN_GRACE_S = 600.0  # after the launcher died: the step in flight and the checkpoint, at most
PR_SET_PDEATHSIG = 1
CLEAN_EXITS = (0, 75, 130)  # a rank's own orderly ends (train/stop.py's codes); anything else is a failure


# ---------------------------------------------------------------- rank side
def _rank_main(target, rank: int, world: int, init_method: str, parent: int, args: tuple) -> None:
    watch_parent(parent, rank)  # first: a rank never outlives the launcher
    os.environ["LOCAL_RANK"] = str(rank)  # launch mechanics: which GPU this rank takes
    target(rank, world, init_method, *args)


def peer_gone(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another rank ended (the launcher names that rank)."""
    import torch.distributed as dist

    text = str(err)
    return isinstance(err, dist.DistError) or any(s in text for s in ("Connection reset by peer",
                                                                      "Connection closed by peer", "Broken pipe"))


def watch_parent(parent_pid: int, rank: int) -> None:
    """Make this rank end when the launcher `parent_pid` does, however it ends."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the poll below still works
    if os.getppid() != parent_pid:  # died before the prctl: no step done, nothing to save
        print(f"rank {rank}: the launcher (pid {parent_pid}) is gone; exiting", file=sys.stderr)
        os._exit(1)
    threading.Thread(target=_poll_parent, args=(parent_pid, rank), daemon=True,
                     name="megatrain-parent-watch").start()


def _poll_parent(parent_pid: int, rank: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    print(f"rank {rank}: the launcher (pid {parent_pid}) is gone; checkpointing after the step in flight, "
          "then exiting", file=sys.stderr)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- launcher side
def spawn_ranks(target, args: tuple, world: int, *, output_dir: str | None = None) -> int:
    """Run `world` ranks, `target(rank, world, init_method, *args)` each in a spawned process (picklable
    target and args), under one Supervisor; returns its exit code. The ranks meet through a file in a temp
    directory (init_method) and start with the stop signals blocked: `target` installs its handlers, then
    unblocks them (train/stop.py: install, unblock). `output_dir`: where a failed run's last complete
    checkpoint lies (None: a run that writes none)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megatrain-dist-") as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [ctx.Process(target=_rank_main, args=(target, rank, world, init, os.getpid(), args))
                 for rank in range(world)]
        supervisor = Supervisor(procs, output_dir)
        with signals_blocked():
            for p in procs:
                p.start()
            supervisor.install()
        return supervisor.run()


@contextmanager
def signals_blocked():
    """Block the stop signals while the ranks start: they inherit the mask, so a signal that comes before a
    rank has its handlers waits (pending) instead of killing it; train/stop.py's unblock() lets it in.
    multiprocessing's resource tracker is started first: starting it unblocks SIGINT and SIGTERM."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class Supervisor:
    """Watches started rank processes until every one has ended; `run()` returns the launcher's exit code."""

    def __init__(self, procs: list, output_dir: str | None = None):
        self.procs, self.output_dir = procs, output_dir
        self.failure: tuple[int, int] | None = None  # (rank, exit code) of the first rank that failed
        self._forwarded: set[int] = set()  # a rank that a forwarded signal ended has not failed
        self._old: dict = {}

    def install(self) -> None:
        """Forward the stop signals to the ranks (call while they are blocked: see signals_blocked)."""
        self._old = {s: signal.signal(s, self._forward) for s in SIGNALS}

    def _forward(self, signum, _frame) -> None:
        self._forwarded.add(signum)
        for p in self.procs:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    def run(self) -> int:
        deadline = None
        try:
            while True:
                alive = [p for p in self.procs if p.exitcode is None]
                if not alive:
                    break
                wait([p.sentinel for p in alive], timeout=POLL_S)
                if self.failure is None:
                    self._check_failure()
                    if self.failure is not None:
                        deadline = time.monotonic() + GRACE_S
                elif time.monotonic() > deadline:
                    for p in alive:
                        if p.exitcode is None:
                            print(f"error: rank {self.procs.index(p)} did not end within {GRACE_S:.0f} s; "
                                  "killing it", file=sys.stderr)
                            p.kill()
                    deadline = float("inf")
            for p in self.procs:
                p.join()
            if self.failure is None:  # every rank ended before a poll saw one fail (a forwarded SIGTERM)
                self._check_failure()
        finally:
            for s, old in self._old.items():
                signal.signal(s, old)
        return self._code()

    def _check_failure(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None and p.exitcode not in CLEAN_EXITS and -p.exitcode not in self._forwarded:
                self.failure = (rank, p.exitcode)
                others = [r for r, q in enumerate(self.procs) if q.exitcode is None]
                if p.exitcode > 0 and not others:
                    return  # every rank ended with its own message: nothing to add
                stopping = ""
                if others:
                    stopping = f"; stopping rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
                after = (f". The last complete checkpoint in {self.output_dir} is intact: resume with "
                         "checkpoint.resume=auto") if p.exitcode < 0 and self.output_dir else ""
                print(f"error: rank {rank} {describe_exit(p.exitcode)}{stopping}{after}", file=sys.stderr)
                return

    def _code(self) -> int:
        if self.failure is not None:
            code = self.failure[1]
            return code if code > 0 else 128 - code
        codes = [c if c >= 0 else 128 - c for c in (p.exitcode for p in self.procs)]
        return codes[0] if all(c == codes[0] for c in codes) else next(c for c in codes if c != 0)
