"""GRPO (Shao et al. 2024, DeepSeekMath, eq. 3) on sampled completions, normalised per token over the whole step
as DAPO does (Yu et al. 2025, eq. 8, "token-level policy gradient loss"; TRL's GRPOConfig loss_type 'dapo').

Per prompt G completions o_1..o_G with rewards r_i; each completion's advantage is group-relative:
    A_i = (r_i - mean(r)) / (std(r) + eps)            std unbiased (Bessel), eps 1e-4: TRL's GRPOTrainer
Per completion token t of o_i, with ratio = p_theta(o_it) / p_old(o_it):
    l_it = -min(ratio * A_i, clip(ratio, 1 - epsilon, 1 + epsilon) * A_i) + beta * KL_it
    KL_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1           (Schulman's k3 estimator, as the paper)
and the step's loss is sum over every completion token of the step / the number of those tokens (every
micro-batch, every rank): DAPO's token-level mean, so a long completion weighs by its length and no 1/|o_i| per
sequence biases towards short wrong answers (the paper's per-sequence mean; Dr. GRPO, Liu et al. 2025, names
that bias). With one policy update per generation batch (the default), p_old is the policy itself: ratio = 1,
nothing is clipped and the gradient is the plain policy gradient A_i * d logp_it.

The loss is a pure function of per-token log-probs (the head computes them, engine/policy_head.py), so its
gradient per token is one autograd call; the head turns it into the weights of a cross-entropy backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from megatrain_cli.batch import MicroBatch

ADVANTAGE_EPS = 1e-4  # TRL's GRPOTrainer: (r - mean) / (std + 1e-4)


@dataclass
class RolloutMicroBatch(MicroBatch):
    """Rows of prompt + sampled completion (labels only on the completion's tokens) and, per label position
    (aligned with `labels`, unshifted [B, T]; 0 where there is no label), what the objective reads of it."""
    advantages: torch.Tensor | None = None  # [B, T] float: the completion's advantage A_i on each of its tokens
    old_logps: torch.Tensor | None = None  # [B, T] float: log p_old of each label; None: the policy now (ratio 1)
    ref_logps: torch.Tensor | None = None  # [B, T] float: the initial policy's log-prob of each label (beta > 0)


def group_advantages(rewards: torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """[P, G] rewards (P prompts, G completions each) -> [P, G] float64 (r - group mean) / (group std + eps);
    a group whose rewards are all equal gets 0 (it teaches nothing)."""
    r = rewards.double()
    if r.dim() != 2 or r.shape[1] < 2:
        raise ValueError(f"group_advantages needs [prompts, generations >= 2] rewards, got {tuple(r.shape)}")
    return (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)


class GRPO:
    """The clipped policy-gradient objective per completion token (module docstring)."""
    name: ClassVar[str] = "grpo"
    token_mean: ClassVar[bool] = True  # the loss is averaged over the step's label tokens, as SFT's

    def __init__(self, epsilon: float = 0.2, beta: float = 0.0):
        self.epsilon, self.beta = epsilon, beta

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def loss(self, logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
             advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(per-token losses, metrics: name -> per-token values) for 1-D tensors over the same labelled tokens.
        The caller sums the losses and scales by 1 / (the step's completion tokens)."""
        ratio = torch.exp(logps - old)
        unclipped = ratio * advantages
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon) * advantages
        losses = -torch.minimum(unclipped, clipped)
        # TRL's clip_ratio: the tokens whose gradient the clip removed (below 1 - eps with A < 0, above 1 + eps with A > 0)
        was_clipped = ((ratio < 1 - self.epsilon) & (advantages < 0)) | ((ratio > 1 + self.epsilon) & (advantages > 0))
        metrics = {"clip_ratio": was_clipped.to(torch.float64)}
        if self.beta > 0:
            if ref is None:
                raise ValueError("grpo.beta > 0 needs the initial policy's log-probs of every completion token")
            delta = ref - logps
            kl = torch.exp(delta) - delta - 1
            losses = losses + self.beta * kl
            metrics["kl"] = kl.detach()
        return losses, metrics
