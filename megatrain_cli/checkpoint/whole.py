"""Resumable checkpoints of the whole host store: fp32 masters, both Adam moments and step counts.

Layout of one checkpoint (every file listed in manifest.json with its size and CRC-32):

    output_dir/step_{N}/
        tiles/embed.safetensors, tiles/layers.0.safetensors, ..., tiles/head.safetensors
        trainer_state.json    the trainer's dict (data position, RNG states, ...)
        config.json           the HF config: a checkpoint describes its own model (export needs it)
        tokenizer/            tokenizer files, when a tokenizer was given
        manifest.json         written LAST: its presence means every other file is complete

A tile file is standard safetensors holding `master/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>`
for every parameter of the tile, all fp32. The grad section is not saved (it is transient within a
step). The bytes of each section are written straight from the tile's views, so saving costs no
copy of the model in RAM; loading reads straight into the views the same way.

Atomicity: everything is written into output_dir/.step_{N}.tmp, each file fsynced, the directory
fsynced, then renamed to step_{N} and the parent fsynced. A crash at any point leaves the earlier
checkpoints untouched and never a step_* directory that looks complete but is not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

from megatrain_cli.store.tiles import HostStore, Tile

FORMAT = "megatrain-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
SECTIONS = ("master", "exp_avg", "exp_avg_sq")
CHUNK_BYTES = 64 << 20  # I/O and CRC granularity; also keeps every write() below Linux's 2 GiB cap
_STEP_DIR = re.compile(r"step_(\d+)")

# Test seam: called with ('tile_written', name), ('manifest_written', '') and ('published', '') so
# the crash tests can kill a writer at a point they choose. None in normal use.
_event_hook: Callable[[str, str], None] | None = None


class CheckpointError(ValueError):
    pass


def _event(kind: str, detail: str = "") -> None:
    if _event_hook is not None:
        _event_hook(kind, detail)


# ---------------------------------------------------------------- raw safetensors + durable files
def safetensors_header(entries: list[tuple[str, str, tuple[int, ...], int, int]],
                       metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header of a safetensors file, padded with spaces to 8 bytes as the
    reference writer does. entries: (name, dtype code, shape, begin, end) with data offsets."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for name, code, shape, begin, end in entries:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_safetensors_header(f, name: str) -> tuple[dict[str, Any], bytes]:
    """(parsed header, its raw bytes including the length prefix); f is positioned at the data."""
    prefix = f.read(8)
    if len(prefix) != 8:
        raise CheckpointError(f"{name}: truncated (no safetensors header)")
    (length,) = struct.unpack("<Q", prefix)
    if length > 100 << 20:
        raise CheckpointError(f"{name}: corrupted safetensors header (claims {length} bytes)")
    raw = f.read(length)
    try:
        return json.loads(raw), prefix + raw
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name}: corrupted safetensors header ({e})") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy (little-endian, as safetensors wants)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_all(f, data: memoryview | bytes, crc: int = 0) -> int:
    """Write everything (in chunks: one write() moves at most ~2 GiB on Linux); returns the CRC."""
    data = memoryview(data)
    for start in range(0, len(data), CHUNK_BYTES):
        chunk = data[start:start + CHUNK_BYTES]
        crc = zlib.crc32(chunk, crc)
        while len(chunk):
            chunk = chunk[f.write(chunk):]
    return crc


def read_into(f, target: memoryview, name: str, crc: int = 0) -> int:
    for start in range(0, len(target), CHUNK_BYTES):
        chunk = target[start:start + CHUNK_BYTES]
        got = 0
        while got < len(chunk):
            n = f.readinto(chunk[got:])
            if not n:
                raise CheckpointError(f"{name}: truncated (ended early)")
            got += n
        crc = zlib.crc32(chunk, crc)
    return crc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> dict[str, int]:
    with open(path, "wb", buffering=0) as f:
        crc = write_all(f, data)
        os.fsync(f.fileno())
    return {"bytes": len(data), "crc32": crc}


def seal_file(path: Path, base: Path) -> dict[str, dict[str, int]]:
    """Fsync and checksum a small file written by other code (config/tokenizer save_pretrained):
    reading it back costs nothing worth mentioning."""
    with open(path, "rb") as f:
        data = f.read()
        os.fsync(f.fileno())
    return {path.relative_to(base).as_posix(): {"bytes": len(data), "crc32": zlib.crc32(data)}}


def seal_tree(root: Path, base: Path) -> dict[str, dict[str, int]]:
    """seal_file for every file under root, then fsync root and its subdirectories."""
    entries: dict[str, dict[str, int]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        entries.update(seal_file(path, base))
    for d in sorted({p for p in root.rglob("*") if p.is_dir()} | {root}):
        fsync_dir(d)
    return entries


def publish_dir(tmp: Path, final: Path) -> None:
    """Atomically rename a finished temp dir into place. rename() cannot replace a non-empty dir, so
    an existing `final` is moved aside first and deleted after (only a same-name re-save pays this)."""
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


# ---------------------------------------------------------------- tile files
def _tile_entries(tile: Tile) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    section_bytes = tile.numel * 4
    if not tile.layout.slots:  # one rank's shard of a tile (store/sharded.py): one flat tensor per section
        return [(f"{section}/shard", "F32", (tile.numel,), k * section_bytes, (k + 1) * section_bytes)
                for k, section in enumerate(SECTIONS)]
    return [(f"{section}/{slot.name}", "F32", slot.shape, k * section_bytes + slot.offset * 4,
             k * section_bytes + (slot.offset + slot.numel) * 4)
            for k, section in enumerate(SECTIONS) for slot in tile.layout.slots]


def _write_tile(tile: Tile, path: Path) -> dict[str, Any]:
    header = safetensors_header(_tile_entries(tile), {"format": FORMAT, "tile": tile.name,
                                                       "step": str(tile.step)})
    crcs = {}
    with open(path, "wb", buffering=0) as f:
        crcs["header"] = write_all(f, header)
        for section in SECTIONS:  # straight from the views: no copy
            crcs[section] = write_all(f, tensor_bytes(getattr(tile, section)))
        os.fsync(f.fileno())  # costs a disk flush per tile; needed before the manifest may claim it
    return {"bytes": len(header) + 3 * tile.numel * 4, "step": tile.step, "crc32": crcs}


def _read_tile(tile: Tile, path: Path, entry: dict[str, Any], sections: tuple[str, ...]) -> None:
    """Read the chosen sections straight into the tile's views, checking header and checksums."""
    name = path.name
    with open(path, "rb", buffering=0) as f:
        header, raw = read_safetensors_header(f, name)
        if zlib.crc32(raw) != entry["crc32"]["header"]:
            raise CheckpointError(f"{name}: header checksum mismatch (file corrupted)")
        expected = json.loads(safetensors_header(_tile_entries(tile), {})[8:])
        expected.pop("__metadata__")
        header.pop("__metadata__", None)
        if header != expected:
            have = {k.split("/", 1)[1]: v["shape"] for k, v in header.items() if k.startswith("master/")}
            want = {k.split("/", 1)[1]: v["shape"] for k, v in expected.items() if k.startswith("master/")}
            diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))[:4]
            raise CheckpointError(f"{name} does not fit tile {tile.name} of this model (another model's "
                                  f"checkpoint?): differing tensors {diff}: checkpoint "
                                  f"{[have.get(k) for k in diff]}, model {[want.get(k) for k in diff]}")
        data_start = len(raw)
        for k, section in enumerate(SECTIONS):
            if section not in sections:
                continue
            f.seek(data_start + k * tile.numel * 4)
            crc = read_into(f, tensor_bytes(getattr(tile, section)), name)
            if crc != entry["crc32"][section]:
                raise CheckpointError(f"{name}: checksum mismatch in section {section} (file corrupted); "
                                      "the store is now partly overwritten and must not be trained on")


