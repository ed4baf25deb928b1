"""A disk cache of tokenised examples, so a rerun (a resume, a second recipe on the same data) skips
tokenisation.

Key: SHA-256 over the examples' text (prompt, history with any system prompt, response, chat layout,
in order), the tokenizer's full serialisation (vocabulary, merges, normaliser, chat template, special
tokens), the prompt template and `data.train_on`. Hashing the text costs one pass over it, far less
than tokenising it. What is cached is the untruncated (ids, loss mask) of every example, before
seq_len is applied, so the same entry serves every seq_len and packing choice.

Format: one safetensors file (no pickle) with three tensors: every example's tokens back to back
(int32), their loss mask (uint8) and each example's length (int64). Written to a temporary name and
renamed, so an interrupted write never leaves a truncated entry that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from megatrain_cli.data.example import Example
from megatrain_cli.data.tokenize import BATCH_SIZE, Batch, iter_tokenized

FORMAT_VERSION = 2  # bump when what tokenize_batch produces changes


def default_cache_dir() -> Path:
    """data.cache_dir 'auto': the user's cache directory (the platform's XDG convention, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatrain" / "tokenized"


def tokenizer_fingerprint(tokenizer) -> str:
    """Everything that decides the ids: the fast tokenizer's JSON, the chat template, special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_key(examples: list[Example], tokenizer, template: str, train_on: str) -> str:
    h = hashlib.sha256(f"megatrain-tokens:v{FORMAT_VERSION}:{template}:{train_on}:".encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    for ex in examples:
        h.update(b"\x00c" if ex.chat else b"\x00p")
        h.update(ex.prompt.encode())
        h.update(b"\x00h")
        h.update(json.dumps(ex.history).encode() if ex.history else b"")
        h.update(b"\x00r")
        h.update(ex.response.encode())
    return h.hexdigest()


def read(path: Path, batch_size: int) -> Iterator[Batch]:
    """The cached entry in batches shaped like tokenize.iter_tokenized's."""
    from safetensors.numpy import load_file

    t = load_file(str(path))
    off = np.concatenate([[0], np.cumsum(t["lengths"])])
    tokens, mask = t["tokens"], t["loss_mask"]
    if len(tokens) != len(mask) or off[-1] != len(tokens):
        raise ValueError(f"{path}: inconsistent entry")
    n = len(t["lengths"])
    for lo in range(0, n, batch_size):
        hi = min(n, lo + batch_size)
        yield ([tokens[off[i]:off[i + 1]].tolist() for i in range(lo, hi)],
               [mask[off[i]:off[i + 1]].tolist() for i in range(lo, hi)])


def write(path: Path, batches: list[Batch]) -> None:
    from safetensors.numpy import save_file

    ids = [x for b, _ in batches for x in b]
    masks = [m for _, mb in batches for m in mb]
    tensors = {
        "tokens": np.fromiter((t for x in ids for t in x), dtype=np.int32),
        "loss_mask": np.fromiter((v for m in masks for v in m), dtype=np.uint8),
        "lengths": np.array([len(x) for x in ids], dtype=np.int64),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def cached_tokenized(examples: list[Example], tokenizer, template: str, train_on: str, num_proc: int = 1,
                     cache_dir: str = "auto") -> Iterator[Batch]:
    """tokenize.iter_tokenized through the cache: 'auto' (default_cache_dir()), a directory, or 'off'."""
    if cache_dir == "off":
        yield from iter_tokenized(examples, tokenizer, template, train_on, num_proc)
        return
    directory = default_cache_dir() if cache_dir == "auto" else Path(cache_dir)
    path = directory / f"{cache_key(examples, tokenizer, template, train_on)}.safetensors"
    if path.is_file():
        try:
            cached = list(read(path, BATCH_SIZE))  # read fully first: a bad file falls back before yielding
        except Exception:  # noqa: BLE001 - an unreadable entry is rebuilt, never trusted
            cached = None
        if cached is not None and sum(len(p) for p, _ in cached) == len(examples):
            yield from cached
            return
    batches = []
    for batch in iter_tokenized(examples, tokenizer, template, train_on, num_proc):
        batches.append(batch)
        yield batch
    try:
        write(path, batches)
    except OSError:  # a read-only or full cache directory costs the next run a re-tokenisation, nothing else
        pass
