"""DPO (Rafailov et al. 2023, eq. 7), with cDPO's label smoothing (Mitchell 2023), as TRL's DPOTrainer
(loss_type 'sigmoid') computes it.

Per pair, with sequence SUMS of completion log-probs of the policy (pi) and the reference (ref):
    logits = (pi_c - pi_r) - (ref_c - ref_r)
    loss   = -(1 - eps) log sigmoid(beta * logits) - eps log sigmoid(-beta * logits)
At step 0 the policy is the reference, logits = 0 and every pair's loss is ln 2.
Rewards (TRL's implicit rewards): beta * (pi - ref) of the chosen and of the rejected completion.
"""

from __future__ import annotations

from typing import ClassVar

from megatrain_cli.methods.base import PreferenceMethod, pair_metrics, sigmoid_pair_loss


class DPO(PreferenceMethod):
    name: ClassVar[str] = "dpo"
    needs_reference: ClassVar[bool] = True

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0):
        self.beta, self.label_smoothing = beta, label_smoothing

    def loss(self, policy, reference, layout, step=None):
        pi_c, pi_r = self.pairs(policy, layout)
        ref_c, ref_r = self.pairs(reference, layout)
        logits = (pi_c - pi_r) - (ref_c - ref_r)
        losses = sigmoid_pair_loss(logits, self.beta, self.label_smoothing)
        return losses, pair_metrics(self.beta * (pi_c - ref_c), self.beta * (pi_r - ref_r), pi_c, pi_r)
