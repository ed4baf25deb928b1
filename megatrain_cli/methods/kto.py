"""KTO (Ethayarajh et al. 2024, eq. 8) as TRL's KTOTrainer computes it (loss_type 'kto'): unpaired examples,
each a completion labelled desirable or not, sequence SUMS of log-probs, r = pi - ref per example:
    desirable:   loss = desirable_weight   * (1 - sigmoid(beta * (r - z0)))
    undesirable: loss = undesirable_weight * (1 - sigmoid(beta * (z0 - r)))
z0, the reference point, estimates KL(policy || reference); it is detached (no gradient) and clamped at 0.
TRL estimates it on mismatched prompt/completion pairs, which costs a second forward (and reference pass)
over as many sequences again. Here z0 = max(0, mean r over the step's own examples), the estimate of the
HALOs paper's paired variant (TRL's former `kto_pair`): no extra pass; it measures the drift on the
completions being trained rather than on unrelated ones. The mean is over the whole step (every
micro-batch and rank: `step_statistics`, summed by the engine), where HALOs averages each micro-batch over
the processes: so a step is the same however it is split into micro-batches and ranks.
At step 0, r = 0 and z0 = 0. Rewards: beta * r. Paired data reads as one desirable and one undesirable
example per pair (as TRL does).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from megatrain_cli.methods.base import PreferenceLayout, PreferenceMethod, SequenceScores


class KTO(PreferenceMethod):
    name: ClassVar[str] = "kto"
    needs_reference: ClassVar[bool] = True
    paired: ClassVar[bool] = False

    def __init__(self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight

    def step_statistics(self, policy: SequenceScores, reference: SequenceScores | None,
                        layout: PreferenceLayout) -> torch.Tensor:
        """[sum of the log-ratios r, examples]: what z0 averages, to be summed over the step."""
        r = (policy.logps - reference.logps).detach().double()
        return torch.stack([r.sum(), torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device)])

    def reference_point(self, policy: SequenceScores, reference: SequenceScores,
                        step: torch.Tensor | None = None) -> torch.Tensor:
        """z0: the step's mean log-ratio (`step`: step_statistics summed; None: these examples'), detached,
        at least 0."""
        if step is None:
            step = self.step_statistics(policy, reference, None)
        step = step.to(device=policy.logps.device, dtype=policy.logps.dtype)
        return (step[0] / step[1]).clamp(min=0)

    def loss(self, policy: SequenceScores, reference: SequenceScores | None, layout: PreferenceLayout,
             step: torch.Tensor | None = None):
        r = policy.logps - reference.logps
        z0 = self.reference_point(policy, reference, step)
        good = layout.desirable
        losses = torch.where(good, self.desirable_weight * (1 - torch.sigmoid(self.beta * (r - z0))),
                             self.undesirable_weight * (1 - torch.sigmoid(self.beta * (z0 - r))))
        rewards = (self.beta * r).detach()
        logps = policy.logps.detach()
        # Unpaired: chosen and rejected are different examples, so margins and accuracies have no per-example
        # value; the margin is the difference of the two means (methods/metrics.py), as TRL logs it.
        return losses, {"rewards/chosen": rewards[good], "rewards/rejected": rewards[~good],
                        "logps/chosen": logps[good], "logps/rejected": logps[~good], "kl": z0.reshape(1)}
