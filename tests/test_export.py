"""Hugging Face export: from_pretrained loads it and computes the same logits; output is deterministic."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatrain_cli.checkpoint import save_checkpoint
from megatrain_cli.checkpoint import export_checkpoint, export_hf
from tests.helpers_checkpoint import filled_store, tiny_tokenizer
from tests.reference import reference_model


def _files(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 20_000], ids=["one-file", "sharded"])
def test_from_pretrained_gives_reference_logits(tmp_path, tied, max_shard_bytes):
    store = filled_store(seed=1, tied=tied)
    out = export_hf(store, tmp_path / "final", dtype=torch.float32, max_shard_bytes=max_shard_bytes)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = reference_model(store, store.adapter.config)
    ids = torch.randint(0, store.adapter.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)

    # The same tensor names transformers itself writes (a tied lm_head is left out, an untied one kept).
    reference.save_pretrained(tmp_path / "by_transformers", max_shard_size=max_shard_bytes)
    ours, theirs = _tensor_names(out), _tensor_names(tmp_path / "by_transformers")
    assert ours == theirs and ("lm_head.weight" in ours) == (not tied)
    sharded = max_shard_bytes < 5 * 2**30
    assert (out / "model.safetensors.index.json").is_file() == sharded
    assert (out / "model.safetensors").is_file() == (not sharded)
    if sharded:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == store.num_params() * 4
        shards = sorted(set(index["weight_map"].values()))
        assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors" and len(shards) > 2


def _tensor_names(path):
    names = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


def test_bf16_export_is_byte_exact_and_rounds_the_masters(tmp_path):
    store = filled_store(seed=1)
    first = export_hf(store, tmp_path / "a", tokenizer=tiny_tokenizer())
    second = export_hf(store, tmp_path / "b", tokenizer=tiny_tokenizer())
    assert _files(first) == _files(second)
    assert json.loads((first / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoTokenizer.from_pretrained(first).eos_token == "<eos>"
    with safe_open(str(first / "model.safetensors"), "pt") as f:
        for name, master in store.hf_state_dict().items():
            assert torch.equal(f.get_tensor(name), master.to(torch.bfloat16)), name

    # Re-exporting over a previous export replaces it; an unrelated directory is never replaced.
    store.tiles["embed"].master.add_(1.0)
    export_hf(store, first)
    assert _files(first)["model.safetensors"] != _files(second)["model.safetensors"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        export_hf(store, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_export_checkpoint_matches_export_of_the_store(tmp_path):
    store = filled_store(seed=1, tied=True)
    save_checkpoint(store, tmp_path / "run", 1, {}, tokenizer=tiny_tokenizer())
    store.tiles["head"].master.mul_(2.0)
    save_checkpoint(store, tmp_path / "run", 2, {}, tokenizer=tiny_tokenizer())
    direct = export_hf(store, tmp_path / "direct", tokenizer=tiny_tokenizer())

    from_step = export_checkpoint(tmp_path / "run" / "step_2", tmp_path / "from_step")
    from_run = export_checkpoint(tmp_path / "run", tmp_path / "from_run")  # the run's latest checkpoint
    assert _files(from_step) == _files(direct) == _files(from_run)
