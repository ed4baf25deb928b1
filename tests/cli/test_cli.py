"""The `megatrain` command as a user runs it: a subprocess, its stdout/stderr and exit code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain_cli import __version__

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
SHIPPED = sorted(p.stem for p in RECIPES.glob("*.yaml"))


def megatrain(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain_cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_commands():
    p = megatrain("--help")
    assert p.returncode == 0, p.stderr
    for cmd in ("train", "bench", "eval", "export", "plot", "recipes"):
        assert re.search(rf"^\W*{cmd}\b", p.stdout, re.M), (cmd, p.stdout)


def test_version():
    p = megatrain("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"megatrain {__version__}"


def test_train_help_documents_recipe_keys():
    p = megatrain("train", "--help")
    assert p.returncode == 0, p.stderr
    assert "--dry-run" in p.stdout and "train.lr" in p.stdout and "checkpoint.resume" in p.stdout


def test_recipes_ls_lists_every_shipped_recipe():
    p = megatrain("recipes", "ls")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == SHIPPED
    for line in lines:
        name = line.split()[0]
        assert f"megatrain train recipes/{name}.yaml" in line, line


def test_recipes_cp_copies_byte_identically(tmp_path):
    dest = tmp_path / "mine.yaml"
    p = megatrain("recipes", "cp", "tiny", dest)
    assert p.returncode == 0, p.stderr
    assert dest.read_bytes() == (RECIPES / "tiny.yaml").read_bytes()
    # Into a directory: keeps the recipe's name.
    p = megatrain("recipes", "cp", "qwen7b.yaml", tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "qwen7b.yaml").read_bytes() == (RECIPES / "qwen7b.yaml").read_bytes()


def test_recipes_cp_unknown_name(tmp_path):
    p = megatrain("recipes", "cp", "qwen8b", tmp_path / "x.yaml")
    assert p.returncode != 0
    assert "qwen8b" in p.stderr
    for name in SHIPPED:
        assert name in p.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_train_unknown_key_suggests_near_miss():
    p = megatrain("train", "recipes/tiny.yaml", "train.lrr=1")
    assert p.returncode == 2
    assert "train.lrr" in p.stderr and "'train.lr'" in p.stderr
    assert "Traceback" not in p.stderr


def test_train_reports_all_problems_at_once():
    p = megatrain("train", "recipes/tiny.yaml", "train.lrr=1", "engine.devic=cpu")
    assert p.returncode == 2
    assert "train.lrr" in p.stderr and "engine.devic" in p.stderr


def test_train_missing_recipe_file(tmp_path):
    p = megatrain("train", tmp_path / "nope.yaml")
    assert p.returncode == 2
    assert "nope.yaml" in p.stderr and "Traceback" not in p.stderr


def test_dry_run_prints_plan_without_a_model():
    p = megatrain("train", "recipes/qwen14b.yaml", "--dry-run", "model.path=null", "model.preset=14b",
                  "train.master_weights=fp32", "train.master_rounding=nearest", "train.optimizer_state=fp32")
    # The exit code is the verdict for this machine: 0 fits, 3 will not fit (~200 GiB of host state).
    verdict = p.stdout.split("verdict for this machine: ", 1)[1]
    assert p.returncode == (0 if verdict.startswith("fits") else 3), (p.stdout[-2000:], p.stderr)
    assert "B/param" in p.stdout
    # The resolved recipe comes first, then the host total: fp32 master + 2 fp32 moments + bf16 grads = 14 B/param.
    assert "preset: 14b" in p.stdout
    host = p.stdout.split("host, pageable", 1)[1]
    m = re.search(r"total\s+([\d.]+) GiB\s+([\d.]+) B/param", host)
    assert m, p.stdout
    assert float(m.group(2)) == pytest.approx(14.0, abs=0.01)
    assert 150 < float(m.group(1)) < 250  # ~14.8 B params x 14 B
    assert "memory plan for 14." in p.stdout


def test_dry_run_output_is_a_loadable_recipe(tmp_path):
    from megatrain_cli.recipe import load_recipe

    p = megatrain("train", "recipes/tiny.yaml", "--dry-run", "train.steps=3")
    assert p.returncode == 0, p.stderr
    resolved = p.stdout.split("# resolved recipe\n", 1)[1].split("\nmemory plan", 1)[0]
    (tmp_path / "r.yaml").write_text(resolved)
    assert load_recipe(tmp_path / "r.yaml") == load_recipe(RECIPES / "tiny.yaml", ["train.steps=3"])


def test_missing_model_path_exits_2_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    p = megatrain("train", "recipes/qwen7b.yaml", f"model.path={missing}", f"output_dir={tmp_path / 'out'}")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert str(missing) in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


def test_bench_cuda_without_gpu_fails_clearly():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    p = megatrain("bench", "--device", "cuda")
    assert p.returncode != 0
    assert "CUDA" in p.stderr and "--device cpu" in p.stderr
    assert "Traceback" not in p.stderr


def test_bench_that_does_not_fit_is_refused_before_allocating():
    # 72B x 14 bytes/param of host state: the plan is refused with its numbers, nothing is allocated.
    p = megatrain("bench", "--model", "72b", "--device", "cpu", "--steps", "1", "logging.dashboard='off'")
    assert p.returncode == 3, p.stderr[-2000:]
    assert "would not fit" in p.stderr and "host memory" in p.stderr and "GiB" in p.stderr
    assert "Traceback" not in p.stderr


def test_bench_unknown_preset():
    p = megatrain("bench", "--model", "9b", "--device", "cpu")
    assert p.returncode == 2
    assert "9b" in p.stderr and "tiny" in p.stderr


def test_train_device_cuda_without_gpu_exits_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    p = megatrain("train", "recipes/tiny.yaml", "engine.device=cuda", "train.steps=1", "train.seq_len=64",
                  f"output_dir={tmp_path}")
    assert p.returncode == 2
    assert "cuda" in p.stderr.lower() and "Traceback" not in p.stderr


def test_eval_missing_model_dir(tmp_path):
    p = megatrain("eval", "--model", tmp_path / "nothing")
    assert p.returncode == 2
    assert "nothing" in p.stderr


def test_export_missing_checkpoint(tmp_path):
    p = megatrain("export", tmp_path / "step_9", tmp_path / "out")
    assert p.returncode == 2
    assert "step_9" in p.stderr


def test_export_of_a_directory_without_checkpoints(tmp_path):
    p = megatrain("export", tmp_path, tmp_path / "out")
    assert p.returncode == 2
    assert "neither a complete checkpoint" in p.stderr and "Traceback" not in p.stderr


def test_bench_long_context_layers_prints_the_measured_run_and_the_extrapolation():
    p = megatrain("bench", "--model", "tiny", "--device", "cpu", "--seq", "256", "--batch", "1", "--steps", "1",
                  "engine.long_context_min_seq=256", "model.dtype=fp32", "--layers", "2")
    assert p.returncode == 0, p.stderr[-2000:]
    table, notes, *extrapolation = p.stdout.strip().splitlines()[1:]
    assert table.startswith("long-ctx   tiny[2 of 4 layers] 1x256") and notes.startswith("notes: interval 1")
    assert extrapolation[0].startswith("extrapolated to 4 layers (NOT measured: 2 of 4 layers ran): step(L) = ")
    assert "planned peak" in extrapolation[-1] and "for 4 layers" in extrapolation[-1]
    # The per-layer progress went to stderr as each layer finished.
    assert "[bench-long] step 0 layer 1 forward" in p.stderr and "[bench-long] step 0 layer 0 recompute + backward" \
        in p.stderr and "the whole 4-layer model's plan (computed, not run)" in p.stderr
