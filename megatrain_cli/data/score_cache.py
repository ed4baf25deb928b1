"""A disk cache of per-sequence scores: the reference's log-prob sums and token counts of every sequence of the
preference data (PreferenceData's order), so a rerun or a resume skips the reference pass.

The key is given by the caller: SHA-256 over what produced the scores, each part a string (`cache_key`): the
data's fingerprint (PreferenceData.fingerprint: tokens, labels, rows, roles, so the tokenizer, template and
seq_len too), the tokenizer's (token_cache.tokenizer_fingerprint), the model files' and whatever decides the
numbers (dtype, kernels). A key that misses any of these would hand a run another model's reference.

Format: one safetensors file (no pickle), `logps` (float64) and `tokens` (int64), written to a temporary name
and renamed; an unreadable entry, or one of another length, is ignored and rewritten, never trusted.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from megatrain_cli.methods.base import SequenceScores

FORMAT_VERSION = 1


def default_cache_dir() -> Path:
    """preference.reference_cache 'auto': the user's cache directory (XDG's, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatrain" / "reference"


def cache_key(*parts: str) -> str:
    h = hashlib.sha256(f"megatrain-scores:v{FORMAT_VERSION}".encode())
    for part in parts:
        h.update(b"\x00" + part.encode())
    return h.hexdigest()


class ScoreCache:
    """The entry for `key` under `setting` ('auto', a directory, or 'off': nothing read or written)."""

    def __init__(self, setting: str, key: str):
        self.path = None if setting == "off" else \
            (default_cache_dir() if setting == "auto" else Path(setting).expanduser()) / f"{key}.safetensors"

    def load(self, num_sequences: int) -> SequenceScores | None:
        """The cached scores, or None (no entry, off, unreadable, or not `num_sequences` long)."""
        if self.path is None or not self.path.is_file():
            return None
        from safetensors.torch import load_file

        try:
            t = load_file(str(self.path))
            scores = SequenceScores(t["logps"], t["tokens"])
        except Exception:  # noqa: BLE001 - a damaged entry is recomputed, never trusted
            return None
        ok = scores.logps.shape == scores.tokens.shape == (num_sequences,) and scores.logps.dtype == torch.float64
        return scores if ok else None

    def save(self, scores: SequenceScores) -> bool:
        """Write the entry; False when it cannot be written (read-only or full: the next run rescores)."""
        if self.path is None:
            return False
        from safetensors.torch import save_file

        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file({"logps": scores.logps.detach().double().cpu().contiguous(),
                       "tokens": scores.tokens.detach().long().cpu().contiguous()}, str(tmp))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        return True
