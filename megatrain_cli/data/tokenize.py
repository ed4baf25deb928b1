"""Tokenising examples into (prompt ids, response ids + eos), in batches.

Small data (the usual case, and the bundled sample) goes through the fast tokenizer's batch call in
this process, which already spreads work over threads. Large data with `data.num_proc > 1` goes
through `datasets.map(num_proc=...)` when `datasets` is installed, so prompt rendering (a Jinja chat
template per example) runs in parallel too. Both paths run the same `tokenize_batch`.
"""

from __future__ import annotations

import json
from typing import Iterator

from megatrain_cli.data.example import Example
from megatrain_cli.data.prompts import default_prefix_ids, eos_id, render_prompt

BATCH_SIZE = 1024
# Below this many examples starting worker processes costs more than it saves.
PARALLEL_MIN_EXAMPLES = 20_000


def tokenize_batch(batch: dict, tokenizer, template: str, prefix_ids: list[int], eos: int) -> dict:
    """Columns prompt / history (JSON text) / response -> columns prompt_ids / response_ids."""
    texts = [render_prompt(tokenizer, p, template, json.loads(h) if h else None)
             for p, h in zip(batch["prompt"], batch["history"])]
    prompt_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    n = len(prefix_ids)
    prompt_ids = [ids if ids[:n] == prefix_ids else [*prefix_ids, *ids] for ids in prompt_ids]
    response_ids = [[*ids, eos] for ids in tokenizer(list(batch["response"]), add_special_tokens=False)["input_ids"]]
    return {"prompt_ids": prompt_ids, "response_ids": response_ids}


def iter_tokenized(examples: list[Example], tokenizer, template: str,
                   num_proc: int = 1) -> Iterator[tuple[list[list[int]], list[list[int]]]]:
    """Batches of (prompt ids, response ids ending in eos), in example order.

    Batches, not one list: the caller packs each into int32 arrays, so a large data set never sits in
    memory as Python ints (about 36 bytes each, against 4).
    """
    columns = {"prompt": [ex.prompt for ex in examples],
               "history": [json.dumps(ex.history) if ex.history else "" for ex in examples],
               "response": [ex.response for ex in examples]}
    args = dict(tokenizer=tokenizer, template=template, prefix_ids=default_prefix_ids(tokenizer),
                eos=eos_id(tokenizer))
    if num_proc > 1 and len(examples) >= PARALLEL_MIN_EXAMPLES:
        mapped = _map_with_datasets(columns, args, num_proc)
        if mapped is not None:
            for batch in mapped.iter(batch_size=BATCH_SIZE):
                yield batch["prompt_ids"], batch["response_ids"]
            return
    for lo in range(0, len(examples), BATCH_SIZE):
        out = tokenize_batch({k: v[lo:lo + BATCH_SIZE] for k, v in columns.items()}, **args)
        yield out["prompt_ids"], out["response_ids"]


def tokenize_examples(examples: list[Example], tokenizer, template: str,
                      num_proc: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids ending in eos) for every example, in order (for small data and tests)."""
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    for p, r in iter_tokenized(examples, tokenizer, template, num_proc):
        prompts += p
        responses += r
    return prompts, responses


def _map_with_datasets(columns: dict, args: dict, num_proc: int):
    try:
        from datasets import Dataset
    except ImportError:  # the GPU machine may not have it: the in-process path is always there
        return None
    ds = Dataset.from_dict(columns)
    return ds.map(tokenize_batch, fn_kwargs=args, batched=True, batch_size=BATCH_SIZE, num_proc=num_proc,
                  remove_columns=list(columns), desc="tokenising")
