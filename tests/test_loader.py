"""Loading a local Hugging Face directory into the host store, tensor by tensor."""

from __future__ import annotations

import pytest
import torch

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
