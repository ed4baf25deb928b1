"""The one contract between the transfer layer and the host optimizer: what the streamers and sinks ask
of whoever updates the host tiles beside the step. optim/worker.py's OptimizerWorker fulfils it by its
methods alone (a Protocol is structural: the optimizer imports nothing of the engine); `NO_UPDATES`
stands in when the optimizer runs on the training thread after the verdict, so nothing is pending.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class HeldUpdate(Protocol):
    """A deferred update its reader applies while reading the tile (update on read: optim/worker.py's
    UpdateOnRead); leaving the `with` closes it, with the error if a piece failed."""

    def apply(self, lo: int, hi: int, out) -> None:
        """Store the new weights of elements [lo, hi) and their cast into `out`."""

    def __enter__(self) -> HeldUpdate: ...

    def __exit__(self, exc_type, exc, tb) -> bool: ...


@runtime_checkable
class HostUpdates(Protocol):
    def wait(self, tile: str) -> None:
        """Before a read of the tile's master: block until it holds its updated weights."""

    def claim(self, tile: str) -> HeldUpdate | None:
        """The tile's update held for this reader to apply as it reads; None: `wait`, then read."""

    def wait_state(self, tile: str) -> None:
        """Before a write into the tile's host gradient: block until nothing reads the previous one."""

    def landed(self, tile: str, sq_norm) -> None:
        """The tile's gradient is complete in its host tile; `sq_norm`, its squared norm (a float or a
        one-element tensor: reading a device tensor syncs, so only an implementation that needs it does)."""


class NoHostUpdates:
    """No host optimizer beside the step: nothing to wait for, claim or hear about."""

    def wait(self, tile: str) -> None:
        pass

    def claim(self, tile: str) -> None:
        return None

    def wait_state(self, tile: str) -> None:
        pass

    def landed(self, tile: str, sq_norm) -> None:
        pass


NO_UPDATES = NoHostUpdates()
