"""MoE checkpoints in and out (issue #20): gpt-oss MXFP4 experts dequantised at load; export in the source
checkpoint's layout (per-expert 2-D tensors for Qwen3-MoE / Qwen2-MoE / Mixtral, as their hub checkpoints
and transformers' save_pretrained store them), through transformers' own conversion and reverse conversion.

CPU, tiny configs (tests/reference.py). Runs under transformers 5.17 and 5.24 alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from megatrain_cli.checkpoint import export_checkpoint, export_hf, save_checkpoint
from megatrain_cli.models.convert import LAYOUT_KEY, CheckpointRules
from megatrain_cli.models.loader import build_store, load_hf_config
from tests.reference import reference_model, tiny_config

# gpt-oss: hidden and expert width multiples of 32 (one MXFP4 block), and unequal, so a transposed
# dequantisation would show as a wrong shape.
HIDDEN, INTER, EXPERTS = 64, 96, 4
# config.json's quantization_config of openai/gpt-oss-20b and -120b.
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in _tensors(path).items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 bytes as int16: equality is byte for byte (a -0 and a +0, or two NaNs, differ)."""
    assert t.dtype == torch.bfloat16
    return t.view(torch.int16)


def _logits_equal(path: Path, store, config) -> None:
    """from_pretrained of the export computes what the store's masters (rounded to bf16, the export dtype)
    compute in HF's model: every tensor found, nothing left over."""
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    reference = reference_model(store, config)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, reference.eval()(input_ids=ids).logits,
                                   rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- gpt-oss MXFP4


