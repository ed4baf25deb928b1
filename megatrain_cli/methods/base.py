"""What every preference method shares: the per-sequence scores it reads, which sequence is which, and the
per-pair metrics TRL names.

The head scores a micro-batch once per sequence (a sequence starts where `position_ids` resets to 0,
sequences numbered row by row): the sum of its completion tokens' log-probs and how many there are
(`SequenceScores`). `PreferenceLayout` says what each sequence is: its global index (the reference cache's
key), whether it is desirable (a chosen completion, or a KTO example labelled true), and for pairs which
local sequence is each pair's chosen and rejected one. A method's `loss` is then a pure function of these
small tensors, so its gradient with respect to the sequence sums is one autograd call (methods/sequences.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from megatrain_cli.batch import MicroBatch


@dataclass
class SequenceScores:
    """One model's scores of a micro-batch's sequences (policy or reference)."""
    logps: torch.Tensor  # [S] sum of the completion tokens' log-probs
    tokens: torch.Tensor  # [S] completion tokens counted (>= 1)

    def means(self) -> torch.Tensor:
        """Per-token mean log-probs: what the length-normalised methods (IPO, SimPO, ORPO) read."""
        return self.logps / self.tokens.to(self.logps.dtype)


@dataclass
class PreferenceLayout:
    """What each sequence of a micro-batch is (sequences in row-major order of their position resets)."""
    sequences: torch.Tensor  # [S] int64: each sequence's index in the whole data (reference cache key)
    desirable: torch.Tensor  # [S] bool: a chosen completion, or a KTO example labelled true
    chosen: torch.Tensor  # [P] int64: the local index of each pair's chosen sequence (empty for unpaired data)
    rejected: torch.Tensor  # [P] int64: ... and of its rejected one


@dataclass
class PreferenceMicroBatch(MicroBatch):
    """A micro-batch of preference data: rows as SFT's (labels only on completions) plus their layout, and
    the reference's scores of its sequences (the training loop attaches them; None for reference-free methods)."""
    layout: PreferenceLayout | None = None
    reference: SequenceScores | None = None


class PreferenceMethod:
    """A loss over per-sequence scores. `loss` returns one loss per unit (a pair; KTO: an example), to be
    summed and scaled by 1 / (units in the whole step) by the caller, and metrics: name -> 1-D tensor of
    per-unit values (detached), averaged over the step by methods/metrics.py."""
    name: ClassVar[str]
    needs_reference: ClassVar[bool]
    paired: ClassVar[bool] = True  # units are (chosen, rejected) pairs; False: single labelled examples
    length_normalised: ClassVar[bool] = False  # reads per-token means (sum / tokens), not sums

    def units(self, layout: PreferenceLayout) -> int:
        """How many units the micro-batch holds: what the step's loss is averaged over."""
        return int(layout.chosen.numel()) if self.paired else int(layout.desirable.numel())

    def scores(self, scores: SequenceScores) -> torch.Tensor:
        """Per-sequence log-probs as this method reads them: sums, or per-token means."""
        return scores.means() if self.length_normalised else scores.logps

    def step_statistics(self, policy: SequenceScores, reference: SequenceScores | None,
                        layout: PreferenceLayout) -> torch.Tensor | None:
        """What the loss reads from the whole step besides its micro-batch: float64 sums that the caller adds
        over every micro-batch and rank and hands to `loss` as `step` (KTO's reference point); None: nothing."""
        return None

    def loss(self, policy: SequenceScores, reference: SequenceScores | None, layout: PreferenceLayout,
             step: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def pairs(self, scores: SequenceScores, layout: PreferenceLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) scores of every pair, [P] each."""
        if 2 * layout.chosen.numel() != layout.desirable.numel() or layout.chosen.numel() != layout.rejected.numel():
            raise ValueError(f"{self.name} needs pairs: every sequence of the micro-batch a pair's chosen or "
                             f"rejected completion ({layout.desirable.numel()} sequences, "
                             f"{layout.chosen.numel()} pairs)")
        s = self.scores(scores)
        return s[layout.chosen], s[layout.rejected]


def pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor,
                 rejected_logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's per-pair metrics: rewards (each method says what they are), margins, accuracies (the chosen
    reward strictly above the rejected one) and the policy's log-probs as the loss read them."""
    c, r = chosen_rewards.detach(), rejected_rewards.detach()
    return {"rewards/chosen": c, "rewards/rejected": r, "rewards/margins": c - r,
            "rewards/accuracies": (c > r).to(c.dtype), "logps/chosen": chosen_logps.detach(),
            "logps/rejected": rejected_logps.detach()}


def sigmoid_pair_loss(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(beta * logits), with conservative label smoothing eps (cDPO, Mitchell 2023): the label is
    flipped with probability eps, so (1 - eps) of the loss pulls the pair apart and eps pushes it back."""
    z = beta * logits
    loss = -torch.nn.functional.logsigmoid(z)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * torch.nn.functional.logsigmoid(-z)
    return loss
