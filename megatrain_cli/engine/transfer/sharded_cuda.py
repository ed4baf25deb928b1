"""Data-parallel layer streaming, overlapped on CUDA (issue #11): cuda_pipeline's streams, pinned staging,
packer thread and gradient slabs, with each rank moving only ITS shard of a tile over its own PCIe link
and NCCL assembling the whole layer between the GPUs. The synchronous reference path, the embedding
rows and the global norm are engine/distributed.py's.

    packer thread   waits for host AdamW to be done with this rank's shard (before_read), casts the
                    SHARD fp32 -> compute dtype into pinned staging (CudaStreamer._transfer, as is)
    H2D stream      waits Buffer-Free, copies the shard into the rank's slice of the whole-layer slot,
                    records Shard-Landed
    comm stream     waits Shard-Landed, all-gathers in place on the WEIGHT communicator, records
                    Weights-Ready; compute waits on it before binding the slot (as on one GPU)
    compute         the layers; records Backward-Done after each tile's fp32 gradient
    reduce stream   waits Backward-Done, reduce-scatters on the GRADIENT communicator (the default group)
                    into an fp32 shard, adds the shard's squared norm to this rank's share (device)
    D2H stream      waits on the reduce stream, casts the shard to the grad dtype and copies it into
                    pinned slabs (CudaGradSink._send_flat, as is)
    lander thread   waits Slab-Full, copies the slab into the host shard's grad, calls on_landed (the
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
              (distributed.py), and send_rows waits for every slab before the embedding's rows
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain_cli.engine.transfer.cuda import CudaGradSink, CudaStreamer, _DeviceSlot
from megatrain_cli.engine.dist import DistContext
from megatrain_cli.engine.transfer.sharded import DistStats, RowsFromOwners, ShardedGradients
from megatrain_cli.store.sharded import ShardedHostStore


def largest_layer_shard(store: ShardedHostStore) -> int:
    """Elements of the largest decoder layer's shard: what a staging buffer or a gradient slab holds (the
    head's larger shard goes through them in chunks, as one GPU's head does)."""
    return max(store.shards[name].shard for name in store.layer_names)


@dataclass(eq=False)
class _ShardTarget:
    """What CudaStreamer._transfer fills: this rank's slice of a whole-tile slot, with the slot's
    Buffer-Free and, as `ready`, the event that says the shard has landed."""

    buffer: torch.Tensor
    free: torch.cuda.Event
    ready: torch.cuda.Event


class DistCudaStreamer(RowsFromOwners, CudaStreamer):
    """CudaStreamer over a ShardedHostStore: the shard through pinned staging, then an all-gather on the
    weight communicator fills the other ranks' slices (module docstring)."""

    def __init__(self, store: ShardedHostStore, device: torch.device, dtype: torch.dtype, ctx: DistContext, *,
                 layer_slots: int = 2, double_buffer: bool = True, before_read=None, packer_threads: int | None = None):
        # CudaStreamer sizes its slots to whole tiles; an all-gather fills shard x N elements, so the layer
        # slots are made here, padded (layer_slots=0: none is allocated twice).
        super().__init__(store, device, dtype, layer_slots=0, staging_numel=largest_layer_shard(store),
                         double_buffer=double_buffer, before_read=before_read, packer_threads=packer_threads)
        self.ctx, self.rows, self.stats = ctx, None, DistStats()
        self.layer_slots = [self._slot(store.largest_padded_layer_numel()) for _ in range(layer_slots)]
        self._lru = list(self.layer_slots)
        self.head_slot = self._padded(self.head_slot, store.padded_numel("head"))
        if self.embed_slot is not None:
            self.embed_slot = self._padded(self.embed_slot, store.padded_numel("embed"))
        self.comm = torch.cuda.Stream(device)
        self._shard_landed = torch.cuda.Event()  # one is enough: only the packer thread records and waits on it
        # The packer thread's CUDA calls on this rank's GPU (a new thread starts on device 0).
        self._packer.submit(torch.cuda.set_device, device).result()
        self._warm_up()

    def _slot(self, numel: int) -> _DeviceSlot:
        return _DeviceSlot(torch.empty(numel, dtype=self.dtype, device=self.device))

    def _padded(self, slot: _DeviceSlot, numel: int) -> _DeviceSlot:
        """`slot` when it holds `numel` elements, else a larger one (the old buffer goes back to the
        caching allocator, which hands it to the activations)."""
        return slot if slot.buffer.numel() >= numel else self._slot(numel)

    def _warm_up(self) -> None:
        """One small all-gather on the weight communicator, now, from this thread: NCCL creates a
        communicator at its first collective, and there it would be the packer's first transfer, beside
        the training thread's first collectives on the other one."""
        probe = torch.zeros(self.ctx.world, dtype=self.dtype, device=self.device)
        self.ctx.gather_weights(probe, probe[self.ctx.rank:self.ctx.rank + 1])

    def begin_step(self, order: list[str]) -> None:
        super().begin_step(order)
        self.rows = None

    def _start(self, tile: str, slot: _DeviceSlot) -> None:
        slot.tile = tile
        self.stats.count_gather(tile, self.store.shards[tile], slot.buffer.element_size())
        slot.pending = self._packer.submit(self._transfer, tile, slot)

    def _transfer(self, tile: str, slot: _DeviceSlot) -> None:
        """Packer thread: this rank's shard into its slice of the slot (CudaStreamer's transfer, which waits
        Buffer-Free first), then the all-gather of the other slices behind it; records Weights-Ready."""
        spec = self.store.shards[tile]
        full = slot.buffer[:spec.padded]
        shard = _ShardTarget(full[spec.start:spec.stop], slot.free, self._shard_landed)
        super()._transfer(tile, shard)
        with torch.cuda.stream(self.comm):
            # GPU-side: the shard is in place, hence the slot free too (the H2D stream waited on that)
            self.comm.wait_event(self._shard_landed)
            self.ctx.gather_weights(full, shard.buffer)
            slot.ready.record(self.comm)


