"""Faults of one training process (issue #19), each ending in a documented exit code, a message naming
what happened, and nothing lost: the lock on output_dir, preemption (SIGUSR1, train.max_wall_time), a full
disk at a checkpoint, resume refusals and fallbacks, the resumable end of a run, metrics.jsonl on resume.

Tiny preset, in process, a few steps each; `straight` is the uninterrupted run every resume is compared
with, file by file (bit-exact: tiles, trainer state, manifest).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain_cli.recipe import load_recipe
from megatrain_cli.train.loop import run_training

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.yaml"
FAST = ["train.steps=4", "train.seq_len=64", "train.micro_batch_size=2", "logging.dashboard=off",
        "logging.every_n_steps=1", "checkpoint.export_final=false", "train.warmup_steps=1", "eval.enabled=false"]


def recipe(out: Path, *extra: str):
    return load_recipe(TINY, [*FAST, f"output_dir={out}", *extra])


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Byte-identical: every tile (masters, moments, step counts), the trainer state (data position), the manifest."""
    sa, sb = snapshot(a), snapshot(b)
    assert sa.keys() == sb.keys()
    for rel in sa:
        assert sa[rel] == sb[rel], rel


def on_step(monkeypatch, n: int, action) -> None:
    """Run `action` right after the n-th engine step (1-based) of this process."""
    from megatrain_cli.engine import step as engine_step

    real, calls = engine_step.Engine.step, {"n": 0}

    def step(self, *a, **kw):
        res = real(self, *a, **kw)
        calls["n"] += 1
        if calls["n"] == n:
            action()
        return res

    monkeypatch.setattr(engine_step.Engine, "step", step)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """4 steps, a checkpoint after every one, all kept."""
    out = tmp_path_factory.mktemp("straight")
    assert run_training(recipe(out, "checkpoint.every_n_steps=1", "checkpoint.keep_last_n=4")) == 0
    return out


# ---------------------------------------------------------------- the lock on output_dir
def test_a_second_writer_is_refused_naming_the_holder(straight, tmp_path, capsys):
    from megatrain_cli.train.lock import OutputLock

    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = snapshot(out)
    with OutputLock(out):
        assert run_training(recipe(out, "checkpoint.resume=auto", "train.steps=6")) == 2
    err = capsys.readouterr().err
    assert f"is in use by another megatrain run (pid {os.getpid()} on host " in err and "Traceback" not in err
    assert snapshot(out) == before  # nothing written, nothing deleted, the lock file gone with its holder


def test_a_stale_lock_after_a_crash_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    crash = ("import os, signal, sys\nfrom megatrain_cli.train.lock import OutputLock\n"
             "OutputLock(sys.argv[1]).acquire()\nos.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", crash, str(out)], cwd=ROOT, timeout=60)
    assert p.returncode == -signal.SIGKILL and (out / ".megatrain.lock").is_file()
    dead = json.loads((out / ".megatrain.lock").read_text())["pid"]
    assert run_training(recipe(out, "train.steps=1")) == 0
    err = capsys.readouterr().err
    assert f"ended without releasing it (pid {dead} on host" in err and "taking it over" in err
    assert not (out / ".megatrain.lock").exists() and (out / "step_1").is_dir()


# ---------------------------------------------------------------- preemption: SIGUSR1, train.max_wall_time
def test_sigusr1_checkpoints_exits_75_and_resume_is_bit_exact_logging_each_step_once(straight, tmp_path,
                                                                                      monkeypatch):
    out = tmp_path / "run"
    on_step(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    assert run_training(recipe(out, "checkpoint.every_n_steps=3")) == 75
    monkeypatch.undo()
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2"] and steps_logged(out) == [1, 2]
    assert_same_checkpoint(straight / "step_2", out / "step_2")
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the loop's handlers are gone with it
    # A kill after step 3 was logged but before its checkpoint, mid-line: the resume redoes step 3.
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": 0.0}) + "\n" + '{"step": 4, "lo')
    assert run_training(recipe(out, "checkpoint.resume=auto", "checkpoint.every_n_steps=3")) == 0
    assert steps_logged(out) == [1, 2, 3, 4]
    loss = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert loss == [json.loads(line)["loss"] for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert_same_checkpoint(straight / "step_4", out / "step_4")


def test_max_wall_time_checkpoints_exits_75_and_resume_is_bit_exact(straight, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    on_step(monkeypatch, 1, lambda: time.sleep(1.0))  # the first step ends past the 1 s limit
    assert run_training(recipe(out, "train.max_wall_time=1s")) == 75
    monkeypatch.undo()
    assert "stopped by train.max_wall_time (1s) reached after step 1" in capsys.readouterr().err
    assert sorted(p.name for p in out.glob("step_*")) == ["step_1"]
    assert_same_checkpoint(straight / "step_1", out / "step_1")
    assert run_training(recipe(out, "checkpoint.resume=auto", "train.max_wall_time=1h")) == 0
    assert_same_checkpoint(straight / "step_4", out / "step_4")


# ---------------------------------------------------------------- a full disk at a checkpoint
def fake_free_space(monkeypatch, out: Path, after: str, free: int) -> None:
    """shutil.disk_usage reports `free` bytes once out/after exists, plenty before."""
    real = shutil.disk_usage

    def disk_usage(path):
        u = real(path)
        return u._replace(free=free) if (out / after).exists() else u

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_not_enough_space_for_a_checkpoint_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    fake_free_space(monkeypatch, out, "step_1", 5 << 20)
    assert run_training(recipe(out, "train.steps=2", "checkpoint.every_n_steps=1")) == 1
    err = capsys.readouterr().err
    assert "not enough free space to write step_2" in err and "5.0 MiB are free" in err and "it needs" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".step", "step"))) == ["step_1"]
    from megatrain_cli.checkpoint import latest_checkpoint

    assert latest_checkpoint(out) == out / "step_1"  # the previous one intact


