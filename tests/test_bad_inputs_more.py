"""More of `megatrain train`'s bad inputs (test_bad_inputs.py has the first ones): what used to be silently
wrong (exit 0 with a wrong result) or answered badly. Each: the exit code, the culprit named, no traceback,
the user's files byte-identical and nothing left behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers_bad_inputs import TINY, megatrain, refused

# A few short steps on the tiny preset: the runs below train for real.
SHORT = ["train.steps=4", "train.seq_len=64", "train.micro_batch_size=2", "logging.dashboard=off",
         "eval.enabled=false", "eval.every_n_steps=null", "train.warmup_steps=0"]


def train(tmp_path: Path, *overrides: str):
    return megatrain("train", TINY, f"output_dir={tmp_path / 'out'}", *SHORT, *overrides)


# ---------------------------------------------------------------- a diverged run (exit 1, no final/)
@pytest.mark.parametrize("limits,stopped_at,names", [
    ([], 3, ["train.max_skipped_fraction=0.5", "2 of the 3 steps so far skipped"]),
    (["train.max_skipped_fraction=1.0", "train.max_skipped_steps=2"], 4,
     ["train.max_skipped_steps=2", "3 steps in a row skipped"]),
], ids=["mostly-skipped", "in-a-row"])
def test_a_diverged_run_stops_and_exports_nothing(tmp_path, limits, stopped_at, names):
    """train.lr=1e30: step 1 sends the weights to ~1e29, every later step's loss is NaN and skipped."""
    out = refused(train(tmp_path, "train.lr=1e30", "train.max_grad_norm=null", "checkpoint.every_n_steps=1",
                        *limits), 1, f"step {stopped_at}: the run diverged", "train.nan_policy=skip", "train.lr",
                  *names)
    run = tmp_path / "out"
    assert f"(latest: {run / f'step_{stopped_at - 1}'})" in out and "without writing final/" in out
    assert not (run / "final").exists() and not (run / f"step_{stopped_at}").exists()
