"""Export the fp32 masters as a Hugging Face model directory that `from_pretrained` loads.

Same files as transformers' `save_pretrained`: `model.safetensors` when one shard suffices, else
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` (greedy split in state-dict order,
a tensor larger than the limit gets a shard of its own), plus `config.json` with `dtype` set and
`generation_config.json`. A tied lm_head is not written (it is not in the store; HF re-ties it).

Tensor names and shapes are the source checkpoint's (models/convert.py SavedLayout): transformers' own
reverse conversion (`revert_weight_conversion`, as save_pretrained after from_pretrained) of the rules the
source's keys went through at load, so a Qwen3-MoE / Qwen2-MoE / Mixtral checkpoint with one 2-D tensor
per expert is written back that way (Mixtral under `block_sparse_moe.experts.N.w1`), one with
transformers 5's fused 3-D experts stays fused. A model with no source checkpoint (a preset, a test) gets
what save_pretrained writes for a model made from its config (per-expert tensors for those families).
gpt-oss from MXFP4 is written dequantised (bf16 values, HF's unquantised gpt-oss names) and its
config.json has no quantization_config, so from_pretrained loads it as a plain model.
The reverse conversion runs one tile (one layer) at a time: a tile's tensors are views of its masters,
split per expert as views, except where transformers' op copies (un-fusing gate_up copies that tensor
once, in the master dtype); pieces are dropped as they are written.

`generation_config.json` is the source model's own, copied byte for byte (`source_dir`): an instruct
model's extra end-of-turn ids and sampling defaults live there and nowhere else (eval reads its stop ids
from it). Only a model without one (a preset) gets it regenerated from the config.

The shards are written with our own safetensors writer, tensor by tensor and in chunks: the cast
to the export dtype costs at most one 64 MiB chunk of temporary memory, and an fp32 export no copy
at all. Output is deterministic (byte-identical for the same weights) and atomic (temp dir, rename).
A sharded store (data-parallel ranks) is gathered onto rank 0 first: export_sharded.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain_cli.checkpoint.format import (CheckpointError, fsync_dir, publish_dir, safetensors_header,
                                             tensor_bytes, write_all, write_file_durably)
from megatrain_cli.checkpoint.layout import MANIFEST, checkpoints_newest_first, latest_checkpoint, sound_one_before
from megatrain_cli.checkpoint.load import load_tiles
from megatrain_cli.models.convert import LAYOUT_KEY, SavedLayout
from megatrain_cli.store.tiles import HostStore

DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
CAST_CHUNK_ELEMENTS = 16 << 20  # 64 MiB of fp32 read, cast and written at a time
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Out:
    """One tensor of the export: its name and shape there, and the tile its values come from."""

    name: str
    tile: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _planned_tensors(store: HostStore, layout: SavedLayout) -> list[_Out]:
    """Every tensor the export writes, tile by tile in store order, before any is read: the reverse
    conversion run on meta tensors (names and shapes only)."""
    out: list[_Out] = []
    for tname, tile_layout in store.layouts.items():
        meta = {store.adapter.hf_name(tname, place.name): torch.empty(place.shape, device="meta")
                for place in tile_layout.places}
        out += [_Out(name, tname, tuple(t.shape)) for name, t in layout.revert(meta).items()]
    twice = sorted(n for n, k in Counter(o.name for o in out).items() if k > 1)
    if twice:
        raise CheckpointError(f"export would write these tensor names twice: {twice[:4]}")
    return out


class _TileTensors:
    """The export's tensors of one tile at a time: the tile's master views reverted to the source layout
    when the first of its tensors is asked for; the previous tile's pieces are dropped then."""

    def __init__(self, store: HostStore, layout: SavedLayout):
        self.store, self.layout, self.tile, self.tensors = store, layout, None, {}

    def take(self, item: _Out) -> torch.Tensor:
        if item.tile != self.tile:
            self.tensors = {}  # free the previous tile's pieces before making the next
            store, tile = self.store, item.tile
            views = {store.adapter.hf_name(tile, p.name): store.master_view(tile, p)
                     for p in store.layouts[tile].places}
            self.tensors, self.tile = self.layout.revert(views), item.tile
        tensor = self.tensors.pop(item.name)  # dropped once written
        if tuple(tensor.shape) != item.shape:
            raise CheckpointError(f"{item.name}: reverted to shape {tuple(tensor.shape)}, planned {item.shape}")
        return tensor


