"""What every weight streamer shares: the device slots, the transfer counters, and where a tile's bytes land.

`SlotPool` is the device side of every path: `layer_slots` buffers sized to the largest decoder layer,
one for the head and, for tied embeddings, one for the embedding table, so the device never holds more
than `layer_slots` layers' weights. Allocated once, at construction; a step allocates nothing here.

A placement says where this process's bytes of a tile go in its slot and how the rest of the slot is
filled: `WholeTiles` (one process: the whole tile, nothing else to do) or sharded.Shards (this rank's
slice, then an all-gather). The streamers (reference.py, cuda.py) move the bytes; the placement only
points at them.

`StreamerBase` holds what every streamer is built with: the slots, the placement, the host updates
(updates.HostUpdates: what a read waits for or applies), `on_bind` and the transfer counters.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatrain_cli.engine.transfer.updates import HostUpdates

# Elements per H2D chunk through pinned staging and per pinned gradient slab: sized to what moves at once,
# not to the largest layer, whose billions of parameters (an MoE layer: gpt-oss-120b's is 3.2 B) would pin
# GBs per buffer. 256 MB of bf16 per copy still runs the link at its ceiling.
TRANSFER_CHUNK = 1 << 27


def transfer_chunk(largest: int) -> int:
    """Elements of one staging buffer / gradient slab for a store whose largest layer has `largest`."""
    return min(largest, TRANSFER_CHUNK)


def embedding_rows_pinned(tokens: int, vocab: int, hidden: int, width: int) -> int:
    """Pinned host bytes of a step's embedding rows in (inputs.py) and their gradients out
    (cuda.CudaGradSink.send_rows): one block at a time in torch's host allocator, which rounds a block up
    to a power of two. At most one row per vocabulary entry, however long the step."""
    rows = min(tokens, vocab) * hidden * width
    return 1 << max(0, rows - 1).bit_length()


@dataclass(eq=False)  # identity semantics: a slot is one buffer
class Slot:
    buffer: torch.Tensor  # flat device buffer, compute dtype
    tile: str | None = None
    # The CUDA pipeline's (cuda.py), None elsewhere:
    ready: Any = None  # Weights-Ready: recorded once the slot holds `tile`
    free: Any = None  # Buffer-Free: recorded on compute after the last use
    pending: Future | None = None  # the packer's transfer into this slot, until the compute side waited on it

    def flat(self, numel: int) -> torch.Tensor:
        return self.buffer[:numel]


@dataclass
class TransferStats:
    """Bytes moved this step (reset by begin_step). The last two stay 0 on one process."""

    h2d_bytes: int = 0  # over this process's host link
    d2h_bytes: int = 0
    h2d_count: dict = field(default_factory=dict)  # tile -> transfers this step
    gathered_bytes: int = 0  # bytes assembled by all-gathers (the whole layers), per rank
    reduced_bytes: int = 0  # bytes entering reduce-scatters / all-reduces, per rank

    def reset(self) -> None:
        self.h2d_bytes = self.d2h_bytes = self.gathered_bytes = self.reduced_bytes = 0
        self.h2d_count = {}

    def count_h2d(self, tile: str, numel: int, element_size: int) -> None:
        self.h2d_bytes += numel * element_size
        self.h2d_count[tile] = self.h2d_count.get(tile, 0) + 1

    def count_gather(self, tile: str, spec, element_size: int) -> None:
        """One transfer of `tile`: this rank's shard over its link, the whole (padded) tile assembled."""
        self.h2d_bytes += spec.shard * element_size
        self.gathered_bytes += spec.padded * element_size
        self.h2d_count[tile] = self.h2d_count.get(tile, 0) + 1


class WholeTiles:
    """One process's placement: the whole tile lands in its slot; nothing else fills it."""

    def __init__(self, store):
        self.store = store

    def largest_layer(self) -> int:
        return self.store.largest_layer_numel()

    def numel(self, tile: str) -> int:
        return self.store.layouts[tile].numel

    def landing(self, tile: str, slot: Slot) -> torch.Tensor:
        """Where the host master goes: its first master.numel() elements."""
        return slot.buffer

    def count(self, stats: TransferStats, tile: str, slot: Slot) -> None:
        stats.count_h2d(tile, self.store.layouts[tile].numel, slot.buffer.element_size())

    def assemble(self, tile: str, slot: Slot, mine: torch.Tensor) -> None:
        """Nothing: `mine` is the whole tile."""

    def h2d_landed(self, slot: Slot):
        """The event the CUDA path records once its H2D is enqueued: here Weights-Ready itself."""
        return slot.ready


