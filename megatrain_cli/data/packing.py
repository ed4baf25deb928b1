"""Packing examples into rows of at most `seq_len` tokens (best-fit decreasing).

Each example goes, longest first, into the row whose free space fits it most tightly. Free space is
an integer below seq_len, so rows are kept in buckets by free space and a sorted list of the
non-empty bucket sizes is searched with bisect: O(n log seq_len), fast for millions of examples.
The result depends only on the lengths, so the same data always packs the same way.
"""

from __future__ import annotations

import bisect


def pack_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Rows of example indices; every example appears once and no row sums to more than seq_len."""
    too_long = [i for i, n in enumerate(lengths) if n > seq_len or n < 1]
    if too_long:
        raise ValueError(f"example {too_long[0]} has length {lengths[too_long[0]]}, not in [1, {seq_len}]")
    rows: list[list[int]] = []
    free_sizes: list[int] = []  # sorted, distinct, each with a non-empty bucket
    buckets: dict[int, list[int]] = {}  # free space -> rows with exactly that much free
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        k = bisect.bisect_left(free_sizes, n)
        if k < len(free_sizes):
            free = free_sizes[k]
            row = buckets[free].pop()
            if not buckets[free]:
                del buckets[free]
                free_sizes.pop(k)
        else:
            free, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(i)
        left = free - n
        if left > 0:
            if left not in buckets:
                bisect.insort(free_sizes, left)
                buckets[left] = []
            buckets[left].append(row)
    return rows
