"""How bytes move between the host store and the compute device.

`WeightStreamer` owns a fixed pool of device buffers, two sized to the largest decoder layer and
one for the head (and, for tied embeddings, one for the embedding table), so the device never holds
more than two layers' weights. `acquire(tile)` makes a tile resident (least-recently-used slot) and
returns its flat buffer; the schedule's fetch order tells it what comes next.

This synchronous streamer is the reference path: on the CPU a "transfer" is a plain cast-copy from
the fp32 master; on CUDA it is a blocking copy. `cuda_pipeline.CudaStreamer` is the overlapped
version with the same interface.

`GradSink.send` moves one tile's finished fp32 gradient to the host tile, cast to its grad dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatrain_cli.store.tiles import HostStore


@dataclass(eq=False)  # identity semantics: a slot is one buffer
class Slot:
    buffer: torch.Tensor  # flat device buffer, compute dtype
    tile: str | None = None

    def flat(self, numel: int) -> torch.Tensor:
        return self.buffer[:numel]


@dataclass
class TransferStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_count: dict = field(default_factory=dict)  # tile -> transfers this step

    def reset(self) -> None:
        self.h2d_bytes = self.d2h_bytes = 0
        self.h2d_count = {}


class WeightStreamer:
    def __init__(self, store: HostStore, device: torch.device, dtype: torch.dtype, layer_slots: int = 2,
                 before_read=None):
        self.store, self.device, self.dtype = store, device, dtype
        big = store.largest_layer_numel()
        self.layer_slots = [Slot(torch.empty(big, dtype=dtype, device=device)) for _ in range(layer_slots)]
        self.head_slot = Slot(torch.empty(store.layouts["head"].numel, dtype=dtype, device=device))
        self.embed_slot: Slot | None = None
        if store.adapter.tied:
            self.embed_slot = Slot(torch.empty(store.layouts["embed"].numel, dtype=dtype, device=device))
        self._lru: list[Slot] = list(self.layer_slots)
        self.stats = TransferStats()
        self.on_bind = None  # callback(tile, flat) so saved-tensor hooks know which buffer holds what
        self.before_read = before_read  # tile -> None: blocks until the host optimizer is done with it
        # tile -> ReadThroughUpdate | None: a deferred update this read applies itself (optim/worker.py)
        self.claim = None

    # ------------------------------------------------------------ residency
    def _slot_for(self, tile: str) -> Slot:
        if tile == "head":
            return self.head_slot
        if tile == "embed":
            assert self.embed_slot is not None, "the full embedding is streamed only when tied"
            return self.embed_slot
        for s in self._lru:
            if s.tile == tile:
                return s
        return self._lru[0]  # least recently used

    def resident(self, tile: str) -> torch.Tensor:
        """The flat device tensor that holds `tile` now (it must be resident)."""
        slot = self._slot_for(tile)
        if slot.tile != tile:
            raise RuntimeError(f"{tile} is not resident on the device")
        return slot.flat(self.store.layouts[tile].numel)

    def begin_step(self, order: list[str]) -> None:
        self.stats.reset()

    def acquire(self, tile: str) -> torch.Tensor:
        slot = self._slot_for(tile)
        if slot in self._lru:
            self._lru.remove(slot)
            self._lru.append(slot)
        numel = self.store.layouts[tile].numel
        if slot.tile != tile:
            self._copy_in(tile, slot.flat(numel))
            slot.tile = tile
            self.stats.h2d_bytes += numel * slot.buffer.element_size()
            self.stats.h2d_count[tile] = self.stats.h2d_count.get(tile, 0) + 1
        flat = slot.flat(numel)
        if self.on_bind is not None:
            self.on_bind(tile, flat)
        return flat

    def invalidate(self) -> None:
        """Forget residency (after the optimizer changed the masters)."""
        for s in [*self.layer_slots, self.head_slot, self.embed_slot]:
            if s is not None:
                s.tile = None

    def idle_while(self, wait) -> None:
        """A host-side wait; on the synchronous path there is no device stream to account it to."""
        wait()

    def _claim_or_wait(self, tile: str):
        """The tile's held update for this read to apply (read-through), or None once its weights are
        current (a host-side wait when host AdamW is behind)."""
        update = self.claim(tile) if self.claim is not None else None
        if update is None and self.before_read is not None:
            self.before_read(tile)
        return update

    def _copy_in(self, tile: str, dst: torch.Tensor) -> None:
        update = self._claim_or_wait(tile)
        if update is None:
            dst.copy_(self.store.tiles[tile].master)  # cast fp32 -> compute dtype on the way
            return
        with update:
            update.apply(0, dst.numel(), dst)

    def pinned_bytes(self) -> int:
        return 0

    def device_bytes(self) -> int:
        slots = [*self.layer_slots, self.head_slot] + ([self.embed_slot] if self.embed_slot else [])
        return sum(s.buffer.numel() * s.buffer.element_size() for s in slots)


class GradSink:
    """Gradients leave the device: a tile's fp32 gradient lands in its host tile's grad section."""

    def __init__(self, store: HostStore, stats: TransferStats):
        self.store, self.stats = store, stats
        # (tile, squared norm of its gradient) -> None, called once the gradient is in the host tile
        # (the optimizer worker starts on it then).
        self.on_landed = None
        # tile -> None, blocks until the tile's host gradient may be replaced (the optimizer worker's
        # deferred moments still read the previous step's); called before every write into it.
        self.before_write = None

    def _landed(self, tile: str, sq_norm) -> None:
        if self.on_landed is not None:
            self.on_landed(tile, float(sq_norm))

    def _await_tile(self, tile: str) -> None:
        if self.before_write is not None:
            self.before_write(tile)

    def send(self, tile: str, grad: torch.Tensor, sq_norm: torch.Tensor | None = None) -> None:
        dst = self.store.tiles[tile].grad
        self._await_tile(tile)
        dst.copy_(grad)
        self.stats.d2h_bytes += grad.numel() * dst.element_size()
        self._landed(tile, sq_norm if sq_norm is not None else 0.0)

    def send_rows(self, tile: str, rows: torch.Tensor, index: torch.Tensor,
                  sq_norm: torch.Tensor | None = None) -> None:
        """Sparse embedding gradient: only the rows the batch touched are non-zero."""
        self.finish()
        dst = self.store.tiles[tile].grad.view(-1, rows.shape[1])
        self._await_tile(tile)
        dst.zero_()
        dst.index_copy_(0, index.cpu(), rows.to("cpu", dst.dtype))
        self.stats.d2h_bytes += rows.numel() * dst.element_size()
        self._landed(tile, sq_norm if sq_norm is not None else 0.0)

    def finish(self) -> None:
        """Wait until every gradient sent has landed (no-op on the synchronous path)."""

    def pinned_bytes(self) -> int:
        return 0
