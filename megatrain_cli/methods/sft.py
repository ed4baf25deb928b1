"""SFT: the default method, a marker only. Its loss stays the token-mean cross-entropy of the engine's head
(engine/loss.py), bit-identical to a run without `train.method`; nothing here computes it."""

from __future__ import annotations

from typing import ClassVar


class SFT:
    name: ClassVar[str] = "sft"
    needs_reference: ClassVar[bool] = False
    token_mean: ClassVar[bool] = True  # the loss is averaged over the step's label tokens, not over pairs
