"""Tokenising examples into (ids, loss mask), in batches.

Each example is rendered into segments (turns.py: text that carries loss, text that does not); every
segment is tokenised on its own and the pieces concatenated, the default prefix (a BOS) first unless the
template wrote it, an eos after the last reply where the plain template needs one. The mask is 1 on
tokens that carry loss (each supervised reply, its end-of-turn token included) and 0 elsewhere.

Small data (the usual case, and the bundled sample) goes through the fast tokenizer's batch call in
this process, which already spreads work over threads. Large data with `data.num_proc > 1` goes
through `datasets.map(num_proc=...)` when `datasets` is installed, so rendering (a Jinja chat template
per turn) runs in parallel too. Both paths run the same `tokenize_batch`.
"""

from __future__ import annotations

import json
from typing import Iterator

from megatrain_cli.data.example import Example
from megatrain_cli.data.prompts import default_prefix_ids, eos_id
from megatrain_cli.data.turns import render_segments

BATCH_SIZE = 1024
# Below this many examples starting worker processes costs more than it saves.
PARALLEL_MIN_EXAMPLES = 20_000

Batch = tuple[list[list[int]], list[list[int]]]  # (ids, loss mask) of each example


def tokenize_batch(batch: dict, tokenizer, template: str, train_on: str, prefix_ids: list[int], eos: int) -> dict:
    """Columns prompt / history (JSON text) / response / chat -> columns ids / mask."""
    rendered = []
    for prompt, history, response, chat in zip(batch["prompt"], batch["history"], batch["response"], batch["chat"]):
        ex = Example(prompt, response, history=json.loads(history) if history else [], chat=chat)
        rendered.append(render_segments(tokenizer, ex, template, train_on))
    texts = [seg.text for segments, _ in rendered for seg in segments]
    pieces = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    all_ids, all_masks = [], []
    n = len(prefix_ids)
    for segments, add_eos in rendered:
        ids: list[int] = []
        mask: list[int] = []
        for seg in segments:
            piece = next(pieces)
            ids += piece
            mask += [int(seg.supervised)] * len(piece)
        if ids[:n] != prefix_ids:
            ids, mask = [*prefix_ids, *ids], [0] * n + mask
        if add_eos:
            ids.append(eos)
            mask.append(1)
        all_ids.append(ids)
        all_masks.append(mask)
    return {"ids": all_ids, "mask": all_masks}


def iter_tokenized(examples: list[Example], tokenizer, template: str, train_on: str,
                   num_proc: int = 1) -> Iterator[Batch]:
    """Batches of (ids, loss mask), in example order.

    Batches, not one list: the caller packs each into int32 arrays, so a large data set never sits in
    memory as Python ints (about 36 bytes each, against 4).
    """
    columns = {"prompt": [ex.prompt for ex in examples],
               "history": [json.dumps(ex.history) if ex.history else "" for ex in examples],
               "response": [ex.response for ex in examples],
               "chat": [ex.chat for ex in examples]}
    args = dict(tokenizer=tokenizer, template=template, train_on=train_on, prefix_ids=default_prefix_ids(tokenizer),
                eos=eos_id(tokenizer))
    if num_proc > 1 and len(examples) >= PARALLEL_MIN_EXAMPLES:
        mapped = _map_with_datasets(columns, args, num_proc)
        if mapped is not None:
            for batch in mapped.iter(batch_size=BATCH_SIZE):
                yield batch["ids"], batch["mask"]
            return
    for lo in range(0, len(examples), BATCH_SIZE):
        out = tokenize_batch({k: v[lo:lo + BATCH_SIZE] for k, v in columns.items()}, **args)
        yield out["ids"], out["mask"]


def _map_with_datasets(columns: dict, args: dict, num_proc: int):
    try:
        from datasets import Dataset
    except ImportError:  # the GPU machine may not have it: the in-process path is always there
        return None
    ds = Dataset.from_dict(columns)
    return ds.map(tokenize_batch, fn_kwargs=args, batched=True, batch_size=BATCH_SIZE, num_proc=num_proc,
                  remove_columns=list(columns), desc="tokenising")
