"""Loading a local Hugging Face directory into the host store, tensor by tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from megatrain_cli.models.loader import ModelLoadError, build_store, load_hf_config
from tests.reference import reference_model, tiny_config


@pytest.mark.parametrize("tied,shard", [(False, "30KB"), (True, "10GB")])
def test_load_hf_directory_equals_the_saved_model(tmp_path, tied, shard):
    config = tiny_config("Qwen2ForCausalLM", tied=tied, layers=2)
    source = reference_model(build_store(config, torch.float32, seed=7), config)
    source.save_pretrained(tmp_path, max_shard_size=shard)
    if shard == "30KB":
        assert (tmp_path / "model.safetensors.index.json").is_file()  # the sharded path is exercised
    loaded_config = load_hf_config(tmp_path)
    store = build_store(loaded_config, torch.float32, weights_path=tmp_path)
    ours = store.hf_state_dict()
    for name, tensor in source.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        assert torch.equal(ours[name], tensor), name
    assert all(float(t.exp_avg.abs().sum()) == 0 for t in store.tiles.values())


def test_missing_directory_and_missing_weights_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_config(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_config(tmp_path)
    config = tiny_config("LlamaForCausalLM", layers=2)
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        build_store(load_hf_config(tmp_path), torch.float32, weights_path=tmp_path)


def test_a_checkpoint_of_another_shape_is_refused(tmp_path):
    small = tiny_config("Qwen2ForCausalLM", layers=2)
    reference_model(build_store(small, torch.float32, seed=1), small).save_pretrained(tmp_path)
    bigger = tiny_config("Qwen2ForCausalLM", layers=3)
    with pytest.raises(ModelLoadError, match="missing"):
        build_store(bigger, torch.float32, weights_path=tmp_path)


# ---------------------------------------------------------------- transformers' conversion rules (issue #18 item 8)
def _save(directory, config, tensors) -> None:
    """A model directory holding exactly `tensors` under their given names (as another tool wrote them)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_base_model_checkpoint_loads_into_the_same_masters(tmp_path, tied):
    """Keys without the base model's `model.` prefix (a Qwen2Model save): transformers' prefix rule."""
    config = tiny_config("Qwen2ForCausalLM", tied=tied, layers=2)
    source = reference_model(build_store(config, torch.float32, seed=3), config)
    source.save_pretrained(tmp_path / "canonical")
    renamed = {k.removeprefix("model."): v for k, v in source.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    assert "embed_tokens.weight" in renamed and "model.norm.weight" not in renamed
    _save(tmp_path / "base", config, renamed)
    canonical = build_store(load_hf_config(tmp_path / "canonical"), torch.float32, weights_path=tmp_path / "canonical")
    loaded = build_store(load_hf_config(tmp_path / "base"), torch.float32, weights_path=tmp_path / "base")
    for name, tile in canonical.tiles.items():
        assert torch.equal(loaded.tiles[name].master, tile.master), name


def _mixtral_config():
    from transformers import AutoConfig

    return AutoConfig.for_model("mixtral", hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
                                num_experts_per_tok=2, vocab_size=50, max_position_embeddings=64)


def _per_expert(state: dict) -> dict:
    """Mixtral's fused expert tensors written the original way (one tensor per expert, `block_sparse_moe`):
    the inverse of transformers' mixtral rules (a rename and two merges)."""
    out = {}
    for key, t in state.items():
        key = key.replace(".mlp.", ".block_sparse_moe.")
        if key.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[key.replace("gate_up_proj", f"{e}.w1.weight")] = gate[e]
                out[key.replace("gate_up_proj", f"{e}.w3.weight")] = up[e]
        elif key.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[key.replace("down_proj", f"{e}.w2.weight")] = t[e]
        else:
            out[key] = t
    return out


def test_per_expert_checkpoint_merges_group_by_group_into_the_fused_parameters(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatrain_cli.models.convert import CheckpointRules

    config = _mixtral_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    canonical = model.state_dict()
    legacy = _per_expert(canonical)
    model.save_pretrained(tmp_path / "by_transformers")  # transformers writes the same legacy layout back
    with safe_open(str(tmp_path / "by_transformers" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(legacy)

    rules = CheckpointRules(config)
    plan = rules.plan(legacy)
    assert not plan.unexpected and plan.produces() == set(canonical)
    merges = [g for g in plan.groups if g.converter is not None]
    # one group per layer and fused parameter, each holding only that layer's experts
    assert sorted(len(g.sources) for g in merges) == [3, 3, 6, 6]
    assert all(len({k.split(".experts.")[0] for k, _ in g.sources}) == 1 for g in merges)
    loaded = {}
    for group in plan.groups:
        loaded.update(rules.realize(group, legacy.__getitem__))
    assert loaded.keys() == canonical.keys()
    for name, tensor in canonical.items():
        assert torch.equal(loaded[name], tensor), name

    # The same through the loader into a host store, when the adapter takes the family.
    from megatrain_cli.models.adapter import ModelAdapter

    try:
        ModelAdapter(config)
    except ValueError as err:
        pytest.skip(f"the adapter does not take mixtral: {err}")
    _save(tmp_path / "legacy", config, legacy)
    store = build_store(load_hf_config(tmp_path / "legacy"), torch.float32, weights_path=tmp_path / "legacy")
    ours = store.hf_state_dict()
    assert ours.keys() == canonical.keys()
    assert all(torch.equal(ours[k], canonical[k]) for k in canonical)


def test_legacy_gamma_beta_names_are_renamed_by_transformers_rules():
    """transformers' `legacy` rules (LayerNorm.gamma/beta), on a family whose modules carry that name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatrain_cli.models.convert import CheckpointRules

    config = AutoConfig.for_model("bert", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, vocab_size=40, is_decoder=True)
    canonical = AutoModelForCausalLM.from_config(config).state_dict()
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in canonical.items()}
    assert sum(".gamma" in k for k in old) >= 2
    rules = CheckpointRules(config)
    plan = rules.plan(old)
    assert not plan.unexpected
    loaded = {}
    for group in plan.groups:
        loaded.update(rules.realize(group, old.__getitem__))
    assert loaded.keys() == canonical.keys()
    assert all(torch.equal(loaded[k], canonical[k]) for k in canonical)


def test_an_unknown_key_is_refused_by_name_before_any_tensor_is_copied(tmp_path, monkeypatch):
    config = tiny_config("LlamaForCausalLM", layers=2)
    state = reference_model(build_store(config, torch.float32, seed=2), config).state_dict()
    state["model.layers.1.mlp.surprise.weight"] = torch.zeros(3, 3)
    _save(tmp_path, config, state)
    from megatrain_cli.store.tiles import HostStore

    copies = []
    monkeypatch.setattr(HostStore, "write_master", lambda self, *a: copies.append(a))
    with pytest.raises(ModelLoadError, match=r"unexpected tensors.*model\.layers\.1\.mlp\.surprise\.weight"):
        build_store(load_hf_config(tmp_path), torch.float32, weights_path=tmp_path)
    assert copies == []


def _family_config(model_type: str):
    from transformers import AutoConfig

    kw = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
    if model_type in ("gemma2", "gemma3_text", "qwen3", "mistral"):
        kw["head_dim"] = 8
    if model_type == "mixtral":
        kw.update(num_local_experts=2, num_experts_per_tok=1)
    return AutoConfig.for_model(model_type, **kw)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3",
                                        "olmo2", "mixtral"])
def test_parameter_names_are_read_back_unconverted(model_type):
    """The names a store exports (the model's own) pass transformers' rules unchanged: what from_pretrained
    of this version reads with no conversion (Mixtral's fused experts included)."""
    from megatrain_cli.models.convert import CheckpointRules

    rules = CheckpointRules(_family_config(model_type))
    names = set(rules.meta_state) - rules.aliases
    plan = rules.plan(names)
    assert not plan.unexpected
    assert all(g.converter is None and g.sources == [(g.target, g.target)] for g in plan.groups)
    assert {g.target for g in plan.groups} == names


def test_a_merge_that_cannot_be_made_names_transformers_converter():
    from transformers import AutoModelForCausalLM

    from megatrain_cli.models.convert import CheckpointRules, ConversionError

    config = _mixtral_config()
    legacy = _per_expert(AutoModelForCausalLM.from_config(config).state_dict())
    del legacy["model.layers.1.block_sparse_moe.experts.2.w3.weight"]  # one expert's up projection lost
    rules = CheckpointRules(config)
    plan = rules.plan(legacy)
    broken = next(g for g in plan.groups if g.target == "model.layers.1.mlp.experts.gate_up_proj")
    with pytest.raises(ConversionError, match=r"WeightConverter.*MergeModulelist.*layers\.1\.mlp\.experts\.gate_up_proj"):
        rules.realize(broken, legacy.__getitem__)
