"""A gradient tile's squared norm, accumulated in fp64.

An fp32 `torch.dot(g, g)` loses the small squares once the running sum is large: on a real tied-embedding
gradient (29M elements, mostly tiny softmax terms) it runs 4.8e-5 low on the CPU, and the error grows with
the tile (a 7B embedding is 545M). fp32 norms of short rows, summed in fp64, still ran 2.7e-7 low on the
same gradient (the CPU reduces each row sequentially). So each chunk is cast to fp64 and dotted there:
exact to fp64 rounding on every device. Costs a cast copy of CHUNK elements at a time (32 MiB), about
7x the fp32 dot on the CPU (~1 ns per element) and one extra pass over the tile on the GPU.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 22


def squared_norm(flat: torch.Tensor) -> torch.Tensor:
    """sum(flat ** 2) as an fp64 0-d tensor on `flat`'s device (no host sync)."""
    flat = flat.reshape(-1)
    sq = torch.zeros((), dtype=torch.float64, device=flat.device)
    for lo in range(0, flat.numel(), CHUNK):
        part = flat[lo:lo + CHUNK].double()
        sq += torch.dot(part, part)
    return sq
