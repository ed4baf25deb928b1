"""The LM head's loss over one micro-batch's normalised hidden states, in token chunks so the full
[tokens, vocab] logits never exist: one [chunk, vocab] logits buffer at a time (fp32 for the loss).

`chunked_loss` is the PyTorch path (a matmul, cross-entropy and autograd per chunk); `fused_loss` runs
kernels.fused_linear_cross_entropy (no autograd; the logits buffer becomes its own gradient). Both add
the LM-head gradient into `lm_grad` (fp32) in place and return (d loss * norm_scale / d hidden, loss sum).

The preference methods' head (engine/preference_head.py) takes two passes of the same chunks: `token_logps`,
each label's log-prob without autograd (what the sequences' sums are made of, for the policy and the
reference alike), then `weighted_loss`, the backward of the cross-entropy weighted per token (the method's
-dL/dS of the token's sequence, methods/sequences.py). The fused kernel takes one scale for every token, so
a preference step runs the PyTorch chunks (one more [chunk, vocab] matmul per chunk than SFT's fused path).
"""

from __future__ import annotations

import torch

from megatrain_cli.batch import IGNORE_INDEX


def head_logits(normed: torch.Tensor, lm_w: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """One chunk's fp32 logits (capped: cap * tanh(logits / cap), Gemma 2/3)."""
    logits = (normed @ lm_w.t()).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def cross_entropy_sum(normed: torch.Tensor, lm_w: torch.Tensor, labels: torch.Tensor,
                      softcap: float | None) -> torch.Tensor:
    """Cross-entropy summed over one chunk's loss tokens, on fp32 logits (head_logits): the training head's
    definition, which validation computes too."""
    return torch.nn.functional.cross_entropy(head_logits(normed, lm_w, softcap), labels, ignore_index=IGNORE_INDEX,
                                             reduction="sum")


@torch.no_grad()
def token_logps(flat_n, flat_l, lm_w, chunk: int, softcap: float | None = None) -> torch.Tensor:
    """[N] fp32: each label's log-prob (-its cross-entropy on head_logits), 0 where there is no label; in token
    chunks, without autograd. The one definition of a scored token, for the policy and the reference."""
    out = torch.zeros(flat_n.shape[0], dtype=torch.float32, device=flat_n.device)
    for lo in range(0, flat_n.shape[0], chunk):
        hi = min(lo + chunk, flat_n.shape[0])
        if not bool((flat_l[lo:hi] != IGNORE_INDEX).any()):
            continue
        out[lo:hi] = -torch.nn.functional.cross_entropy(head_logits(flat_n[lo:hi], lm_w, softcap), flat_l[lo:hi],
                                                        ignore_index=IGNORE_INDEX, reduction="none")
    return out


def weighted_loss(flat_n, flat_l, weights, lm_w, lm_grad, chunk: int, softcap: float | None = None) -> torch.Tensor:
    """The backward of sum_t weights[t] * cross-entropy[t] (fp32 `weights`, 0 where there is no label), per
    token chunk as chunked_loss: adds the LM-head gradient to lm_grad; returns d / d flat_n."""
    d_normed = torch.zeros_like(flat_n)
    for lo in range(0, flat_n.shape[0], chunk):
        hi = min(lo + chunk, flat_n.shape[0])
        if not bool((flat_l[lo:hi] != IGNORE_INDEX).any()):
            continue
        n_c = flat_n[lo:hi].detach().requires_grad_()
        w_c = lm_w.detach().requires_grad_()
        with torch.enable_grad():
            ce = torch.nn.functional.cross_entropy(head_logits(n_c, w_c, softcap), flat_l[lo:hi],
                                                   ignore_index=IGNORE_INDEX, reduction="none")
            total = (ce * weights[lo:hi]).sum()
        gn, gw = torch.autograd.grad(total, [n_c, w_c])
        d_normed[lo:hi] = gn
        lm_grad.add_(gw)
    return d_normed


def chunked_loss(flat_n, flat_l, lm_w, lm_grad, norm_scale: float, chunk: int,
                 softcap: float | None = None) -> tuple[torch.Tensor, float]:
    """The PyTorch head loss: per token chunk a matmul, cross-entropy on fp32 logits and autograd;
    adds the LM-head gradient to lm_grad; returns (d loss*norm_scale / d flat_n, unscaled loss sum).
    `softcap`: cap * tanh(logits / cap) before the loss (Gemma 2/3), on the fp32 logits."""
    d_normed = torch.zeros_like(flat_n)
    total = 0.0
    for lo in range(0, flat_n.shape[0], chunk):
        hi = min(lo + chunk, flat_n.shape[0])
        if not bool((flat_l[lo:hi] != IGNORE_INDEX).any()):
            continue
        n_c = flat_n[lo:hi].detach().requires_grad_()
        w_c = lm_w.detach().requires_grad_()
        with torch.enable_grad():
            l_sum = cross_entropy_sum(n_c, w_c, flat_l[lo:hi], softcap)
        gn, gw = torch.autograd.grad(l_sum * norm_scale, [n_c, w_c])
        d_normed[lo:hi] = gn
        lm_grad.add_(gw)
        total += float(l_sum.detach())
    return d_normed, total


def fused_loss(fused_ce, flat_n, flat_l, lm_w, lm_grad, norm_scale: float, chunk: int) -> tuple[torch.Tensor, float]:
    """The same through kernels.fused_linear_cross_entropy: no autograd, one [chunk, V] logits buffer
    that becomes its own gradient, the LM-head gradient accumulated in lm_grad (fp32) in place."""
    loss, d_normed, _ = fused_ce(flat_n, lm_w, flat_l.to(torch.int64), ignore_index=IGNORE_INDEX,
                                 chunk_tokens=chunk, scale=norm_scale, grad_weight=lm_grad)
    return d_normed, float(loss) / norm_scale  # the kernel's loss is scaled; the engine reports sums
