"""Data-parallel layer streaming on torch.distributed (issue #11), the synchronous reference path. Each of N
ranks (one GPU each, or N CPU processes on gloo) holds 1/N of every tile (store/sharded.py) and moves only
its shard over its own link; an all-gather assembles the whole layer, gradients are reduce-scattered, the
embedding's rows come from the ranks that own them, and one all-reduce at the step's end gives the global
gradient norm. Every collective of a step, and what it moves: docs/architecture.md ("Data parallel over N
GPUs"). Here the training thread issues them all, in schedule order, on the default group (host tensors
on `cpu_group`, gloo); sharded_cuda.py overlaps them (`engine.overlap_ranks=false` keeps a CUDA run here).

The pieces, shared with sharded_cuda.py: `Shards` (where a rank's shard lands in the whole-tile slot, and
the all-gather that fills the rest), `RowsFromOwners` (the embedding rows) and `ShardReducer`
(reduce-scatter, the norm share, the row gradients); the streamers and sinks hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain_cli.engine.dist import DistContext
from megatrain_cli.engine.grad_norm import squared_norm
from megatrain_cli.engine.transfer.reference import GradSink, WeightStreamer
from megatrain_cli.engine.transfer.slots import Slot, TransferStats
from megatrain_cli.engine.transfer.updates import HostUpdates
from megatrain_cli.store.sharded import ShardedHostStore


class Shards:
    """The sharded placement: slots sized to whole tiles padded to N shards; this rank's shard lands in
    its slice (over its own link: 1/N of the bytes), a blocking all-gather on the default group fills
    the others' (sharded_cuda.OverlappedShards issues it on a side stream instead)."""

    def __init__(self, store: ShardedHostStore, ctx: DistContext):
        self.store, self.ctx = store, ctx

    def largest_layer(self) -> int:
        return self.store.largest_padded_layer_numel()

    def numel(self, tile: str) -> int:
        return self.store.padded_numel(tile)

    def landing(self, tile: str, slot: Slot) -> torch.Tensor:
        spec = self.store.shards[tile]
        return slot.buffer[spec.start:spec.stop]

    def count(self, stats: TransferStats, tile: str, slot: Slot) -> None:
        stats.count_gather(tile, self.store.shards[tile], slot.buffer.element_size())

    def assemble(self, tile: str, slot: Slot, mine: torch.Tensor) -> None:
        """All-gather in place: every rank's slice of the padded tile, on the calling thread."""
        self.ctx.all_gather(slot.buffer[:self.store.shards[tile].padded], mine)


@dataclass
class RowPlan:
    """The step's embedding rows: the global used set and this rank's part of it."""

    used: torch.Tensor  # [|U|] sorted token ids (device)
    lo: int  # used[lo:hi] are the rows this rank owns
    hi: int
    local: torch.Tensor  # [hi - lo] their row index in this rank's shard (host)
    pos: torch.Tensor  # [u] where this rank's unique ids sit in `used` (device)


class RowsFromOwners:
    """The step's embedding rows from the ranks that own them: every rank marks its token ids in a [V]
    vector, one all-reduce gives the step's used rows U (sorted, the same everywhere); each rank reads the
    rows of U its shard holds (shards are whole rows) into a zero [|U|, H] buffer and an all-reduce (one
    non-zero term per element: exact) gives every rank all of them. Per step 2 all-reduces of |U| x H and
    one of V int32, against gathering the V x H table; tied, the table is acquired whole (the head needs it).
    Held by the sharded streamers (their embed_rows); leaves the step's row plan in `plan` for
    ShardReducer.reduce_rows."""

    def __init__(self, store: ShardedHostStore, device: torch.device, dtype: torch.dtype, ctx: DistContext,
                 stats: TransferStats):
        self.store, self.device, self.dtype, self.ctx, self.stats = store, device, dtype, ctx, stats
        self.plan: RowPlan | None = None

    def embed_rows(self, ids: torch.Tensor, acquire, wait) -> torch.Tensor:
        """The embedding rows of this rank's unique token ids (`ids`: on the device, sorted), [u, H] in the
        compute dtype, in that order. Tied: read from the whole table, `acquire("embed")`. Else two host
        syncs (the used set's size and bounds), a pageable H2D of this rank's |U|/N rows (after
        `wait("embed")`: the host optimizer is done with them) and two all-reduces (the used-row marks, the rows)."""
        V, H = self.store.adapter.vocab_size, self.store.adapter.hidden_size
        if self.store.adapter.tied:
            return acquire("embed").view(V, H)[ids]
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
        wait("embed")
        buf[lo:hi] = self.store.tiles["embed"].master.view(rows_per, H)[local].to(self.device, self.dtype)
        self.ctx.all_reduce(buf)  # one non-zero term per element: exact
        self.plan = RowPlan(used, lo, hi, local, torch.searchsorted(used, ids))
        # (not in h2d_bytes: one process does not count its embedding rows there either)
        self.stats.reduced_bytes += buf.numel() * buf.element_size() + mark.numel() * 4
        return buf[self.plan.pos]


