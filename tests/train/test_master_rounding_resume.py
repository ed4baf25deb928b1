"""A resume under another train.master_rounding than its checkpoint's (bf16 masters): it works, and says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_resume_says_when_its_bf16_masters_round_otherwise_than_the_checkpoints(tmp_path):
    """train.master_rounding is in the trainer state; a resume under the other rounding works and says so (a
    checkpoint naming none was written under round to nearest, the default before stochastic)."""
    from megatrain_cli.train.resume import rounding_note

    assert rounding_note({"master_rounding": "stochastic"}, "bf16", "stochastic") is None
    assert rounding_note({}, "fp32", "stochastic") is None  # fp32 masters are not rounded
    assert rounding_note({}, "bf16", "stochastic") == (
        "note: the checkpoint's bf16 masters were rounded with train.master_rounding=nearest, this run rounds them "
        "stochastic; set train.master_rounding=nearest to continue as that run would")
    args = [sys.executable, "-m", "megatrain_cli", "train", str(ROOT / "recipes" / "tiny.yaml"), "model.dtype=bf16",
            "train.master_weights=bf16", "train.seq_len=64", "train.micro_batch_size=2", "eval.enabled=false",
            "logging.dashboard=off", "checkpoint.every_n_steps=1", "checkpoint.export_final=false",
            f"output_dir={tmp_path}"]
    first = subprocess.run([*args, "train.steps=1", "train.master_rounding=nearest"], capture_output=True, text=True,
                           cwd=ROOT, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    state = json.loads((tmp_path / "step_1" / "trainer_state.json").read_text())
    assert state["master_rounding"] == "nearest"
    second = subprocess.run([*args, "train.steps=2", "checkpoint.resume=auto"], capture_output=True, text=True,
                            cwd=ROOT, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert ("note: the checkpoint's bf16 masters were rounded with train.master_rounding=nearest, this run rounds "
            "them stochastic; set train.master_rounding=nearest to continue as that run would") in second.stderr
