"""From tokens to sequences and back: what the head needs to score a micro-batch per sequence and to turn a
method's loss into per-token weights for its weighted cross-entropy backward.

A sequence starts where `position_ids` is 0 (every row starts one; packed rows hold several) and runs to the
next start; the padding at a row's end continues its last sequence and carries no label. Sequences are
numbered row by row, left to right, which is the order of `PreferenceLayout`'s sequences. The head's token t
(logits[:, t]) predicts labels[:, t + 1], a token of the sequence of position t + 1; a sequence's first token
is a prompt token and never a label, so no label is counted in the wrong sequence.

The loss L is a function of the sequences' log-prob sums S; a labelled token's log-prob counts once in its
sequence's S, and its cross-entropy is -log-prob, so its weight in the backward is -dL/dS of its sequence.
"""

from __future__ import annotations

import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.methods.base import PreferenceLayout, PreferenceMethod, SequenceScores


def sequence_index(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """([B, T] int64: each token's sequence, numbered row by row from 0; the number of sequences)."""
    starts = position_ids == 0
    if not bool(starts[:, 0].all()):
        raise ValueError("every row must start a sequence (position_ids[:, 0] == 0)")
    per_row = starts.sum(1)
    first = per_row.cumsum(0) - per_row  # the number of the first sequence of each row
    return starts.long().cumsum(1) - 1 + first[:, None], int(per_row.sum())


def label_sequence_index(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """([B, T - 1]: the sequence of each shifted label, labels[:, 1:]; the number of sequences)."""
    index, n = sequence_index(position_ids)
    return index[:, 1:], n


def sequence_sums(token_logps: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> SequenceScores:
    """Per-sequence sums (float64) of the labelled tokens' log-probs and their counts. `token_logps` [B, T - 1]
    is the log-prob of labels[:, 1:] (any value where the label is IGNORE_INDEX: it is not counted)."""
    index, n = label_sequence_index(position_ids)
    counted = labels[:, 1:] != IGNORE_INDEX
    idx = index[counted]
    # float64: CUDA's index_add_ adds in no fixed order; in float64 that order moves a sum by ~1e-16 of it
    logps = torch.zeros(n, dtype=torch.float64, device=token_logps.device).index_add_(0, idx,
                                                                                     token_logps[counted].double())
    tokens = torch.zeros(n, dtype=torch.int64, device=idx.device).index_add_(0, idx, torch.ones_like(idx))
    return SequenceScores(logps, tokens)


def sequence_grads(method: PreferenceMethod, policy: SequenceScores, reference: SequenceScores | None,
                   layout: PreferenceLayout, scale: float,
                   step: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(per-unit losses, d(scale * sum of losses) / d(policy sums) [S], metrics), in float64: the losses of
    one micro-batch and the gradient its backward scales each sequence's tokens by. `scale` is 1 / (units
    in the whole step: every micro-batch, accumulation step and rank); `step`: the method's
    step_statistics summed over the same (None: this micro-batch's own)."""
    logps = policy.logps.detach().double().requires_grad_(True)
    ref = None if reference is None else SequenceScores(reference.logps.double(), reference.tokens)
    losses, metrics = method.loss(SequenceScores(logps, policy.tokens), ref, layout, step)
    (grad,) = torch.autograd.grad(losses.sum() * scale, logps)
    return losses.detach(), grad, metrics


def token_weights(grad: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T - 1] weight of each shifted label's cross-entropy: -grad of its sequence, 0 where no label."""
    index, _ = label_sequence_index(position_ids)
    weights = -grad[index]
    return torch.where(labels[:, 1:] != IGNORE_INDEX, weights, torch.zeros((), dtype=grad.dtype,
                                                                         device=grad.device))
