"""Layer-contiguous host tiles: the authoritative home of all training state.

One tile per piece of the model (the embedding, each decoder layer, the head = final norm + LM
head). A tile is ONE contiguous, 4 KiB-aligned allocation of ordinary pageable memory, in sections:

    | master fp32 | exp_avg fp32 | exp_avg_sq fp32 | [block exponents] | grad (compute dtype) |
                                                                          each section 4 KiB-aligned

= 12 + 2 = 14 bytes per parameter with bf16 compute (16 with fp32 compute). The master section's dtype
is the store's `master_dtype` (train.master_weights): bf16 masters make it 2 + 8 + 2 = 12 bytes per
parameter, at the cost of updates rounded to bf16 every step (docs/precision.md). The moments' format is
the store's `moments` (train.optimizer_state, store/moments.py): fp32, bf16 (2 + 2 bytes), or int8 (1 + 1
bytes of 8-bit codes and one exponent byte per 64-element block and moment): bf16 masters with int8
moments are 2 + 2.03 + 2 = ~6 bytes per parameter. The compute-dtype copy
of the weights that the GPU receives is not kept here: the packer casts the fp32 master into pinned
staging on its way out (saves 2 bytes/param, i.e. 15 GB on a 7B model). Inside each section the
parameters lie in the same order, matrices first, so that the weight-decayed part of a tile is one
leading range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatrain_cli.store.disk import DiskTier, disk_sections
from megatrain_cli.store.moments import MOMENT_DTYPES, block_count


ALIGN = 4096
MASTER_DTYPE = torch.float32  # the default master section (and the default moments' dtype)
MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.master_weights -> the master section
SECTIONS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp", "grad")  # a tile's, in order


@dataclass
class ParamSpec:
    name: str  # name inside its piece, e.g. 'self_attn.q_proj.weight'
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def decays(self) -> bool:
        """Weight decay goes to matrices only (as HF Trainer does): not to norms or biases."""
        return len(self.shape) >= 2


class ModelParts(Protocol):
    """What the store needs to know of a model (models/adapter.ModelAdapter is one): the parameters of
    each piece and their Hugging Face names. The store never imports the model code."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    tied: bool
    config: Any

    def embed_specs(self) -> list[ParamSpec]: ...
    def layer_specs(self, index: int) -> list[ParamSpec]: ...
    def head_specs(self) -> list[ParamSpec]: ...
    def hf_name(self, tile: str, name: str) -> str: ...
    def extra_tiles(self) -> list[tuple[str, list[ParamSpec]]]: ...  # a VLM's image side; [] for a plain LM


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass
class ParamPlace:
    """Where one parameter lies inside its tile: the same offset in every section."""

    name: str
    shape: tuple[int, ...]
    offset: int  # elements from the start of each section
    numel: int


