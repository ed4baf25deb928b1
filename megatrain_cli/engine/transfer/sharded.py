"""Data-parallel layer streaming on torch.distributed (issue #11): the engine-level pieces.

N ranks (one GPU each, or N CPU processes on gloo), each with its share of every step's micro-batches
and 1/N of every tile in host memory (store/sharded.py). Per layer and step:

    acquire   the rank's shard of the master, cast to the compute dtype, goes into ITS slice of the
              whole-layer device buffer (over its own PCIe link: 1/N of the layer's bytes), then one
              all-gather (in place) assembles the whole layer on every device
    backward  each rank's fp32 gradient accumulator (its micro-batches only) is reduce-scattered
              (sum over ranks); the rank's shard goes to its host grad section; its squared norm is
              added to this rank's share of the global norm

The embedding is not streamed whole (one process never does that either, unless tied):

    forward   every rank marks the token ids of its micro-batches in a [V] int32 vector; one
              all-reduce gives the step's global set U of used rows (sorted, the same everywhere).
              Embedding shards are whole rows (rank r owns rows [r V/N, (r+1) V/N)), so each rank
              reads only the rows of U it owns from its host shard (|U|/N rows on average over PCIe),
              writes them into a zero [|U|, H] device buffer and an all-reduce (sum; every element
              has exactly one non-zero term, so the sum is exact) gives every rank all rows of U.
    backward  each rank index-adds its row gradients into a zero [|U|, H] fp32 buffer; an all-reduce
              sums them; each rank keeps the rows it owns (sparse, as one process does).
    cost      2 all-reduces of |U| x H (compute dtype forward, fp32 backward) + one of V int32 per step,
              against gathering the whole table (V x H) every step: |U| <= tokens per step, usually far
              below V, and no V x H buffer on the device.

With tied embeddings the head needs the whole table anyway: it is acquired (all-gathered) once at the
start of the step, the forward rows are read from it and the head reuses it; its gradient is a whole
tile's and is reduce-scattered like a layer's.

Global quantities (the only extra host syncs; one process has the first and the last too):

    step start   the number of loss tokens of the GLOBAL batch (all-reduce), so every rank scales its
                 loss by 1 / global tokens and the summed gradients are the single-process gradients
    step end     one all-reduce of (this rank's shard squared norms, loss sum, loss tokens, tokens):
                 the global gradient norm, hence the clip coefficient, identical on every rank

Collectives per step: one all-gather per layer transfer (2-3 per layer, as the schedule's
transfers_per_layer), one reduce-scatter per layer, one each for the head; the embedding's three
(or, tied, one all-gather + one reduce-scatter); the two scalar all-reduces. Every rank issues them in
schedule order. The classes here are the synchronous reference path (like transfers.WeightStreamer):
the training thread issues all of them on the default group, one after the other. The overlapped CUDA
path (dist_pipeline.py) issues the weight all-gathers from the packer thread on `weight_group`, a
second NCCL communicator, and everything else from the training thread on the default group: one
thread per communicator, so each sees the same ordered sequence on every rank (the optimizer worker
and the gradient lander run no collective). `DistContext.overlap = False` keeps a CUDA run on the
classes here.

Host tensors (gathering the masters for tests / export) go through `cpu_group`, a gloo group; under
NCCL the device collectives use the default group.
"""


from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatrain_cli.engine.dist import DistContext
from megatrain_cli.engine.transfer.reference import GradSink, Slot, TransferStats, WeightStreamer
from megatrain_cli.store.sharded import ShardedHostStore


@dataclass
class DistStats(TransferStats):
    gathered_bytes: int = 0  # bytes assembled by all-gathers (the whole layers), per rank
    reduced_bytes: int = 0  # bytes entering reduce-scatters / all-reduces, per rank

    def reset(self) -> None:
        super().reset()
        self.gathered_bytes = self.reduced_bytes = 0

    def count_gather(self, tile: str, spec, element_size: int) -> None:
        """One transfer of `tile`: this rank's shard over its link, the whole (padded) tile assembled."""
        self.h2d_bytes += spec.shard * element_size
        self.gathered_bytes += spec.padded * element_size
        self.h2d_count[tile] = self.h2d_count.get(tile, 0) + 1