# ---------------------------------------------------------------- save / find / load
def _model_summary(store: HostStore) -> dict[str, Any]:
    a = store.adapter
    return {"architecture": a.architecture, "num_layers": a.num_layers, "hidden_size": a.hidden_size,
            "vocab_size": a.vocab_size, "tied_embeddings": a.tied, "num_params": store.num_params()}


def save_checkpoint(store: HostStore, output_dir: str | Path, step: int, trainer_state: dict,
                    keep_last_n: int = 2, *, tokenizer=None) -> Path:
    """Write output_dir/step_{step}/ atomically, then keep only the newest `keep_last_n` checkpoints
    (the one just written is always kept). Returns the checkpoint path."""
    output_dir = Path(output_dir)
    # Serialise first, so a non-JSON value fails before anything is written.
    state_bytes = (json.dumps(trainer_state, indent=2) + "\n").encode()
    if not output_dir.is_dir():
        output_dir.mkdir(parents=True)
        fsync_dir(output_dir.parent)  # make the new directory's own entry durable
    final, tmp = output_dir / f"step_{step}", output_dir / f".step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a crashed save of the same step
    (tmp / "tiles").mkdir(parents=True)

    tiles = []
    for name, tile in store.tiles.items():
        rel = f"tiles/{name}.safetensors"
        tiles.append({"name": name, "file": rel, **_write_tile(tile, tmp / rel)})
        _event("tile_written", name)
    files = _write_side_files(tmp, store, state_bytes, tokenizer)
    fsync_dir(tmp / "tiles")
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "model": _model_summary(store),
                "tiles": tiles, "files": files}
    _seal_and_publish(tmp, final, output_dir, manifest, keep_last_n)
    return final


