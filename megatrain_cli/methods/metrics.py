"""A step's metrics from its micro-batches' (and ranks') per-unit values: sums and counts, then means.

Each method's `loss` gives name -> 1-D tensor of per-unit values. A step adds them up micro-batch by
micro-batch (`MetricTotals.add`); with several ranks the sums and counts are all-reduced as one tensor
(`as_tensor` / `from_tensor`, names in a fixed order) before `means`. A mean over the whole step's units is
what TRL logs per batch. `rewards/margins` missing (KTO: chosen and rejected are different examples) is the
difference of the two reward means.
"""

from __future__ import annotations

import torch

# Every metric a method reports, in the order the ranks all-reduce them.
NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
         "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen", "kl", "clip_ratio")


class MetricTotals:
    def __init__(self):
        self.sums = torch.zeros(len(NAMES), dtype=torch.float64)
        self.counts = torch.zeros(len(NAMES), dtype=torch.float64)

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for name, values in metrics.items():
            i = NAMES.index(name)
            self.sums[i] += float(values.detach().double().sum())
            self.counts[i] += values.numel()

    def as_tensor(self) -> torch.Tensor:
        """[2, len(NAMES)] float64 (sums, counts): what the ranks all-reduce (sum)."""
        return torch.stack([self.sums, self.counts])

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "MetricTotals":
        totals = cls()
        totals.sums, totals.counts = t[0].double().cpu().clone(), t[1].double().cpu().clone()
        return totals

    def means(self) -> dict[str, float]:
        out = {name: float(self.sums[i] / self.counts[i]) for i, name in enumerate(NAMES) if self.counts[i] > 0}
        if "rewards/margins" not in out and "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out
