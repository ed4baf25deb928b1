"""Validation during training: which held-out rows, and when (the pass itself: engine/validate.py).

The rows are the first `eval.val_batches` micro-batches of the held-out split (the data's test split,
the one the exact-match eval scores), tokenised and packed as training rows are, in their stored order:
the same rows at every pass, so the values of one run compare with each other. They are built once,
before the host store (a data problem costs nothing big), and held as token ids: eval.val_batches x
micro_batch_size x seq_len x 3 int64 (ids, labels, positions) of host memory.
"""

from __future__ import annotations

import math

import torch

from megatrain_cli.batch import MicroBatch
from megatrain_cli.data import build_train_data
from megatrain_cli.recipe import Recipe
from megatrain_cli.train.errors import TrainingError


class HeldOut:
    """The held-out micro-batches of this process and the steps at which they are scored."""

    def __init__(self, micro_batches: list[MicroBatch], every: int, group: int):
        self.micro_batches, self.every, self.group = micro_batches, every, group

    @classmethod
    def build(cls, r: Recipe, test_examples: list, tokenizer, dist=None) -> "HeldOut | None":
        """None when eval.every_n_steps is null. Refused (exit 2) when the held-out split is empty or the
        settings are out of range. `dist`: this rank keeps its share, the same count on every rank."""
        ev, t = r.eval, r.train
        if ev.every_n_steps is None:
            return None
        if not test_examples:
            raise TrainingError(f"eval.every_n_steps={ev.every_n_steps} needs held-out rows, but the test split of "
                                f"{r.data.source} is empty: set data.test_fraction above 0 or data.test_source, or "
                                f"eval.every_n_steps=null", 2)
        rows = build_train_data(test_examples, tokenizer, r.data, t.seq_len, t.seed)
        mbs = held_out_micro_batches(rows, t.micro_batch_size, ev.val_batches)
        world = dist.world if dist is not None else 1
        if world > 1:
            if len(mbs) < world:
                raise TrainingError(f"the held-out split makes {len(mbs)} micro-batch(es) of "
                                    f"train.micro_batch_size={t.micro_batch_size}, fewer than the {world} ranks "
                                    f"that share them: raise data.test_fraction or lower train.micro_batch_size", 2)
            mbs = mbs[:len(mbs) - len(mbs) % world][dist.rank::world]  # the same count on every rank
        # A pass holds as many micro-batches as a step's forward (this rank's share of grad_accum).
        group = max(1, math.ceil(t.grad_accum / world))
        return cls(mbs, ev.every_n_steps, group)

    @property
    def rows(self) -> int:
        """Held-out rows of this process."""
        return sum(mb.input_ids.shape[0] for mb in self.micro_batches)

    def due(self, step: int, total: int) -> bool:
        return due(self.every, step, total)

    def loss(self, engine) -> float:
        """The validation loss now (every rank calls it at the same step: the pass has collectives)."""
        from megatrain_cli.engine.validate import validation_loss

        value, _ = validation_loss(engine, self.micro_batches, group=self.group)
        return value


def due(every: int | None, step: int, total: int) -> bool:
    """A held-out pass after step `step` (1-based) of `total`: every `every` steps, and after the last (never
    when `every` is None)."""
    return every is not None and (step % every == 0 or step == total)


def held_out_micro_batches(rows, micro_batch_size: int, count: int) -> list[MicroBatch]:
    """The first `count` micro-batches of `rows` (data.TrainData) in their stored order; the last one
    shorter when the rows run out, fewer micro-batches when they do sooner."""
    wanted = min(rows.num_rows, micro_batch_size * count)
    out = []
    for lo in range(0, wanted, micro_batch_size):
        ids, labels, pos = zip(*(rows.build_row(i) for i in range(lo, min(lo + micro_batch_size, wanted))))
        out.append(MicroBatch(torch.stack(ids), torch.stack(labels), torch.stack(pos)))
    return out