def _mxfp4_checkpoint(path: Path, layers: int = 2):
    """An MXFP4 gpt-oss checkpoint made by hand as openai ships one: per layer and projection
    `experts.{proj}_blocks` [E, rows, cols/32, 16] (two FP4 values a byte) and `_scales` [E, rows, cols/32]
    (E8M0 exponents), rows x cols the projection as [out, in] (gate_up: 2I x H, down: H x I); every other
    tensor (attention, router, sinks, expert biases, norms) plain bf16. Returns (config, plain tensors,
    {parameter name: (blocks, scales)})."""
    config = tiny_config("gpt_oss", layers=layers, hidden=HIDDEN, inter=INTER)
    plain = {k: v.to(torch.bfloat16) for k, v in build_store(config, torch.float32, seed=3).hf_state_dict().items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    g = torch.Generator().manual_seed(0)
    packed = {}
    for layer in range(layers):
        for proj, rows, cols in (("gate_up_proj", 2 * INTER, HIDDEN), ("down_proj", HIDDEN, INTER)):
            blocks = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(118, 132, (EXPERTS, rows, cols // 32), generator=g, dtype=torch.uint8)
            packed[f"model.layers.{layer}.mlp.experts.{proj}"] = (blocks, scales)
    on_disk = dict(plain)
    for name, (blocks, scales) in packed.items():
        on_disk[f"{name}_blocks"], on_disk[f"{name}_scales"] = blocks, scales
    path.mkdir()
    save_file(on_disk, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "quantization_config": MXFP4_CONFIG}))
    return config, plain, packed


def test_mxfp4_gpt_oss_loads_dequantised_one_group_at_a_time(tmp_path):
    """Every expert tensor equals transformers' own dequantisation of its blocks and scales (bit for bit:
    MXFP4 values are exact in bf16 and in the fp32 masters); every other tensor is what the file holds.
    Each conversion group holds one layer's blocks + scales of one projection: nothing more is in memory."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, plain, packed = _mxfp4_checkpoint(tmp_path / "src")
    config = load_hf_config(tmp_path / "src")
    assert getattr(config, "quantization_config", None)  # the MXFP4 checkpoint as AutoConfig reads it

    with safe_open(str(tmp_path / "src" / "model.safetensors"), framework="pt") as f:
        plan = CheckpointRules(config).plan(f.keys())
    merged = [g for g in plan.groups if g.converter is not None]
    assert not plan.unexpected and len(merged) == len(packed)
    for group in merged:
        assert sorted(k for k, _ in group.sources) == [f"{group.target}_blocks", f"{group.target}_scales"]

    store = build_store(config, torch.float32, weights_path=tmp_path / "src")
    loaded = store.hf_state_dict()
    assert set(loaded) == set(plain) | set(packed)
    for name, (blocks, scales) in packed.items():
        want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        assert loaded[name].shape == want.shape
        assert torch.equal(loaded[name], want.float()), name
        assert torch.equal(loaded[name].to(torch.bfloat16).float(), loaded[name])  # bf16-exact in the fp32 master
    for name, want in plain.items():
        assert torch.equal(loaded[name], want.float()), name
    assert getattr(store.adapter.config, LAYOUT_KEY) == []  # nothing of the model's own rules was used


def test_mxfp4_gpt_oss_exports_plain_bf16_that_from_pretrained_loads(tmp_path):
    """Export of an MXFP4-loaded gpt-oss: HF's unquantised gpt-oss tensors (no _blocks / _scales), bf16,
    equal to the masters; config.json without quantization_config; from_pretrained loads it plainly."""
    _mxfp4_checkpoint(tmp_path / "src")
    config = load_hf_config(tmp_path / "src")
    store = build_store(config, torch.float32, weights_path=tmp_path / "src")
    out = export_hf(store, tmp_path / "out", source_dir=tmp_path / "src")

    written = _tensors(out)
    masters = store.hf_state_dict()
    assert set(written) == set(masters)
    for name, t in written.items():
        assert torch.equal(_bits(t), _bits(masters[name].to(torch.bfloat16))), name
    saved = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in saved and LAYOUT_KEY not in saved and saved["dtype"] == "bfloat16"
    _logits_equal(out, store, tiny_config("gpt_oss", layers=2, hidden=HIDDEN, inter=INTER))

    # `megatrain export` of a step checkpoint (whose config.json still says MXFP4): the same file.
    save_checkpoint(store, tmp_path / "run", 1, {})
    again = export_checkpoint(tmp_path / "run", tmp_path / "from_step")
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert "quantization_config" not in json.loads((again / "config.json").read_text())


# ---------------------------------------------------------------------------------------------- per-expert layouts

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral"]


def _per_expert(name: str, fused: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """The hub checkpoints' per-expert tensors of one fused parameter, written out by hand (not through
    transformers): gate_up_proj [E, 2I, H] is gate rows then up rows; down_proj [E, H, I]. Mixtral names
    them w1 (gate), w3 (up), w2 (down) under `block_sparse_moe`."""
    t = fused[name]
    base = name.rsplit(".", 1)[0]
    if family == "mixtral":
        base = base.replace(".mlp.", ".block_sparse_moe.")
    names = {"gate": "w1", "up": "w3", "down": "w2"} if family == "mixtral" else \
        {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    out = {}
    for e in range(t.shape[0]):
        if name.endswith("gate_up_proj"):
            gate, up = t[e].chunk(2, dim=0)
            out[f"{base}.{e}.{names['gate']}.weight"], out[f"{base}.{e}.{names['up']}.weight"] = gate, up
        else:
            out[f"{base}.{e}.{names['down']}.weight"] = t[e]
    return out


def _expected(store, family: str) -> dict[str, torch.Tensor]:
    """The store's masters cast to bf16, under the hub checkpoint's names."""
    fused = store.hf_state_dict(torch.bfloat16)
    out = {}
    for name, t in fused.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out.update(_per_expert(name, fused, family))
        else:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.") if family == "mixtral" else name] = t
    return out


def _source(tmp_path: Path, family: str):
    """A per-expert checkpoint as transformers' save_pretrained writes it (the hub layout)."""
    config = tiny_config(family, layers=3)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    return config


