"""What a checkpoint directory holds, and how one comes to exist: the tile files, the manifest, the
side files, the atomic publication and the rotation. whole.py (one process) and sharded.py (N ranks)
write and read through it.

Layout of one checkpoint (every file listed in manifest.json with its size and CRC-32):

    output_dir/step_{N}/
        tiles/embed.safetensors, tiles/layers.0.safetensors, ..., tiles/head.safetensors
        trainer_state.json    the trainer's dict (data position, RNG states, ...)
        config.json           the HF config: a checkpoint describes its own model (export needs it)
        tokenizer/            tokenizer files, when a tokenizer was given
        manifest.json         written LAST: its presence means every other file is complete

(a checkpoint of N ranks puts its tile files under tiles/rank{r}/: sharded.py.)

A tile file is standard safetensors holding `master/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>`
for every parameter of the tile: the moments fp32 (whatever train.optimizer_state: bf16 and int8 moments are
written decoded and coded again on reading, which gives back the same values, so a resume continues bit for
bit and a checkpoint loads under any optimizer_state, converted; the cost is disk: 8 bytes/param of moments
however few the host holds), the masters in the store's master dtype (fp32, or
bf16 with train.master_weights: bf16; the manifest's "master_weights" says which, absent = fp32). A
resume with the other setting is refused (load.py); a read of the masters alone (export) converts them.
The grad section is not saved (it is transient within a
step). The bytes of each section are written straight from the tile's views, so saving costs no
copy of the model in RAM; loading reads straight into the views the same way.

Atomicity: everything is written into output_dir/.step_{N}.tmp, each file fsynced, the directory
fsynced, then renamed to step_{N} and the parent fsynced. A crash at any point leaves the earlier
checkpoints untouched and never a step_* directory that looks complete but is not. A write that fails
(the disk full, an I/O error, an exception) removes its temp dir (format.removed_on_failure); one that was
killed leaves it, and the next save removes it (format.remove_interrupted).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from megatrain_cli.checkpoint.format import (CheckpointError, CheckpointSettingError, fsync_dir, publish_dir, read_into,
                                             read_safetensors_header, safetensors_header, seal_file,
                                             seal_tree, tensor_bytes, write_all, write_file_durably)
from megatrain_cli.store.moments import BLOCK, read_moment, write_moment
from megatrain_cli.store.tiles import HostStore, Tile, TileLayout

FORMAT = "megatrain-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
SECTIONS = ("master", "exp_avg", "exp_avg_sq")
MOMENT_CHUNK = BLOCK << 16  # elements of bf16 / int8 moments converted at a time (16 MiB of fp32)
_STEP_DIR = re.compile(r"step_(\d+)")

# Test seam: called with ('tile_written', name), ('manifest_written', '') and ('published', '') so
# the crash tests can kill a writer at a point they choose. None in normal use.
event_hook: Callable[[str, str], None] | None = None


def event(kind: str, detail: str = "") -> None:
    if event_hook is not None:
        event_hook(kind, detail)


# ---------------------------------------------------------------- tile files
MASTER_WEIGHTS = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # the manifest's word for each master dtype
_TAGS = {torch.float32: "F32", torch.bfloat16: "BF16"}


def manifest_master_dtype(manifest: dict[str, Any]) -> torch.dtype:
    """The master dtype a checkpoint's tile files hold (checkpoints from before the setting: fp32)."""
    word = manifest.get("master_weights", "fp32")
    found = [d for d, w in MASTER_WEIGHTS.items() if w == word]
    if not found:
        raise CheckpointError(f"unknown master_weights {word!r} in the manifest")
    return found[0]


def check_master_weights(store, manifest: dict[str, Any], path: Path) -> None:
    """Refuse to resume (read moments into) a store whose master dtype is not the checkpoint's."""
    have, want = MASTER_WEIGHTS[manifest_master_dtype(manifest)], MASTER_WEIGHTS[store.master_dtype]
    if have != want:
        raise CheckpointSettingError(
            f"{path} was written with train.master_weights={have}, this run has train.master_weights={want}: "
            f"resuming would {'round its fp32 masters' if want == 'bf16' else 'go on from masters rounded'} to bf16. "
            f"Resume with train.master_weights={have}, or export it and start a new run from the export")


def section_dtypes(tile: Tile, master_dtype: torch.dtype | None = None) -> list[tuple[str, torch.dtype]]:
    """(section, dtype in the file) in file order; the masters' dtype is the file's (default: the tile's)."""
    master = tile.master_dtype if master_dtype is None else master_dtype
    return [(s, master if s == "master" else torch.float32) for s in SECTIONS]


