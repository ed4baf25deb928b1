"""The host store split across data-parallel ranks (issue #11): each rank owns 1/N of every tile.

Every tile's flat parameter range [0, numel) is padded to `padded = shard * N` and cut into N
contiguous shards; rank r owns [r * shard, (r + 1) * shard). A rank's tile is an ordinary `Tile`
(tiles.allocate_tile) of `shard` elements, so it has the same four sections as a whole tile
(master | exp_avg | exp_avg_sq | grad) and the host bytes per parameter stay those of one GPU:
14 (bf16 compute; 12 with bf16 masters; less with bf16 or int8 moments), now over numel / N parameters per
rank. int8 moments are coded in 64-element blocks counted from the shard's first element, i.e. the whole
tile's blocks (SHARD_ALIGN is the block), except an embedding whose hidden size is not a multiple of 64.

    tile      | p0 p1 p2 ... (decayed matrices) ... | ... (norms, biases) ... | pad |
    rank 0    |<---------- shard ---------->|
    rank 1                                  |<---------- shard ---------->|

The weight-decayed part of a tile is its leading range [0, decay_numel) (tiles.TileLayout), so its
intersection with any contiguous shard is again a leading range of that shard: a shard's
`TileLayout` has no named places, numel = shard and decay_numel = clamp(decay_numel - start, 0,
shard). HostAdamW._sections reads only `layout.decay_numel` and `tile.numel`, so it updates a shard
exactly as it updates the matching elements of the whole tile (AdamW is elementwise). The padding
lies past numel >= decay_numel, i.e. in the no-decay part, and stays zero: its gradient is zero, so
m = v = 0 and the update is lr * 0 / (0 + eps) = 0.

Shard sizes are rounded up to SHARD_ALIGN elements (each rank's piece of a gathered device buffer
starts 256 B aligned for fp32, 128 B for bf16), except the embedding, whose shards are whole rows
(a multiple of hidden_size): rank r owns rows [r * V/N, (r + 1) * V/N), which is what the
distributed streamer's row gather and the sparse row gradients need (engine/transfer/sharded.py).

`layouts` are the WHOLE tiles' layouts (the device assembles whole layers and binds their views);
`tiles` are this rank's shards; `shards[name]` says which range. Reading whole tensors needs the
other ranks: `hf_state_dict()` and `gather_tile()` are collectives (every rank must call them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain_cli.store.disk import DiskTier
from megatrain_cli.store.moments import read_moments, write_moments
from megatrain_cli.store.tiles import (HostStore, LayoutQueries, ParamPlace, Tile, TileLayout, allocate_tile,
                                      store_master_dtype, tile_bytes)

SHARD_ALIGN = 64  # elements


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's shard of one tile lies in the tile's flat range."""

    numel: int  # parameters of the whole tile
    shard: int  # elements per rank (the same on every rank); padded = shard * world
    start: int  # this rank's first element: rank * shard
    decay: int  # this shard's weight-decayed leading range
    world: int

    @property
    def padded(self) -> int:
        return self.shard * self.world

    @property
    def stop(self) -> int:
        return self.start + self.shard

    @property
    def valid(self) -> int:
        """Elements of this shard that are parameters (the rest is padding)."""
        return max(0, min(self.shard, self.numel - self.start))


def shard_spec(layout: TileLayout, rank: int, world: int, unit: int = SHARD_ALIGN) -> ShardSpec:
    """Rank `rank`'s shard of a tile with this layout: `unit` divides the shard size."""
    shard = _ceil_div(layout.numel, world * unit) * unit
    start = rank * shard
    decay = min(shard, max(0, layout.decay_numel - start))
    return ShardSpec(layout.numel, shard, start, decay, world)