@dataclass
class TileLayout:
    """Where each tensor of a piece lies inside its tile (same offsets in every section)."""

    places: list[ParamPlace]
    numel: int  # parameters in the tile
    decay_numel: int  # the leading range that gets weight decay

    @classmethod
    def from_specs(cls, specs: list[ParamSpec]) -> "TileLayout":
        ordered = [s for s in specs if s.decays] + [s for s in specs if not s.decays]
        places, offset = [], 0
        for spec in ordered:
            places.append(ParamPlace(spec.name, spec.shape, offset, spec.numel))
            offset += spec.numel
        decay = sum(s.numel for s in ordered if s.decays)
        return cls(places, offset, decay)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named, shaped views of one flat section (no copies)."""
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.places}


@dataclass
class Tile:
    name: str  # 'embed', 'layers.N', 'head'
    layout: TileLayout
    grad_dtype: torch.dtype
    buffer: torch.Tensor = field(repr=False)  # the one uint8 allocation
    master: torch.Tensor = field(repr=False)
    exp_avg: torch.Tensor = field(repr=False)
    exp_avg_sq: torch.Tensor = field(repr=False)
    grad: torch.Tensor = field(repr=False)
    step: int = 0  # optimizer steps taken by this tile
    moments: str = "fp32"  # train.optimizer_state: the format of exp_avg / exp_avg_sq (store/moments.py)
    # int8 moments: each 64-element block's power-of-two scale exponent (int8); empty otherwise
    exp_avg_exp: torch.Tensor | None = field(default=None, repr=False)
    exp_avg_sq_exp: torch.Tensor | None = field(default=None, repr=False)
    origin: int = 0  # the tile's first element in the whole tile (a rank's shard: store/sharded.py)
    disk_bytes: int = 0  # bytes of its sections in the disk tier's file (store.disk_state; store/disk.py)

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def master_dtype(self) -> torch.dtype:
        return self.master.dtype


def _width(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _sections(numel: int, grad_dtype: torch.dtype, master_dtype: torch.dtype, moments: str) -> list[int]:
    """Bytes of each section, 4 KiB-aligned: master, exp_avg, exp_avg_sq, the two block-exponent rows
    (int8 moments; else 0), grad."""
    mw = _width(MOMENT_DTYPES[moments])
    exps = block_count(numel) if moments == "int8" else 0
    return [_round_up(b, ALIGN) for b in (numel * _width(master_dtype), numel * mw, numel * mw, exps, exps,
                                          numel * _width(grad_dtype))]


def tile_bytes(numel: int, grad_dtype: torch.dtype, master_dtype: torch.dtype = MASTER_DTYPE,
               moments: str = "fp32", on_disk: tuple[str, ...] = ()) -> int:
    """Bytes of a tile in host memory; `on_disk`: the sections the disk tier holds instead (their bytes:
    tile_disk_bytes)."""
    return sum(b for k, b in zip(SECTIONS, _sections(numel, grad_dtype, master_dtype, moments)) if k not in on_disk)


def tile_disk_bytes(numel: int, grad_dtype: torch.dtype, master_dtype: torch.dtype, moments: str,
                    on_disk: tuple[str, ...]) -> int:
    return sum(b for k, b in zip(SECTIONS, _sections(numel, grad_dtype, master_dtype, moments)) if k in on_disk)


def allocate_tile(name: str, layout: TileLayout, grad_dtype: torch.dtype,
                  master_dtype: torch.dtype = MASTER_DTYPE, moments: str = "fp32", tier: DiskTier | None = None) -> Tile:
    """One aligned pageable allocation for the whole tile; sections are dtype views into it. With a disk `tier`
    the sections it holds (store.disk_state) are views into the tile's file there instead, in the same order."""
    if master_dtype not in MASTER_DTYPES.values():
        raise ValueError(f"master weights must be fp32 or bf16, got {master_dtype}")
    if moments not in MOMENT_DTYPES:
        raise ValueError(f"optimizer state must be one of {tuple(MOMENT_DTYPES)}, got {moments!r}")
    sizes = _sections(layout.numel, grad_dtype, master_dtype, moments)
    on_disk = tier.sections if tier is not None else ()
    cold = [k in on_disk for k in SECTIONS]
    total = sum(b for b, c in zip(sizes, cold) if not c)
    raw = torch.empty(total + ALIGN, dtype=torch.uint8)  # untouched pages cost nothing until written
    shift = (-raw.data_ptr()) % ALIGN
    buf = raw[shift:shift + total]
    disk_total = sum(b for b, c in zip(sizes, cold) if c)
    disk = tier.map(name, disk_total) if disk_total else buf[:0]  # the file's mapping is page-aligned
    n = layout.numel
    starts = [sum(b for b, c in zip(sizes[:k], cold[:k]) if c == cold[k]) for k in range(len(sizes))]

    def section(k: int, dtype: torch.dtype, count: int = n) -> torch.Tensor:
        return (disk if cold[k] else buf)[starts[k]:starts[k] + count * _width(dtype)].view(dtype)

    mdt = MOMENT_DTYPES[moments]
    exps = block_count(n) if moments == "int8" else 0
    return Tile(name, layout, grad_dtype, buf, master=section(0, master_dtype), exp_avg=section(1, mdt),
                exp_avg_sq=section(2, mdt), grad=section(5, grad_dtype), moments=moments,
                exp_avg_exp=section(3, torch.int8, exps), exp_avg_sq_exp=section(4, torch.int8, exps),
                disk_bytes=disk_total)


def store_master_dtype(adapter: ModelParts, master_dtype: torch.dtype | None) -> torch.dtype:
    """The master section of a store: the one named (train.master_weights), else fp32."""
    dtype = master_dtype if master_dtype is not None else MASTER_DTYPE
    if dtype not in MASTER_DTYPES.values():
        raise ValueError(f"master weights must be fp32 or bf16, got {dtype}")
    return dtype


