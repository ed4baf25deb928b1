"""What one step takes and gives: micro-batches in, a StepResult out.

Kept apart from step.py so that data code, benches and tests can build batches without importing
the engine (and its CUDA, kernel and distributed dependencies).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100
# Long-context path: the largest sliding-window mask (bool elements) a micro-batch of one document per row
# may build, 4 GiB (one 64K-token row); longer rows are refused with what to change instead of running out of
# memory. Packed rows build no mask (models/attention.py).
MAX_LONG_CONTEXT_MASK = 2**32


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] int64 (host)
    labels: torch.Tensor  # [B, T], IGNORE_INDEX where no loss (unshifted, as HF)
    position_ids: torch.Tensor | None = None  # [B, T]; resets to 0 where a packed document starts
    # A vision-language model's images for these rows, in row order: the processor's tensors (pixel_values,
    # image_grid_thw for Qwen2-VL), each concatenated over the images along dim 0. None: text only.
    images: dict | None = None


@dataclass
class StepResult:
    losses: list[float]  # mean loss per micro-batch (its own tokens)
    loss: float  # token-weighted mean over the step (a preference method: the mean over its pairs / examples)
    grad_norm: float
    tokens: int  # input tokens processed
    loss_tokens: int  # tokens that carried loss
    skipped: bool = False
    times: dict = field(default_factory=dict)  # phase -> seconds
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_count: dict = field(default_factory=dict)
    speculation: dict = field(default_factory=dict)  # tiles updated before the verdict / corrected
    metrics: dict = field(default_factory=dict)  # a preference method's, TRL's names -> the step's mean
