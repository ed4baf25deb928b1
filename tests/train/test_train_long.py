"""`megatrain train` on the long-context path (issue #9), on the tiny preset (CPU).

The trainer takes the path from train.seq_len >= LONG_CONTEXT_MIN_SEQ (32768). A 32K-token step of the
tiny model takes about a minute on two CPU cores, so the training tests lower the threshold with
engine.long_context_min_seq and train 4096-token rows; the dry runs plan at 32K and up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain_cli.recipe import load_recipe
from megatrain_cli.engine.plan.step_plan import plan_step
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.train.loop import run_training
from megatrain_cli.train.setup import model_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.yaml"
SEQ = 4096  # the training tests' seq_len, and their long-context threshold
# One document per row; 3 micro-batches of one row: 12288 tokens of
# checkpoints and layer graphs in the plan; each micro-batch (4096 tokens) is below one 8192-token MLP chunk,
# so the MLP runs unchunked, and the plan says so.
LONG = ["train.steps=1", f"train.seq_len={SEQ}", "train.micro_batch_size=1", "train.grad_accum=3",
        "data.packing=false", "logging.dashboard=plain", "logging.every_n_steps=1", "train.warmup_steps=0",
        "eval.enabled=false", "checkpoint.every_n_steps=1", "checkpoint.export_final=true"]


def recipe(out: Path, *extra: str):
    return load_recipe(TINY, [*LONG, f"output_dir={out}", *extra])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def megatrain(*args):
    return subprocess.run([sys.executable, "-m", "megatrain_cli", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def offloading_budget(out: Path) -> tuple[int, object]:
    """An engine.max_gpu_mem (bytes) whose plan fits only by offloading checkpoints to host memory, and
    that plan: scanned down from the peak of the plan that offloads nothing, 1 MiB at a time."""
    from megatrain_cli.models.tokenizer import load_tokenizer

    r = recipe(out)
    config = model_config(r, load_tokenizer(r.model))

    def plan(budget: int):
        with_budget = dataclasses.replace(r, engine=dataclasses.replace(r.engine, max_gpu_mem=f"{budget}B"))
        with_budget.engine.long_context_min_seq = SEQ
        return plan_step(with_budget, ModelAdapter(config), torch.device("cpu")).lean

    budget = int(plan(64 * 2**30).predicted_peak / 0.95) + 2**20
    for _ in range(512):
        p = plan(budget)
        if p.offloaded_checkpoints and p.fits:
            return budget, p
        budget -= 2**20
    raise AssertionError("no budget makes the tiny plan offload")


# ---------------------------------------------------------------- dry run
def test_dry_run_prints_the_long_context_plan():
    p = megatrain("train", TINY, "--dry-run", "train.seq_len=32768", "engine.max_gpu_mem=24GiB",
                  "train.micro_batch_size=1")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "path: long-context engine (train.seq_len 32768 >= 32768)" in out
    assert "long-context plan: 1 x 32768 tokens; device budget   24.00 GiB" in out
    assert "predicted device peak" in out and "fits" in out
    assert out.index("memory plan for") < out.index("path: long-context") < out.index("long-context plan:")


def test_dry_run_short_context_names_its_path(capsys):
    assert run_training(load_recipe(TINY), dry_run=True) == 0
    out = capsys.readouterr().out
    assert "path: short-context engine (train.seq_len 256 < 32768" in out
    assert "long-context plan" not in out


def test_dry_run_reports_a_plan_that_does_not_fit(capsys):
    r = load_recipe(TINY, ["train.seq_len=524288", "train.micro_batch_size=1", "data.packing=false",
                           "engine.max_gpu_mem=2GiB"])
    assert run_training(r, dry_run=True) == 3  # the verdict is the exit code
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "would not fit: predicted device peak" in out
    assert "verdict for this machine: will not fit:" in out


def test_dry_run_for_cuda_without_a_budget_asks_for_max_gpu_mem(capsys):
    if torch.cuda.is_available():
        pytest.skip("plans from the GPU's own memory")
    r = load_recipe(TINY, ["train.seq_len=32768", "train.micro_batch_size=1", "engine.device=cuda"])
    assert run_training(r, dry_run=True) == 2
    assert "engine.max_gpu_mem" in capsys.readouterr().err


# ---------------------------------------------------------------- packed rows
@pytest.mark.parametrize("extra,planned", [
    (["train.seq_len=131072", "train.micro_batch_size=1"], "1 x 131072 tokens"),
    # 8 rows of 32K: a dense block-causal mask would be 8 GiB; packed rows build none (models/attention.py).
    (["train.seq_len=32768"], "8 x 32768 tokens"),
], ids=["128K", "8x32K"])
def test_packed_rows_at_long_context_are_planned(capsys, extra, planned):
    """Issue #31: packed rows take the long-context path like one document per row (they were refused
    for their [T, T] mask)."""
    r = load_recipe(TINY, [*extra, "data.packing=true", "engine.max_gpu_mem=24GiB"])
    assert run_training(r, dry_run=True) == 0
    out = capsys.readouterr()
    assert f"long-context plan: {planned}" in out.out and "data.packing=false" not in out.out + out.err


def test_unpacked_rows_beyond_the_limit_are_planned(capsys):
    r = load_recipe(TINY, ["train.seq_len=131072", "train.micro_batch_size=1", "data.packing=false",
                           "engine.max_gpu_mem=24GiB"])
    assert run_training(r, dry_run=True) == 0
    assert "long-context plan: 1 x 131072 tokens" in capsys.readouterr().out


# ---------------------------------------------------------------- training
@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """One step on the long-context path with a device budget that makes it offload checkpoints:
    (output dir, the plan, the engine that ran, what the dashboard printed)."""
    from megatrain_cli.engine import step as engine_step

    out = tmp_path_factory.mktemp("long") / "run"
    budget, plan = offloading_budget(out)
    engines = []
    real_step = engine_step.Engine.step

    def spy(self, *a, **kw):
        engines.append(self)
        return real_step(self, *a, **kw)

    log = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(log):
        mp.setattr(engine_step.Engine, "step", spy)
        code = run_training(recipe(out, f"engine.max_gpu_mem={budget}B", f"engine.long_context_min_seq={SEQ}"))
    assert code == 0, log.getvalue()
    return out, plan, engines[0], log.getvalue()


def test_long_context_step_offloads_and_writes_checkpoint_and_final(long_run):
    out, plan, engine, log = long_run
    assert plan.mlp_chunk_tokens is None and plan.checkpoint_interval == 1 and plan.offloaded_checkpoints >= 1
    assert f"long-context path: {plan.offloaded_checkpoints} of 4 checkpoints in host memory" in log
    assert engine.plan.lean.offloaded_checkpoints == plan.offloaded_checkpoints
    assert engine.interval == 1 and engine.keep_blocks == frozenset()  # the recipe's interval is 2
    assert engine.chunk == plan.loss_chunk_tokens
    # Every offloaded checkpoint went out and came back, for each of the 3 micro-batches (fp32, hidden 128).
    moved = plan.offloaded_checkpoints * 3 * SEQ * 128 * 4
    assert engine.offloader.d2h_bytes == engine.offloader.h2d_bytes == moved

    assert sorted(p.name for p in out.glob("step_*")) == ["step_1"]
    assert (out / "final" / "config.json").is_file() and (out / "final" / "model.safetensors").is_file()
    m = metrics(out)
    assert [x["step"] for x in m] == [1] and all(torch.isfinite(torch.tensor(x["loss"])) for x in m)


def test_long_context_step_matches_the_short_context_engine(long_run, tmp_path):
    """The same step on the short-context engine (the default threshold): the same loss and gradient."""
    out = long_run[0]
    short = tmp_path / "short"
    assert run_training(recipe(short)) == 0
    a, b = metrics(out)[0], metrics(short)[0]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_long_context_that_does_not_fit_exits_3(tmp_path, capsys):
    out = tmp_path / "nofit"
    r = recipe(out, "engine.max_gpu_mem=64MiB")  # under one layer graph of the 3 x 4096 tokens (~0.15 GiB)
    assert run_training(dataclasses.replace(r, engine=dataclasses.replace(r.engine, long_context_min_seq=SEQ))) == 3
    err = capsys.readouterr().err
    assert "would not fit" in err and "long context: predicted device peak" in err and "--force" in err
    assert "device memory:" not in err  # the generic short-context estimate is not asked
    assert not (out / "step_1").exists()