def section_start(numel: int, section: str, master_dtype: torch.dtype) -> int:
    """Byte offset of `section` in the data of a tile file holding `numel` elements per section."""
    k = SECTIONS.index(section)
    return 0 if k == 0 else numel * (master_dtype.itemsize + 4 * (k - 1))


def _tile_entries(tile: Tile, master_dtype: torch.dtype | None = None
                  ) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    entries, start = [], 0
    for section, dtype in section_dtypes(tile, master_dtype):
        w, tag = dtype.itemsize, _TAGS[dtype]
        if not tile.layout.places:  # one rank's shard of a tile (store/sharded.py): one flat tensor per section
            entries.append((f"{section}/shard", tag, (tile.numel,), start, start + tile.numel * w))
        else:
            entries += [(f"{section}/{place.name}", tag, place.shape, start + place.offset * w,
                         start + (place.offset + place.numel) * w) for place in tile.layout.places]
        start += tile.numel * w
    return entries


def _data_bytes(tile: Tile) -> int:
    return sum(tile.numel * dtype.itemsize for _, dtype in section_dtypes(tile))


def tile_file_bytes(tile: Tile) -> int:
    """The size write_tile gives the tile's file (header + the masters + two fp32 moments)."""
    return len(safetensors_header(_tile_entries(tile), {"format": FORMAT, "tile": tile.name,
                                                         "step": str(tile.step)})) + _data_bytes(tile)


class _TileShape(NamedTuple):
    """What tile_file_bytes reads of a tile, for a store built without its memory (allocate=False)."""
    name: str
    layout: TileLayout
    numel: int
    master_dtype: torch.dtype
    step: int


def checkpoint_bytes(store: HostStore) -> int:
    """The disk space save_checkpoint asks for before it writes a byte: every tile's file and room for the
    side files. The one figure of the writer and of `train --dry-run`, whose store has layouts and no
    memory (HostStore(..., allocate=False)); its tiles' step counts are taken as 0 (a few header bytes)."""
    tiles = list(store.tiles.values()) or [_TileShape(name, layout, layout.numel, store.master_dtype, 0)
                                           for name, layout in store.layouts.items()]
    return sum(map(tile_file_bytes, tiles)) + SIDE_FILES_BYTES


def write_tile(tile: Tile, path: Path) -> dict[str, Any]:
    """The tile's three sections into one safetensors file, straight from its views (no copy), fsynced;
    its manifest entry (bytes, step, CRC-32 of the header and of each section)."""
    header = safetensors_header(_tile_entries(tile), {"format": FORMAT, "tile": tile.name,
                                                       "step": str(tile.step)})
    crcs = {}
    with open(path, "wb", buffering=0) as f:
        crcs["header"] = write_all(f, header)
        for section in SECTIONS:  # straight from the views: no copy
            if section == "master" or tile.moments == "fp32":
                crcs[section] = write_all(f, tensor_bytes(getattr(tile, section)))
                continue
            crc = 0  # bf16 / int8 moments go to the file as fp32, decoded a chunk at a time
            for lo in range(0, tile.numel, MOMENT_CHUNK):
                crc = write_all(f, tensor_bytes(read_moment(tile, section, lo, min(tile.numel, lo + MOMENT_CHUNK))), crc)
            crcs[section] = crc
        os.fsync(f.fileno())  # costs a disk flush per tile; needed before the manifest may claim it
    return {"bytes": len(header) + _data_bytes(tile), "step": tile.step, "crc32": crcs}


def read_tile(tile: Tile, path: Path, entry: dict[str, Any], sections: tuple[str, ...],
              master_dtype: torch.dtype | None = None) -> None:
    """Read the chosen sections straight into the tile's views, checking header and checksums (a
    section not chosen is skipped by a seek, not read). `master_dtype`: the file's (default: the tile's);
    masters of another dtype are read through a temporary copy and converted (load.py allows it only
    when no moment is read: an export)."""
    name = path.name
    file_master = tile.master.dtype if master_dtype is None else master_dtype
    with open(path, "rb", buffering=0) as f:
        header, raw = read_safetensors_header(f, name)
        if zlib.crc32(raw) != entry["crc32"]["header"]:
            raise CheckpointError(f"{name}: header checksum mismatch (file corrupted)")
        expected = json.loads(safetensors_header(_tile_entries(tile, file_master), {})[8:])
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
        for section, dtype in section_dtypes(tile, file_master):
            if section not in sections:
                continue
            f.seek(data_start + section_start(tile.numel, section, file_master))
            if section != "master" and tile.moments != "fp32":
                crc = _read_coded(f, tile, section, name)
                if crc != entry["crc32"][section]:
                    raise CheckpointError(f"{name}: checksum mismatch in section {section} (file corrupted)")
                continue
            dst = getattr(tile, section)
            landing = dst if dst.dtype == dtype else torch.empty(tile.numel, dtype=dtype)
            crc = read_into(f, tensor_bytes(landing), name)
            if landing is not dst:
                dst.copy_(landing)
            if crc != entry["crc32"][section]:
                raise CheckpointError(f"{name}: checksum mismatch in section {section} (file corrupted)")


