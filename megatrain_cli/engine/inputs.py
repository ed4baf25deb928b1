"""A step's inputs on the device: embedding rows, rotary tables, masks and shifted labels per micro-batch.

Only the step's unique token rows cross PCIe (gathered from the fp32 master on the host and cast on the
way; on the data-parallel path each rank reads the rows it owns), never the whole embedding table; the
labels are shifted once here. Costs one host-to-device copy of |unique tokens| x hidden rows and, with
ranks, the all-reduces of the row exchange and of the global loss-token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain_cli.batch import IGNORE_INDEX, MAX_LONG_CONTEXT_MASK, MicroBatch, block_causal_mask


@dataclass
class StepInputs:
    ids: torch.Tensor  # every input id of the step, flat (host)
    uniq: torch.Tensor  # the step's unique ids, sorted (host)
    inverse: torch.Tensor  # ids -> index into uniq (device)
    h: list  # per micro-batch hidden states [B, T, H] (device)
    ctx: list  # per micro-batch (rotary cos/sin, block-causal mask or None, position ids)
    labels: list  # per micro-batch labels shifted by one, IGNORE_INDEX at the end of each row
    offsets: list  # per micro-batch (start, end) into the flat ids
    loss_tokens: int  # tokens that carry loss, over every rank's micro-batches


def check_mask_size(pos: torch.Tensor) -> None:
    """The long-context path refuses packed rows whose [T, T] block-causal mask would pass
    MAX_LONG_CONTEXT_MASK (it would also keep SDPA off flash/cuDNN); one host sync on the positions."""
    b, t = pos.shape
    if b * t * t > MAX_LONG_CONTEXT_MASK and bool((pos[:, 1:] == 0).any()):
        raise ValueError(f"packed rows (positions restart inside a row) of {t} tokens need a [T, T] block-causal "
                         f"mask ({b * t * t / 2**30:.0f} GiB) and keep SDPA off flash/cuDNN: at long context "
                         f"train one document per row (data.packing=false)")


def step_inputs(mbs: list[MicroBatch], store, streamer, rotary, device: torch.device, dtype: torch.dtype, dist=None,
                check_mask: bool = False) -> StepInputs:
    """`check_mask`: refuse packed rows too long for their mask (check_mask_size), on the long-context path."""
    H = store.adapter.hidden_size
    ids_all = torch.cat([mb.input_ids.reshape(-1) for mb in mbs])
    uniq, inverse = torch.unique(ids_all, return_inverse=True)
    if dist is None:
        rows = store.tiles["embed"].master.view(-1, H)[uniq].to(device, dtype)
    else:
        rows = streamer.embed_rows(uniq)  # the rows live on their owner ranks
    inv_dev = inverse.to(device)
    h, ctx, labels, offsets = [], [], [], []
    n_loss_tokens, start = 0, 0
    for mb in mbs:
        b, t = mb.input_ids.shape
        offsets.append((start, start + b * t))
        h.append(rows[inv_dev[start:start + b * t]].view(b, t, H))
        start += b * t
        pos = mb.position_ids if mb.position_ids is not None else torch.arange(t).expand(b, t)
        pos = pos.to(device)
        if check_mask:
            check_mask_size(pos)
        ctx.append((rotary(h[-1], pos), block_causal_mask(pos), pos))
        shifted = torch.full_like(mb.labels, IGNORE_INDEX)
        shifted[:, :-1] = mb.labels[:, 1:]
        labels.append(shifted.to(device))
        n_loss_tokens += int((shifted != IGNORE_INDEX).sum())
    if dist is not None:  # every rank scales by the global batch's loss tokens
        n_loss_tokens = int(dist.sum_scalars([n_loss_tokens])[0])
    return StepInputs(ids_all, uniq, inv_dev, h, ctx, labels, offsets, n_loss_tokens)
