"""The order of work in one step: which piece, when. Pure logic; no tensors, testable on the CPU.

Micro-batches are the INNER loop: while a layer's weights are on the device, every micro-batch of
the step runs through it. So gradient accumulation costs no extra transfers, a layer's gradients
accumulate on the device and leave once per step, and the weights cross PCIe a fixed number of
times per step whatever the accumulation count.

    forward      layers 0..L-1 without autograd; keep each block's input (every
                 checkpoint_interval layers) as its activation checkpoint
    head         final norm + LM head + chunked loss, forward and backward
    per block, last block first:
      recompute  the block's layers from its checkpoint, with autograd (activations kept)
      backward   the block's layers in reverse; each layer's gradients leave as soon as they exist
    embed        embedding-row gradients
    optimizer    host AdamW over every tile

Blocks listed in `keep_blocks` skip the recompute: their forward already ran with autograd
(memory-adaptive recompute: spend spare device memory on activations instead of FLOPs).

Blocks listed in `dropped` keep no checkpoint (the lean plans' trade when host memory is short,
engine/rebuild.py): right before such a block's recompute, `rebuild` ops run the block before it again
without autograd, from that block's checkpoint, to get this one back. Their weights are listed like any
other use, so the streamer prefetches them and transfers_per_layer counts them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    kind: str  # 'forward' | 'head' | 'rebuild' | 'recompute' | 'backward' | 'embed_backward'
    layer: int = -1
    block: int = -1  # a rebuild: the dropped block whose checkpoint it rebuilds (its layer is in the block before)
    checkpoint: bool = False  # forward: this layer's input is a block checkpoint
    grad: bool = False  # forward: build the autograd graph (kept block)

    @property
    def tile(self) -> str | None:
        if self.kind == "head":
            return "head"
        return f"layers.{self.layer}" if self.layer >= 0 else None


def blocks(num_layers: int, interval: int) -> list[range]:
    return [range(s, min(s + interval, num_layers)) for s in range(0, num_layers, interval)]


def build_schedule(num_layers: int, checkpoint_interval: int, keep_blocks: frozenset[int] = frozenset(),
                   dropped: frozenset[int] = frozenset()) -> list[Op]:
    ops: list[Op] = []
    bl = blocks(num_layers, checkpoint_interval)
    for b in dropped:  # rebuilt from the block before's checkpoint: that one must be stored
        if not (0 < b < len(bl)) or b in keep_blocks or b - 1 in keep_blocks or b - 1 in dropped:
            raise ValueError(f"checkpoint {b} cannot be dropped: a dropped checkpoint is rebuilt from the one "
                             f"before, which must be stored (blocks 1..{len(bl) - 1}, neither kept; dropped "
                             f"{sorted(dropped)}, kept {sorted(keep_blocks)})")
    for b, layers in enumerate(bl):
        for i in layers:
            ops.append(Op("forward", i, b, checkpoint=(i == layers.start), grad=b in keep_blocks))
    ops.append(Op("head"))
    for b in reversed(range(len(bl))):
        if b in dropped:
            ops.extend(Op("rebuild", i, b) for i in bl[b - 1])
        if b not in keep_blocks:
            ops.extend(Op("recompute", i, b) for i in bl[b])
        ops.extend(Op("backward", i, b) for i in reversed(bl[b]))
    ops.append(Op("embed_backward"))
    return ops


def fetch_order(ops: list[Op]) -> list[str]:
    """The tiles in the order their weights are needed (consecutive repeats folded)."""
    order: list[str] = []
    for op in ops:
        t = op.tile
        if t is not None and (not order or order[-1] != t):
            order.append(t)
    return order


def transfers_per_layer(ops: list[Op], resident_buffers: int = 2) -> dict[str, int]:
    """H2D weight transfers of each layer in one step, for a pool of `resident_buffers` LRU slots."""
    counts: dict[str, int] = {}
    resident: list[str] = []
    for tile in fetch_order(ops):
        if not tile.startswith("layers."):
            counts[tile] = counts.get(tile, 0) + 1  # head/embed have their own buffer
            continue
        if tile in resident:
            resident.remove(tile)
            resident.append(tile)
            continue
        counts[tile] = counts.get(tile, 0) + 1
        resident.append(tile)
        if len(resident) > resident_buffers:
            resident.pop(0)
    return counts
