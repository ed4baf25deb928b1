"""Data-parallel layer streaming overlapped on CUDA (issue #11): cuda.py's streams, pinned staging, packer
thread and gradient slabs, each rank moving only its shard over its own PCIe link and NCCL assembling the
layer between the GPUs (docs/architecture.md, "Data parallel over N GPUs"). The packer casts the shard into
staging; the H2D stream copies it into the rank's slice of the slot (Shard-Landed); a comm stream
all-gathers in place (Weights-Ready). Gradients are reduce-scattered on a reduce stream, then cross PCIe
through the slabs as on one GPU. Per tile and rank: 1/N of the host cast, of both PCIe copies and of host
AdamW; NVLink carries (N-1)/N of the bf16 tile and of its fp32 gradient.

Two NCCL communicators, one thread each: NCCL needs every rank to issue a communicator's collectives in the
same order, and on one communicator the packer's all-gathers (in fetch order) and the training thread's
reduce-scatters and all-reduces (program order) would interleave differently on each rank (a mismatch or a
hang). So the all-gathers run on `DistContext.weight_group`, its communicator created at construction from
the training thread on every rank alike (`warm_up`). Nothing may synchronise the whole device mid-step
(torch.cuda.empty_cache, an out-of-memory retry that frees cached blocks): it could wait on a kernel whose
peer waits on this rank.
"""

from __future__ import annotations

import torch

from megatrain_cli.engine.dist import DistContext
from megatrain_cli.engine.transfer.cuda import CudaGradSink, CudaStreamer
from megatrain_cli.engine.transfer.sharded import RowPlan, RowsFromOwners, ShardReducer, Shards
from megatrain_cli.engine.transfer.slots import Slot
from megatrain_cli.engine.transfer.updates import HostUpdates
from megatrain_cli.store.sharded import ShardedHostStore


def largest_layer_shard(store: ShardedHostStore) -> int:
    """Elements of the largest decoder layer's shard: what a staging buffer or a gradient slab holds (the
    head's larger shard goes through them in chunks, as one GPU's head does)."""
    return max(store.shards[name].shard for name in store.layer_names)


class OverlappedShards(Shards):
    """Shards' placement for CudaStreamer: the H2D of this rank's shard records Shard-Landed (not Weights-
    Ready); then, on the comm stream, the in-place all-gather on the weight communicator (the packer
    thread's only collective), which records Weights-Ready. No host wait."""

    def __init__(self, store: ShardedHostStore, ctx: DistContext, device: torch.device):
        super().__init__(store, ctx)
        self.device = device
        self.comm = torch.cuda.Stream(device)
        self._shard_landed = torch.cuda.Event()  # one is enough: only the packer thread records and waits on it

    def h2d_landed(self, slot: Slot):
        return self._shard_landed

    def assemble(self, tile: str, slot: Slot, mine: torch.Tensor) -> None:
        with torch.cuda.stream(self.comm):
            # GPU-side: the shard is in place, hence the slot free too (the H2D stream waited on that)
            self.comm.wait_event(self._shard_landed)
            self.ctx.gather_weights(slot.buffer[:self.store.shards[tile].padded], mine)
            slot.ready.record(self.comm)

    def warm_up(self, dtype: torch.dtype) -> None:
        """One small all-gather on the weight communicator, now, from this thread: NCCL creates a
        communicator at its first collective, and there it would be the packer's first transfer, beside
        the training thread's first collectives on the other one."""
        probe = torch.zeros(self.ctx.world, dtype=dtype, device=self.device)
        self.ctx.gather_weights(probe, probe[self.ctx.rank:self.ctx.rank + 1])


class DistCudaStreamer(CudaStreamer):
    """CudaStreamer over a ShardedHostStore: the shard through pinned staging, then an all-gather on the
    weight communicator fills the other ranks' slices (OverlappedShards)."""

    def __init__(self, store: ShardedHostStore, device: torch.device, dtype: torch.dtype, ctx: DistContext, *,
                 layer_slots: int, double_buffer: bool, packer_threads: int | None, updates: HostUpdates, on_bind):
        super().__init__(store, device, dtype, layer_slots=layer_slots, double_buffer=double_buffer,
                         packer_threads=packer_threads, updates=updates, on_bind=on_bind,
                         staging_numel=largest_layer_shard(store), place=OverlappedShards(store, ctx, device))
        self.ctx = ctx
        self.owners = RowsFromOwners(store, device, dtype, ctx, self.stats)
        # The packer thread's CUDA calls on this rank's GPU (a new thread starts on device 0).
        self._packer.submit(torch.cuda.set_device, device).result()
        self.place.warm_up(dtype)

    @property
    def rows(self) -> RowPlan | None:
        return self.owners.plan

    def begin_step(self, order: list[str]) -> None:
        super().begin_step(order)
        self.owners.plan = None

    def embed_rows(self, uniq: torch.Tensor) -> torch.Tensor:
        """RowsFromOwners.embed_rows for this rank's unique token ids (host int64, sorted); tied, the table
        comes through acquire (the pipeline)."""
        return self.owners.embed_rows(uniq.to(self.device), self.acquire, self.updates.wait)


class DistCudaGradSink(CudaGradSink):
    """CudaGradSink's slabs and lander for this rank's shards: each gradient is reduce-scattered on a side
    stream first, and only the shard crosses PCIe."""

    def __init__(self, store: ShardedHostStore, streamer: DistCudaStreamer, ctx: DistContext, updates: HostUpdates, *,
                 slabs: int):
        super().__init__(store, streamer.stats, ctx.device, updates, slabs=slabs, slab_numel=largest_layer_shard(store),
                         lander_sets_device=True)
        self.shards = ShardReducer(store, ctx, streamer.stats, streamer.owners)
        self.reduce = torch.cuda.Stream(ctx.device)  # the reduce-scatters and the norm share; the D2H waits on it

    def reset(self) -> None:
        self.shards.reset()

    def take_sq_norm(self) -> torch.Tensor:
        return self.shards.take_sq_norm()

    def send(self, tile: str, grad: torch.Tensor, sq_norm: torch.Tensor | None = None) -> None:
        """`grad`: this rank's fp32 gradient of the whole tile, padded. `sq_norm` (the local, unreduced
        norm) is not this rank's share of the global one: the share is taken on the reduced shard."""
        done = torch.cuda.Event()
        done.record(self.compute)  # Backward-Done
        grad.record_stream(self.reduce)  # the training thread drops `grad` while the reduce-scatter reads it
        with torch.cuda.stream(self.reduce):
            self.reduce.wait_event(done)
            mine, sq = self.shards.reduce(tile, grad)  # NCCL reduce-scatter, then the shard's squared norm
            sq.record_stream(self.d2h)  # the D2H stream copies it after this function drops it
            self._send_flat(tile, self.store.tiles[tile].grad, mine, sq, self.reduce)

    def send_rows(self, tile: str, rows: torch.Tensor, index: torch.Tensor,
                  sq_norm: torch.Tensor | None = None) -> None:
        """sharded.DistGradSink.send_rows: after every slab has landed and the reduce stream's norm adds
        (finish), one all-reduce of the rows and a blocking D2H of this rank's |U|/N."""
        self.finish()
        mine, sq, local = self.shards.reduce_rows(rows)
        self._land_rows(tile, local, mine, sq)

    def finish(self) -> None:
        super().finish()  # every slab has landed
        # The compute stream reads this rank's norm share next (take_sq_norm, send_rows): after the adds.
        self.compute.wait_stream(self.reduce)
