"""The embedding's backward: the step's token-row gradients, summed on the device per unique token, sent.

Only the rows of the step's unique tokens exist (the host gathers and updates those rows only); with a tied
LM head they are added into the head's whole-table gradient instead, which is then sent as one tile. Costs:
one index_add over the step's tokens and one D2H of |unique tokens| x hidden fp32 rows (or the tied table).
"""

from __future__ import annotations

import torch

from megatrain_cli.engine.grad_norm import squared_norm
from megatrain_cli.engine.inputs import embed_scale


def embed_backward(engine, grads_out, uniq, inv_dev, offsets, tied_flat, sq_norm) -> None:
    """`grads_out`: per micro-batch d loss / d embedding output; `tied_flat`: the tied head's gradient tile."""
    adapter, dev = engine.adapter, engine.device
    H = adapter.hidden_size
    rows = torch.zeros(uniq.numel(), H, dtype=torch.float32, device=dev)
    for g, (lo, hi) in zip(grads_out, offsets):
        rows.index_add_(0, inv_dev[lo:hi], g.reshape(-1, H).float())
    if adapter.input_scale is not None:  # the embedding module's scale (Gemma)
        rows.mul_(embed_scale(adapter, engine.dtype))
    pad = adapter.padding_idx
    # The unique ids on the device, copied once (a small synchronous copy from pageable memory).
    uniq_dev = uniq.to(dev) if pad is not None or tied_flat is not None else None
    if pad is not None:  # nn.Embedding(padding_idx=...): that row gets no input-side gradient, as in HF
        rows.masked_fill_((uniq_dev == pad).unsqueeze(1), 0.0)  # no host sync
    if tied_flat is not None:
        tied_grad = tied_flat[:adapter.vocab_size * H].view(adapter.vocab_size, H)
        tied_grad.index_add_(0, uniq_dev, rows)
        sq = squared_norm(tied_flat)
        sq_norm.add_(sq)
        engine.sink.send("embed", tied_flat, sq)
    else:
        sq = squared_norm(rows)
        sq_norm.add_(sq)
        engine.sink.send_rows("embed", rows, uniq, sq)
