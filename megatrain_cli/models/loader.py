"""Fill the host store: from a local HF directory (safetensors, tensor by tensor) or random init.

Loading never holds a second full copy of the model: each tensor (or each group of tensors that
transformers' conversion rules merge into one parameter, models/convert.py) is read from its shard with
`safe_open`, cast into its place among the fp32 masters, and dropped before the next one is read.
"""

from __future__ import annotations

import copy
import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import torch

from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.store.sharded import ShardedHostStore
from megatrain_cli.store.tiles import HostStore, allocate_tile


class ModelLoadError(ValueError):
    pass


def load_hf_config(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"model path does not exist or is not a directory: {p}")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {p}: not a Hugging Face model directory")
    return AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code, local_files_only=True)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({path / f for f in weight_map.values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = list(path.glob("*.bin")) + list(path.glob("*.pt"))
        hint = " (only pickle checkpoints found; convert them to safetensors first)" if bins else ""
        raise ModelLoadError(f"no *.safetensors files in {path}{hint}")
    return files


def load_weights(store: HostStore, path: str | Path) -> None:
    """Copy the checkpoint into the masters' places, through transformers' own conversion rules
    (models/convert.py: renamed and legacy keys, a base model's prefix, merged or split tensors), one
    tensor group at a time. Unknown and missing tensors are refused, by name, before any is read; a wrong
    shape before it is copied.

    Costs: a meta-device model of the config, every shard's header, and one group of tensors in memory
    at a time (one tensor, or one merge's sources); the shards are memory-mapped by safetensors.
    """
    from safetensors import safe_open

    from megatrain_cli.models.convert import LAYOUT_KEY, CheckpointRules, ConversionError

    path = Path(path)
    targets = {hf: (tname, place) for hf, tname, place in store.hf_items()}
    rules = CheckpointRules(store.adapter.config)
    with ExitStack() as stack:
        where: dict[str, tuple[str, object]] = {}
        for file in safetensors_files(path):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            where.update({key: (file.name, handle) for key in handle.keys()})
        try:
            plan = rules.plan(where)
        except ConversionError as err:
            raise ModelLoadError(f"checkpoint in {path}: {err}") from None
        # Refuse before reading a byte: names no place takes (a tied copy excepted: HF re-ties it), places
        # nothing fills.
        made = plan.produces()
        unexpected = plan.unexpected + sorted(made - set(targets) - rules.aliases)
        missing = sorted(set(targets) - made)
        if missing or unexpected:
            raise _mismatch(path, store, missing, unexpected)
        unexpected = []
        seen: set[str] = set()
        for group in plan.groups:
            try:
                tensors = rules.realize(group, lambda key: where[key][1].get_tensor(key))
            except ConversionError as err:
                raise ModelLoadError(f"checkpoint in {path}: {err}") from None
            for name, tensor in tensors.items():
                if name not in targets:
                    if name not in rules.aliases:  # a tied copy is dropped: HF re-ties it
                        unexpected.append(f"{name} (made from {group.describe()})")
                    continue
                tname, place = targets[name]
                if tuple(tensor.shape) != place.shape:
                    source = where[group.sources[0][0]][0]
                    raise ModelLoadError(f"{source}: {group.describe()} has shape {tuple(tensor.shape)}, "
                                         f"the config implies {place.shape}")
                store.write_master(tname, place, tensor)
                seen.add(name)
            del tensors
    missing = sorted(set(targets) - seen)
    if missing or unexpected:
        raise _mismatch(path, store, missing, unexpected)
    # Export writes the tensors back in this checkpoint's layout (checkpoint/export.py): the rules its keys
    # went through are recorded on the store's config, which every checkpoint saves (a few pattern strings).
    # A shallow copy: the caller's config object (perhaps shared with another store) is left as it was.
    config = copy.copy(store.adapter.config)
    setattr(config, LAYOUT_KEY, rules.used_layout())
    store.adapter.config = config


def _mismatch(path: Path, store, missing: list[str], unexpected: list[str]) -> ModelLoadError:
    def listed(names: list[str]) -> str:
        return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")

    parts = ([f"unexpected tensors (no parameter of the model takes them): {listed(unexpected)}"] if unexpected
             else []) + ([f"missing tensors: {listed(missing)}"] if missing else [])
    kind = getattr(store.adapter.config, "model_type", "?")
    return ModelLoadError(f"checkpoint in {path} does not match its config (model type {kind!r}): "
                          + "; ".join(parts))


def random_init_tile(tile, std: float, seed: int, index: int, norm_value: float = 1.0) -> None:
    """One whole tile's masters as random_init draws them (tile `index` in store order). bf16 masters get
    the fp32 draw rounded (the same start as fp32 masters, and as a sharded store's), through one place's
    fp32 copy at a time."""
    gen = torch.Generator().manual_seed(seed * 100_003 + index)
    vision = tile.name.startswith("vision.")
    for place in tile.layout.places:
        target = tile.master[place.offset:place.offset + place.numel]
        view = target if target.dtype == torch.float32 else torch.empty(place.numel)
        if len(place.shape) >= 2:
            view.normal_(0.0, std, generator=gen)
        elif vision and place.name.endswith("weight"):
            view.fill_(1.0)  # a vision tower's 1-D weights are its norms' (LayerNorm, RMSNorm; the merger's ln_q)
        elif "norm" in place.name and not place.name.endswith(".bias"):
            view.fill_(norm_value)  # 1, or 0 for Gemma's (1 + weight) norms: what HF's own init gives
        else:
            view.zero_()
        if view is not target:
            target.copy_(view)


def random_init(store: HostStore, seed: int = 0, threads: int | None = None) -> None:
    """HF-style init (normal(0, initializer_range) for matrices, ones for norms, zeros for biases).

    Each tile gets its own generator seeded from (seed, tile index), so the result does not depend
    on the thread count; tiles are filled in parallel (torch releases the GIL in normal_).
    """
    std, norm_value = store.adapter.init_std(), store.adapter.norm_init_value()
    names = list(store.tiles)

    def fill(i: int) -> None:
        random_init_tile(store.tiles[names[i]], std, seed, i, norm_value)

    threads = threads or min(len(names), os.cpu_count() or 1)
    if threads <= 1:
        for i in range(len(names)):
            fill(i)
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # one tile per thread; avoid oversubscribing the intra-op pool
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fill, range(len(names))))
    finally:
        torch.set_num_threads(prev)


def build_store(config, compute_dtype: torch.dtype, *, weights_path: str | Path | None = None,
                seed: int = 0, master_dtype: torch.dtype | None = None, moments: str = "fp32",
                tier=None) -> HostStore:
    """The host store of `config` (`tier`: a store/disk.DiskTier holding part of each tile), its weights read or
    drawn, its optimizer state zero."""
    adapter = ModelAdapter(config)
    store = HostStore(adapter, compute_dtype, master_dtype=master_dtype, moments=moments, tier=tier)
    if weights_path is not None:
        load_weights(store, weights_path)
    else:
        random_init(store, seed)
    store.zero_state()
    return store


def build_sharded_store(config, compute_dtype: torch.dtype, rank: int, world: int, *,
                        weights_path=None, seed: int = 0, cpu_group=None,
                        master_dtype: torch.dtype | None = None, moments: str = "fp32", tier=None) -> ShardedHostStore:
    """build_store for one rank: safetensors tensor by tensor (each rank keeps its part), or the
    same random init as one process (each tile is drawn whole, one at a time, and sliced), so a sharded
    run starts from exactly the weights of a single-process run with the same seed."""
    store = ShardedHostStore(ModelAdapter(config), compute_dtype, rank, world, cpu_group=cpu_group,
                             master_dtype=master_dtype, moments=moments, tier=tier)
    if weights_path is not None:
        load_weights(store, weights_path)
    else:
        for i, (name, layout) in enumerate(store.layouts.items()):  # one whole tile at a time
            whole = allocate_tile(name, layout, compute_dtype)
            random_init_tile(whole, store.adapter.init_std(), seed, i, store.adapter.norm_init_value())
            spec = store.shards[name]
            store.tiles[name].master[:spec.valid].copy_(whole.master[spec.start:spec.start + spec.valid])
            del whole
    store.zero_state()
    return store
