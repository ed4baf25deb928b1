"""A step's inputs on the device: embedding rows, every layer's call arguments and shifted labels per micro-batch.

Only the step's unique token rows cross PCIe (gathered from the master on the host and cast there into
page-locked memory; on the data-parallel path each rank reads the rows it owns), never the whole embedding
table; the labels are shifted once here. Costs one host-to-device copy of |unique tokens| x hidden rows and, with
ranks, the all-reduces of the row exchange and of the global loss-token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain_cli.batch import IGNORE_INDEX, MAX_LONG_CONTEXT_MASK, MicroBatch
from megatrain_cli.models.attention import document_bounds
from megatrain_cli.models.vision import PACKING_BIDIRECTIONAL


@dataclass
class StepInputs:
    ids: torch.Tensor  # every input id of the step, flat (host)
    uniq: torch.Tensor  # the step's unique ids, sorted (host)
    inverse: torch.Tensor  # ids -> index into uniq (device)
    h: list  # per micro-batch layer-0 inputs [B, T, H] (device, detached)
    calls: list  # per micro-batch LayerCall: every layer's keyword arguments
    transforms: list  # per micro-batch (embedding output, layer-0 input, image features or None) when HF's
    #                   decoder code transformed one into the other (a multiplier in the decoder's forward: see
    #                   layer_inputs.py; a VLM's image features placed), else None
    labels: list  # per micro-batch labels shifted by one, IGNORE_INDEX at the end of each row
    offsets: list  # per micro-batch (start, end) into the flat ids
    loss_tokens: int  # tokens that carry loss, over every rank's micro-batches


def check_mask_size(pos: torch.Tensor, window: int | None) -> None:
    """The long-context path refuses rows whose dense [T, T] mask would pass MAX_LONG_CONTEXT_MASK (it would
    also keep SDPA off flash/cuDNN): one document per row with a sliding window shorter than the row. Packed
    rows build no mask (models/attention.py: the documents' boundaries go to the attention instead), nor
    does a row without a window. `pos`: the host positions."""
    b, t = pos.shape
    if b * t * t <= MAX_LONG_CONTEXT_MASK or window is None or window >= t or document_bounds(pos) is not None:
        return
    raise ValueError(f"the model's sliding window ({window} tokens) is shorter than train.seq_len ({t}): its "
                     f"dense [T, T] mask ({b * t * t / 2**30:.0f} GiB) is too large at long context; use "
                     f"train.seq_len <= {int((MAX_LONG_CONTEXT_MASK // b) ** 0.5)}")


def step_inputs(mbs: list[MicroBatch], store, streamer, layer_inputs, device: torch.device, dtype: torch.dtype,
                dist=None, check_mask: bool = False, features: list | None = None) -> StepInputs:
    """`layer_inputs`: the adapter's LayerInputs on this device. `check_mask`: refuse rows too long for a
    dense mask (check_mask_size), on the long-context path. `features`: a vision-language model's image
    features per micro-batch (engine/vision_phase.py), placed at its image tokens with HF's own mask; its
    rows then take the family's multimodal positions (models/vision.py)."""
    adapter = store.adapter
    H = adapter.hidden_size
    ids_all = torch.cat([mb.input_ids.reshape(-1) for mb in mbs])
    uniq, inverse = torch.unique(ids_all, return_inverse=True)
    if dist is None:
        rows = _gathered_rows(store.tiles["embed"].master.view(-1, H), uniq, device, dtype)
    else:
        rows = streamer.embed_rows(uniq)  # the rows live on their owner ranks
    if adapter.input_scale is not None:  # the embedding module's scale, in the weights' dtype as HF does
        rows = rows * embed_scale(adapter, dtype)
    inv_dev = inverse.to(device)
    h, calls, transforms, labels, offsets = [], [], [], [], []
    n_loss_tokens, start = 0, 0
    for m, mb in enumerate(mbs):
        b, t = mb.input_ids.shape
        offsets.append((start, start + b * t))
        e = rows[inv_dev[start:start + b * t]].view(b, t, H).requires_grad_()
        start += b * t
        pos = mb.position_ids if mb.position_ids is not None else torch.arange(t).expand(b, t)
        pos = pos.cpu()  # read on the host (documents, the mask check), moved by layer_inputs
        if check_mask:
            check_mask_size(pos, adapter.sliding_window)
        feats = features[m] if features is not None else None
        x, masks = e, None
        if mb.images is not None:
            if feats is None:
                raise ValueError("rows with images run in a training step only")
            packed = mb.position_ids is not None and document_bounds(pos) is not None
            if packed and adapter.vision.bidirectional_images():
                raise ValueError(PACKING_BIDIRECTIONAL)
            with torch.enable_grad():
                x = adapter.vision.scatter(mb.input_ids, e, feats)
            # packed rows: each document's own multimodal positions, [4, B, T] with the documents' text
            # positions in front (models/vision.py); rows of one example: [3, B, T] over the whole row
            mm_pos = adapter.vision.position_ids(mb.input_ids, mb.images, pos if packed else None)
            pos = mm_pos if mm_pos is not None else pos
            masks = adapter.vision.decoder_masks(mb.input_ids, x)
        with torch.enable_grad():
            call = layer_inputs(x, pos, masks)
        transforms.append(None if call.hidden is e else (e, call.hidden, feats))
        h.append(call.hidden.detach())
        call.hidden = None  # held by h (and transforms) only: the long-context offloader may move it out
        calls.append(call)
        shifted = torch.full_like(mb.labels, IGNORE_INDEX)
        shifted[:, :-1] = mb.labels[:, 1:]
        labels.append(shifted.to(device))
        n_loss_tokens += int((shifted != IGNORE_INDEX).sum())
    if dist is not None:  # every rank scales by the global batch's loss tokens
        n_loss_tokens = int(dist.sum_scalars([n_loss_tokens])[0])
    return StepInputs(ids_all, uniq, inv_dev, h, calls, transforms, labels, offsets, n_loss_tokens)


def _gathered_rows(table: torch.Tensor, uniq: torch.Tensor, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
    """The masters' rows of `uniq`, in the compute dtype, on the device. On CUDA they are cast on the host into
    page-locked memory (the same rounding as a device cast; half the bytes of fp32 over PCIe) and copied
    without blocking: a pageable copy runs at a fraction of the link and stops the host. The pinned buffer is
    cached by torch's host allocator (it also keeps it until the copy has read it)."""
    rows = table[uniq]
    if device.type != "cuda":
        return rows.to(device, dtype)
    host = torch.empty(rows.shape, dtype=dtype, pin_memory=True)
    host.copy_(rows)
    return host.to(device, non_blocking=True)


def embed_scale(adapter, dtype: torch.dtype) -> float:
    """The embedding module's scale rounded to the compute dtype (Gemma casts it to the weights' dtype)."""
    return float(torch.tensor(adapter.input_scale, dtype=torch.float32).to(dtype))


def embed_output_grads(transform, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d loss / d embedding output, d loss / d image features or None), from d loss / d layer-0 input:
    through HF's decoder code when it transformed the embeddings (autograd over its few elementwise ops;
    a VLM's image features placed among them), else the same tensor."""
    if transform is None:
        return grad, None
    embeds, hidden, feats = transform
    wrt = [embeds] + ([feats] if feats is not None and feats.requires_grad else [])
    out = torch.autograd.grad(hidden, wrt, grad)
    return out[0], (out[1] if len(out) > 1 else None)
