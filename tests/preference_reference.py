"""The reference the preference parity tests compare against: a plain HF causal LM (fp32), every sequence scored
by a forward of its own (no packing, no masks), the methods' losses from the published formulas written out here
(independently of megatrain_cli.methods), and torch AdamW with megatrain's settings (tests/reference.py: weight
decay on matrices only, global-norm clipping, megatrain's LR schedule).

The reference model is the policy's starting weights, frozen (a copy made before the first step). A step's loss
is the mean over its units (pairs; KTO: examples) across every micro-batch: each micro-batch's summed unit
losses are divided by the step's unit count before its backward, as megatrain normalises per pair. KTO's
reference point z0 is the mean log-ratio over the whole step's examples (methods/kto.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from tests.reference import param_groups

PAIRED = ("dpo", "ipo", "simpo", "orpo")
MEANS = ("ipo", "simpo", "orpo")  # per-token mean log-probs; dpo and kto use sums


@dataclass
class Sequence:
    input_ids: torch.Tensor  # [T] one prompt + completion
    labels: torch.Tensor  # [T] IGNORE_INDEX outside the completion (unshifted, as HF)
    desirable: bool  # chosen, or a KTO example labelled true


Unit = list  # [chosen, rejected] Sequences of a pair, or [one Sequence] for KTO


@dataclass
class Hyper:
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    orpo_lambda: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


def sequence_logps(model, seq: Sequence) -> tuple[torch.Tensor, int]:
    """(sum of the completion tokens' log-probs, their count) by a plain HF forward of the sequence alone."""
    dev = next(model.parameters()).device
    logits = model(input_ids=seq.input_ids[None].to(dev), use_cache=False).logits[0].float()
    target = seq.labels[1:].to(dev)
    counted = target != IGNORE_INDEX
    logps = torch.log_softmax(logits[:-1], -1).gather(-1, target.clamp(min=0)[:, None])[:, 0]
    return logps[counted].sum(), int(counted.sum())


def unit_losses(method: str, hp: Hyper, policy: list[list], reference: list[list] | None,
                counts: list[list[int]], desirable: list[list[bool]], z0: torch.Tensor | None = None
                ) -> list[torch.Tensor]:
    """One loss per unit of a micro-batch; policy / reference / counts / desirable hold, per unit, its
    sequences' log-prob sums, token counts and labels (a pair: chosen first). `z0`: KTO's reference point
    (None: these units' mean log-ratio)."""
    if method == "kto":  # Ethayarajh et al. 2024, eq. 8; z0 the step's mean log-ratio, no gradient, >= 0
        ratios = [policy[k][0] - reference[k][0] for k in range(len(policy))]
        if z0 is None:
            z0 = torch.clamp(torch.stack(ratios).detach().mean(), min=0)
        return [hp.desirable_weight * (1 - torch.sigmoid(hp.beta * (r - z0))) if desirable[k][0]
                else hp.undesirable_weight * (1 - torch.sigmoid(hp.beta * (z0 - r))) for k, r in enumerate(ratios)]

    def score(values, k, j):
        return values[k][j] / counts[k][j] if method in MEANS else values[k][j]

    out = []
    for k in range(len(policy)):
        pc, pr = score(policy, k, 0), score(policy, k, 1)
        if method == "dpo":  # Rafailov et al. 2023, eq. 7; cDPO's label smoothing
            z = hp.beta * ((pc - pr) - (score(reference, k, 0) - score(reference, k, 1)))
            out.append(-(1 - hp.label_smoothing) * F.logsigmoid(z) - hp.label_smoothing * F.logsigmoid(-z))
        elif method == "ipo":  # Azar et al. 2023, eq. 17
            h = (pc - pr) - (score(reference, k, 0) - score(reference, k, 1)) - 1 / (2 * hp.beta)
            out.append(h * h)
        elif method == "simpo":  # Meng et al. 2024, eq. 6
            z = hp.beta * (pc - pr) - hp.simpo_gamma
            out.append(-(1 - hp.label_smoothing) * F.logsigmoid(z) - hp.label_smoothing * F.logsigmoid(-z))
        elif method == "orpo":  # Hong et al. 2024, eqs. 2-7
            log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
            out.append(-pc - hp.orpo_lambda * F.logsigmoid(log_odds))
        else:
            raise ValueError(f"unknown method {method!r}")
    return out


def units_of(mb, method: str) -> list[Unit]:
    """A preference micro-batch (rows packed with sequences, and their layout) as units of plain sequences:
    rows cut where position_ids restart, pairs read from the layout (KTO: every sequence its own unit)."""
    seqs = []
    for ids, labels, pos in zip(mb.input_ids, mb.labels, mb.position_ids):
        starts = [t for t in range(len(pos)) if pos[t] == 0] + [len(pos)]
        for lo, hi in zip(starts, starts[1:]):
            seqs.append((ids[lo:hi], labels[lo:hi]))
    desirable = mb.layout.desirable.tolist()
    if method == "kto":
        return [[Sequence(ids, labels, good)] for (ids, labels), good in zip(seqs, desirable)]
    return [[Sequence(*seqs[c], True), Sequence(*seqs[r], False)]
            for c, r in zip(mb.layout.chosen.tolist(), mb.layout.rejected.tolist())]


def reference_preference_train(model, steps: list[list[list[Unit]]], method: str, hp: Hyper, cfg: TrainConfig,
                               total_steps: int) -> list[list[list[float]]]:
    """Train `model` in place for len(steps) steps (each a list of micro-batches, each a list of units); returns
    every unit's loss, per step and micro-batch. Trailing padding in a sequence carries no label (no effect)."""
    reference = None
    if method not in ("simpo", "orpo"):
        reference = copy.deepcopy(model).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                            foreach=False)
    history = []
    for s, micro_batches in enumerate(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s, cfg, total_steps)
        n_units = sum(len(mb) for mb in micro_batches)
        z0 = None
        if method == "kto":  # over every example of the step, before any backward
            with torch.no_grad():
                ratios = [sequence_logps(model, u[0])[0] - sequence_logps(reference, u[0])[0]
                          for units in micro_batches for u in units]
            z0 = torch.clamp(torch.stack(ratios).mean(), min=0)
        step_losses = []
        for units in micro_batches:
            policy, counts, ref = [], [], []
            for unit in units:
                scored = [sequence_logps(model, seq) for seq in unit]
                policy.append([v for v, _ in scored])
                counts.append([n for _, n in scored])
                if reference is not None:
                    with torch.no_grad():
                        ref.append([sequence_logps(reference, seq)[0] for seq in unit])
            losses = unit_losses(method, hp, policy, ref or None, counts, [[q.desirable for q in u] for u in units],
                                 z0)
            (torch.stack(losses).sum() / n_units).backward()
            step_losses.append([float(v.detach()) for v in losses])
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append(step_losses)
    return history

