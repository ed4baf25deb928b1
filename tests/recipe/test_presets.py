"""Presets build the published shapes: their HF config, a meta-device model (no memory), and the
parameter count the model's publisher states, within 1%."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain_cli.presets import PRESETS

# Published parameter counts (a tied embedding counted once) and where each figure comes from.
PUBLISHED = {
    "qwen3-30b-a3b": (30.5e9, "Qwen/Qwen3-30B-A3B model card: 30.5B"),
    "qwen3-235b-a22b": (235e9, "Qwen/Qwen3-235B-A22B model card: 235B"),
    "mixtral-8x7b": (46.7e9, "Mixtral of Experts paper: 46.7B"),
    "gpt-oss-20b": (20.91e9, "gpt-oss model card: 20.91B"),
    "gpt-oss-120b": (116.83e9, "gpt-oss model card: 116.83B"),
    "0.5b": (0.49e9, "Qwen2.5-0.5B model card: 0.49B"),
    "1.5b": (1.54e9, "Qwen2.5-1.5B model card: 1.54B"),
    "3b": (3.09e9, "Qwen2.5-3B model card: 3.09B"),
    "7b": (7.61e9, "Qwen2.5-7B model card: 7.61B"),
    "14b": (14.7e9, "Qwen2.5-14B model card: 14.7B"),
    "32b": (32.5e9, "Qwen2.5-32B model card: 32.5B"),
    "72b": (72.7e9, "Qwen2.5-72B model card: 72.7B"),
    "llama3-8b": (8.03e9, "meta-llama/Meta-Llama-3-8B on the Hugging Face hub: 8.03B"),
    "gemma2-9b": (917_504_000 + 8_324_201_984,
                  "Gemma 2 technical report, table 1: 917,504,000 embedding + 8,324,201,984 non-embedding"),
    "gemma3-12b": (1_012e6 + 10_759e6,
                   "Gemma 3 technical report, table 1: 1,012M embedding + 10,759M non-embedding "
                   "(the 417M vision encoder is not part of the text model)"),
    "phi4-14b": (14.7e9, "microsoft/phi-4 on the Hugging Face hub: 14.7B (the report rounds to 14B)"),
    "olmo2-7b": (7.30e9, "allenai/OLMo-2-1124-7B on the Hugging Face hub: 7.3B"),
    "qwen2.5-vl-7b": (8.29e9, "Qwen/Qwen2.5-VL-7B-Instruct on the Hugging Face hub: 8.29B (vision tower included)"),
}

NEW_FAMILIES = {"gemma2-9b": "gemma2", "gemma3-12b": "gemma3_text", "phi4-14b": "phi3", "olmo2-7b": "olmo2"}


def _meta_model(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):  # shapes only: a 72B model costs no memory
        return auto.from_config(config)


def test_every_preset_but_ours_has_a_published_figure():
    assert set(PRESETS) - set(PUBLISHED) == {"tiny", "qwen2-vl-tiny"}


def test_the_tiny_vlm_presets_token_ids_are_the_bundled_processors():
    from megatrain_cli.models.processor import load_processor

    config = PRESETS["qwen2-vl-tiny"].hf_config(vocab_size=508)
    tok = load_processor(None).tokenizer
    ids = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    assert [config.image_token_id, config.video_token_id, config.vision_start_token_id,
            config.vision_end_token_id] == ids
    assert len(tok) == 508


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_builds_the_published_shape(name):
    preset = PRESETS[name]
    config = preset.hf_config()
    model = _meta_model(config)
    assert type(model).__name__ == config.architectures[0] == preset.architecture
    assert config.model_type == preset.model_type
    count = sum(p.numel() for p in model.parameters())  # tied parameters are listed once
    figure, source = PUBLISHED[name]
    assert abs(count - figure) <= 0.01 * figure, f"{name}: {count:,} parameters, published {figure:,.0f} ({source})"
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == preset.tie_word_embeddings


def test_family_fields_reach_the_config():
    g2 = PRESETS["gemma2-9b"].hf_config()
    assert (g2.head_dim, g2.sliding_window, g2.final_logit_softcapping, g2.attn_logit_softcapping,
            g2.query_pre_attn_scalar) == (256, 4096, 30.0, 50.0, 256)
    assert g2.layer_types[:2] == ["sliding_attention", "full_attention"]
    g3 = PRESETS["gemma3-12b"].hf_config()
    assert g3.final_logit_softcapping is None and g3.sliding_window == 1024
    assert g3.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert g3.layer_types.count("full_attention") == 8  # 48 layers, 5 local : 1 global
    assert g3.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert g3.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    phi = PRESETS["phi4-14b"].hf_config()
    assert phi.rope_parameters["rope_theta"] == 250_000.0 and phi.max_position_embeddings == 16384
    assert phi.pad_token_id < phi.vocab_size
    olmo = PRESETS["olmo2-7b"].hf_config()
    assert olmo.rope_parameters["rope_theta"] == 500_000.0 and not olmo.tie_word_embeddings
    # hf_config gives a new config each call: a caller's change does not leak into the preset
    g3.rope_parameters["full_attention"]["factor"] = 1.0
    assert PRESETS["gemma3-12b"].hf_config().rope_parameters["full_attention"]["factor"] == 8.0


@pytest.mark.parametrize("name", sorted(NEW_FAMILIES))
def test_a_few_layers_of_a_new_preset_make_a_host_store(name):
    """What `bench --model NAME --layers N` streams: the same layer shape, N of them, in a host store
    (layouts only, nothing allocated)."""
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.store.tiles import HostStore

    config = dataclasses.replace(PRESETS[name], num_hidden_layers=2).hf_config()
    assert len(getattr(config, "layer_types", None) or [None, None]) == 2
    try:
        adapter = ModelAdapter(config)
    except ValueError as err:
        pytest.skip(f"the adapter does not take {NEW_FAMILIES[name]} yet: {err}")
    store = HostStore(adapter, torch.bfloat16, allocate=False)
    assert store.num_params() == sum(p.numel() for p in _meta_model(config).parameters())
