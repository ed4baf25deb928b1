"""`megatrain bench train.method=grpo` on the CPU (tiny preset): the rollout row and the training row, each with
the step's split, as the lead runs it at 7B on the GPU (recipes/grpo-7b.yaml)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from megatrain_cli.cli import app


def test_the_grpo_bench_prints_rollout_and_train_speed_and_the_split(tmp_path):
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "--device", "cpu", "model.preset=tiny", "model.dtype=fp32",
                                   "train.method=grpo", "train.micro_batch_size=4", "train.grad_accum=2",
                                   "train.seq_len=48", "grpo.num_generations=4", "grpo.max_new_tokens=16",
                                   "--steps", "2", "--output", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    rows = rows if isinstance(rows, list) else rows["results"]
    rollout, train = rows
    assert (rollout["name"], rollout["batch"], rollout["seq"]) == ("rollout", 8, 16)
    assert (train["name"], train["batch"], train["seq"]) == ("grpo train", 8, 48)  # 32 prompt + 16 new tokens
    for row in rows:
        assert set(row["split"]) == {"generate", "score", "train"} and row["tokens_per_s"] > 0
    # no end token stops a bench completion: 8 x 16 tokens a step (a trailing id 0 may be cut as padding)
    assert rollout["tokens_per_s"] * rollout["step_time_s"] == pytest.approx(128, rel=0.05)
    assert "GRPO step" in rollout["notes"] and "2 prompts x 4 completions of 16 new tokens" in rollout["notes"]
