"""Checkpoints: exact round trip, rotation, crash safety (SIGKILL mid-write), corruption refusal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatrain_cli.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from tests.helpers_checkpoint import assert_same_state, filled_store, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TRAINER_STATE = {"global_step": 7, "data_position": [3, 41], "rng": {"torch": [1, 2, 3], "seed": 5},
                 "skipped_steps": [], "recipe": {"train": {"lr": 1e-5}}}


def test_round_trip_is_bit_exact(tmp_path):
    saved = filled_store(seed=1)
    path = save_checkpoint(saved, tmp_path, 7, TRAINER_STATE, tokenizer=tiny_tokenizer())
    assert path == tmp_path / "step_7"

    fresh = filled_store(seed=2)
    assert load_checkpoint(fresh, path) == TRAINER_STATE
    assert_same_state(saved, fresh)
    assert all(t.grad.eq(7.0).all() for t in fresh.tiles.values())  # grads are not part of the state

    manifest = json.loads((path / "manifest.json").read_text())
    assert {"config.json", "trainer_state.json", "tokenizer/tokenizer.json"} <= set(manifest["files"])
    # Tile files are plain safetensors that any reader opens; no grad section inside.
    with safe_open(str(path / "tiles" / "layers.1.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert not any(k.startswith("grad") for k in keys)
        views = saved.tiles["layers.1"].layout.views(saved.tiles["layers.1"].exp_avg_sq)
        assert torch.equal(f.get_tensor("exp_avg_sq/self_attn.q_proj.weight"), views["self_attn.q_proj.weight"])
        assert f.metadata()["step"] == str(saved.tiles["layers.1"].step)


def test_rotation_keeps_newest_and_the_one_just_written(tmp_path):
    store = filled_store(seed=1)
    (tmp_path / ".step_9.tmp").mkdir()  # what a crashed save leaves behind
    (tmp_path / "notes").mkdir()
    for step in (1, 2, 3):
        save_checkpoint(store, tmp_path, step, {"global_step": step}, keep_last_n=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_2", "step_3"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"

    # Saving a step that exists replaces it whole.
    newer = filled_store(seed=4)
    save_checkpoint(newer, tmp_path, 3, {"global_step": 33}, keep_last_n=2)
    loaded = filled_store(seed=5)
    assert load_checkpoint(loaded, tmp_path / "step_3") == {"global_step": 33}
    assert_same_state(newer, loaded)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_2", "step_3"]

    # Re-saving an older step (resumed from it) never deletes what was just written.
    save_checkpoint(store, tmp_path, 1, {"global_step": 1}, keep_last_n=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_1"]
    assert latest_checkpoint(tmp_path / "missing") is None


CHILD = r"""
import sys, time
from megatrain_cli import checkpoint
from megatrain_cli.checkpoint import layout
from tests.helpers_checkpoint import filled_store

out, kill_at = sys.argv[1], sys.argv[2]
store = filled_store(seed=2)

def stop_here(kind, detail):
    if f"{kind}:{detail}" == kill_at:
        print("READY", flush=True)
        time.sleep(600)

layout.event_hook = stop_here
checkpoint.save_checkpoint(store, out, 2, {"global_step": 2}, keep_last_n=1)
print("FINISHED", flush=True)
"""


def test_sigkill_while_writing_keeps_previous_checkpoint(tmp_path):
    before = filled_store(seed=1)
    kill_points = ["tile_written:layers.0", "manifest_written:", "published:"]
    children = []
    for i, point in enumerate(kill_points):  # children run at once: each pays a fresh interpreter's imports
        out = tmp_path / f"run{i}"
        save_checkpoint(before, out, 1, {"global_step": 1})
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out), point], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        children.append((point, out, proc))
    for point, out, proc in children:
        line = proc.stdout.readline()
        assert line.strip() == "READY", (point, line, proc.stderr.read())
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL

    after = filled_store(seed=2)
    for point, out, _ in children:
        store = filled_store(seed=3)
        if point == "published:":
            # Renamed into place but killed before rotation: the new one is whole, the old one kept.
            assert latest_checkpoint(out) == out / "step_2"
            assert load_checkpoint(store, out / "step_2") == {"global_step": 2}
            assert_same_state(after, store)
            assert (out / "step_1").is_dir()
        else:
            assert (out / ".step_2.tmp").is_dir() and not (out / "step_2").exists()
            assert latest_checkpoint(out) == out / "step_1"
            assert load_checkpoint(store, out / "step_1") == {"global_step": 1}
            assert_same_state(before, store)
    # The next save clears what the crash left.
    out = children[0][1]
    save_checkpoint(before, out, 3, {}, keep_last_n=2)
    assert sorted(p.name for p in out.iterdir()) == ["step_1", "step_3"]


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_corrupted_or_truncated_files_are_refused(tmp_path):
    store = filled_store(seed=1)
    save_checkpoint(store, tmp_path, 1, TRAINER_STATE)
    path = save_checkpoint(store, tmp_path, 2, TRAINER_STATE)
    tile = path / "tiles" / "layers.1.safetensors"
    original = tile.read_bytes()

    _flip_byte(tile, len(original) - 100)  # inside exp_avg_sq
    with pytest.raises(CheckpointError, match="layers.1.safetensors: checksum mismatch in section exp_avg_sq"):
        load_checkpoint(filled_store(seed=2), path)

    tile.write_bytes(original)
    _flip_byte(tile, 20)  # inside the header
    with pytest.raises(CheckpointError, match="layers.1.safetensors: header checksum mismatch"):
        load_checkpoint(filled_store(seed=2), path)

    tile.write_bytes(original[:-64])
    with pytest.raises(CheckpointError, match="layers.1.safetensors has .* bytes, the manifest says"):
        load_checkpoint(filled_store(seed=2), path)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"  # an incomplete one is skipped

    tile.write_bytes(original)
    _flip_byte(path / "trainer_state.json", 5)
    with pytest.raises(CheckpointError, match="trainer_state.json: checksum mismatch"):
        load_checkpoint(filled_store(seed=2), path)

    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(filled_store(seed=2), path)
    with pytest.raises(CheckpointError, match="step_1"):  # an output dir: says which checkpoints it holds
        load_checkpoint(filled_store(seed=2), tmp_path)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    path = save_checkpoint(filled_store(seed=1), tmp_path, 1, {})
    with pytest.raises(CheckpointError, match=r"mlp.up_proj.weight.*\[48, 32\].*\[40, 32\]"):
        load_checkpoint(filled_store(seed=1, inter=40), path)
    with pytest.raises(CheckpointError, match="written for another model"):
        load_checkpoint(filled_store(seed=1, layers=3), path)


def test_non_json_trainer_state_fails_before_writing(tmp_path):
    with pytest.raises(TypeError):
        save_checkpoint(filled_store(seed=1), tmp_path, 1, {"rng": torch.get_rng_state()})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
