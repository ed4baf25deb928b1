"""The synchronous reference path: weights in, gradients out, one blocking copy at a time.

`WeightStreamer.acquire(tile)` makes a tile resident in the least-recently-used slot (slots.SlotPool)
and returns its flat buffer. On the CPU a "transfer" is a plain cast-copy from the fp32 master; on CUDA
it would be a blocking copy (make_transfers picks cuda.CudaStreamer there, the overlapped version with
the same interface). With a sharded placement (sharded.DistStreamer) the copy is this rank's shard and
a blocking all-gather assembles the rest.

`GradSink.send` moves one tile's finished fp32 gradient to the host tile, cast to its grad dtype.
"""

from __future__ import annotations

import time

import torch

from megatrain_cli.engine.transfer.slots import Slot, StreamerBase, TransferStats, WholeTiles
from megatrain_cli.engine.transfer.updates import HostUpdates
from megatrain_cli.store.tiles import HostStore


class WeightStreamer(StreamerBase):
    """Copies a tile into its slot when it is acquired, on the calling thread; nothing overlaps."""

    def __init__(self, store: HostStore, device: torch.device, dtype: torch.dtype, *, layer_slots: int,
                 updates: HostUpdates, on_bind, place=None):
        super().__init__(store, device, dtype, place if place is not None else WholeTiles(store),
                         layer_slots=layer_slots, updates=updates, on_bind=on_bind)
        self._stall = 0.0

    def begin_step(self, order: list[str]) -> None:
        self.stats.reset()
        self._stall = 0.0

    def stall_seconds(self) -> float:
        """Host seconds in weight transfers this step: on this synchronous path compute waits for all."""
        return self._stall

    def acquire(self, tile: str) -> torch.Tensor:
        """`tile`'s flat device buffer; a blocking transfer first unless it is resident (its host time
        counts as stall)."""
        slot = self.slots.slot_for(tile)
        self.slots.use(slot)
        if slot.tile != tile:
            t0 = time.perf_counter()
            self._copy_in(tile, slot)
            self._stall += time.perf_counter() - t0
            slot.tile = tile
            self.place.count(self.stats, tile, slot)
        flat = slot.flat(self.store.layouts[tile].numel)
        self.on_bind(tile, flat)
        return flat

    def _copy_in(self, tile: str, slot: Slot) -> None:
        """This process's part of the tile into the slot (a cast fp32 -> compute dtype, or the held update's
        new weights), then the placement fills the rest (sharded: a blocking all-gather)."""
        master = self.store.tiles[tile].master
        mine = self.place.landing(tile, slot)[:master.numel()]
        update = self._claim_or_wait(tile)
        if update is None:
            mine.copy_(master)
        else:
            with update:
                update.apply(0, mine.numel(), mine)
        self.place.assemble(tile, slot, mine)

    def invalidate(self) -> None:
        """Forget residency (after the optimizer changed the masters)."""
        for s in self.slots.all():
            s.tile = None

    def idle_while(self, wait) -> None:
        """A host-side wait; on the synchronous path there is no device stream to account it to."""
        wait()


class GradSink:
    """Gradients leave the device: a tile's fp32 gradient lands in its host tile's grad section. Before
    every write into it `updates.wait_state` (deferred moments still read the previous gradient), after
    it `updates.landed` (the optimizer worker starts on the tile then)."""

    def __init__(self, store: HostStore, stats: TransferStats, updates: HostUpdates):
        self.store, self.stats, self.updates = store, stats, updates

    def send(self, tile: str, grad: torch.Tensor, sq_norm: torch.Tensor | None = None) -> None:
        dst = self.store.tiles[tile].grad
        self.updates.wait_state(tile)
        dst.copy_(grad)
        self.stats.d2h_bytes += grad.numel() * dst.element_size()
        self.updates.landed(tile, sq_norm if sq_norm is not None else 0.0)

    def send_rows(self, tile: str, rows: torch.Tensor, index: torch.Tensor,
                  sq_norm: torch.Tensor | None = None) -> None:
        """Sparse embedding gradient: only the rows the batch touched are non-zero. Synchronous: after
        every gradient sent before it has landed, one blocking copy of the rows to the host."""
        self.finish()
        self._land_rows(tile, index, rows, sq_norm if sq_norm is not None else 0.0)

    def _land_rows(self, tile: str, index: torch.Tensor, rows: torch.Tensor, sq_norm) -> None:
        """The host grad section: zero, then `rows` (device) at row `index` (copied to the host here)."""
        dst = self.store.tiles[tile].grad.view(-1, rows.shape[1])
        self.updates.wait_state(tile)
        dst.zero_()
        dst.index_copy_(0, index.cpu(), rows.to("cpu", dst.dtype))
        self.stats.d2h_bytes += rows.numel() * dst.element_size()
        self.updates.landed(tile, sq_norm)

    def finish(self) -> None:
        """Wait until every gradient sent has landed (no-op on the synchronous path)."""

    def pinned_bytes(self) -> int:
        return 0
