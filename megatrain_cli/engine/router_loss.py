"""HF's router load-balancing loss, computed over layers that stream through one at a time (MoE families).

With `output_router_logits` on (as HF's and TRL's training turn it on), an HF MoE causal LM adds
`router_aux_loss_coef * aux` to each forward's loss (`load_balancing_loss_func`, the same in every family
verified here), where over the router logits of ALL MoE layers of that forward concatenated
(R = MoE layers x tokens rows, E experts):

    aux = E * sum_e f_e * P_e,   f_e = (top-k picks of e) / R  (no gradient),
                                 P_e = (sum of softmax probabilities of e) / R

The engine never holds every layer's logits at once, and the loss is not a sum of per-layer terms (f is
global). So: in the forward a hook on each router adds that layer's picks and probability sums to the
micro-batch's totals; once the forward is done, aux is known, and the gradient of layer l's part is that
of  sum_e G_e * sum_t softmax(logits_l)[t, e]  with  G_e = w * coef * E * picks_e / R^2,  a scalar the
layer's backward differentiates together with its output (its router logits are kept from the recompute).

Accumulation (what we chose): HF computes aux per forward, i.e. per micro-batch. The step's objective is
each micro-batch's HF loss (its cross-entropy mean + coef * its aux) weighted by its share w of the step's
loss tokens, the weight the reference loop gives its cross-entropy: global token-mean cross-entropy +
coef * token-weighted mean of the micro-batches' aux. (HF's Trainer, which does not divide by the
accumulation steps when the model takes num_items_in_batch, sums aux over micro-batches instead.)
The reported per-micro-batch loss is HF's: cross-entropy + coef * aux.

Costs: per layer and micro-batch, a softmax and top-k over [tokens, E] in the forward (no host sync), the
router logits of the block being recomputed kept until their layer's backward ([tokens, E] each), and one
host sync per step to read the aux values.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from megatrain_cli.models import families
from megatrain_cli.models.families import MoeSpec


def routers(template: nn.Module, spec: MoeSpec) -> list[nn.Module]:
    """The router modules of a layer template: what HF's router-logits recorder would read."""
    return [m for name, m in template.named_modules()
            if isinstance(m, spec.router_class) and (spec.router_name is None or spec.router_name in name)]


class RouterLoss:
    """Hooks on every template's routers; per step, the micro-batches' pick counts and probability sums."""

    def __init__(self, spec: MoeSpec, templates: Iterable[nn.Module], device: torch.device):
        self.spec, self.device = spec, device
        self.hooked = 0
        for template in templates:
            for router in routers(template, spec):
                router.register_forward_hook(self._hook)
                self.hooked += 1
        self._at: tuple[int, int] | None = None  # (layer, micro-batch) of the call running now
        self._count = self._keep = False
        self.begin(0)

    def begin(self, micro_batches: int) -> None:
        """A new step of `micro_batches` micro-batches: totals to zero, nothing kept."""
        e = self.spec.num_experts
        self.picks = torch.zeros(micro_batches, e, dtype=torch.float32, device=self.device)
        self.prob_sums = torch.zeros(micro_batches, e, dtype=torch.float32, device=self.device)
        self.rows = [0] * micro_batches
        self.kept: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.grad_weights: torch.Tensor | None = None

    def at(self, layer: int, micro_batch: int, *, count: bool, keep: bool) -> None:
        """Say which call comes next: `count` its routing into the totals (the forward, once per layer),
        `keep` its router logits for the backward (a call that builds a graph)."""
        self._at, self._count, self._keep = (layer, micro_batch), count, keep

    def _hook(self, module, args, output) -> None:
        if self._at is None:
            return
        logits = output[self.spec.router_output]
        layer, mb = self._at
        if self._count:
            with torch.no_grad():  # as load_balancing_loss_func: softmax in the logits' dtype, top-k of it
                probs = torch.softmax(logits.detach(), dim=-1)
                picked = torch.topk(probs, self.spec.top_k, dim=-1).indices.reshape(-1)
                # histc: exact integer counts without bincount's host sync (int on CUDA for determinism)
                picked = picked.float() if picked.device.type in ("cpu", "mps") else picked.int()
                e = self.spec.num_experts
                self.picks[mb].add_(torch.histc(picked, bins=e, min=0, max=e))
                self.prob_sums[mb].add_(probs.float().sum(0))
                self.rows[mb] += probs.shape[0]
        if self._keep:
            self.kept.setdefault((layer, mb), []).append(logits)

    def add_to(self, losses: list[tuple[float, int]], loss_tokens: int) -> list[tuple[float, int]]:
        """After the forward: each micro-batch's (cross-entropy, tokens) becomes (HF's loss, tokens), and
        the per-expert gradient weights G of every micro-batch are set. `loss_tokens`: the step's (every
        rank's) loss tokens. One host sync (the aux values)."""
        e, coef = self.spec.num_experts, self.spec.aux_coef
        rows = torch.tensor(self.rows, dtype=torch.float32, device=self.device).clamp_min(1).unsqueeze(1)
        aux = e * ((self.picks / rows) * (self.prob_sums / rows)).sum(-1)
        share = torch.tensor([n / max(1, loss_tokens) for _, n in losses], dtype=torch.float32, device=self.device)
        self.grad_weights = (coef * e) * share.unsqueeze(1) * self.picks / rows.square()
        return [(loss + coef * a, n) for (loss, n), a in zip(losses, aux.tolist())]

    def terms(self, layer: int, micro_batch: int) -> list[torch.Tensor]:
        """Scalars whose gradient is the aux loss's through this layer's routers on this micro-batch (the
        kept logits are released)."""
        g = self.grad_weights[micro_batch]
        return [(torch.softmax(logits, dim=-1).float().sum(0) * g).sum()
                for logits in self.kept.pop((layer, micro_batch), [])]


def moe_setup(config, templates, device: torch.device) -> tuple[MoeSpec | None, RouterLoss | None]:
    """For an MoE family: every template's experts on transformers' grouped-mm code, and the router loss
    when the model's coefficient is not 0. (None, None) for a dense model."""
    spec = families.moe_spec(config)
    if spec is None:
        return None, None
    for template in templates.all():
        families.grouped_experts(template)
    return spec, (RouterLoss(spec, templates.all(), device) if spec.aux_coef else None)
