"""The head phase of a step: final norm + LM head + cross-entropy, forward and backward at once.

Runs on the last layer's output for every micro-batch, in token chunks (engine/loss.py) so the full
logits never exist. The head tile streams in once; with tied embeddings the LM head is the embedding
table's slot, and its gradient (the whole table's, fp32 on the device until the embedding rows are
added) is returned for the embedding backward to send. Costs one D2H of the head's gradient.
`HeadWeights` is the head tile as every head uses it: SFT's here, the preference methods'
(engine/preference_head.py) and the forward-only passes' (engine/validate.py).
"""

from __future__ import annotations

import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.engine.grad_norm import squared_norm
from megatrain_cli.engine.loss import chunked_loss, fused_loss
from megatrain_cli.engine.templates import run_bound


def lm_weight(engine, head_views: dict) -> torch.Tensor:
    """The LM head's [vocab, hidden] weight: the head tile's, or with tied embeddings the embedding table
    (streamed into its own slot)."""
    if engine.adapter.tied:
        return engine.streamer.acquire("embed").view(engine.adapter.vocab_size, -1)
    return head_views["lm_head.weight"]


class HeadWeights:
    """The head tile on the device: the final norm's and the LM head's weights and, with `grad`, their fp32
    gradients, accumulated over the step's micro-batches and sent by `finish`."""

    def __init__(self, engine, grad: bool = True):
        self.engine = engine
        w = engine.weight_views("head", engine.acquire("head"), grad=False)
        self.norm_w = {k[len("norm."):]: v.detach().requires_grad_() if grad else v
                       for k, v in w.items() if k.startswith("norm.")}
        self.lm_w = lm_weight(engine, w)
        self.tied_flat = None
        if not grad:
            return
        if engine.adapter.tied:  # the embedding tile's gradient: padded on the distributed path
            self.tied_flat = engine.grad_zeros("embed")
            self.lm_grad = self.tied_flat[:self.lm_w.numel()].view(self.lm_w.shape)
        else:
            self.lm_grad = torch.zeros(self.lm_w.shape, dtype=torch.float32, device=engine.device)
        self.norm_grad = {k: torch.zeros(v.shape, dtype=torch.float32, device=engine.device)
                          for k, v in self.norm_w.items()}

    def norm(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x as a leaf, the final norm of it with its graph)."""
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            return x, run_bound(self.engine.norm_template, self.norm_w, x)

    def norm_backward(self, x: torch.Tensor, normed: torch.Tensor, d_normed: torch.Tensor) -> torch.Tensor:
        """d / d x from d / d normed (flat); the norm weights' gradient accumulated."""
        out = torch.autograd.grad(normed, [x, *self.norm_w.values()], d_normed.view_as(normed))
        for name, g in zip(self.norm_w, out[1:]):
            self.norm_grad[name].add_(g)
        return out[0]

    def finish(self, sq_norm: torch.Tensor) -> torch.Tensor | None:
        """The head tile's gradient written and sent; with tied embeddings the embedding tile's gradient is
        returned (sent after the embedding rows are added)."""
        engine = self.engine
        head_acc = engine.grad_zeros("head")
        views = engine.store.layouts["head"].views(head_acc)
        for name, g in self.norm_grad.items():
            views["norm." + name].copy_(g)
        if not engine.adapter.tied:
            views["lm_head.weight"].copy_(self.lm_grad)
        sq = squared_norm(head_acc)
        sq_norm.add_(sq)
        engine.send_grad("head", head_acc, sq)
        return self.tied_flat


def run_head(engine, h, labels, norm_scale, sq_norm):
    """Final norm + LM head + cross-entropy, in token chunks so full logits never exist."""
    head = HeadWeights(engine)
    grads_out, losses = [], []
    for x, lab in zip(h, labels):
        x, normed = head.norm(x)
        flat_n = normed.detach().reshape(-1, normed.shape[-1])
        flat_l = lab.reshape(-1)
        if engine.fused_ce is not None:
            d_normed, loss_sum = fused_loss(engine.fused_ce, flat_n, flat_l, head.lm_w, head.lm_grad, norm_scale,
                                            engine.chunk)
        else:
            d_normed, loss_sum = chunked_loss(flat_n, flat_l, head.lm_w, head.lm_grad, norm_scale, engine.chunk,
                                              engine.adapter.logit_softcap)
        n_tok = int((flat_l != IGNORE_INDEX).sum())
        grads_out.append(head.norm_backward(x, normed, d_normed))
        losses.append((loss_sum / max(1, n_tok), n_tok))
    # Tied: the whole embedding tile's gradient, sent after the embedding rows are added; else sent now.
    return grads_out, losses, head.finish(sq_norm)