@dataclass
class _RowPlan:
    """The step's embedding rows: the global used set and this rank's part of it."""

    used: torch.Tensor  # [|U|] sorted token ids (device)
    lo: int  # used[lo:hi] are the rows this rank owns
    hi: int
    local: torch.Tensor  # [hi - lo] their row index in this rank's shard (host)
    pos: torch.Tensor  # [u] where this rank's unique ids sit in `used` (device)


class RowsFromOwners:
    """embed_rows: the step's embedding rows from the ranks that own them (module docstring). Mixed into
    DistStreamer and dist_pipeline.DistCudaStreamer; uses their store, device, dtype, ctx, stats (DistStats),
    before_read and acquire, and leaves the step's row plan in `rows` for the sink's send_rows."""

    rows: _RowPlan | None = None

    def embed_rows(self, uniq: torch.Tensor) -> torch.Tensor:
        """The embedding rows of this rank's unique token ids (host int64, sorted), [u, H] in the compute
        dtype on the device, in that order. Small and synchronous on every path: two host syncs (the used
        set's size and bounds) and a pageable H2D of this rank's |U|/N rows."""
        V, H = self.store.adapter.vocab_size, self.store.adapter.hidden_size
        ids = uniq.to(self.device)
        if self.store.adapter.tied:
            return self.acquire("embed").view(V, H)[ids]
        mark = torch.zeros(V, dtype=torch.int32, device=self.device)
        mark[ids] = 1
        self.ctx.all_reduce(mark)  # counts of ranks using each row
        used = mark.nonzero().squeeze(1)
        spec = self.store.shards["embed"]
        rows_per, first = spec.shard // H, spec.start // H
        bounds = torch.searchsorted(used, torch.tensor([first, first + rows_per], device=self.device))
        lo, hi = (int(b) for b in bounds.tolist())
        local = (used[lo:hi] - first).cpu()
        buf = torch.zeros(used.numel(), H, dtype=self.dtype, device=self.device)
        if self.before_read is not None:
            self.before_read("embed")
        buf[lo:hi] = self.store.tiles["embed"].master.view(rows_per, H)[local].to(self.device, self.dtype)
        self.ctx.all_reduce(buf)  # one non-zero term per element: exact
        self.rows = _RowPlan(used, lo, hi, local, torch.searchsorted(used, ids))
        # (not in h2d_bytes: one process does not count its embedding rows there either)
        self.stats.reduced_bytes += buf.numel() * buf.element_size() + mark.numel() * 4
        return buf[self.rows.pos]


class DistStreamer(RowsFromOwners, WeightStreamer):
    """WeightStreamer over a ShardedHostStore: shard H2D, then an all-gather into the whole-layer slot."""

    def __init__(self, store: ShardedHostStore, device: torch.device, dtype: torch.dtype, ctx: DistContext, *,
                 layer_slots: int = 2, before_read=None):
        self.store, self.device, self.dtype, self.ctx = store, device, dtype, ctx
        big = store.largest_padded_layer_numel()
        self.layer_slots = [Slot(torch.empty(big, dtype=dtype, device=device)) for _ in range(layer_slots)]
        self.head_slot = Slot(torch.empty(store.padded_numel("head"), dtype=dtype, device=device))
        self.embed_slot: Slot | None = None
        if store.adapter.tied:
            self.embed_slot = Slot(torch.empty(store.padded_numel("embed"), dtype=dtype, device=device))
        self._lru: list[Slot] = list(self.layer_slots)
        self.stats = DistStats()
        self.on_bind = None
        self.before_read = before_read
        self.rows = None
        self._stall = 0.0

    def begin_step(self, order: list[str]) -> None:
        self.stats.reset()
        self.rows = None
        self._stall = 0.0

    def stall_seconds(self) -> float:
        """Host seconds in weight transfers this step: on this synchronous path compute waits for all."""
        return self._stall

    def acquire(self, tile: str) -> torch.Tensor:
        slot = self._slot_for(tile)
        if slot in self._lru:
            self._lru.remove(slot)
            self._lru.append(slot)
        if slot.tile != tile:
            t0 = time.perf_counter()
            self._gather(tile, slot)
            self._stall += time.perf_counter() - t0
            slot.tile = tile
        flat = slot.flat(self.store.layouts[tile].numel)
        if self.on_bind is not None:
            self.on_bind(tile, flat)
        return flat

    def _gather(self, tile: str, slot: Slot) -> None:
        if self.before_read is not None:
            self.before_read(tile)
        spec = self.store.shards[tile]
        full = slot.buffer[:spec.padded]
        mine = full[spec.start:spec.stop]
        mine.copy_(self.store.tiles[tile].master)  # this rank's shard only, cast fp32 -> compute dtype
        self.ctx.all_gather(full, mine)
        self.stats.count_gather(tile, spec, slot.buffer.element_size())