def _read_coded(f, tile: Tile, section: str, name: str) -> int:
    """An fp32 moment section of a file into a tile holding bf16 / int8 moments, coded a chunk at a time
    (store/moments.py: decoded values come back unchanged, so a resume continues bit for bit); its CRC-32."""
    buf, crc = torch.empty(min(tile.numel, MOMENT_CHUNK), dtype=torch.float32), 0
    for lo in range(0, tile.numel, MOMENT_CHUNK):
        chunk = buf[:min(tile.numel, lo + MOMENT_CHUNK) - lo]
        crc = read_into(f, tensor_bytes(chunk), name, crc)
        write_moment(tile, section, chunk, lo)
    return crc


# ---------------------------------------------------------------- the rest of a checkpoint, and its publication
SIDE_FILES_BYTES = 32 << 20  # room asked for trainer_state, config and tokenizer (a large tokenizer.json: ~10 MiB)
SIDE_FILES = 32  # files (and folders) asked for beside the tiles: manifest, state, config, tokenizer files


def master_weights(store: HostStore) -> str:
    """The manifest's "master_weights": the dtype of the masters in the tile files."""
    return MASTER_WEIGHTS[store.master_dtype]


def model_summary(store: HostStore) -> dict[str, Any]:
    """The manifest's "model": what a loader compares before reading any tile."""
    a = store.adapter
    return {"architecture": a.architecture, "num_layers": a.num_layers, "hidden_size": a.hidden_size,
            "vocab_size": a.vocab_size, "tied_embeddings": a.tied, "num_params": store.num_params()}


def write_side_files(tmp: Path, store, state_bytes: bytes, tokenizer, source_dir=None) -> dict[str, dict[str, int]]:
    """trainer_state.json, config.json, the tokenizer and the source model's generation_config.json (its
    end-of-turn ids and sampling defaults, which `megatrain export` carries on), each fsynced; their
    manifest entries."""
    files = {TRAINER_STATE: write_file_durably(tmp / TRAINER_STATE, state_bytes)}
    store.adapter.config.save_pretrained(str(tmp))  # writes tmp/config.json
    files.update(seal_file(tmp / "config.json", tmp))
    generation = Path(source_dir) / "generation_config.json" if source_dir else None
    if generation is not None and generation.is_file():
        files[generation.name] = write_file_durably(tmp / generation.name, generation.read_bytes())
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        files.update(seal_tree(tmp / "tokenizer", tmp))
    return files


def seal_and_publish(tmp: Path, final: Path, output_dir: Path, manifest: dict, keep_last_n: int) -> None:
    """The manifest LAST (its presence means complete), then the atomic rename and the rotation (which
    stats the files of every older checkpoint to know which are complete)."""
    write_file_durably(tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    fsync_dir(tmp)
    event("manifest_written")
    publish_dir(tmp, final)
    event("published")
    _rotate(output_dir, max(1, keep_last_n), final)


# ---------------------------------------------------------------- finding checkpoints, rotation
def _step_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    """step_* directories, newest step first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir()
             if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def read_manifest(path: Path) -> dict[str, Any]:
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
        read_manifest(path)
        return True
    except CheckpointError:
        return False


def sound_one_before(path: Path) -> Path | None:
    """The newest complete checkpoint (stats only) older than `path` beside it: the way out a message about a
    damaged checkpoint names (resume's and export's)."""
    found = checkpoints_newest_first(path.parent)
    names = [p.name for p, _ in found]
    if path.name not in names:
        return None
    return next((p for p, problem in found[names.index(path.name) + 1:] if problem is None), None)


def checkpoints_newest_first(output_dir: str | Path) -> list[tuple[Path, str | None]]:
    """Every step_* directory under output_dir, newest first, with why it is not complete (None: it is;
    stats only). `checkpoint.resume: auto` says which ones it passes over and why."""
    found = []
    for _, path in _step_dirs(Path(output_dir)):
        if not (path / MANIFEST).is_file():
            found.append((path, f"no {MANIFEST}: not a complete checkpoint"))
            continue
        try:
            read_manifest(path)
            found.append((path, None))
        except CheckpointError as e:
            found.append((path, str(e).removeprefix(f"{path}: ")))
    return found


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest step_* under output_dir whose manifest is present and whose files all have their
    listed sizes (stats only, no data read); None if there is none."""
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
