"""Mixing several datasets into one list of examples, in proportions set by weights.

Counts first, exactly: the mixture's size is shared out by the largest-remainder method, so each
dataset gets its weight's share to within one example, whatever the seed. Then which examples: each
dataset is drawn in a seeded random order without repeats, a new pass (a new order) only once every
example has been drawn, and the whole is shuffled with the same seeded generator, so an eval `limit` or
the train/test split takes every dataset in proportion. Without weights every example of every dataset
is used once. Same seed, same inputs: the same list. Costs one shuffle of the mixture.
"""

from __future__ import annotations

import math
import random

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.recipe.checks import parse_datasets as parse_entries


def parse_datasets(entries: list) -> list[tuple[str, float | None]]:
    """data.datasets as (name, weight or None), by the recipe's own rule (recipe/checks.py)."""
    problems: list[str] = []
    parsed = parse_entries(entries, problems)
    if problems:
        raise DataError("; ".join(problems))
    return parsed


def mix_counts(sizes: list[int], weights: list[float], total: int) -> list[int]:
    """Examples to take from each dataset: `total` shared in proportion to `weights` (largest remainder)."""
    quotas = [total * w / sum(weights) for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


def full_size(sizes: list[int], weights: list[float]) -> int:
    """The largest mixture that repeats no example: the first dataset to run out decides."""
    return min(math.floor(n * sum(weights) / w + 1e-9) for n, w in zip(sizes, weights))


def mix(groups: list[list[Example]], weights: list[float | None], seed: int, size: int | None = None,
        cap: int | None = None) -> list[Example]:
    """One list from `groups` (one list of examples per dataset), shares as `weights` say (all None: every
    example once), `size` examples in all (None: full_size), at most `cap`."""
    sizes = [len(g) for g in groups]
    if any(n == 0 for n in sizes):
        raise DataError(f"data.datasets: dataset {sizes.index(0)} has no examples")
    if weights[0] is None:
        if size is not None:
            raise DataError("data.mix_size: needs weights on data.datasets (without them every example is used)")
        weights, size = [float(n) for n in sizes], sum(sizes)
    total = size if size is not None else full_size(sizes, weights)
    if cap is not None:
        total = min(total, cap)
    rng = random.Random(f"megatrain-mix:{seed}")
    mixed: list[Example] = []
    for group, count in zip(groups, mix_counts(sizes, weights, total)):
        order: list[int] = []
        while len(order) < count:
            one_pass = list(range(len(group)))
            rng.shuffle(one_pass)
            order += one_pass
        mixed += [group[j] for j in order[:count]]
    rng.shuffle(mixed)
    return mixed