class LayoutQueries:
    """What a store does from its layouts and tiles alone (shared by HostStore and the sharded store)."""

    adapter: ModelParts
    layouts: dict[str, TileLayout]
    tiles: dict[str, Tile]

    @property
    def layer_names(self) -> list[str]:
        return [f"layers.{i}" for i in range(self.adapter.num_layers)]

    @property
    def vision_layer_names(self) -> list[str]:
        """A vision-language model's tower layers (`vision.N`): streamed through the layer slots too."""
        return [n for n in self.layouts if n.startswith("vision.") and n[len("vision."):].isdigit()]

    def num_params(self) -> int:
        """Parameters of the whole model (for a sharded store too: not just this rank's part)."""
        return sum(l.numel for l in self.layouts.values())

    def largest_layer_numel(self) -> int:
        return max(self.layouts[n].numel for n in [*self.layer_names, *self.vision_layer_names])

    tier: DiskTier | None = None

    def zero_state(self) -> None:
        """Moments, gradients and step counts zero; the masters (on disk too, beside the moments) kept."""
        on_disk = self.tier.sections if self.tier is not None else ()
        for t in self.tiles.values():
            fresh = self.tier is not None and self.tier.fresh(t.name)  # its file's moments: zeros already
            for name in ("exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp", "grad"):
                if name not in on_disk or not fresh:
                    getattr(t, name).zero_()
            if on_disk and not fresh:
                self.settle(t.name)
            t.step = 0

    def settle(self, name: str) -> None:
        """Tile `name`'s state on disk written back and out of memory (no disk tier: nothing to do)."""
        if self.tier is not None:
            self.tier.settle(name)

    def close(self) -> None:
        """The disk tier's threads stopped and its folder removed (the mappings live on with the tiles)."""
        if self.tier is not None:
            self.tier.close()

    def hf_items(self):
        """(hf_name, tile, place) for every tensor, in store order; tied lm_head is not listed."""
        for tname, layout in self.layouts.items():
            for place in layout.places:
                yield self.adapter.hf_name(tname, place.name), tname, place


class HostStore(LayoutQueries):
    """All tiles of one model: embed, layers.0 .. layers.L-1, head, then a VLM's vision.* tiles."""

    def __init__(self, adapter: ModelParts, compute_dtype: torch.dtype, allocate: bool = True,
                 master_dtype: torch.dtype | None = None, moments: str = "fp32", tier: DiskTier | None = None,
                 disk_state: str | None = None):
        """`tier`: the disk tier holding part of each tile (store/disk.py); `disk_state`: what it holds, for a
        store that is not allocated (the planner's; an allocated one takes its tier's)."""
        self.adapter = adapter
        self.compute_dtype = compute_dtype
        self.master_dtype = store_master_dtype(adapter, master_dtype)
        self.moments = moments  # train.optimizer_state
        self.tier = tier
        self.on_disk = tier.sections if tier is not None else disk_sections(disk_state)
        self.layouts: dict[str, TileLayout] = {"embed": TileLayout.from_specs(adapter.embed_specs())}
        for i in range(adapter.num_layers):
            self.layouts[f"layers.{i}"] = TileLayout.from_specs(adapter.layer_specs(i))
        self.layouts["head"] = TileLayout.from_specs(adapter.head_specs())
        for name, specs in adapter.extra_tiles():  # after the head: the decoder's tiles keep their init seeds
            self.layouts[name] = TileLayout.from_specs(specs)
        self.tiles: dict[str, Tile] = {}
        if allocate:
            for name, layout in self.layouts.items():
                self.tiles[name] = allocate_tile(name, layout, compute_dtype, self.master_dtype, moments, tier)

    def host_bytes(self) -> int:
        """Bytes of the tiles in host memory (what the disk tier holds is not counted: disk_bytes)."""
        return sum(tile_bytes(l.numel, self.compute_dtype, self.master_dtype, self.moments, self.on_disk)
                   for l in self.layouts.values())

    def disk_bytes(self) -> int:
        return sum(tile_disk_bytes(l.numel, self.compute_dtype, self.master_dtype, self.moments, self.on_disk)
                   for l in self.layouts.values())

    # ------------------------------------------------------------ HF names
    def master_view(self, tile: str, place: ParamPlace) -> torch.Tensor:
        t = self.tiles[tile]
        return t.master[place.offset:place.offset + place.numel].view(place.shape)

    def write_master(self, tile: str, place: ParamPlace, tensor: torch.Tensor) -> None:
        """Copy one whole HF tensor into its place among the masters (loading; the sharded store keeps its part)."""
        self.master_view(tile, place).copy_(tensor)

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Views of the masters under HF names (cast copies when dtype is given): for tests and export."""
        out = {}
        for hf, tname, place in self.hf_items():
            v = self.master_view(tname, place)
            out[hf] = v if dtype is None else v.to(dtype)
        return out
