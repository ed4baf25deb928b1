"""Training methods: what a micro-batch's loss is, given what the head computes.

`sft` (the default) is the token-mean cross-entropy of the engine's head, untouched. The preference methods
(dpo, ipo, simpo, orpo, kto) are pure functions of per-sequence log-prob sums (base.py), each in its own
module with its formula; sequences.py maps tokens to sequences and a loss's gradient back to token weights;
metrics.py reduces their metrics over a step. `grpo` (grpo.py) is a pure function of per-token log-probs (its
rewards, plain functions of (prompt, completion, example), are data/rewards.py's). They know nothing of
streaming.
"""

from megatrain_cli.methods.base import (PreferenceLayout, PreferenceMethod, PreferenceMicroBatch, SequenceScores,
                                        pair_metrics)
from megatrain_cli.methods.dpo import DPO
from megatrain_cli.methods.grpo import GRPO, RolloutMicroBatch
from megatrain_cli.methods.ipo import IPO
from megatrain_cli.methods.kto import KTO
from megatrain_cli.methods.metrics import MetricTotals
from megatrain_cli.methods.orpo import ORPO
from megatrain_cli.methods.sft import SFT
from megatrain_cli.methods.simpo import SimPO

METHODS = ("sft", "dpo", "ipo", "simpo", "orpo", "kto", "grpo")
PAIRED = ("dpo", "ipo", "simpo", "orpo")  # read {prompt, chosen, rejected}; kto also reads unpaired examples


def make_method(name: str, preference=None, grpo=None) -> SFT | PreferenceMethod | GRPO:
    """The method `train.method` names, with the hyper-parameters of the recipe's `preference` section (a
    PreferenceConfig; None: TRL's defaults), or for grpo its `grpo` section (a GRPOConfig; None: its defaults)."""
    if name == "sft":
        return SFT()
    if name == "grpo":
        return GRPO() if grpo is None else GRPO(grpo.epsilon, grpo.beta)
    if preference is None:
        from megatrain_cli.recipe.schema import PreferenceConfig
        preference = PreferenceConfig()
    p = preference
    builders = {"dpo": lambda: DPO(p.beta, p.label_smoothing), "ipo": lambda: IPO(p.beta),
                "simpo": lambda: SimPO(p.beta, p.simpo_gamma, p.label_smoothing), "orpo": lambda: ORPO(p.orpo_lambda),
                "kto": lambda: KTO(p.beta, p.desirable_weight, p.undesirable_weight)}
    if name not in builders:
        raise ValueError(f"train.method: unknown method {name!r} (known: {', '.join(METHODS)})")
    return builders[name]()


__all__ = ["DPO", "GRPO", "IPO", "KTO", "METHODS", "MetricTotals", "ORPO", "PAIRED", "PreferenceLayout", "PreferenceMethod",
           "PreferenceMicroBatch", "RolloutMicroBatch", "SFT", "SequenceScores", "SimPO", "make_method", "pair_metrics"]