class SlotPool:
    """The device buffers weights are streamed into, least-recently-used layer slots first.

    Costs device memory only: layer_slots x the largest layer (padded to N shards on the sharded path)
    + the head + a tied embedding, in the compute dtype. `events` (the CUDA pipeline) gives each slot its
    Weights-Ready / Buffer-Free events; Buffer-Free is recorded at once (nothing uses a new slot)."""

    def __init__(self, store, device: torch.device, dtype: torch.dtype, layer_slots: int, place, *,
                 events: bool = False):
        self.device, self.dtype, self.events = device, dtype, events
        self.layers = [self._make(place.largest_layer()) for _ in range(layer_slots)]
        self.head = self._make(place.numel("head"))
        self.embed: Slot | None = self._make(place.numel("embed")) if store.adapter.tied else None
        self._lru: list[Slot] = list(self.layers)

    def _make(self, numel: int) -> Slot:
        slot = Slot(torch.empty(numel, dtype=self.dtype, device=self.device))
        if self.events:
            slot.ready, slot.free = torch.cuda.Event(), torch.cuda.Event()
            slot.free.record()
        return slot

    def all(self) -> list[Slot]:
        return [*self.layers, self.head] + ([self.embed] if self.embed is not None else [])

    def slot_for(self, tile: str) -> Slot:
        """The slot that holds `tile`, else the one it goes into (the least recently used layer slot)."""
        if tile == "head":
            return self.head
        if tile == "embed":
            assert self.embed is not None, "the full embedding is streamed only when tied"
            return self.embed
        for s in self._lru:
            if s.tile == tile:
                return s
        return self._lru[0]

    def use(self, slot: Slot) -> None:
        """`slot` becomes the most recently used."""
        if slot in self._lru:
            self._lru.remove(slot)
            self._lru.append(slot)

    def in_use(self, slot: Slot) -> bool:
        """`slot` is the layer slot used last (prefetching into it would evict the tile in use)."""
        return slot in self._lru and self._lru[-1] is slot

    def device_bytes(self) -> int:
        return sum(s.buffer.numel() * s.buffer.element_size() for s in self.all())


class StreamerBase:
    """The slots, the placement and the hooks it is built with; the subclasses move the bytes."""

    def __init__(self, store, device: torch.device, dtype: torch.dtype, place, *, layer_slots: int,
                 updates: HostUpdates, on_bind: Callable[[str, torch.Tensor], None], events: bool = False):
        self.store, self.device, self.dtype, self.place = store, device, dtype, place
        self.slots = SlotPool(store, device, dtype, layer_slots, place, events=events)
        self.stats = TransferStats()
        self.updates = updates  # the host optimizer: a tile's read waits for its update, or applies it
        self.on_bind = on_bind  # (tile, flat): the saved-tensor hooks learn which buffer holds what

    @property
    def layer_slots(self) -> list[Slot]:
        return self.slots.layers

    def resident(self, tile: str) -> torch.Tensor:
        """The flat device tensor that holds `tile` now (it must be resident). Called by the backward's
        saved-tensor hooks for every streamed weight (templates.WeightRedirect): a lookup, no copy."""
        slot = self.slots.slot_for(tile)
        if slot.tile != tile:
            raise RuntimeError(f"{tile} is not resident on the device")
        return slot.flat(self.store.layouts[tile].numel)

    def _claim_or_wait(self, tile: str):
        """The tile's held update for this read to apply (update on read), or None once its weights are
        current (a host-side wait when host AdamW is behind)."""
        update = self.updates.claim(tile)
        if update is None:
            self.updates.wait(tile)
        return update

    def prefetch_first(self) -> None:
        """Start the step's first transfer before anything acquires it (the overlapped path; here none)."""

    def device_bytes(self) -> int:
        return self.slots.device_bytes()

    def pinned_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass
