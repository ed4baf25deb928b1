"""Checkpoints of data-parallel ranks (issue #11): written per shard, read back on any number of ranks.

A checkpoint of N ranks (store/sharded.py) keeps layout.py's directory with the tile files per rank,

    tiles/rank{r}/{name}.safetensors   one flat tensor per section: the rank's shard, padding included

and the manifest records "world": N and "shards": [the tile entries of rank 0, of rank 1, ...] (its
"tiles" list is empty). Every rank writes its own files into the same temp dir; rank 0 writes the rest
and the manifest, last, then publishes (layout.seal_and_publish).

Reading: on the same N each rank reads its own files whole (layout.read_tile: header and section
checksums). On another N, or in one process (resume, export), each needed element range is gathered
from the files that hold it, in the tiles' flat coordinates, which do not depend on N: rank r of N holds
elements [r * shard, (r + 1) * shard) of every section, a one-process file all of them. A source section
is streamed whole through a 64 MiB buffer (CHUNK_BYTES) so that its checksum is checked too, and only the
overlap is copied: resharding reads each touched file's sections in full (one rank of M reads up to the whole
checkpoint; it is the rare path), never holds more than one buffer beside the store. Which reader a
load takes is decided in load.py.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch

from megatrain_cli.checkpoint.format import (CHUNK_BYTES, CheckpointError, CheckpointWriteError, check_free_space,
                                             fsync_dir, read_safetensors_header, remove_interrupted,
                                             removed_on_failure, tensor_bytes)
from megatrain_cli.checkpoint.layout import (FORMAT, SECTIONS, SIDE_FILES_BYTES, VERSION, event,
                                             manifest_master_dtype, master_weights, model_summary, read_tile,
                                             seal_and_publish, section_start, tile_file_bytes, write_side_files,
                                             write_tile)
from megatrain_cli.store.moments import write_moment


def save_sharded_checkpoint(store, output_dir: str | Path, step: int, trainer_state: dict,
                            keep_last_n: int = 2, *, tokenizer=None, source_dir=None) -> Path:
    """whole.save_checkpoint for one rank of a ShardedHostStore; a collective (every rank calls it, on a
    file system all ranks share): three all-gathers of small objects and a broadcast; each rank pays an
    fsync per tile file it writes. Every rank raises the same CheckpointWriteError when any rank cannot
    write (not enough space for all the shards, an OS error): the ranks decide together, so none waits
    for a rank that gave up, and rank 0 removes the temp dir."""
    try:
        return _save(store, Path(output_dir), step, trainer_state, keep_last_n, tokenizer, source_dir)
    except BaseException:  # a peer gone mid-collective, or any other failure: no partial folder left
        if store.rank == 0:
            shutil.rmtree(Path(output_dir) / f".step_{step}.tmp", ignore_errors=True)
        raise


def _save(store, output_dir: Path, step: int, trainer_state: dict, keep_last_n: int, tokenizer, source_dir) -> Path:
    import torch.distributed as dist

    rank, world, group = store.rank, store.world, store.cpu_group
    state_bytes = (json.dumps(trainer_state, indent=2) + "\n").encode()
    final, tmp = output_dir / f"step_{step}", output_dir / f".step_{step}.tmp"
    mine_bytes = sum(tile_file_bytes(t) for t in store.tiles.values()) + (SIDE_FILES_BYTES if rank == 0 else 0)
    need = sum(_gather(mine_bytes, world, group))
    problem = None
    if rank == 0:
        try:
            if not output_dir.is_dir():
                output_dir.mkdir(parents=True)
                fsync_dir(output_dir.parent)
            remove_interrupted(output_dir)
            check_free_space(output_dir, need, final.name)
            (tmp / "tiles").mkdir(parents=True)
        except (OSError, CheckpointError) as e:
            problem = e
    _raise_any(_gather(problem and str(problem), world, group), tmp, rank)
    tiles, problem = [], None
    try:
        with removed_on_failure(tmp / "tiles" / f"rank{rank}", final.name, need, where=output_dir):
            mine = tmp / "tiles" / f"rank{rank}"
            mine.mkdir()
            for name, tile in store.tiles.items():
                rel = f"tiles/rank{rank}/{name}.safetensors"
                tiles.append({"name": name, "file": rel, "shard": store.shards[name].shard,
                              **write_tile(tile, tmp / rel)})
                store.settle(name)  # a disk tier's pages read for it leave memory again
                event("tile_written", name)
            fsync_dir(mine)
    except CheckpointError as e:
        problem = str(e)
    shards = _gather((tiles, problem), world, group)
    _raise_any([p for _, p in shards], tmp, rank)
    if rank == 0:
        try:
            with removed_on_failure(tmp, final.name, need):
                fsync_dir(tmp / "tiles")
                files = write_side_files(tmp, store, state_bytes, tokenizer, source_dir)
                manifest = {"format": FORMAT, "version": VERSION, "step": step, "model": model_summary(store),
                            "master_weights": master_weights(store), "optimizer_state": store.moments, "world": world, "tiles": [], "shards": [t for t, _ in shards], "files": files}
                seal_and_publish(tmp, final, output_dir, manifest, keep_last_n)
        except (OSError, CheckpointError) as e:
            problem = str(e)
    done = [problem]
    dist.broadcast_object_list(done, src=0, group=group)  # also the barrier: published before anyone goes on
    _raise_any(done, tmp, rank)
    return final


def _gather(obj, world: int, group) -> list:
    import torch.distributed as dist

    out: list = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _raise_any(problems: list, tmp: Path, rank: int) -> None:
    """The same CheckpointWriteError on every rank when any rank had a problem; rank 0 removes the temp dir."""
    found = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
    if found:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(found[0] if len(found) == 1 else "; ".join(found))


def load_rank(store, path: Path, manifest: dict[str, Any]) -> None:
    """This rank's shards (a ShardedHostStore), from a checkpoint of any number of ranks or of one process."""
    if manifest.get("world") == store.world:
        _check_model(store, path, manifest)
        entries = manifest["shards"][store.rank]
        if any(t["shard"] != store.shards[t["name"]].shard for t in entries):
            raise CheckpointError(f"{path}: its shards do not match this run's (same model, same ranks: "
                                  f"written by another version?)")
        for entry in entries:
            read_tile(store.tiles[entry["name"]], path / entry["file"], entry, SECTIONS,
                      manifest_master_dtype(manifest))
            store.settle(entry["name"])
            store.tiles[entry["name"]].step = int(entry["step"])
        return
    load_resharded(store, path, manifest, SECTIONS)


def load_resharded(store, path: Path, manifest: dict[str, Any], sections: tuple[str, ...] = SECTIONS) -> None:
    """The chosen sections of every tile of `store` (a whole HostStore, or one rank's ShardedHostStore) from
    the files of a checkpoint written with another number of ranks (module docstring); step counts too
    when the moments are read."""
    _check_model(store, path, manifest)
    sources = _sources(store, manifest)
    master = manifest_master_dtype(manifest)
    for name, tile in store.tiles.items():
        first, count = _wanted(store, name)
        for section in sections:
            coded = section != "master" and tile.moments != "fp32"  # read as fp32, then coded (layout.py)
            dst = torch.empty(count, dtype=torch.float32) if coded else getattr(tile, section)[:count]
            filled = 0
            for entry, src_first, src_count in sources[name]:
                lo, hi = max(first, src_first), min(first + count, src_first + src_count)
                if lo < hi:
                    _copy_range(path / entry["file"], entry, section, src_first, src_count, lo, hi,
                                dst[lo - first:hi - first], master)
                    filled += hi - lo
            if filled != count:
                raise CheckpointError(f"{path}: tile {name} has {filled} of the {count} elements this store needs")
            if coded:
                write_moment(tile, section, dst)
        if "exp_avg" in sections:
            tile.step = int(sources[name][0][0]["step"])


def _check_model(store, path: Path, manifest: dict[str, Any]) -> None:
    if manifest.get("model") != model_summary(store):
        raise CheckpointError(f"{path} was written for another model: checkpoint model {manifest.get('model')}, "
                              f"this model {model_summary(store)}")


def _sources(store, manifest: dict[str, Any]) -> dict[str, list[tuple[dict, int, int]]]:
    """Per tile: (file entry, its first element, its elements per section), in order. A one-process file
    holds the whole tile (the same model: _check_model), whose size the store's layout gives."""
    out: dict[str, list] = {}
    if "world" in manifest:
        for r, entries in enumerate(manifest["shards"]):
            for e in entries:
                out.setdefault(e["name"], []).append((e, r * e["shard"], e["shard"]))
    else:
        for e in manifest["tiles"]:
            out[e["name"]] = [(e, 0, store.layouts[e["name"]].numel)]
    missing = sorted(set(store.tiles) - set(out))
    if missing:
        raise CheckpointError(f"the checkpoint has no files for tiles {missing[:3]}")
    return out


def _wanted(store, name: str) -> tuple[int, int]:
    """(first element, count) of the tile's flat range this store holds: a shard's parameters, or all."""
    if getattr(store, "world", None) is not None:
        spec = store.shards[name]
        return spec.start, spec.valid
    return 0, store.tiles[name].numel


def _copy_range(file: Path, entry: dict, section: str, src_first: int, src_count: int, lo: int, hi: int,
                dst: torch.Tensor, master_dtype: torch.dtype = torch.float32) -> None:
    """Elements [lo, hi) (tile coordinates) of `section` from a file holding [src_first, src_first +
    src_count) whose masters are `master_dtype`: the whole section is streamed so its checksum is checked;
    the overlap lands in `dst` (converted, when dst's dtype is another)."""
    dtype = master_dtype if section == "master" else torch.float32
    w = dtype.itemsize
    with open(file, "rb", buffering=0) as f:
        _, raw = read_safetensors_header(f, file.name)
        if zlib.crc32(raw) != entry["crc32"]["header"]:
            raise CheckpointError(f"{file.name}: header checksum mismatch (file corrupted)")
        f.seek(len(raw) + section_start(src_count, section, master_dtype))
        buf = torch.empty(CHUNK_BYTES // w, dtype=dtype)
        view, crc, at = tensor_bytes(buf), 0, src_first
        while at < src_first + src_count:
            n = min(buf.numel(), src_first + src_count - at)
            got = 0
            while got < n * w:
                r = f.readinto(view[got:n * w])
                if not r:
                    raise CheckpointError(f"{file.name}: truncated (ended early)")
                got += r
            crc = zlib.crc32(view[:n * w], crc)
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                dst[a - lo:b - lo].copy_(buf[a - at:b - at])
            at += n
        if crc != entry["crc32"][section]:
            raise CheckpointError(f"{file.name}: checksum mismatch in section {section} (file corrupted)")
