"""SimPO (Meng et al. 2024, eq. 6) as TRL's CPOTrainer computes it with loss_type 'simpo' and cpo_alpha 0:
reference-free, per-token MEAN log-probs, a target margin gamma, and the same label smoothing as DPO:
    logits = (pi_c - pi_r) - gamma / beta              (means)
    loss   = -(1 - eps) log sigmoid(beta * logits) - eps log sigmoid(-beta * logits)
Rewards (TRL's, for reference-free methods): beta * pi, the scaled mean log-prob of each completion.
The paper's beta is larger than DPO's (2 to 10) with gamma / beta about 0.5; TRL's defaults are 0.1 / 0.5.
"""

from __future__ import annotations

from typing import ClassVar

from megatrain_cli.methods.base import PreferenceMethod, pair_metrics, sigmoid_pair_loss


class SimPO(PreferenceMethod):
    name: ClassVar[str] = "simpo"
    needs_reference: ClassVar[bool] = False
    length_normalised: ClassVar[bool] = True

    def __init__(self, beta: float = 0.1, simpo_gamma: float = 0.5, label_smoothing: float = 0.0):
        self.beta, self.simpo_gamma, self.label_smoothing = beta, simpo_gamma, label_smoothing

    def loss(self, policy, reference, layout, step=None):
        pi_c, pi_r = self.pairs(policy, layout)
        logits = (pi_c - pi_r) - self.simpo_gamma / self.beta
        losses = sigmoid_pair_loss(logits, self.beta, self.label_smoothing)
        return losses, pair_metrics(self.beta * pi_c, self.beta * pi_r, pi_c, pi_r)
