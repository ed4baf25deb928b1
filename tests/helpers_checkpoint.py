"""Tiny stores with non-trivial optimizer state, and a tiny offline tokenizer, for checkpoint tests."""

from __future__ import annotations

import torch

from megatrain_cli.models.loader import build_store
from megatrain_cli.store.tiles import HostStore
from tests.reference import tiny_config

SECTIONS = ("master", "exp_avg", "exp_avg_sq")


def filled_store(seed: int = 1, *, tied: bool = False, layers: int = 2, **config_kw) -> HostStore:
    """A store whose masters, both moments and step counts all differ per seed and per tile."""
    store = build_store(tiny_config(layers=layers, tied=tied, **config_kw), torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    for i, tile in enumerate(store.tiles.values()):
        tile.exp_avg.copy_(torch.randn(tile.numel, generator=gen) * 1e-3)
        tile.exp_avg_sq.copy_(torch.rand(tile.numel, generator=gen) * 1e-6)
        tile.grad.fill_(7.0)  # must not travel with a checkpoint
        tile.step = 10 * seed + i
    return store


def assert_same_state(a: HostStore, b: HostStore) -> None:
    assert list(a.tiles) == list(b.tiles)
    for name, tile in a.tiles.items():
        other = b.tiles[name]
        for section in SECTIONS:
            assert torch.equal(getattr(tile, section), getattr(other, section)), (name, section)
        assert tile.step == other.step, name


def tiny_tokenizer():
    """A word-level fast tokenizer built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(20)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
