"""From a `DataConfig` to examples, and the seeded train/test split that training and eval share."""

from __future__ import annotations

import dataclasses
import random

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.data.formats import records_to_examples
from megatrain_cli.data.sources import read_records
from megatrain_cli.recipe import DataConfig


def load_examples(data_cfg: DataConfig, *, default_split: str = "train") -> list[Example]:
    """Every example of `data_cfg.source` (the first `max_samples` of them when that is set)."""
    records, label = read_records(data_cfg.source, data_cfg.split, default_split=default_split,
                                  max_records=data_cfg.max_samples)
    return records_to_examples(records, data_cfg.format, dict(data_cfg.fields or {}), label)


def split_examples(examples: list[Example], data_cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """(train, test): `data.test_source` as the test set, else a seeded random hold-out.

    The random split shuffles indices with `random.Random(split_seed)` and holds out
    round(n * test_fraction) of them (at least one when the fraction is positive and n > 1). Both
    halves keep the data set's order, so an eval `limit` takes the same examples every time.
    """
    if not examples:
        raise DataError(f"{data_cfg.source}: no examples to split")
    if data_cfg.test_source:
        # The test set's own default split is 'test' (a hub / saved data set with splits); data.split
        # names the training split, so it does not carry over.
        test_cfg = dataclasses.replace(data_cfg, source=data_cfg.test_source, split=None, max_samples=None)
        return list(examples), load_examples(test_cfg, default_split="test")
    fraction = data_cfg.test_fraction
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"data.test_fraction must be in [0, 1), got {fraction}")
    n = len(examples)
    n_test = round(n * fraction)
    if fraction > 0 and n > 1:
        n_test = min(max(n_test, 1), n - 1)  # never an empty side when a split was asked for
    order = list(range(n))
    random.Random(data_cfg.split_seed).shuffle(order)
    test_idx = set(order[:n_test])
    train = [ex for i, ex in enumerate(examples) if i not in test_idx]
    test = [ex for i, ex in enumerate(examples) if i in test_idx]
    return train, test
