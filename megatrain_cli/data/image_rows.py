"""Training rows of chats with images: ids and loss mask from the model's processor, packed or one example
per row, each micro-batch handed its rows' images as the image processor's tensors (models/processor.py).

An example is rendered into segments as a text chat is (turns.py: the chat template, the replies that
carry loss), with each IMAGE placeholder written as the processor's image marker; a segment holding images
is tokenised with them (each image token expanded to the image's feature count: Qwen2-VL's dynamic
resolution, the image's own size kept within the processor's bounds), any other as text. Loss: the
supervised replies' tokens only; an image token never carries loss. Images are decoded again per
micro-batch rather than held: a row's pixels cost memory only while its step runs.

With data.packing, examples are packed into rows as text examples are (packing.py: best-fit decreasing by
length; position_ids restart at 0 where each one starts), images and all: a row's images are its documents'
in order, and the engine gives each document the multimodal positions it would have alone (models/vision.py)
and attention within itself only (models/attention.py). Without it, one example per row, position_ids None
(the engine's multimodal positions over the whole row), as before packing existed here.
An example whose image tokens would pass train.seq_len is left out (cutting it would cut an image).
"""

from __future__ import annotations

import dataclasses

import torch

from megatrain_cli.batch import MicroBatch
from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.data.images import IMAGE
from megatrain_cli.data.load import source_label
from megatrain_cli.data.packing import pack_rows
from megatrain_cli.data.prompts import default_prefix_ids, eos_id, pad_id
from megatrain_cli.data.train_data import EMPTY_REPLIES, NO_REPLY, TrainData
from megatrain_cli.data.turns import render_segments
from megatrain_cli.recipe import DataConfig

IMAGES_CUT = "its image tokens pass train.seq_len"


class ImageTrainData(TrainData):
    """TrainData whose micro-batches carry their rows' images (`MicroBatch.images`)."""

    def __init__(self, *args, images: list[list[str]], processor, **kwargs):
        super().__init__(*args, **kwargs)
        self.images = images  # per kept example, its image paths in placeholder order
        self.processor = processor

    def micro_batch(self, rows: list[int]) -> MicroBatch:
        mb = super().micro_batch(rows)
        if not self.packing:  # one example per row: the engine gives the rows their multimodal positions
            mb.position_ids = None
        paths = [p for r in rows for ex in self.rows[r] for p in self.images[ex]]
        mb.images = self.processor.images(paths) if paths else None
        return mb

    def probe_images(self, micro_batch_size: int) -> tuple[int, int] | None:
        """The planner probe's tower shape for these rows (engine/plan/probe.recipe_shape): (images a micro-batch,
        patches a side), as square images of the data's mean patches each (the tower's work is linear in
        patches: attention runs per image or window); None without images, or for a processor of a fixed count
        (LLaVA, Gemma 3: the probe's pixel rows are Qwen-VL's)."""
        merge = int(getattr(self.processor, "merge", 0) or 0)
        images = sum(map(len, self.images))
        if not images or not merge:
            return None
        patches = int((self.tokens == self.processor.image_token_id).sum()) * merge ** 2 / images
        return max(1, round(images / self.num_rows * micro_batch_size)), merge * max(1, round(patches ** 0.5 / merge))


def encode_example(processor, ex: Example, template: str, train_on: str) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one example with images, as the processor reads it."""
    marker = processor.marker
    swap = lambda text: text.replace(IMAGE, marker)  # noqa: E731
    rendered = dataclasses.replace(ex, prompt=swap(ex.prompt), response=swap(ex.response),
                                   history=[{**t, "content": swap(t["content"])} for t in ex.history])
    segments, add_eos = render_segments(processor.tokenizer, rendered, template, train_on)
    paths = iter(ex.images)
    ids: list[int] = []
    mask: list[int] = []
    for seg in segments:
        n = seg.text.count(processor.image_token)  # the token each image is marked with (processor.py)
        piece, _ = processor.encode(seg.text, [next(paths) for _ in range(n)])
        ids += piece
        mask += [int(seg.supervised and i != processor.image_token_id) for i in piece]
    prefix = default_prefix_ids(processor.tokenizer)
    if ids[:len(prefix)] != prefix:
        ids, mask = [*prefix, *ids], [0] * len(prefix) + mask
    if add_eos:
        ids.append(eos_id(processor.tokenizer))
        mask.append(1)
    return ids, mask


def build_image_data(examples: list[Example], processor, data_cfg: DataConfig, seq_len: int,
                     seed: int) -> ImageTrainData:
    """Every example tokenised through the processor, packed into rows (data.packing) or one per row (left
    out: nothing to learn, or an image past seq_len)."""
    label = source_label(data_cfg)
    left_out: dict[str, list[int]] = {}
    ids_all, masks, lengths, images = [], [], [], []
    truncated = 0
    for ex in examples:
        why = ex.unusable or ("" if any(t["content"].strip() for t in ex.messages() if t["role"] == "assistant")
                              else EMPTY_REPLIES)
        ids, mask = encode_example(processor, ex, data_cfg.template, data_cfg.train_on) if not why else ([], [])
        if not why and not any(mask[:seq_len]):
            why = NO_REPLY if not any(mask) else f"the prompt fills train.seq_len={seq_len}"
        if not why and processor.image_token_id in ids[seq_len:]:
            why = IMAGES_CUT
        if why:
            left_out.setdefault(why, []).append(ex.record)
            continue
        if len(ids) > seq_len:
            truncated += 1
            ids, mask = ids[:seq_len], mask[:seq_len]
        ids_all += ids
        masks += mask
        lengths.append(len(ids))
        images.append(list(ex.images))
    if not lengths:
        raise DataError(f"{label}: nothing left to train on ({', '.join(sorted(left_out))})")
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    rows = pack_rows(lengths, seq_len) if data_cfg.packing else [[i] for i in range(len(lengths))]
    return ImageTrainData(torch.tensor(ids_all, dtype=torch.int32), offsets, torch.tensor(masks, dtype=torch.bool),
                          rows, seq_len=seq_len, pad_token_id=pad_id(processor.tokenizer), seed=seed,
                          packing=data_cfg.packing, truncated=truncated,
                          left_out=left_out, images=images, processor=processor)
