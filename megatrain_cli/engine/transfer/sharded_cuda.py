"""Data-parallel layer streaming, overlapped on CUDA (issue #11): cuda.py's streams, pinned staging,
packer thread and gradient slabs, with each rank moving only ITS shard of a tile over its own PCIe link
and NCCL assembling the whole layer between the GPUs. The synchronous reference path, the embedding
rows and the global norm are sharded.py's (RowsFromOwners, ShardReducer: held here as there).

    packer thread   waits for host AdamW to be done with this rank's shard (updates.wait), casts the
                    SHARD fp32 -> compute dtype into pinned staging (CudaStreamer._transfer)
    H2D stream      waits Buffer-Free, copies the shard into the rank's slice of the whole-layer slot,
                    records Shard-Landed
    comm stream     waits Shard-Landed, all-gathers in place on the WEIGHT communicator, records
                    Weights-Ready; compute waits on it before binding the slot (as on one GPU);
                    OverlappedShards, the placement CudaStreamer._transfer ends with
    compute         the layers; records Backward-Done after each tile's fp32 gradient
    reduce stream   waits Backward-Done, reduce-scatters on the GRADIENT communicator (the default group)
                    into an fp32 shard, adds the shard's squared norm to this rank's share (device)
    D2H stream      waits on the reduce stream, casts the shard to the grad dtype and copies it into
                    pinned slabs (CudaGradSink._send_flat, waiting on the reduce stream)
    lander thread   waits Slab-Full, copies the slab into the host shard's grad, calls updates.landed (the
                    optimizer worker starts on the shard), as on one GPU

Two NCCL communicators, one thread each. NCCL needs every rank to issue a communicator's collectives in
the same order. The packer thread issues the weight all-gathers in the order the training thread asks
for tiles (acquire / prefetch: the schedule's, the same on every rank); the training thread issues the
reduce-scatters, the embedding rows' all-reduces and the scalar all-reduces in program order. On one
communicator the two threads would interleave differently on each rank (a mismatch or a hang), so the
all-gathers get their own (DistContext.weight_group), created at construction from the training thread
on every rank alike (see `_warm_up`). Two communicators' kernels run side by side on the GPU; anything
that synchronises the whole device in the middle of a step (torch.cuda.empty_cache, an out-of-memory
retry that frees cached blocks) could wait on a kernel whose peer waits on this rank: keep them out of
the step.

Costs per tile per rank, N ranks, bf16 compute (one GPU: the whole tile over PCIe both ways):
    host      cast of 1/N of the tile into pinned staging (packer); copy of 1/N of its gradient out of
              a slab (lander); AdamW over 1/N of it
    PCIe      H2D of 1/N of the tile's bf16 weights; D2H of 1/N of its bf16 gradient
    NVLink    all-gather: receives (N-1)/N of the bf16 tile; reduce-scatter: (N-1)/N of its fp32
              gradient; both on a few SMs beside the compute stream
    device    the whole-tile slots as on one GPU (padded to N shards); one fp32 shard and its grad-dtype
              copy per gradient in flight; the weight communicator's NCCL buffers
    syncs     no host wait on the hot path but the packer's on its own staging buffers and the lander's
              on its slabs (their own threads); per step, embed_rows' two and the two scalar all-reduces'
              (sharded.py), and send_rows waits for every slab before the embedding's rows
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
    weight communicator fills the other ranks' slices (OverlappedShards; module docstring)."""

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
    stream first, and only the shard crosses PCIe (module docstring)."""

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
