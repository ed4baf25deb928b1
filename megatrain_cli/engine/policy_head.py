"""The head phase of a GRPO step (train.method grpo, methods/grpo.py): the clipped policy-gradient loss over
per-token log-probs, its gradient as per-token weights of a cross-entropy backward.

Per micro-batch, in the loss's token chunks (engine/loss.py), the full logits never whole: the final norm once
(with its graph), every label's log-prob without autograd (`token_logps`, the one definition of a scored token
that the reference pass shares), the method's per-token losses and d(sum / the step's label tokens)/d(logp) by
one autograd call over those few numbers (float64), then the cross-entropy backward weighted per token by -that:
the LM head's gradient and d/d(hidden), as SFT's head. Costs over SFT's head: one more chunked LM-head matmul
and one host sync for the step's losses and metrics; the fused Triton cross-entropy takes one scale for every
token, so a GRPO step runs the PyTorch chunks.
"""

from __future__ import annotations

import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.engine.head import HeadWeights
from megatrain_cli.engine.loss import token_logps, weighted_loss
from megatrain_cli.engine.preference_head import PreferenceHead
from megatrain_cli.engine.templates import run_bound
from megatrain_cli.methods import MetricTotals
from megatrain_cli.methods.grpo import GRPO


def shifted(values: torch.Tensor | None, device) -> torch.Tensor | None:
    """A per-label [B, T] tensor (aligned with `labels`) in the head's shifted layout: position t holds label t + 1's."""
    if values is None:
        return None
    out = torch.zeros(values.shape, dtype=torch.float64, device=device)
    out[:, :-1] = values[:, 1:].to(device, torch.float64)
    return out


def run_policy_head(engine, h, labels, mbs, sq_norm, loss_tokens: int) -> PreferenceHead:
    """The head of a GRPO step over its micro-batches (`loss_tokens`: the step's label tokens, every rank's)."""
    method: GRPO = engine.method
    head = HeadWeights(engine)
    scale = 1.0 / max(1, loss_tokens)
    out = PreferenceHead([], [], None, MetricTotals(), loss_tokens)
    per_mb = []  # (token losses, metrics) on the device: read back at once after the loop (one host sync)
    for x, lab, mb in zip(h, labels, mbs):
        b, t = lab.shape
        flat_l = lab.reshape(-1)
        x, normed = head.norm(x)
        flat_n = normed.detach().reshape(b * t, -1)
        logps = token_logps(flat_n, flat_l, head.lm_w, engine.chunk, engine.adapter.logit_softcap)
        counted = flat_l != IGNORE_INDEX
        if mb.advantages is None:
            raise ValueError("a GRPO micro-batch needs the advantages of its completions' tokens")
        lp = logps[counted].double().requires_grad_(True)
        adv = shifted(mb.advantages, lp.device).reshape(-1)[counted]
        old = lp.detach() if mb.old_logps is None else shifted(mb.old_logps, lp.device).reshape(-1)[counted]
        ref = None if mb.ref_logps is None else shifted(mb.ref_logps, lp.device).reshape(-1)[counted]
        losses, metrics = method.loss(lp, old, ref, adv)
        (grad,) = torch.autograd.grad(losses.sum() * scale, lp)
        weights = torch.zeros(b * t, dtype=torch.float32, device=lp.device)
        weights[counted] = (-grad).float()
        d_normed = weighted_loss(flat_n, flat_l, weights, head.lm_w, head.lm_grad, engine.chunk,
                                 engine.adapter.logit_softcap)
        out.grads_out.append(head.norm_backward(x, normed, d_normed))
        per_mb.append((losses.detach(), metrics))
    out.tied_grad = head.finish(sq_norm)
    flat = [v.detach().double().reshape(-1) for losses, metrics in per_mb for v in (losses, *metrics.values())]
    host = iter(torch.cat(flat).cpu().split([v.numel() for v in flat]))
    for losses, metrics in per_mb:
        n = losses.numel()
        out.losses.append((float(next(host).sum()) / max(1, n), n))
        out.totals.add({name: next(host) for name in metrics})
    return out


@torch.no_grad()
def score_tokens(engine, hidden: list, labels: list, head: HeadWeights | None = None) -> list[torch.Tensor]:
    """Each micro-batch's per-label log-probs from its last hidden states and its shifted labels (the step's
    inputs' `labels`): [B, T] float32 aligned with the micro-batch's own (unshifted) labels, 0 where there is
    no label. What a forward-only pass (engine/validate.forward_passes) scores rollouts with: the training
    head's `token_logps`."""
    head = head if head is not None else HeadWeights(engine, grad=False)
    out = []
    for x, lab in zip(hidden, labels):
        b, t = lab.shape
        normed = run_bound(engine.norm_template, head.norm_w, x)
        logps = token_logps(normed.reshape(b * t, -1), lab.reshape(-1), head.lm_w, engine.chunk,
                            engine.adapter.logit_softcap).view(b, t)
        aligned = torch.zeros_like(logps)
        aligned[:, 1:] = logps[:, :-1]
        out.append(aligned)
    return out
