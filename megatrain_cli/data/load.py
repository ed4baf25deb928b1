"""From a `DataConfig` to examples, and the seeded train/test split that training and eval share.

A source is a path / hub name / built-in (sources.py) read in `data.format` with `data.fields`, or a
registry entry (`registry:NAME`, registry.py) read in its own format and columns; `data.datasets` mixes
several registry entries (mixing.py). `data.system_prompt` then goes to every example without one.
"""

from __future__ import annotations

import dataclasses
import random

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.data.formats import records_to_examples
from megatrain_cli.data.mixing import mix, parse_datasets
from megatrain_cli.data.registry import DatasetSpec, registry_name, resolve
from megatrain_cli.data.sources import read_records
from megatrain_cli.recipe import DataConfig


def source_label(data_cfg: DataConfig) -> str:
    """How messages name the data: the source, or the mixture's datasets."""
    if data_cfg.datasets:
        return f"data.datasets [{', '.join(name for name, _ in parse_datasets(data_cfg.datasets))}]"
    return data_cfg.source


def load_examples(data_cfg: DataConfig, *, default_split: str = "train") -> list[Example]:
    """Every example of the data (the first `max_samples` of them when that is set)."""
    if data_cfg.datasets:
        parsed = parse_datasets(data_cfg.datasets)
        groups = [_load_spec(resolve(data_cfg.registry, name, f"data.datasets[{i}].name"), default_split, None)
                  for i, (name, _) in enumerate(parsed)]
        examples = mix(groups, [w for _, w in parsed], data_cfg.split_seed, data_cfg.mix_size, data_cfg.max_samples)
    elif registry_name(data_cfg.source) is not None:
        spec = resolve(data_cfg.registry, registry_name(data_cfg.source), "data.source")
        examples = _load_spec(spec, default_split, data_cfg.max_samples)
    else:
        records, label = read_records(data_cfg.source, data_cfg.split, default_split=default_split,
                                      max_records=data_cfg.max_samples)
        examples = records_to_examples(records, data_cfg.format, dict(data_cfg.fields or {}), label)
    return with_system_prompt(examples, data_cfg.system_prompt)


def _load_spec(spec: DatasetSpec, default_split: str, max_samples: int | None) -> list[Example]:
    limits = [n for n in (spec.max_samples, max_samples) if n is not None]
    records, label = read_records(spec.source, spec.split, default_split=default_split,
                                  max_records=min(limits) if limits else None)
    return records_to_examples(records, spec.format, dict(spec.fields), f"{label} (registry: {spec.name})")


def with_system_prompt(examples: list[Example], system_prompt: str | None) -> list[Example]:
    """`system_prompt` as the first turn of every example that has no system turn (copies, not edits: a
    mixture may hold one example twice)."""
    if not system_prompt:
        return examples
    system = {"role": "system", "content": system_prompt}
    return [ex if any(t["role"] == "system" for t in ex.history)
            else dataclasses.replace(ex, history=[system, *ex.history]) for ex in examples]


def split_examples(examples: list[Example], data_cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """(train, test): `data.test_source` as the test set, else a seeded random hold-out.

    The random split shuffles indices with `random.Random(split_seed)` and holds out
    round(n * test_fraction) of them (at least one when the fraction is positive and n > 1). Both
    halves keep the data set's order, so an eval `limit` takes the same examples every time.
    """
    if not examples:
        raise DataError(f"{source_label(data_cfg)}: no examples to split")
    if data_cfg.test_source:
        # The test set's own default split is 'test' (a hub / saved data set with splits); data.split
        # names the training split, so it does not carry over, nor does a mixture.
        test_cfg = dataclasses.replace(data_cfg, source=data_cfg.test_source, split=None, max_samples=None,
                                       datasets=[], mix_size=None)
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