class DistCudaGradSink(ShardedGradients, CudaGradSink):
    """CudaGradSink's slabs and lander for this rank's shards: each gradient is reduce-scattered on a side
    stream first, and only the shard crosses PCIe (module docstring)."""

    def __init__(self, store: ShardedHostStore, streamer: DistCudaStreamer, ctx: DistContext, *, slabs: int = 12):
        self.device = ctx.device  # read by the lander thread, which CudaGradSink starts
        super().__init__(store, streamer.stats, ctx.device, slabs=slabs, slab_numel=largest_layer_shard(store))
        self._attach(streamer, ctx)
        self.backward = self.compute  # the stream the gradients are made on
        self.reduce = torch.cuda.Stream(ctx.device)
        # _send_flat's D2H waits on an event it records on `self.compute`: here, on the stream the shard
        # is reduced on (after the reduce-scatter and the norm).
        self.compute = self.reduce

    def _drain(self) -> None:
        torch.cuda.set_device(self.device)  # its event waits on this rank's GPU (a new thread starts on device 0)
        super()._drain()

    def send(self, tile: str, grad: torch.Tensor, sq_norm: torch.Tensor | None = None) -> None:
        """`grad`: this rank's fp32 gradient of the whole tile, padded. `sq_norm` (the local, unreduced
        norm) is not this rank's share of the global one: the share is taken on the reduced shard."""
        done = torch.cuda.Event()
        done.record(self.backward)  # Backward-Done
        grad.record_stream(self.reduce)  # the training thread drops `grad` while the reduce-scatter reads it
        with torch.cuda.stream(self.reduce):
            self.reduce.wait_event(done)
            mine, sq = self._reduce(tile, grad)  # NCCL reduce-scatter, then the shard's squared norm
            sq.record_stream(self.d2h)  # the D2H stream copies it after this function drops it
            self._send_flat(tile, self.store.tiles[tile].grad, mine, sq)

    def finish(self) -> None:
        super().finish()  # every slab has landed
        # The compute stream reads this rank's norm share next (take_sq_norm, send_rows): after the adds.
        self.backward.wait_stream(self.reduce)