class ShardedHostStore(LayoutQueries):
    """This rank's 1/N of every tile, with the whole tiles' layouts; the interface the engine uses."""

    def __init__(self, adapter, compute_dtype: torch.dtype, rank: int, world: int, *,
                 cpu_group=None, allocate: bool = True, master_dtype: torch.dtype | None = None,
                 moments: str = "fp32", tier: DiskTier | None = None):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.adapter = adapter
        self.compute_dtype = compute_dtype
        self.master_dtype = store_master_dtype(adapter, master_dtype)
        self.moments = moments  # train.optimizer_state
        self.tier = tier  # this rank's disk tier (store/disk.py), or None
        self.on_disk = tier.sections if tier is not None else ()
        self.rank, self.world = rank, world
        self.cpu_group = cpu_group  # a gloo group for host-tensor collectives (None: the default group)
        self.layouts: dict[str, TileLayout] = HostStore(adapter, compute_dtype, allocate=False).layouts
        self.shards: dict[str, ShardSpec] = {
            name: shard_spec(layout, rank, world, adapter.hidden_size if name == "embed" else SHARD_ALIGN)
            for name, layout in self.layouts.items()}
        self.tiles: dict[str, Tile] = {}
        if allocate:
            for name, spec in self.shards.items():
                tile = allocate_tile(name, TileLayout([], spec.shard, spec.decay), compute_dtype, self.master_dtype,
                                     moments, tier)
                tile.origin = spec.start  # bf16 moments' stochastic rounding counts whole-tile elements
                for section in (tile.master, tile.exp_avg, tile.exp_avg_sq, tile.grad):
                    section[spec.valid:].zero_()  # the padding is gathered and updated like the rest: zero
                self.tiles[name] = tile

    @classmethod
    def from_full(cls, store: HostStore, rank: int, world: int, *, cpu_group=None) -> "ShardedHostStore":
        """This rank's shards of a whole store (all four sections and the step counts): the tests' shards of
        a one-process reference (a run builds its shard directly: models/loader.build_sharded_store)."""
        out = cls(store.adapter, store.compute_dtype, rank, world, cpu_group=cpu_group,
                  master_dtype=store.master_dtype, moments=store.moments)
        for name, tile in out.tiles.items():
            src, spec = store.tiles[name], out.shards[name]
            n = spec.valid
            for dst_s, src_s in ((tile.master, src.master), (tile.exp_avg, src.exp_avg),
                                 (tile.exp_avg_sq, src.exp_avg_sq), (tile.grad, src.grad)):
                dst_s[:n].copy_(src_s[spec.start:spec.start + n])
            if store.moments == "int8":  # the block exponents: coded again from the decoded values (the same codes)
                m, v = read_moments(src, spec.start, spec.start + n)
                write_moments(tile, m, v)
            tile.step = src.step
        return out

    # ------------------------------------------------------------ what HostStore offers
    def host_bytes(self) -> int:
        """This rank's tile bytes."""
        return sum(tile_bytes(s.shard, self.compute_dtype, self.master_dtype, self.moments, self.on_disk)
                   for s in self.shards.values())

    def disk_bytes(self) -> int:
        """This rank's bytes in the disk tier."""
        return sum(t.disk_bytes for t in self.tiles.values())

    def padded_numel(self, tile: str) -> int:
        """Elements of the tile's gathered device buffer and gradient accumulator (whole tile + padding)."""
        return self.shards[tile].padded

    def largest_padded_layer_numel(self) -> int:
        return max(self.padded_numel(n) for n in self.layer_names)

    def master_view(self, tile: str, place: ParamPlace):
        raise RuntimeError("a sharded store holds no whole tensor: gather with hf_state_dict() / gather_tile(), "
                           "write with write_master()")

    # ------------------------------------------------------------ local writes
    def write_master(self, tile: str, place: ParamPlace, tensor: torch.Tensor) -> None:
        """Copy the part of one whole HF tensor that falls in this rank's shard (loading)."""
        spec = self.shards[tile]
        lo, hi = max(place.offset, spec.start), min(place.offset + place.numel, spec.stop)
        if hi > lo:
            flat = tensor.reshape(-1)
            self.tiles[tile].master[lo - spec.start:hi - spec.start].copy_(flat[lo - place.offset:hi - place.offset])

    # ------------------------------------------------------------ collectives (every rank calls them)
    def gather_tile(self, tile: str, section: str = "master") -> torch.Tensor:
        """The whole tile's flat `section` (numel elements, a new host tensor) on every rank."""
        import torch.distributed as dist

        spec = self.shards[tile]
        mine = getattr(self.tiles[tile], section)
        full = torch.empty(spec.padded, dtype=mine.dtype)
        dist.all_gather(list(full.split(spec.shard)), mine.contiguous(), group=self.cpu_group)
        return full[:spec.numel]

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The whole masters under HF names, on every rank (a collective; one tile at a time): tests,
        export. Host memory: the whole model in the master dtype (or `dtype`) on each rank."""
        out = {}
        for tname, layout in self.layouts.items():
            full = self.gather_tile(tname)
            if dtype is not None:
                full = full.to(dtype)
            for place in layout.places:
                out[self.adapter.hf_name(tname, place.name)] = full[place.offset:place.offset + place.numel].view(
                    place.shape)
        return out
