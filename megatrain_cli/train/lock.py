"""One writer per output_dir: output_dir/.megatrain.lock, held with flock(2) by the lead process.

The lock is the flock on an open file, not the file: the kernel drops it when its holder exits in any
way (SIGKILL, a crash, the OOM killer), so a stale lock never needs a person to remove it. The file
holds who took it (pid, host, start time) so that a refused run can name the holder; when a run finds
the file but takes the lock, the holder it names ended without releasing it and the run says so.
A clean exit removes the file. Costs: one open, one flock and one small write at the start.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from megatrain_cli.train.errors import EXIT_BAD_INPUT, TrainingError

LOCK_NAME = ".megatrain.lock"


def _describe(info: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {when}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


class OutputLock:
    """`with OutputLock(output_dir):` the caller is output_dir's only writer until the block ends."""

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        """Take the lock, or raise TrainingError (exit 2) naming the run that holds it."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:  # read-only, not a directory, no permission
                raise TrainingError(f"output_dir {self.path.parent}: cannot create {self.path.name} "
                                    f"({err.strerror}); choose a writable output_dir", EXIT_BAD_INPUT) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise TrainingError(f"output_dir {self.path.parent} is in use by another megatrain run "
                                    f"({_describe(_read(self.path))}; lock file {self.path}): wait for it to "
                                    "end or stop it, or choose another output_dir", EXIT_BAD_INPUT) from None
            except OSError as err:  # a file system without flock: run unlocked, and say so
                os.close(fd)
                print(f"warning: cannot lock {self.path} ({err.strerror}); make sure no other run writes "
                      f"to {self.path.parent}", file=sys.stderr)
                return self
            # The holder we waited for may have removed the file between our open and our flock: then we
            # locked a deleted file, and must lock the one now at the path.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read(self.path)
        if stale:
            print(f"note: {self.path} was left by a run that ended without releasing it ({_describe(stale)}); "
                  "taking it over", file=sys.stderr)
        data = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data + b"\n", 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()  # while still holding it: whoever opens the path next makes a new file
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_free(output_dir: str | os.PathLike) -> None:
    """Refuse (exit 2) at once when output_dir is held, before any rank is started; takes nothing."""
    if (Path(output_dir) / LOCK_NAME).exists():
        OutputLock(output_dir).acquire().release()
