"""IPO (Azar et al. 2023, eq. 17) as TRL's DPOTrainer computes it with loss_type 'ipo': the DPO logits
of per-token MEAN log-probs (TRL divides each sequence's sum by its completion length for IPO), regressed
onto 1 / (2 beta) (beta is the paper's tau):
    logits = (pi_c - pi_r) - (ref_c - ref_r)          (means)
    loss   = (logits - 1 / (2 beta))^2
Step 0: (1 / (2 beta))^2. Rewards: beta * (pi - ref) of the means, as TRL logs them.
"""

from __future__ import annotations

from typing import ClassVar

from megatrain_cli.methods.base import PreferenceMethod, pair_metrics


class IPO(PreferenceMethod):
    name: ClassVar[str] = "ipo"
    needs_reference: ClassVar[bool] = True
    length_normalised: ClassVar[bool] = True

    def __init__(self, beta: float = 0.1):
        self.beta = beta

    def loss(self, policy, reference, layout, step=None):
        pi_c, pi_r = self.pairs(policy, layout)
        ref_c, ref_r = self.pairs(reference, layout)
        logits = (pi_c - pi_r) - (ref_c - ref_r)
        losses = (logits - 1 / (2 * self.beta)) ** 2
        return losses, pair_metrics(self.beta * (pi_c - ref_c), self.beta * (pi_r - ref_r), pi_c, pi_r)