def _write_side_files(tmp: Path, store, state_bytes: bytes, tokenizer) -> dict[str, dict[str, int]]:
    """trainer_state.json, config.json and the tokenizer, each fsynced; their manifest entries."""
    files = {TRAINER_STATE: write_file_durably(tmp / TRAINER_STATE, state_bytes)}
    store.adapter.config.save_pretrained(str(tmp))  # writes tmp/config.json
    files.update(seal_file(tmp / "config.json", tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        files.update(seal_tree(tmp / "tokenizer", tmp))
    return files


def _seal_and_publish(tmp: Path, final: Path, output_dir: Path, manifest: dict, keep_last_n: int) -> None:
    """The manifest LAST (its presence means complete), then the atomic rename and the rotation."""
    write_file_durably(tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    fsync_dir(tmp)
    _event("manifest_written")
    publish_dir(tmp, final)
    _event("published")
    _rotate(output_dir, max(1, keep_last_n), final)


def _step_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    """step_* directories, newest step first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir()
             if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, checked for completeness by file sizes (a stat per file: no data is read)."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        hint = ""
        if _step_dirs(path):
            hint = f"; it holds checkpoints {[p.name for _, p in _step_dirs(path)]}: pass one of them"
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}){hint}")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:
        raise CheckpointError(f"{mpath} is corrupted ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: not a {FORMAT} v{VERSION} checkpoint")
    try:
        listed = {t["file"]: t["bytes"] for t in manifest["tiles"]}
        listed.update({t["file"]: t["bytes"] for rank in manifest.get("shards", []) for t in rank})
        listed.update({k: v["bytes"] for k, v in manifest["files"].items()})
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{mpath} is malformed ({e!r})") from None
    for rel, size in listed.items():
        p = path / rel
        if not p.is_file():
            raise CheckpointError(f"{path}: {rel} is missing")
        if p.stat().st_size != size:
            raise CheckpointError(f"{path}: {rel} has {p.stat().st_size} bytes, the manifest says {size} "
                                  "(truncated or overwritten)")
    return manifest


def _is_complete(path: Path) -> bool:
    try:
        _read_manifest(path)
        return True
    except CheckpointError:
        return False


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest step_* under output_dir whose manifest is present and whose files all have their
    listed sizes; None if there is none."""
    for _, path in _step_dirs(Path(output_dir)):
        if _is_complete(path):
            return path
    return None


def _rotate(output_dir: Path, keep: int, just_written: Path) -> None:
    for stale in output_dir.glob(".step_*"):  # .tmp/.old/.trash left by interrupted saves
        if stale.is_dir():
            shutil.rmtree(stale)
    others = [p for _, p in _step_dirs(output_dir) if p != just_written and _is_complete(p)]
    for path in others[keep - 1:]:
        trash = output_dir / f".{path.name}.trash"  # rename first: a half-deleted dir never looks complete
        os.rename(path, trash)
        shutil.rmtree(trash)
    fsync_dir(output_dir)


def _check_fits(store: HostStore, manifest: dict[str, Any], path: Path) -> None:
    names = [t["name"] for t in manifest["tiles"]]
    if names != list(store.layouts):
        raise CheckpointError(f"{path} was written for another model: its tiles are {names[:3]}... "
                              f"({len(names)}), this model has {len(store.layouts)}; checkpoint model "
                              f"{manifest.get('model')}, this model {_model_summary(store)}")


def load_tiles(store: HostStore, path: str | Path, sections: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    """Validate the checkpoint and read the chosen sections into the store, tile by tile (no
    temporary copy: bytes land directly in the views). Returns the manifest."""
    path = Path(path)
    manifest = _read_manifest(path)
    if "world" in manifest:  # written by N data-parallel ranks: gathered from their shard files
        from megatrain_cli.checkpoint.sharded import load_resharded

        load_resharded(store, path, manifest, sections)
        return manifest
    _check_fits(store, manifest, path)
    for entry in manifest["tiles"]:
        _read_tile(store.tiles[entry["name"]], path / entry["file"], entry, sections)
    if "exp_avg" in sections:  # step counts only mean something together with the moments
        for entry in manifest["tiles"]:
            store.tiles[entry["name"]].step = int(entry["step"])
    return manifest


def load_checkpoint(store: HostStore, path: str | Path) -> dict:
    """Restore masters, Adam moments and step counts into `store`; returns the trainer state. The grad
    section is left as it is (the trainer zeroes it at the start of a step)."""
    path = Path(path)
    manifest = _read_manifest(path)
    raw = (path / TRAINER_STATE).read_bytes()
    if zlib.crc32(raw) != manifest["files"][TRAINER_STATE]["crc32"]:
        raise CheckpointError(f"{path / TRAINER_STATE}: checksum mismatch (file corrupted)")
    trainer_state = json.loads(raw)
    if getattr(store, "world", None) is not None:  # a ShardedHostStore: this rank's part, from any N
        from megatrain_cli.checkpoint.sharded import load_rank

        load_rank(store, path, manifest)
    else:
        load_tiles(store, path)
    return trainer_state
