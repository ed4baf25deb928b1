"""A step's activation checkpoints between the forward and the backward, and the dropped ones rebuilt.

`StepCheckpoints` is where the engine keeps a block's checkpoint (its input) from the forward until the
block's recompute: a plain dict on the short-context path, the CheckpointOffloader (device or pinned host
memory, transfer/offload.py) on the lean paths.

Dropped checkpoints are the lean plans' trade when host memory cannot take the checkpoints the device
cannot (engine/plan/lean.py): checkpoint b is not stored at all, and right before block b's recompute the
`rebuild` ops (schedule.py) run block b-1 again without autograd, from checkpoint b-1, to get it back.
The same weights and inputs through the same (deterministic) kernels as the forward: the rebuilt
checkpoint is the one the forward dropped, bit for bit. Checkpoint b-1 is read twice, by the rebuild and
by block b-1's own recompute right after block b, so it is held on the device in between. Costs, per
dropped checkpoint and step: one no-grad forward of block b-1 (at interval 1 with 2 weight slots no extra
weight transfer: layer b-1 is still in its slot for its own recompute), and while block b recomputes,
the held checkpoint b-1 (one more checkpoint of device memory when it was offloaded).
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain_cli.engine.schedule import Op, blocks
from megatrain_cli.engine.transfer.offload import CheckpointOffloader


def read_order(ops: list[Op]) -> list[int]:
    """The stored checkpoints in the order the backward reads them: a block's own at its recompute, the
    block before's at a rebuild (its own recompute then takes the held one, a dropped block's the rebuilt)."""
    dropped = {op.block for op in ops if op.kind == "rebuild"}
    order: list[int] = []
    for op in ops:
        key = op.block - 1 if op.kind == "rebuild" else op.block
        if (op.kind == "rebuild" or op.kind == "recompute" and key not in dropped) and key not in order:
            order.append(key)
    return order


class StepCheckpoints:
    """save() in the forward, load() at a block's recompute, rebuild() for a rebuild op; forget() at a
    step's start. `offloader` None: a plain dict on the device (no lean plan, no drops)."""

    def __init__(self, ops: list[Op], num_layers: int, interval: int, keep_blocks: frozenset[int],
                 offloader: CheckpointOffloader | None = None):
        self.offloader = offloader
        self.keep_blocks = keep_blocks
        self.dropped = frozenset(op.block for op in ops if op.kind == "rebuild")
        self.blocks = blocks(num_layers, interval)
        self.order = read_order(ops)
        self._next = dict(zip(self.order, self.order[1:]))  # each read prefetches the next one
        self._plain: dict[int, list[torch.Tensor]] = {}
        self._held: dict[int, list[torch.Tensor]] = {}  # read once already (a rebuild's input) or rebuilt

    def forget(self) -> None:
        """Drop whatever a failed step left behind (the offloader keeps its pinned buffers)."""
        if self.offloader is not None:
            self.offloader.forget()
        self._plain.clear()
        self._held.clear()

    def reserve(self, like: list) -> int:
        """Pin the host buffers of every offloaded checkpoint now (like: (shape, dtype) per micro-batch);
        the bytes pinned."""
        if self.offloader is None:
            return 0
        return sum(self.offloader.reserve(block, like) for block in self.order)

    def save(self, block: int, h: list[torch.Tensor]) -> None:
        """Block `block`'s input, in the forward: stored unless the block is kept (never recomputed) or its
        checkpoint is dropped (rebuilt)."""
        if block in self.keep_blocks or block in self.dropped:
            return
        if self.offloader is None:
            self._plain[block] = list(h)
        else:
            self.offloader.put(block, list(h))

    def prefetch_first(self) -> None:
        """Start bringing back the first checkpoint the backward reads (behind the head's compute)."""
        if self.offloader is not None and self.order:
            self.offloader.prefetch(self.order[0])

    def load(self, block: int) -> list[torch.Tensor]:
        """Block `block`'s checkpoint for its recompute: held (rebuilt, or read by the rebuild after this
        block), else read from where it was stored."""
        if block in self._held:
            return self._held.pop(block)
        return self._read(block)

    def _read(self, block: int) -> list[torch.Tensor]:
        if self.offloader is None:
            return self._plain.pop(block)
        h = self.offloader.get(block)
        if block in self._next:  # one read ahead, behind this block's compute
            self.offloader.prefetch(self._next[block])
        return h

    def rebuild(self, engine: Any, op: Op, h: list[torch.Tensor], ctx) -> list[torch.Tensor]:
        """One layer of the no-grad forward of block op.block - 1 that rebuilds checkpoint op.block
        (`engine`: the step's Engine, for its weights and its layer forward)."""
        before = self.blocks[op.block - 1]
        if op.layer == before.start:
            h = self._read(op.block - 1)
            self._held[op.block - 1] = h  # its own recompute, right after block op.block's, reads it again
        h = engine.forward_layer(op.layer, engine.acquire(op.tile), h, ctx)
        if op.layer == before[-1]:
            self._held[op.block] = h
        return h
