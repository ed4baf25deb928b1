"""Forward-only passes over the streamed layers (no autograd, no optimizer): one pass runner, several heads.
`validation_loss` (the held-out rows' loss) and `score_passes` (each sequence's log-prob sum: the preference
methods' reference pass and their held-out eval, with the preference head's pass 1) both run `forward_passes`.

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

import itertools
from typing import Callable, Iterable

import torch

from megatrain_cli.batch import IGNORE_INDEX, MicroBatch
from megatrain_cli.engine.head import HeadWeights
from megatrain_cli.engine.inputs import step_inputs
from megatrain_cli.engine.loss import cross_entropy_sum
from megatrain_cli.engine.preference_head import score
from megatrain_cli.engine.schedule import fetch_order
from megatrain_cli.engine.templates import run_bound


def forward_order(ops) -> list[str]:
    """The tiles a forward-only pass reads, in the order the step's forward reads them: every layer, then
    the head (the schedule's forward and head ops; no recompute, no backward)."""
    return fetch_order([op for op in ops if op.kind in ("forward", "head")])


@torch.no_grad()
def forward_passes(engine, micro_batches: Iterable[MicroBatch], group: int, head: Callable,
                   on_pass: Callable[[list], None] | None = None) -> None:
    """Stream the model over `micro_batches`, `group` of them per pass (the device holds what a step's
    forward holds), and call head(engine, last hidden states, StepInputs, micro-batches) at the end of each
    pass; on_pass(the pass's micro-batches) after it. Every rank must run as many passes (collectives)."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    engine.synchronize(masters=False)  # pending host updates land: the pass reads current masters
    before_first_step = not engine.resident.loaded  # the reference pass: a resume may still fill the host tiles
    if before_first_step:
        engine.resident.load(weights_only=True)  # forward only: no moments, released after
    batches = iter(micro_batches)
    try:
        while mbs := list(itertools.islice(batches, group)):
            _pass(engine, mbs, head)
            if on_pass is not None:
                on_pass(mbs)
    finally:
        engine.streamer.invalidate()  # every slot free: the next step fetches as after any step
        if before_first_step:
            engine.resident.release()


def validation_loss(engine, micro_batches: list[MicroBatch], group: int = 1) -> tuple[float, int]:
    """(token-mean cross-entropy, loss tokens) of the model in `engine`'s store over `micro_batches`, run
    `group` micro-batches per pass. With ranks, each passes its own share (the same number of passes on
    every rank) and the result is the global one."""
    if not micro_batches:
        raise ValueError("validation needs at least one micro-batch")
    sums = []
    forward_passes(engine, micro_batches, group, lambda e, h, x, mbs: sums.append(_head_loss(e, h, x.labels)))
    loss_sum, tokens = sum(float(s) for s, _ in sums), sum(int(n) for _, n in sums)
    if engine.dist is not None:
        loss_sum, tokens = engine.dist.sum_scalars([loss_sum, tokens])
        tokens = int(tokens)
    return loss_sum / max(1, tokens), tokens


def score_passes(engine, micro_batches: Iterable[MicroBatch], group: int,
                 on_scores: Callable[[MicroBatch, object], None], on_pass: Callable[[list], None] | None = None) -> None:
    """Each sequence's sum of label log-probs and its label count (methods SequenceScores), by the preference
    head's pass 1 (engine/preference_head.score: the function a training step scores the policy with), per
    micro-batch: on_scores(micro-batch, its scores on the device); on_pass as forward_passes'."""
    def head(e, h, x, mbs):
        weights = HeadWeights(e, grad=False)
        for hid, lab, mb in zip(h, x.labels, mbs):
            on_scores(mb, score(e, weights, hid, lab, mb))

    forward_passes(engine, micro_batches, group, head, on_pass)


def _pass(engine, mbs: list[MicroBatch], head: Callable):
    """One forward over `mbs`, ending in `head`."""
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
        return head(engine, h, x, mbs)


def _head_loss(engine, h: list[torch.Tensor], labels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Final norm + LM head + cross-entropy summed over loss tokens, in the engine's token chunks (fp32
    logits, the family's softcap), as the training head computes it; device tensors, no sync."""
    head = HeadWeights(engine, grad=False)
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    tokens = torch.zeros((), dtype=torch.int64, device=engine.device)
    for hid, lab in zip(h, labels):
        normed = run_bound(engine.norm_template, head.norm_w, hid)
        flat_n, flat_l = normed.reshape(-1, normed.shape[-1]), lab.reshape(-1)
        for lo in range(0, flat_n.shape[0], engine.chunk):
            hi = min(lo + engine.chunk, flat_n.shape[0])
            total += cross_entropy_sum(flat_n[lo:hi], head.lm_w, flat_l[lo:hi], engine.adapter.logit_softcap)
        tokens += (flat_l != IGNORE_INDEX).sum()
    return total, tokens
