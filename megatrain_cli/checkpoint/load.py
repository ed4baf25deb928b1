"""Reading a checkpoint back, whoever wrote it and whoever reads it: the one place that looks at a
manifest and picks the reader, so whole.py and sharded.py never import each other.

    written by one process, read into a whole store      whole.load_whole (each file read once)
    written by N ranks, read by one rank of the same N    sharded.load_rank (its own files, read once)
    any other pairing                                    sharded.load_resharded (gathers element
                                                         ranges; may read every touched file whole)
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path
from typing import Any

from megatrain_cli.checkpoint.format import CheckpointError
from megatrain_cli.checkpoint.layout import SECTIONS, TRAINER_STATE, check_master_weights, read_manifest
from megatrain_cli.checkpoint.sharded import load_rank, load_resharded
from megatrain_cli.checkpoint.whole import load_whole
from megatrain_cli.store.tiles import HostStore


def load_tiles(store: HostStore, path: str | Path, sections: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    """Validate the checkpoint and read the chosen sections into a whole store, tile by tile (no
    temporary copy: bytes land directly in the views). Returns the manifest. The masters alone (an export)
    may be read into a store of the other master dtype (converted); with the moments (a resume) the store
    must have the checkpoint's train.master_weights (CheckpointSettingError)."""
    path = Path(path)
    manifest = read_manifest(path)
    if set(sections) != {"master"}:
        check_master_weights(store, manifest, path)
    if "world" in manifest:  # written by N data-parallel ranks: gathered from their shard files
        load_resharded(store, path, manifest, sections)
    else:
        load_whole(store, path, manifest, sections)
    return manifest


def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint was written at, from its manifest (checked complete by file sizes: stats only,
    no data read): what a resume decides on before anything is built or written."""
    return int(read_manifest(Path(path))["step"])


def load_checkpoint(store: HostStore, path: str | Path) -> dict:
    """Restore masters, Adam moments and step counts into `store` (a whole one, or one rank's
    ShardedHostStore); returns the trainer state. The grad section is left as it is (the trainer zeroes
    it at the start of a step)."""
    path = Path(path)
    manifest = read_manifest(path)
    raw = (path / TRAINER_STATE).read_bytes()
    if zlib.crc32(raw) != manifest["files"][TRAINER_STATE]["crc32"]:
        raise CheckpointError(f"{path / TRAINER_STATE}: checksum mismatch (file corrupted)")
    trainer_state = json.loads(raw)
    check_master_weights(store, manifest, path)  # before any tile is touched
    written = manifest.get("optimizer_state", "fp32")
    if written != store.moments:  # the file's moments are fp32 either way: converting is coding them
        print(f"note: {path} was written with train.optimizer_state={written}; its Adam moments are coded as "
              f"train.optimizer_state={store.moments} on loading (docs/precision.md)", file=sys.stderr, flush=True)
    if getattr(store, "world", None) is not None:  # a ShardedHostStore: this rank's part, from any N
        load_rank(store, path, manifest)
    else:
        load_tiles(store, path)
    return trainer_state