class ShardedGradients:
    """What a sink does with a sharded store (mixed into DistGradSink and dist_pipeline.DistCudaGradSink):
    reduce-scatter a tile's gradient, keep this rank's share of the global squared norm (`take_sq_norm`),
    land the embedding's row gradients on their owners (`send_rows`). Uses the sink's store, stats
    (DistStats), finish, _await_tile and _landed."""

    def _attach(self, streamer, ctx: DistContext) -> None:
        self.streamer, self.ctx = streamer, ctx
        self._sq = torch.zeros((), dtype=torch.float32, device=ctx.device)

    def reset(self) -> None:
        self._sq.zero_()

    def take_sq_norm(self) -> torch.Tensor:
        """This rank's shards' squared gradient norms, summed (device scalar), and reset for the next step."""
        sq, self._sq = self._sq, torch.zeros_like(self._sq)
        return sq

    def _reduce(self, tile: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's shard of the sum over ranks of `grad`, its squared norm), the norm also added to this
        rank's share; on the current stream. `grad`: this rank's fp32 gradient of the whole tile, padded."""
        spec = self.store.shards[tile]
        if grad.numel() != spec.padded:
            raise ValueError(f"{tile}: the gradient has {grad.numel()} elements, the sharded store needs "
                             f"{spec.padded} (the tile padded to {spec.world} shards)")
        mine = self.ctx.reduce_scatter(grad)
        sq = torch.dot(mine, mine)
        self._sq.add_(sq)
        self.stats.reduced_bytes += grad.numel() * grad.element_size()
        return mine, sq

    def send_rows(self, tile: str, rows: torch.Tensor, index: torch.Tensor,
                  sq_norm: torch.Tensor | None = None) -> None:
        """This rank's row gradients of its unique ids `index` (the order embed_rows saw): summed over
        ranks on the device; each rank keeps the rows it owns. Synchronous (one D2H of |U|/N rows), after
        every gradient sent before it has landed (finish: landing order, and the norm share's stream)."""
        self.finish()
        plan = self.streamer.rows
        if plan is None:
            raise RuntimeError("send_rows before embed_rows in this step")
        H = rows.shape[1]
        buf = torch.zeros(plan.used.numel(), H, dtype=torch.float32, device=rows.device)
        buf.index_copy_(0, plan.pos, rows.float())
        self.ctx.all_reduce(buf)
        mine = buf[plan.lo:plan.hi]
        sq = mine.square().sum()
        self._sq.add_(sq)
        dst = self.store.tiles[tile].grad.view(-1, H)
        self._await_tile(tile)
        dst.zero_()
        dst.index_copy_(0, plan.local, mine.to("cpu", dst.dtype))
        self.stats.d2h_bytes += mine.numel() * dst.element_size()
        self.stats.reduced_bytes += buf.numel() * buf.element_size()
        self._landed(tile, sq)


class DistGradSink(ShardedGradients, GradSink):
    """Gradients leave the device reduce-scattered: each rank's host grad section gets its shard of the
    sum over ranks. Keeps this rank's share of the global squared norm (`take_sq_norm`)."""

    def __init__(self, store: ShardedHostStore, streamer: DistStreamer, ctx: DistContext):
        super().__init__(store, streamer.stats)
        self._attach(streamer, ctx)

    def send(self, tile: str, grad: torch.Tensor, sq_norm: torch.Tensor | None = None) -> None:
        """`grad`: this rank's fp32 gradient of the whole tile, padded (store.padded_numel). `sq_norm`, the
        local unreduced norm, is not this rank's share of the global one: it is recomputed on the shard."""
        mine, sq = self._reduce(tile, grad)
        dst = self.store.tiles[tile].grad
        self._await_tile(tile)
        dst.copy_(mine)
        self.stats.d2h_bytes += mine.numel() * dst.element_size()
        self._landed(tile, sq)
