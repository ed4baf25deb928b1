"""A gradient tile's squared norm, accumulated in fp64.

An fp32 `torch.dot(g, g)` loses the small squares once the running sum is large: on a real tied-embedding
gradient (29M elements, mostly tiny softmax terms) it ran 4.8e-5 low on the CPU, 6.8e-7 low on the H200
over a 7B layer's 233M elements, and the error grows with the tile (a 7B embedding is 545M).

- CUDA: fp32 norms of 1024-element rows, squared and summed in fp64: 4.6e-8 low on that 7B-layer tile
  (a row still sums in fp32), 0.28 ms against the dot's 0.26, a temporary of n/1024 values. A cast of
  the tile to fp64 was exact but ran 2.8 ms per 7B layer (H200): 2% of a 7B step.
- CPU: each 4M-element chunk cast to fp64 and dotted there (32 MiB at a time): exact to fp64 rounding.
  Rows do not serve here: the CPU reduces a row sequentially, and row norms ran 2.7e-7 low on that
  gradient. About 1 ns per element, 7x the fp32 dot; the CPU path is the functional one.
"""

from __future__ import annotations

import torch

ROW = 1024
CHUNK = 1 << 22


def squared_norm(flat: torch.Tensor) -> torch.Tensor:
    """sum(flat ** 2) of an fp32 tensor as an fp64 0-d tensor on its device (no host sync)."""
    flat = flat.reshape(-1)
    if flat.is_cuda:
        full = flat.numel() - flat.numel() % ROW
        sq = torch.linalg.vector_norm(flat[:full].view(-1, ROW), dim=1).double().square().sum()
        return sq + torch.linalg.vector_norm(flat[full:]).double().square()
    sq = torch.zeros((), dtype=torch.float64)
    for lo in range(0, flat.numel(), CHUNK):
        part = flat[lo:lo + CHUNK].double()
        sq += torch.dot(part, part)
    return sq
