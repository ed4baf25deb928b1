"""Shared by the bad-input tests: the CLI in-process, snapshots of the user's files, the refusal check,
a tiny model folder (one shard and four) with a run's step_1 checkpoint, and a simulated cgroup limit."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from typer.testing import CliRunner

from megatrain_cli import machine
from megatrain_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "tiny.yaml"
GiB = 2**30


def megatrain(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def snapshot(*roots: Path) -> dict[str, bytes]:
    """Every file under `roots` with its bytes: what the user had."""
    files = {}
    for root in map(Path, roots):
        if root.is_file():
            files[str(root)] = root.read_bytes()
        elif root.is_dir():
            files.update({str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()})
    return files


def refused(result, code: int, *names: str) -> str:
    """The run exited `code` with an 'error:' message naming every one of `names`, and no traceback."""
    out = result.output
    assert result.exit_code == code, out
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in out and "error: " in out, out
    for name in names:
        assert name in out, (name, out)
    return out


def make_models(out: Path) -> Path:
    """In `out`: a tiny model folder as a run's final/ is (one/: one shard; sharded/: four and an index),
    and run/step_1, a training checkpoint of the same weights."""
    from megatrain_cli.checkpoint import export_hf, save_checkpoint
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer
    from megatrain_cli.recipe import load_recipe
    from megatrain_cli.train.setup import model_config

    tok = load_bundled_tokenizer()
    store = build_store(model_config(load_recipe(TINY), tok), torch.float32, seed=0)
    export_hf(store, out / "one", dtype=torch.float32, tokenizer=tok)
    export_hf(store, out / "sharded", dtype=torch.float32, tokenizer=tok, max_shard_bytes=1_000_000)
    save_checkpoint(store, out / "run", 1, {"step": 1}, tokenizer=tok)
    return out


def copy_model(models: Path, name: str, dest: Path) -> Path:
    return Path(shutil.copytree(models / name, dest))


def fake_cgroup(tmp_path: Path, monkeypatch, limit: int, version: int = 2) -> Path:
    """This process in a cgroup limited to `limit` bytes (v2 memory.max or v1 memory.limit_in_bytes)."""
    root = tmp_path / "cgroup"
    if version == 2:
        job = root / "job"
        job.mkdir(parents=True)
        (root / "cgroup.controllers").write_text("memory\n")
        (job / "memory.max").write_text(f"{limit}\n")
        (job / "memory.current").write_text("0\n")
        (tmp_path / "self_cgroup").write_text("0::/job\n")
        limit_file = job / "memory.max"
    else:
        job = root / "memory" / "job"
        job.mkdir(parents=True)
        (job / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (tmp_path / "self_cgroup").write_text("4:memory:/job\n")
        limit_file = job / "memory.limit_in_bytes"
    monkeypatch.setattr(machine, "CGROUP_ROOT", root)
    monkeypatch.setattr(machine, "PROC_SELF_CGROUP", tmp_path / "self_cgroup")
    return limit_file
