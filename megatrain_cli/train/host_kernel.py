"""The C++ host AdamW kernel (optim/adamw_cpp.py) compiled before the engine asks for it, said out loud.

Its first use in an environment compiles it: 1.5-2 minutes on two cores, during which a run printed
nothing. `prepare` loads it first (the engine then finds it loaded) and, when the load takes longer than
a cached one can, says it is compiling, then how long so far every PROGRESS_S, then how long it took.

torch's compile lock (FileBaton: a `lock` file in the build folder) is never released by a process that
was killed while compiling, and the next run waits for it forever. A lock older than STALE_S (a compile
takes minutes) is such a leftover: the run is refused naming the file to delete. A younger one is another
process compiling now, and this one says it waits for it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from megatrain_cli.train.errors import TrainingError

NOTICE_AFTER_S = 3.0  # a cached kernel loads in well under a second
PROGRESS_S = 30.0
STALE_S = 15 * 60.0


def compile_lock() -> Path:
    """The lock file torch's cpp_extension.load takes while it builds the kernel."""
    from torch.utils.cpp_extension import _get_build_directory

    from megatrain_cli.optim import adamw_cpp

    # adamw_cpp's extension name: the folder torch builds (and locks) it in.
    return Path(_get_build_directory(adamw_cpp._NAME, False)) / "lock"


def lock_age(lock: Path) -> float:
    return time.time() - lock.stat().st_mtime


def stale_lock_message(lock: Path, who: str) -> str:
    return (f"{who}: the C++ AdamW kernel's compile lock {lock} is {lock_age(lock) / 60:.0f} min old: a compile "
            f"that was killed left it, and torch would wait for it forever. Delete it (rm {lock}) and run again")


def prepare(host_adamw: str, log=print) -> None:
    """engine.host_adamw 'auto' or 'cpp': the kernel loaded (compiled first when needed) with a word about it;
    a failed compile is left for the engine to answer ('auto' falls back to torch with a warning)."""
    if host_adamw == "torch":
        return
    from megatrain_cli.optim import adamw_cpp

    lock = compile_lock()
    if lock.exists():
        age = lock_age(lock)
        if age > STALE_S:
            raise TrainingError(stale_lock_message(lock, f"engine.host_adamw={host_adamw}") +
                                ", or set engine.host_adamw=torch", 2)
        log(f"host AdamW: waiting for another process compiling the C++ kernel (its lock {lock}, "
            f"{age:.0f} s old)")
    done = threading.Event()
    t0 = time.perf_counter()

    def progress() -> None:
        if done.wait(NOTICE_AFTER_S):
            return
        log("host AdamW: compiling the C++ kernel (the first run in this environment: 1-2 minutes on two "
            "cores, once; engine.host_adamw=torch skips it)")
        while not done.wait(PROGRESS_S):
            log(f"host AdamW: still compiling, {time.perf_counter() - t0:.0f} s")

    watcher = threading.Thread(target=progress, daemon=True)
    watcher.start()
    try:
        compiled = adamw_cpp.available()
    finally:
        done.set()
        watcher.join()
    took = time.perf_counter() - t0
    if compiled and took > NOTICE_AFTER_S:
        log(f"host AdamW: the C++ kernel is ready ({took:.0f} s; cached for later runs)")
