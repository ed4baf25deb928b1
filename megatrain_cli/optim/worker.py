"""Host AdamW in a background thread, tile by tile, in the order the next forward needs them.

Exact clipping needs the global gradient norm, known only when the whole backward is done; so the
updates cannot start earlier without changing the optimizer's semantics. What can overlap is the
NEXT step: its forward waits only for the tile it is about to stream (`wait(tile)`), so the updates
of later layers run while earlier layers compute. Cost: the forward of step t+1 is gated by the
optimizer's throughput (about 2-4 G params/s on 16 cores) instead of by the GPU.
"""

from __future__ import annotations

import queue
import threading

from megatrain_cli.optim.cpu_adamw import HostAdamW
from megatrain_cli.store.tiles import HostStore


class OptimizerWorker:
    def __init__(self, optimizer: HostAdamW, store: HostStore):
        self.optimizer, self.store = optimizer, store
        self._done = {name: threading.Event() for name in store.tiles}
        for ev in self._done.values():
            ev.set()
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="megatrain-adamw", daemon=True)
        self._thread.start()

    def submit(self, order: list[str], lr: float, clip: float) -> None:
        for name in order:
            self._done[name].clear()
        self._jobs.put((order, lr, clip))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            order, lr, clip = job
            for name in order:
                try:
                    if self._error is None:
                        self.optimizer.update(self.store.tiles[name], lr, clip)
                except BaseException as err:  # re-raised in the training thread by wait()
                    self._error = err
                finally:
                    self._done[name].set()

    def wait(self, tile: str) -> None:
        """Block until `tile` holds its updated weights (a host-side wait, only when AdamW is behind)."""
        self._done[tile].wait()
        if self._error is not None:
            raise RuntimeError("host AdamW failed") from self._error

    def drain(self) -> None:
        for name in self._done:
            self.wait(name)

    def close(self) -> None:
        self.drain()
        self._jobs.put(None)
        self._thread.join()
