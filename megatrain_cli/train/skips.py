"""Skipped steps (a non-finite loss or gradient, train.nan_policy=skip) counted, and a run that diverged stopped.

A step is skipped when its loss or gradient norm is not finite: no update, the run goes on. A few in a long
run are noise; a run whose steps are mostly skipped has diverged (train.lr=1e30: the one finite step sends
the weights to 1e29, every later one is NaN), and finishing it would export a broken model as final/ with
exit 0. So after every step: more than train.max_skipped_fraction of the steps so far skipped, or more than
train.max_skipped_steps in a row, stops the run with exit 1 before any further checkpoint or export.
Costs: two integers a step.
"""

from __future__ import annotations

from pathlib import Path

from megatrain_cli.recipe import Recipe
from megatrain_cli.train.errors import TrainingError


class SkipCount:
    def __init__(self, r: Recipe, out: Path, skipped: int = 0):
        self.train, self.out = r.train, out
        self.skipped = skipped  # in the whole run, resumed ones included (the checkpoint's skipped_steps)
        self.in_a_row = 0

    def count(self, step: int, skipped: bool, loss: float, grad_norm: float) -> None:
        """After step `step` (0-based): count it, and raise when the run has diverged (train.nan_policy=stop
        raises at the first skipped step)."""
        t = self.train
        if not skipped:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        if t.nan_policy == "stop":
            raise TrainingError(f"step {step + 1}: loss {loss} / gradient norm {grad_norm} is not finite "
                                f"(train.nan_policy=stop); the last checkpoint is intact", 1)
        done = step + 1
        if self.skipped > t.max_skipped_fraction * done:
            why = (f"{self.skipped} of the {done} steps so far skipped, more than train.max_skipped_fraction="
                   f"{t.max_skipped_fraction}")
        elif t.max_skipped_steps is not None and self.in_a_row > t.max_skipped_steps:
            why = f"{self.in_a_row} steps in a row skipped, more than train.max_skipped_steps={t.max_skipped_steps}"
        else:
            return
        from megatrain_cli.checkpoint import latest_checkpoint

        last = latest_checkpoint(self.out)
        kept = f"the checkpoints written so far are kept (latest: {last})" if last else "no checkpoint was written"
        raise TrainingError(
            f"step {step + 1}: the run diverged: {why} (train.nan_policy=skip skips a step whose loss or gradient "
            f"norm is not finite; this one's loss {loss}, gradient norm {grad_norm}). Stopped without writing "
            f"final/; {kept}. Lower train.lr (now {t.lr:g}) or check the data and the model's config.json", 1)
