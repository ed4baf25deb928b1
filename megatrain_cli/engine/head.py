"""The head phase of a step: final norm + LM head + cross-entropy, forward and backward at once.

Runs on the last layer's output for every micro-batch, in token chunks (engine/loss.py) so the full
logits never exist. The head tile streams in once; with tied embeddings the LM head is the embedding
table's slot, and its gradient (the whole table's, fp32 on the device until the embedding rows are
added) is returned for the embedding backward to send. Costs one D2H of the head's gradient.
"""

from __future__ import annotations

import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.engine.loss import chunked_loss, fused_loss
from megatrain_cli.engine.templates import run_bound


def lm_weight(engine, head_views: dict) -> torch.Tensor:
    """The LM head's [vocab, hidden] weight: the head tile's, or with tied embeddings the embedding table
    (streamed into its own slot)."""
    if engine.adapter.tied:
        return engine.streamer.acquire("embed").view(engine.adapter.vocab_size, -1)
    return head_views["lm_head.weight"]


def run_head(engine, h, labels, norm_scale, sq_norm):
    """Final norm + LM head + cross-entropy, in token chunks so full logits never exist."""
    flat = engine.acquire("head")
    w = engine.weight_views("head", flat, grad=False)
    norm_w = {k[len("norm."):]: v.detach().requires_grad_() for k, v in w.items() if k.startswith("norm.")}
    lm_w = lm_weight(engine, w)
    if engine.adapter.tied:  # the embedding tile's gradient: padded on the distributed path
        tied_flat = engine.grad_zeros("embed")
        lm_grad = tied_flat[:lm_w.numel()].view(lm_w.shape)
    else:
        lm_grad = torch.zeros(lm_w.shape, dtype=torch.float32, device=engine.device)
    norm_grad = {k: torch.zeros(v.shape, dtype=torch.float32, device=engine.device) for k, v in norm_w.items()}
    grads_out, losses = [], []
    for x, lab in zip(h, labels):
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            normed = run_bound(engine.norm_template, norm_w, x)
        flat_n = normed.detach().reshape(-1, normed.shape[-1])
        flat_l = lab.reshape(-1)
        if engine.fused_ce is not None:
            d_normed, loss_sum = fused_loss(engine.fused_ce, flat_n, flat_l, lm_w, lm_grad, norm_scale, engine.chunk)
        else:
            d_normed, loss_sum = chunked_loss(flat_n, flat_l, lm_w, lm_grad, norm_scale, engine.chunk,
                                              engine.adapter.logit_softcap)
        n_tok = int((flat_l != IGNORE_INDEX).sum())
        out = torch.autograd.grad(normed, [x, *norm_w.values()], d_normed.view_as(normed))
        grads_out.append(out[0])
        for name, g in zip(norm_w, out[1:]):
            norm_grad[name].add_(g)
        losses.append((loss_sum / max(1, n_tok), n_tok))
    head_layout = engine.store.layouts["head"]
    head_acc = engine.grad_zeros("head")
    views = head_layout.views(head_acc)
    for name, g in norm_grad.items():
        views["norm." + name].copy_(g)
    if not engine.adapter.tied:
        views["lm_head.weight"].copy_(lm_grad)
    sq = torch.dot(head_acc, head_acc)
    sq_norm.add_(sq)
    engine.send_grad("head", head_acc, sq)
    # Tied: the whole embedding tile's gradient, sent after the embedding rows are added; else sent now.
    return grads_out, losses, (tied_flat if engine.adapter.tied else None)