class DistStreamer(WeightStreamer):
    """WeightStreamer over a ShardedHostStore: shard copy, then an all-gather into the whole-layer slot."""

    def __init__(self, store: ShardedHostStore, device: torch.device, dtype: torch.dtype, ctx: DistContext, *,
                 layer_slots: int, updates: HostUpdates, on_bind):
        super().__init__(store, device, dtype, layer_slots=layer_slots, updates=updates, on_bind=on_bind,
                         place=Shards(store, ctx))
        self.ctx = ctx
        self.owners = RowsFromOwners(store, device, dtype, ctx, self.stats)

    @property
    def rows(self) -> RowPlan | None:
        return self.owners.plan

    def begin_step(self, order: list[str]) -> None:
        super().begin_step(order)
        self.owners.plan = None

    def embed_rows(self, uniq: torch.Tensor) -> torch.Tensor:
        """RowsFromOwners.embed_rows for this rank's unique token ids (host int64, sorted)."""
        return self.owners.embed_rows(uniq.to(self.device), self.acquire, self.updates.wait)


class ShardReducer:
    """What a sink does with a sharded store: reduce-scatter a tile's gradient, keep this rank's share of
    the global squared norm (a device scalar: no sync until the step's end), all-reduce the embedding's
    row gradients. Held by DistGradSink and sharded_cuda.DistCudaGradSink; they land the results."""

    def __init__(self, store: ShardedHostStore, ctx: DistContext, stats: TransferStats, owners: RowsFromOwners):
        self.store, self.ctx, self.stats, self.owners = store, ctx, stats, owners
        self._sq = torch.zeros((), dtype=torch.float64, device=ctx.device)

    def reset(self) -> None:
        self._sq.zero_()

    def take_sq_norm(self) -> torch.Tensor:
        """This rank's shards' squared gradient norms, summed (device scalar), and reset for the next step."""
        sq, self._sq = self._sq, torch.zeros_like(self._sq)
        return sq

    def reduce(self, tile: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's shard of the sum over ranks of `grad`, its squared norm), the norm also added to this
        rank's share; on the current stream. `grad`: this rank's fp32 gradient of the whole tile, padded."""
        spec = self.store.shards[tile]
        if grad.numel() != spec.padded:
            raise ValueError(f"{tile}: the gradient has {grad.numel()} elements, the sharded store needs "
                             f"{spec.padded} (the tile padded to {spec.world} shards)")
        mine = self.ctx.reduce_scatter(grad)
        sq = squared_norm(mine)
        self._sq.add_(sq)
        self.stats.reduced_bytes += grad.numel() * grad.element_size()
        return mine, sq

    def reduce_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the rows this rank owns of the sum over ranks, their squared norm, their index in this rank's
        shard (host)). `rows`: this rank's row gradients of its unique ids, in embed_rows' order. One
        all-reduce of |U| x H fp32; the norm is added to this rank's share."""
        plan = self.owners.plan
        if plan is None:
            raise RuntimeError("send_rows before embed_rows in this step")
        H = rows.shape[1]
        buf = torch.zeros(plan.used.numel(), H, dtype=torch.float32, device=rows.device)
        buf.index_copy_(0, plan.pos, rows.float())
        self.ctx.all_reduce(buf)
        mine = buf[plan.lo:plan.hi]
        sq = squared_norm(mine)
        self._sq.add_(sq)
        self.stats.reduced_bytes += buf.numel() * buf.element_size()
        return mine, sq, plan.local


class DistGradSink(GradSink):
    """Gradients leave the device reduce-scattered: each rank's host grad section gets its shard of the
    sum over ranks. Keeps this rank's share of the global squared norm (`take_sq_norm`)."""

    def __init__(self, store: ShardedHostStore, streamer: DistStreamer, ctx: DistContext, updates: HostUpdates):
        super().__init__(store, streamer.stats, updates)
        self.shards = ShardReducer(store, ctx, streamer.stats, streamer.owners)

    def reset(self) -> None:
        self.shards.reset()

    def take_sq_norm(self) -> torch.Tensor:
        return self.shards.take_sq_norm()

    def send(self, tile: str, grad: torch.Tensor, sq_norm: torch.Tensor | None = None) -> None:
        """`grad`: this rank's fp32 gradient of the whole tile, padded (store.padded_numel). `sq_norm`, the
        local unreduced norm, is not this rank's share of the global one: it is recomputed on the shard."""
        super().send(tile, *self.shards.reduce(tile, grad))

    def send_rows(self, tile: str, rows: torch.Tensor, index: torch.Tensor,
                  sq_norm: torch.Tensor | None = None) -> None:
        """This rank's row gradients of its unique ids `index` (the order embed_rows saw): summed over
        ranks on the device; each rank keeps the rows it owns. Synchronous (one D2H of |U|/N rows), after
        every gradient sent before it has landed."""
        self.finish()
        mine, sq, local = self.shards.reduce_rows(rows)
        self._land_rows(tile, local, mine, sq)
