"""The head phase of a preference step (train.method dpo, ipo, simpo, orpo, kto): the method's loss over
per-sequence log-prob sums, its gradient as per-token weights of a cross-entropy backward.

Two passes over each micro-batch's last hidden states, in the loss's token chunks (engine/loss.py), the full
logits never whole:
    1. `score`: the final norm and every label's log-prob without autograd, summed per sequence
       (methods/sequences.py). The reference pass (engine/validate.py: score_passes) runs this same function
       on the same shapes, so at the first step the policy's sums are the reference's bit for bit (DPO's
       loss is ln 2 exactly).
    2. once every micro-batch is scored and the step's units (pairs; KTO: examples) and the method's step
       statistics (KTO's reference point) are summed over micro-batches and ranks (one all-reduce), the
       method's loss and d(sum of losses / units)/d(sums) per micro-batch, then the cross-entropy backward
       weighted per token by -dL/dS of its sequence: the LM head's gradient and d/d(hidden), as SFT's head.
Costs over SFT's head: one more chunked LM-head matmul (pass 1), the final norm twice, one host sync for the
step's losses and metrics, and with ranks one all-reduce of a few scalars. The fused Triton
cross-entropy takes one scale for every token: a preference step runs the PyTorch chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain_cli.engine.head import HeadWeights
from megatrain_cli.engine.loss import token_logps, weighted_loss
from megatrain_cli.engine.templates import run_bound
from megatrain_cli.methods import MetricTotals, PreferenceLayout, PreferenceMethod, SequenceScores
from megatrain_cli.methods.sequences import sequence_grads, sequence_sums, token_weights


@dataclass
class PreferenceHead:
    grads_out: list  # per micro-batch d loss / d (last hidden state)
    losses: list  # per micro-batch (mean unit loss, units)
    tied_grad: torch.Tensor | None  # as run_head's
    totals: MetricTotals  # this rank's metric sums and counts over its micro-batches
    units: int  # the step's units, every rank's


def score(engine, head: HeadWeights, hidden: torch.Tensor, shifted: torch.Tensor, mb) -> SequenceScores:
    """Pass 1 on one micro-batch: the sums of its sequences' label log-probs and their counts (device)."""
    dev = hidden.device
    with torch.no_grad():
        normed = run_bound(engine.norm_template, head.norm_w, hidden)
    b, t = hidden.shape[:2]
    logps = token_logps(normed.reshape(b * t, -1), shifted.reshape(-1), head.lm_w, engine.chunk,
                        engine.adapter.logit_softcap)
    return sequence_sums(logps.view(b, t)[:, :-1], mb.labels.to(dev), mb.position_ids.to(dev))


def run_preference_head(engine, h, labels, mbs, sq_norm) -> PreferenceHead:
    method: PreferenceMethod = engine.method
    dev = engine.device
    head = HeadWeights(engine)
    layouts = [layout_on(mb.layout, dev) for mb in mbs]
    policy = [score(engine, head, x, lab, mb) for x, lab, mb in zip(h, labels, mbs)]
    reference = [reference_of(method, mb, dev) for mb in mbs]
    units = sum(method.units(layout) for layout in layouts)
    stats = [method.step_statistics(p, r, layout) for p, r, layout in zip(policy, reference, layouts)]
    step = None if stats[0] is None else torch.stack(stats).sum(0)
    if engine.dist is not None:  # every rank's units (and statistics) in one all-reduce
        local = [units, *(step.tolist() if step is not None else [])]
        summed = engine.dist.sum_scalars(local)
        units = int(summed[0])
        step = None if step is None else torch.tensor(summed[1:], dtype=torch.float64, device=dev)
    scale = 1.0 / max(1, units)
    out = PreferenceHead([], [], None, MetricTotals(), units)
    per_mb = []  # (unit losses, metrics) on the device: read back at once after the loop (one host sync)
    for x, lab, mb, pol, ref, layout in zip(h, labels, mbs, policy, reference, layouts):
        losses, grad, metrics = sequence_grads(method, pol, ref, layout, scale, step)
        per_mb.append((losses, metrics))
        b, t = lab.shape
        weights = torch.zeros(b, t, dtype=torch.float32, device=dev)
        weights[:, :-1] = token_weights(grad, mb.labels.to(dev), mb.position_ids.to(dev))
        x, normed = head.norm(x)
        flat_n = normed.detach().reshape(b * t, -1)
        d_normed = weighted_loss(flat_n, lab.reshape(-1), weights.reshape(-1), head.lm_w, head.lm_grad, engine.chunk,
                                 engine.adapter.logit_softcap)
        out.grads_out.append(head.norm_backward(x, normed, d_normed))
    out.tied_grad = head.finish(sq_norm)
    flat = [t.detach().double().reshape(-1) for losses, metrics in per_mb for t in (losses, *metrics.values())]
    host = iter(torch.cat(flat).cpu().split([t.numel() for t in flat]))
    for (losses, metrics), layout in zip(per_mb, layouts):
        n = method.units(layout)
        out.losses.append((float(next(host).sum()) / max(1, n), n))
        out.totals.add({name: next(host) for name in metrics})
    return out


def layout_on(layout: PreferenceLayout, device: torch.device) -> PreferenceLayout:
    return PreferenceLayout(*(t.to(device) for t in (layout.sequences, layout.desirable, layout.chosen,
                                                     layout.rejected)))


def reference_of(method: PreferenceMethod, mb, device: torch.device) -> SequenceScores | None:
    """The micro-batch's reference scores on the device (None for a reference-free method)."""
    if not method.needs_reference:
        return None
    if getattr(mb, "reference", None) is None:
        raise ValueError(f"{method.name} needs the reference's scores of every micro-batch (the reference pass, "
                         f"train/preference.py); this one has none")
    return SequenceScores(mb.reference.logps.to(device), mb.reference.tokens.to(device))