def _plan_shards(items: list[_Out], itemsize: int, max_shard_bytes: int) -> list[list[_Out]]:
    """Greedy split in order, as huggingface_hub's split_torch_state_dict_into_shards does."""
    shards, current, current_bytes = [], [], 0
    for item in items:
        size = item.numel * itemsize
        if size > max_shard_bytes:
            shards.append([item])
            continue
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(item)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def _write_shard(source: _TileTensors, items: list[_Out], dtype: torch.dtype, path: Path) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    entries, offset = [], 0
    for item in items:
        entries.append((item.name, DTYPE_CODES[dtype], item.shape, offset, offset + item.numel * itemsize))
        offset += item.numel * itemsize
    with open(path, "wb", buffering=0) as f:
        write_all(f, safetensors_header(entries, {"format": "pt"}))
        for item in items:
            flat = source.take(item).contiguous().reshape(-1)  # a master view or one expert's piece: no copy
            for start in range(0, item.numel, CAST_CHUNK_ELEMENTS):
                part = flat[start:start + CAST_CHUNK_ELEMENTS]
                write_all(f, tensor_bytes(part if part.dtype == dtype else part.to(dtype)))
            del flat
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    """Flush what transformers wrote (config, tokenizer); shards are already synced, and fsync of a
    clean file costs next to nothing, so no file is read back."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for d in sorted({p for p in root.rglob("*") if p.is_dir()} | {root}):
        fsync_dir(d)


def _looks_like_hf_export(path: Path) -> bool:
    return (path / "config.json").is_file() and ((path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file())


GENERATION_CONFIG = "generation_config.json"


def _write_generation_config(config, tmp: Path, source_dir: Path | None) -> None:
    """The source's generation_config.json unchanged (a file copy), else one made from the config."""
    if source_dir is not None and (source_dir / GENERATION_CONFIG).is_file():
        shutil.copyfile(source_dir / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
        return
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(str(tmp))


def _export(store: HostStore, out_dir: Path, dtype: torch.dtype, max_shard_bytes: int, write_tokenizer,
            source_dir: Path | None = None) -> Path:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"export dtype must be one of {list(DTYPE_CODES)}, got {dtype}")
    if out_dir.exists() and any(out_dir.iterdir()) and not _looks_like_hf_export(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a model export; refusing to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a crashed export
    tmp.mkdir()
    try:  # a failure, Ctrl-C or SIGTERM (`megatrain export` raises it) leaves no partial folder behind
        _write(store, tmp, dtype, max_shard_bytes, write_tokenizer, source_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, out_dir)
    return out_dir


def _write(store: HostStore, tmp: Path, dtype: torch.dtype, max_shard_bytes: int, write_tokenizer,
           source_dir: Path | None) -> None:
    """The export's files into the temp folder `tmp`, made durable."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout = SavedLayout(store.adapter.config)
    items = _planned_tensors(store, layout)
    shards = _plan_shards(items, itemsize, max_shard_bytes)
    source = _TileTensors(store, layout)
    if len(shards) == 1:
        _write_shard(source, shards[0], dtype, tmp / WEIGHTS_NAME)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_shard(source, shard, dtype, tmp / name)
            weight_map.update({item.name: name for item in shard})
        total = sum(item.numel for item in items)
        index = {"metadata": {"total_parameters": total, "total_size": total * itemsize}, "weight_map": weight_map}
        write_file_durably(tmp / INDEX_NAME, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    del source

    config = copy.deepcopy(store.adapter.config)  # the store's config must keep its own dtype
    config.dtype = dtype
    # The weights are plain (an MXFP4 source was dequantised at load) and in the layout just written.
    for attr in ("quantization_config", LAYOUT_KEY):
        if hasattr(config, attr):
            delattr(config, attr)
    config.architectures = [store.adapter.architecture]
    config.save_pretrained(str(tmp))
    _write_generation_config(config, tmp, source_dir)
    write_tokenizer(tmp)
    _fsync_tree(tmp)


def export_hf(store: HostStore, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16, tokenizer=None,
              max_shard_bytes: int = 5 * 2**30, source_dir: str | Path | None = None) -> Path:
    """Write the store's masters to out_dir in Hugging Face format (cast to `dtype`). `source_dir`: the
    model directory the run started from (model.path), whose generation_config.json is carried over."""

    def write_tokenizer(tmp: Path) -> None:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    source = Path(source_dir) if source_dir is not None else None
    return _export(store, Path(out_dir), dtype, max_shard_bytes, write_tokenizer, source)


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                      max_shard_bytes: int = 5 * 2**30, source_dir: str | Path | None = None) -> Path:
    """`megatrain export CHECKPOINT OUT`: a step_N checkpoint (or a run's output_dir: its latest
    checkpoint) to a Hugging Face directory, with the tokenizer files saved in the checkpoint. The
    generation config: `source_dir`'s, else one the checkpoint itself holds, else made from its config."""
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.models.loader import load_hf_config

    path = Path(checkpoint_dir)
    if not (path / MANIFEST).is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            found = checkpoints_newest_first(path)
            damaged = "; ".join(f"{p.name}: {why}" for p, why in found)
            raise CheckpointError(f"{path} is neither a complete checkpoint nor a directory holding one"
                                  + (f" (damaged: {damaged})" if found else ""))
        path = latest
    # Allocating a full store costs only address space: torch.empty pages are not touched until
    # written, and only the master sections are read.
    store = HostStore(ModelAdapter(load_hf_config(path)), torch.bfloat16)
    try:
        load_tiles(store, path, sections=("master",))
    except CheckpointError as err:
        before = sound_one_before(path)
        raise CheckpointError(f"{path} is damaged ({str(err).removeprefix(f'{path}: ')}); nothing was exported"
                              + (f". {before} is the newest sound checkpoint before it: `megatrain export {before} "
                                 f"{out_dir}`" if before else "")) from None

    def copy_tokenizer(tmp: Path) -> None:
        if (path / "tokenizer").is_dir():
            for f in sorted((path / "tokenizer").iterdir()):
                shutil.copyfile(f, tmp / f.name)

    holders = [Path(source_dir)] if source_dir is not None else []
    source = next((d for d in holders + [path] if (d / GENERATION_CONFIG).is_file()), None)
    return _export(store, Path(out_dir), dtype, max_shard_bytes, copy_tokenizer, source)


def export_sharded(store, out_dir: str | Path, *, dtype: torch.dtype, tokenizer=None,
                   source_dir: str | Path | None = None) -> Path | None:
    """export_hf of a sharded store (a collective): the masters are gathered tile by tile into a whole
    host store on rank 0 (the model in fp32 on that rank's host, masters only touched), which rank 0
    exports. Returns the path on rank 0, None elsewhere."""
    import torch.distributed as dist

    whole = HostStore(store.adapter, store.compute_dtype) if store.rank == 0 else None
    for name in store.layouts:
        full = store.gather_tile(name)
        if whole is not None:
            whole.tiles[name].master.copy_(full)
    path = (export_hf(whole, out_dir, dtype=dtype, tokenizer=tokenizer, source_dir=source_dir)
            if whole is not None else None)
    dist.barrier(group=store.cpu_group)
    return path
