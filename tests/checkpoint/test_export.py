"""Hugging Face export: from_pretrained loads it and computes the same logits; output is deterministic."""

from __future__ import annotations

import json
from pathlib import Path

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


# ---------------------------------------------------------------- issue #18 items 8 and 10
def test_the_source_generation_config_is_carried_unchanged(tmp_path):
    from transformers import GenerationConfig

    store = filled_store(seed=1)
    source = tmp_path / "instruct"
    GenerationConfig(bos_token_id=0, eos_token_id=[1, 7], do_sample=True, temperature=0.6,
                     top_p=0.9).save_pretrained(source)
    carried = export_hf(store, tmp_path / "carried", source_dir=source)
    assert (carried / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    generation = GenerationConfig.from_pretrained(carried)
    assert generation.eos_token_id == [1, 7] and generation.temperature == 0.6 and generation.do_sample

    # No source (a preset), or a source without one: regenerated from the config, as before.
    plain = export_hf(store, tmp_path / "plain")
    (tmp_path / "bare").mkdir()
    bare = export_hf(store, tmp_path / "bare_export", source_dir=tmp_path / "bare")
    made = GenerationConfig.from_pretrained(plain)
    assert made.eos_token_id == store.adapter.config.eos_token_id and not made.do_sample
    assert (bare / "generation_config.json").read_bytes() == (plain / "generation_config.json").read_bytes()

    # `megatrain export` of a checkpoint: the source's when given.
    save_checkpoint(store, tmp_path / "run", 1, {}, tokenizer=tiny_tokenizer())
    from_step = export_checkpoint(tmp_path / "run", tmp_path / "from_step", source_dir=source)
    assert (from_step / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()


def _family_config(model_type: str):
    from transformers import AutoConfig

    kw = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
    if model_type in ("gemma2", "gemma3_text"):
        kw["head_dim"] = 8
    if model_type == "mixtral":
        kw.update(num_local_experts=3, num_experts_per_tok=2)
    return AutoConfig.for_model(model_type, **kw)


@pytest.mark.parametrize("model_type,layout", [("qwen2", "base model"), ("mixtral", "per expert"),
                                               ("gemma2", "canonical"), ("gemma3_text", "canonical"),
                                               ("phi3", "canonical"), ("olmo2", "canonical")])
def test_a_converted_checkpoint_exports_names_from_pretrained_reads(tmp_path, model_type, layout):
    """Load a checkpoint transformers converts (prefix-less base-model keys; Mixtral as save_pretrained
    writes it, one tensor per expert), export (in the source's layout), and from_pretrained reads every
    tensor, with nothing missing, and computes the source model's logits."""
    from safetensors.torch import save_file

    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.models.loader import build_store, load_hf_config

    config = _family_config(model_type)
    try:
        ModelAdapter(config)
    except ValueError as err:
        pytest.skip(f"the adapter does not take {model_type}: {err}")
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(config).eval()
    src = tmp_path / "source"
    source.save_pretrained(src)
    if layout == "base model":
        (src / "model.safetensors").unlink()
        state = {k.removeprefix("model."): v.contiguous() for k, v in source.state_dict().items()}
        save_file(state, str(src / "model.safetensors"))
    names_in_source = _tensor_names(src)
    assert ("model.embed_tokens.weight" in names_in_source) == (layout != "base model")
    assert any(".experts.0." in n for n in names_in_source) == (layout == "per expert")

    store = build_store(load_hf_config(src), torch.float32, weights_path=src)
    out = export_hf(store, tmp_path / "export", dtype=torch.float32, source_dir=src)
    # The source's own names (Mixtral's per-expert tensors written back); a base model's keys get the
    # causal LM's prefix, as save_pretrained after from_pretrained writes them.
    expected = {n for n, _, _ in store.hf_items()} if layout == "base model" else names_in_source
    assert _tensor_names(out) == expected
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(3, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, source(input_ids=ids).logits,
                                   rtol=0, atol=1e-6)


def test_checkpoint_carries_the_source_generation_config_to_export(tmp_path):
    """A run from a model directory seals that model's generation_config.json into each checkpoint, so
    `megatrain export CHECKPOINT` carries it on byte for byte (issue #18 item 10)."""
    from megatrain_cli.checkpoint import export_checkpoint, save_checkpoint
    from megatrain_cli.models.loader import build_store
    from tests.reference import tiny_config

    source = tmp_path / "model"
    source.mkdir()
    own = b'{"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9}\n'
    (source / "generation_config.json").write_bytes(own)
    store = build_store(tiny_config("llama", layers=1), torch.float32, seed=0)
    ckpt = save_checkpoint(store, tmp_path / "run", 1, {"step": 1}, source_dir=source)
    assert (ckpt / "generation_config.json").read_bytes() == own
    out = export_checkpoint(ckpt, tmp_path / "export", dtype=torch.float32)
    assert (Path(out) / "generation_config.json").read_bytes() == own