def _train_a_little(store) -> None:
    """Change every master after load, as training does (not bf16-exact any more): the export must come
    from the masters, not from the source files."""
    g = torch.Generator().manual_seed(7)
    for tile in store.tiles.values():
        tile.master.add_(torch.randn(tile.master.shape, generator=g) * 1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_the_source_per_expert_layout(tmp_path, family):
    """(a) the exported tensor names and shapes are the source checkpoint's (per expert, 2-D); (b) each value
    is the store's master cast to bf16, byte for byte; (c) from_pretrained of the export gives the logits of
    the store in HF's model. `megatrain export` of a step checkpoint writes the same bytes, sharded too."""
    config = _source(tmp_path, family)
    source = _shapes(tmp_path / "src")
    assert any(".experts.0." in n for n in source) and not any(n.endswith("gate_up_proj") for n in source)
    assert any(".block_sparse_moe." in n for n in source) == (family == "mixtral")

    store = build_store(load_hf_config(tmp_path / "src"), torch.float32, weights_path=tmp_path / "src")
    _train_a_little(store)
    out = export_hf(store, tmp_path / "out", source_dir=tmp_path / "src")
    assert _shapes(out) == source  # (a)
    written, expected = _tensors(out), _expected(store, family)
    assert set(expected) == set(written)
    for name, t in written.items():  # (b)
        assert torch.equal(_bits(t), _bits(expected[name])), name
    _logits_equal(out, store, config)  # (c)

    # From a step checkpoint (the layout travels in its config.json), in several shards: a layer's
    # experts straddle shard files.
    save_checkpoint(store, tmp_path / "run", 1, {})
    assert json.loads((tmp_path / "run" / "step_1" / "config.json").read_text())[LAYOUT_KEY]
    sharded = export_checkpoint(tmp_path / "run", tmp_path / "from_step", max_shard_bytes=20_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source) and len(set(index["weight_map"].values())) > 2
    again = _tensors(sharded)
    assert set(again) == set(written)
    assert all(torch.equal(_bits(again[n]), _bits(t)) for n, t in written.items())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_fused_source_exports_fused(tmp_path, family):
    """A checkpoint already in transformers 5's fused layout (3-D experts) is written back fused: the
    source's layout, not a fixed one."""
    config = tiny_config(family, layers=2)
    first = build_store(config, torch.float32, seed=4)
    (tmp_path / "src").mkdir()
    save_file(first.hf_state_dict(), str(tmp_path / "src" / "model.safetensors"))
    config.save_pretrained(tmp_path / "src")
    store = build_store(load_hf_config(tmp_path / "src"), torch.float32, weights_path=tmp_path / "src")
    out = export_hf(store, tmp_path / "out", dtype=torch.float32)
    assert _shapes(out) == _shapes(tmp_path / "src")
    assert all(torch.equal(t, first.hf_state_dict()[n]) for n, t in _tensors(out).items())


@pytest.mark.parametrize("family", FAMILIES + ["gpt_oss"])
def test_a_model_without_checkpoint_exports_what_save_pretrained_writes(tmp_path, family):
    """Random init from a config (a preset, a bench): the names and shapes transformers' save_pretrained
    writes for the same model made from that config (per-expert for Qwen-MoE and Mixtral, gpt-oss fused)."""
    config = tiny_config(family, layers=2)
    store = build_store(config, torch.float32, seed=2)
    out = export_hf(store, tmp_path / "out")
    reference_model(store, config).save_pretrained(tmp_path / "by_transformers")
    assert _shapes(out) == _shapes(tmp_path / "by_transformers")
    assert LAYOUT_KEY not in json.loads((out / "config.json").read_text())


def test_export_reverts_one_tile_at_a_time(tmp_path, monkeypatch):
    """The reverse conversion sees one tile's tensors per call (an MoE layer's experts are one tile): once
    on meta tensors to plan names and shapes, once on the master views to write them; never the model."""
    from megatrain_cli.models.convert import SavedLayout

    calls, real = [], SavedLayout.revert

    def spy(self, tensors):
        calls.append((sorted(tensors), all(t.device.type == "meta" for t in tensors.values())))
        return real(self, tensors)

    monkeypatch.setattr(SavedLayout, "revert", spy)
    store = build_store(tiny_config("qwen3_moe", layers=3), torch.float32, seed=1)
    export_hf(store, tmp_path / "out", max_shard_bytes=20_000)
    tiles = [sorted(store.adapter.hf_name(t, s.name) for s in layout.places) for t, layout in store.layouts.items()]
    assert [names for names, meta in calls if meta] == tiles
    assert [names for names, meta in calls if not meta] == tiles
