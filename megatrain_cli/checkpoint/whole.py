"""Checkpoints of one process's whole host store: masters (fp32, or bf16: train.master_weights), both
Adam moments and step counts,
one tile file per tile (the directory's layout: layout.py).

Saving writes each tile straight from its views (no copy of the model in RAM) and costs an fsync per
tile; reading fills the views straight from the files the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatrain_cli.checkpoint.format import (CheckpointError, check_free_space, fsync_dir, remove_interrupted,
                                             removed_on_failure)
from megatrain_cli.checkpoint.layout import (FORMAT, SECTIONS, SIDE_FILES, VERSION, checkpoint_bytes, event,
                                             manifest_master_dtype, master_weights, model_summary, read_tile,
                                             seal_and_publish, write_side_files, write_tile)
from megatrain_cli.store.tiles import HostStore


def save_checkpoint(store: HostStore, output_dir: str | Path, step: int, trainer_state: dict,
                    keep_last_n: int = 2, *, tokenizer=None, source_dir=None) -> Path:
    """Write output_dir/step_{step}/ atomically, then keep only the newest `keep_last_n` checkpoints
    (the one just written is always kept). Returns the checkpoint path. Not enough free space, or a write
    that fails, raises CheckpointWriteError with nothing of the new checkpoint left (format.py)."""
    output_dir = Path(output_dir)
    # Serialise first, so a non-JSON value fails before anything is written.
    state_bytes = (json.dumps(trainer_state, indent=2) + "\n").encode()
    if not output_dir.is_dir():
        output_dir.mkdir(parents=True)
        fsync_dir(output_dir.parent)  # make the new directory's own entry durable
    final, tmp = output_dir / f"step_{step}", output_dir / f".step_{step}.tmp"
    remove_interrupted(output_dir)  # temp dirs of killed saves (this step's included): only holding space
    need = checkpoint_bytes(store)  # train --dry-run asks the same figure
    check_free_space(output_dir, need, final.name, files=len(store.tiles) + SIDE_FILES)
    with removed_on_failure(tmp, final.name, need):
        (tmp / "tiles").mkdir(parents=True)
        tiles = []
        for name, tile in store.tiles.items():
            rel = f"tiles/{name}.safetensors"
            tiles.append({"name": name, "file": rel, **write_tile(tile, tmp / rel)})
            store.settle(name)  # a disk tier's pages read for it leave memory again
            event("tile_written", name)
        files = write_side_files(tmp, store, state_bytes, tokenizer, source_dir)
        fsync_dir(tmp / "tiles")
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "model": model_summary(store),
                    "master_weights": master_weights(store), "optimizer_state": store.moments, "tiles": tiles, "files": files}
        seal_and_publish(tmp, final, output_dir, manifest, keep_last_n)
    return final


def load_whole(store: HostStore, path: Path, manifest: dict[str, Any], sections: tuple[str, ...] = SECTIONS) -> None:
    """The chosen sections of a one-process checkpoint (its manifest already read and checked) into a
    whole store, tile by tile, straight into the views; step counts too when the moments are read."""
    _check_fits(store, manifest, path)
    master = manifest_master_dtype(manifest)
    for entry in manifest["tiles"]:
        read_tile(store.tiles[entry["name"]], path / entry["file"], entry, sections, master)
        store.settle(entry["name"])  # what it wrote into a disk tier goes there now, not all at the end
    if "exp_avg" in sections:  # step counts only mean something together with the moments
        for entry in manifest["tiles"]:
            store.tiles[entry["name"]].step = int(entry["step"])


def _check_fits(store: HostStore, manifest: dict[str, Any], path: Path) -> None:
    names = [t["name"] for t in manifest["tiles"]]
    if names != list(store.layouts):
        raise CheckpointError(f"{path} was written for another model: its tiles are {names[:3]}... "
                              f"({len(names)}), this model has {len(store.layouts)}; checkpoint model "
                              f"{manifest.get('model')}, this model {model_summary(store)}")
