"""ORPO (Hong et al. 2024, eqs. 2-7): reference-free; the chosen completion's NLL plus lambda times the
odds-ratio loss, both on per-token MEAN log-probs m (TRL's ORPOTrainer; its `beta` is the paper's lambda):
    log_odds = (m_c - m_r) - (log(1 - e^m_c) - log(1 - e^m_r))
    loss     = -m_c - lambda * log sigmoid(log_odds)
The NLL term is each pair's own per-token mean (the paper's L_SFT); TRL takes one token mean over the whole
batch's chosen tokens instead, which differs only when chosen lengths differ, and would couple pairs.
log(1 - e^m) is computed as log(-expm1(m)) near 0 and log1p(-e^m) below -ln 2 (exact in both ranges).
Rewards (TRL's): lambda * m. Also TRL's `nll_loss`, `log_odds_ratio` (log sigmoid(log_odds)) and
`log_odds_chosen` (log_odds).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from megatrain_cli.methods.base import PreferenceMethod, pair_metrics


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0 (Maechler 2012)."""
    near_zero = x > -math.log(2)
    return torch.where(near_zero, torch.log(-torch.expm1(x.clamp(max=0))),
                       torch.log1p(-torch.exp(x.clamp(max=-math.log(2)))))


class ORPO(PreferenceMethod):
    name: ClassVar[str] = "orpo"
    needs_reference: ClassVar[bool] = False
    length_normalised: ClassVar[bool] = True

    def __init__(self, orpo_lambda: float = 0.1):
        self.orpo_lambda = orpo_lambda

    def loss(self, policy, reference, layout, step=None):
        m_c, m_r = self.pairs(policy, layout)
        log_odds = (m_c - m_r) - (log1mexp(m_c) - log1mexp(m_r))
        ratio = torch.nn.functional.logsigmoid(log_odds)
        losses = -m_c - self.orpo_lambda * ratio
        metrics = pair_metrics(self.orpo_lambda * m_c, self.orpo_lambda * m_r, m_c, m_r)
        metrics.update({"nll_loss": -m_c.detach(), "log_odds_ratio": ratio.detach(),
                        "log_odds_chosen": log_odds.detach()})
        return losses, metrics
