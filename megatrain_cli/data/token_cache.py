"""A disk cache of tokenised examples, so a rerun (a resume, a second recipe on the same data) skips
tokenisation.

Key: SHA-256 over the examples' text (prompt, history, response, in order), the tokenizer's full
serialisation (vocabulary, merges, normaliser, chat template, special tokens) and the prompt
template. Hashing the text costs one pass over it, far less than tokenising it. What is cached is the
untruncated (prompt ids, response ids + eos) of every example, before seq_len is applied, so the
same entry serves every seq_len and packing choice.

Format: one safetensors file (no pickle) with four int32/int64 tensors: prompt tokens, response
tokens, and each example's prompt and response lengths. Written to a temporary name and renamed, so
an interrupted write never leaves a truncated entry that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from megatrain_cli.data.example import Example

FORMAT_VERSION = 1  # bump when what tokenize_batch produces changes


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


def cache_key(examples: list[Example], tokenizer, template: str) -> str:
    h = hashlib.sha256(f"megatrain-tokens:v{FORMAT_VERSION}:{template}:".encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    for ex in examples:
        h.update(b"\x00p")
        h.update(ex.prompt.encode())
        h.update(b"\x00h")
        h.update(json.dumps(ex.history).encode() if ex.history else b"")
        h.update(b"\x00r")
        h.update(ex.response.encode())
    return h.hexdigest()


def read(path: Path, batch_size: int) -> Iterator[tuple[list[list[int]], list[list[int]]]]:
    """The cached entry in batches shaped like tokenize.iter_tokenized's."""
    from safetensors.numpy import load_file

    t = load_file(str(path))
    p_off = np.concatenate([[0], np.cumsum(t["prompt_lens"])])
    r_off = np.concatenate([[0], np.cumsum(t["response_lens"])])
    prompt_tokens, response_tokens = t["prompt_tokens"], t["response_tokens"]
    n = len(t["prompt_lens"])
    for lo in range(0, n, batch_size):
        hi = min(n, lo + batch_size)
        yield ([prompt_tokens[p_off[i]:p_off[i + 1]].tolist() for i in range(lo, hi)],
               [response_tokens[r_off[i]:r_off[i + 1]].tolist() for i in range(lo, hi)])


def write(path: Path, batches: list[tuple[list[list[int]], list[list[int]]]]) -> None:
    from safetensors.numpy import save_file

    prompts = [ids for p, _ in batches for ids in p]
    responses = [ids for _, r in batches for ids in r]
    tensors = {
        "prompt_tokens": np.fromiter((t for ids in prompts for t in ids), dtype=np.int32),
        "response_tokens": np.fromiter((t for ids in responses for t in ids), dtype=np.int32),
        "prompt_lens": np.array([len(ids) for ids in prompts], dtype=np.int64),
        "response_lens": np.array([len(ids) for ids in responses], dtype=np.int64),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def cached_tokenized(examples: list[Example], tokenizer, template: str, num_proc: int = 1,
                     cache_dir: str = "auto") -> Iterator[tuple[list[list[int]], list[list[int]]]]:
    """tokenize.iter_tokenized through the cache: 'auto' (default_cache_dir()), a directory, or 'off'."""
    from megatrain_cli.data.tokenize import BATCH_SIZE, iter_tokenized

    if cache_dir == "off":
        yield from iter_tokenized(examples, tokenizer, template, num_proc)
        return
    directory = default_cache_dir() if cache_dir == "auto" else Path(cache_dir)
    path = directory / f"{cache_key(examples, tokenizer, template)}.safetensors"
    if path.is_file():
        try:
            cached = list(read(path, BATCH_SIZE))  # read fully first: a bad file falls back before yielding
        except Exception:  # noqa: BLE001 - an unreadable entry is rebuilt, never trusted
            cached = None
        if cached is not None and sum(len(p) for p, _ in cached) == len(examples):
            yield from cached
            return
    batches = []
    for batch in iter_tokenized(examples, tokenizer, template, num_proc):
        batches.append(batch)
        yield batch
    try:
        write(path, batches)
    except OSError:  # a read-only or full cache directory costs the next run a re-tokenisation, nothing else
        pass