def test_disk_full_mid_write_removes_the_partial_folder(straight, tmp_path, monkeypatch, capsys):
    from megatrain_cli.checkpoint import layout

    out = tmp_path / "run"
    real = layout.write_all

    def write_all(f, data, crc=0):
        if ".step_2.tmp" in f.name and "layers.0" in f.name:  # the embedding's file is already written
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, data, crc)

    monkeypatch.setattr(layout, "write_all", write_all)
    assert run_training(recipe(out, "train.steps=2", "checkpoint.every_n_steps=1")) == 1
    err = capsys.readouterr().err
    assert "writing step_2 in" in err and "(the disk is full)" in err and "free; it needs" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".step", "step"))) == ["step_1"]
    assert_same_checkpoint(straight / "step_1", out / "step_1")


@pytest.mark.parametrize("fault", [KeyboardInterrupt, RuntimeError])
def test_any_failure_mid_write_removes_the_temp_folder(tmp_path, monkeypatch, fault):
    from megatrain_cli.checkpoint import layout, save_checkpoint
    from tests.helpers_checkpoint import filled_store

    store = filled_store(seed=1)
    save_checkpoint(store, tmp_path, 1, {})
    before = snapshot(tmp_path)

    def hook(kind, detail):
        if kind == "tile_written" and detail == "layers.0":
            raise fault("mid-write")

    monkeypatch.setattr(layout, "event_hook", hook)
    with pytest.raises(fault):
        save_checkpoint(store, tmp_path, 2, {})
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_a_real_full_file_system_refuses_the_checkpoint(tmp_path, capsys):
    """A 50 MiB tmpfs: the first checkpoint (10 MiB + room for side files) fits, the second does not."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=50m", "tmpfs", str(mnt)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.decode().strip()}")
    try:
        out = mnt / "run"
        assert run_training(recipe(out, "train.steps=2", "checkpoint.every_n_steps=1")) == 1
        err = capsys.readouterr().err
        assert "not enough free space to write step_2" in err and "Traceback" not in err
        assert sorted(p.name for p in out.iterdir() if p.name.startswith((".step", "step"))) == ["step_1"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# ---------------------------------------------------------------- resume: refusals, fallbacks, the run's end
def test_resume_with_steps_below_the_checkpoint_is_refused(straight, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = snapshot(out)
    assert run_training(recipe(out, "checkpoint.resume=auto", "train.steps=2")) == 2
    err = capsys.readouterr().err
    assert "step_4 is at step 4, past the run's last step 2 (train.steps=2)" in err and "Traceback" not in err
    assert snapshot(out) == before  # no mislabelled step_2 written, step_4 not rotated away


def test_auto_resume_says_which_checkpoints_are_damaged_and_where_it_resumes(straight, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    for n in (2, 3, 4):
        shutil.copytree(straight / f"step_{n}", out / f"step_{n}")
    tile = out / "step_4" / "tiles" / "layers.1.safetensors"
    tile.write_bytes(tile.read_bytes()[:-64])  # truncated: found by the file sizes
    tile = out / "step_3" / "tiles" / "layers.0.safetensors"
    data = bytearray(tile.read_bytes())
    data[-100] ^= 0xFF  # a flipped byte: found when read
    tile.write_bytes(bytes(data))
    assert run_training(recipe(out, "checkpoint.resume=auto", "checkpoint.every_n_steps=1")) == 0
    err = capsys.readouterr().err
    assert "checkpoint.resume=auto: step_4 is damaged (tiles/layers.1.safetensors has" in err
    assert "checkpoint.resume=auto: step_3 is damaged (layers.0.safetensors: checksum mismatch in section" in err
    assert f"resumed from {out / 'step_2'} at step 2" in err
    assert_same_checkpoint(straight / "step_4", out / "step_4")  # retrained and rewritten


def test_auto_resume_with_every_checkpoint_damaged_is_refused(straight, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(straight / "step_2", out / "step_2")
    (out / "step_2" / "manifest.json").unlink()
    assert run_training(recipe(out, "checkpoint.resume=auto")) == 2
    err = capsys.readouterr().err
    assert "no usable checkpoint in" in err and "step_2: no manifest.json: not a complete checkpoint" in err
    assert sorted(p.name for p in out.iterdir()) == ["step_2"]  # not silently started over


def test_without_periodic_checkpoints_the_end_is_resumable_and_exportable(tmp_path):
    from megatrain_cli.checkpoint import export_checkpoint, latest_checkpoint

    out = tmp_path / "run"
    assert run_training(recipe(out, "train.steps=2", "checkpoint.every_n_steps=null")) == 0
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2"] and latest_checkpoint(out) == out / "step_2"
    export_checkpoint(out, tmp_path / "hf")  # `megatrain export OUTPUT_DIR DIR` reads it
    assert (tmp_path / "hf" / "model.safetensors").is_file()
