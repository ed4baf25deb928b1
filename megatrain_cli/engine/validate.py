"""Validation loss: the forward alone over held-out rows, layers streamed, no autograd, no optimizer.

The same pieces as a step (engine/step.py): the step's inputs (engine/inputs.py), each layer through its
template (`Engine._layer`), the final norm and the LM head in token chunks (as engine/loss.py, without its
backward), so the value is the training loss's definition on other rows: the token-mean cross-entropy
(for a mixture of experts without the router's auxiliary term, which is a training regulariser).

What it leaves alone: host AdamW's pending updates land first (`engine.synchronize(masters=False)`: the
resident tiles are read where they are, on the device, not copied home), then nothing writes a master,
moment or gradient; the weights stream in the forward's own order (`forward_order`, less the resident
tiles), and every slot is released at the end
(`streamer.invalidate()`), so the next step starts exactly as after any step. Costs: one forward
transfer of every layer and the head per pass (none of the backward's), a pass per `group` micro-batches
(the step's count, so the device holds what a step's forward holds: no plan is exceeded), one
[chunk, vocab] fp32 logits buffer at a time, the host syncs of a step's inputs plus one to read each
pass's loss; no host state is kept (only the transient embedding rows a step's inputs gather too).
"""

from __future__ import annotations

import torch

from megatrain_cli.batch import IGNORE_INDEX, MicroBatch
from megatrain_cli.engine.head import lm_weight
from megatrain_cli.engine.inputs import step_inputs
from megatrain_cli.engine.loss import cross_entropy_sum
from megatrain_cli.engine.schedule import fetch_order
from megatrain_cli.engine.templates import run_bound


def forward_order(ops) -> list[str]:
    """The tiles a forward-only pass reads, in the order the step's forward reads them: every layer, then
    the head (the schedule's forward and head ops; no recompute, no backward)."""
    return fetch_order([op for op in ops if op.kind in ("forward", "head")])


@torch.no_grad()
def validation_loss(engine, micro_batches: list[MicroBatch], group: int = 1) -> tuple[float, int]:
    """(token-mean cross-entropy, loss tokens) of the model in `engine`'s store over `micro_batches`, run
    `group` micro-batches per pass. With ranks, each passes its own share (the same number of passes on
    every rank) and the result is the global one."""
    if not micro_batches:
        raise ValueError("validation needs at least one micro-batch")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    engine.synchronize(masters=False)  # pending host updates land: the pass reads current masters
    loss_sum, tokens = 0.0, 0
    try:
        for lo in range(0, len(micro_batches), group):
            s, n = _pass(engine, micro_batches[lo:lo + group])
            loss_sum, tokens = loss_sum + s, tokens + n
    finally:
        engine.streamer.invalidate()  # every slot free: the next step fetches as after any step
    if engine.dist is not None:
        loss_sum, tokens = engine.dist.sum_scalars([loss_sum, tokens])
        tokens = int(tokens)
    return loss_sum / max(1, tokens), tokens


def _pass(engine, mbs: list[MicroBatch]) -> tuple[float, int]:
    """One forward over `mbs`: (loss sum, loss tokens) of this process's rows."""
    streamer = engine.streamer
    streamer.begin_step([t for t in forward_order(engine.ops) if t not in engine.resident])
    x = step_inputs(mbs, engine.store, streamer, engine.layer_inputs, engine.device, engine.dtype, engine.dist,
                    check_mask=engine.plan.lean is not None)
    h, calls = x.h, x.calls
    with engine._sdpa_context():
        for i in range(engine.adapter.num_layers):
            tile = f"layers.{i}"
            w = engine.weight_views(tile, engine.acquire(tile), grad=False)
            h = [engine._layer(i, w, hid, call, m) for m, (hid, call) in enumerate(zip(h, calls))]
        loss_sum, tokens = _head_loss(engine, h, x.labels)
    return float(loss_sum), int(tokens)


def _head_loss(engine, h: list[torch.Tensor], labels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Final norm + LM head + cross-entropy summed over loss tokens, in the engine's token chunks (fp32
    logits, the family's softcap), as the training head computes it; device tensors, no sync."""
    adapter = engine.adapter
    w = engine.weight_views("head", engine.acquire("head"), grad=False)
    norm_w = {k[len("norm."):]: v for k, v in w.items() if k.startswith("norm.")}
    lm_w = lm_weight(engine, w)
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    tokens = torch.zeros((), dtype=torch.int64, device=engine.device)
    for hid, lab in zip(h, labels):
        normed = run_bound(engine.norm_template, norm_w, hid)
        flat_n, flat_l = normed.reshape(-1, normed.shape[-1]), lab.reshape(-1)
        for lo in range(0, flat_n.shape[0], engine.chunk):
            hi = min(lo + engine.chunk, flat_n.shape[0])
            total += cross_entropy_sum(flat_n[lo:hi], lm_w, flat_l[lo:hi], adapter.logit_softcap)
        tokens += (flat_l != IGNORE_INDEX).sum()
    return total, tokens
