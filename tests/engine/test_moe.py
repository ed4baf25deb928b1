"""Mixture-of-experts families (issue #20) against plain HF + torch AdamW, router aux loss included.

CPU, fp32, tiny configs of each MoE family (tests/reference.py FAMILY_EXTRAS: Qwen3-MoE's renormalised
top-k, Qwen2-MoE's shared expert and a dense layer between MoE layers, Mixtral, gpt-oss's attention sinks,
router bias, expert biases and local/global layers), trained with the router's load-balancing loss on
(HF's output_router_logits) at coefficient 0.5. Three steps, accumulation 2 with micro-batches of
different loss-token counts (the aux loss's weighting shows), clipping active, packed rows, checkpoint
interval 2. Every parameter, router and sinks included, within 1e-5; the losses are HF's (cross-entropy
+ coef * aux).
"""

from __future__ import annotations

import re

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.models.families import VERIFIED_MOE, moe_spec
from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.engine.test_families import assert_parity
from tests.reference import random_batches, reference_model, reference_train, saved_bytes, tiny_config

STEPS, ACCUM, SEQ = 3, 2, 16
MOE = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"]


def batches_for(config, seed=5):
    """Packed rows (positions restart at token 9); the second micro-batch has a longer prompt (fewer loss
    tokens), so per-micro-batch aux losses weighted by loss tokens differ from a plain mean."""
    batches = random_batches(config.vocab_size, STEPS, ACCUM, batch=2, seq=SEQ, seed=seed)
    for mbs in batches:
        mbs[1].labels[:, :11] = IGNORE_INDEX
        for mb in mbs:
            mb.position_ids = torch.cat([torch.arange(9), torch.arange(SEQ - 9)]).expand_as(mb.input_ids).clone()
    return batches


def run_both(config, *, edit=None, keep_blocks=frozenset(), aux=True, interval=2, **engine_kwargs):
    """The engine and the reference from the same store; `edit(store)` changes the masters first."""
    store = build_store(config, torch.float32, seed=3)
    if edit is not None:
        edit(store)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1,
                      grad_accum=ACCUM, eps=1e-6)
    batches = batches_for(config)
    ref = reference_model(store, config)
    ref_losses = reference_train(ref, batches, cfg, STEPS, router_aux=aux)
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=interval, loss_chunk_tokens=7,
                         keep_blocks=keep_blocks, overlap_optimizer=False, **engine_kwargs)
    results = [engine.step(mbs, lr_at(s, cfg, STEPS)) for s, mbs in enumerate(batches)]
    engine.close()
    return store, ref, ref_losses, results




def test_every_verified_moe_family_has_a_case():
    assert sorted(VERIFIED_MOE) == sorted(MOE)


@pytest.mark.parametrize("family", MOE)
def test_moe_family_parity_with_router_aux_loss(family):
    config = tiny_config(family, layers=3)
    spec = moe_spec(config)
    assert spec is not None and spec.aux_coef == 0.5
    keep = frozenset({1}) if family == "qwen3_moe" else frozenset()  # the last block keeps its graph
    assert_parity(*run_both(config, keep_blocks=keep))


def test_the_aux_loss_is_large_enough_to_be_tested():
    """Without the aux loss the routers end elsewhere by far more than the parity tolerance, and the
    engine's losses (HF's, aux included) differ from the cross-entropy alone."""
    config = tiny_config("mixtral", layers=2)
    with_aux = run_both(config)
    config.router_aux_loss_coef = 0.0
    without = run_both(config, aux=False)
    assert_parity(*without)
    router = "model.layers.0.mlp.gate.weight"
    a, b = with_aux[0].hf_state_dict()[router], without[0].hf_state_dict()[router]
    assert (a - b).abs().max() > 1e-4
    assert with_aux[3][0].losses[0] > without[3][0].losses[0] + 0.4  # + 0.5 * aux, aux ~ 1 when balanced


def _starve_gpt_oss(expert):
    def edit(store):  # a router bias no logit overcomes: the expert is never in any token's top-k
        for name, t in store.hf_state_dict().items():
            if name.endswith("mlp.router.bias"):
                t[expert] = -1e4
    return edit


def _starve_qwen3(store):
    """Top-1 routing on one coordinate of the normalised hidden state: expert 0 for tokens where it is
    positive, expert 1 where it is negative; experts 2.. keep logits 0 and never win."""
    for name, t in store.hf_state_dict().items():
        if name.endswith("post_attention_layernorm.weight"):
            t.zero_()
            t[0] = 1.0
        if name.endswith("mlp.gate.weight"):
            t.zero_()
            t[0, 0], t[1, 0] = 1.0, -1.0


@pytest.mark.parametrize("family,edit,starved,extra", [
    ("gpt_oss", _starve_gpt_oss(3), [3], {}),
    ("qwen3_moe", _starve_qwen3, [2, 3, 4, 5, 6, 7], {"num_experts_per_tok": 1}),
])
def test_an_expert_without_tokens_gets_adamws_zero_gradient_update(family, edit, starved, extra):
    """An expert no token reaches has a zero gradient; torch AdamW still decays it (moments stay 0, so the
    Adam step is 0): after 3 steps its weights are w0 * prod(1 - lr_s * wd), in the engine as in torch."""
    config = tiny_config(family, layers=2, **extra)
    initial = build_store(config, torch.float32, seed=3)
    edit(initial)
    w0 = {k: v.clone() for k, v in initial.hf_state_dict().items()}
    store, ref, ref_losses, results = run_both(config, edit=edit)
    assert_parity(store, ref, ref_losses, results)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, warmup_steps=1)
    decay = torch.tensor([1.0 - lr_at(s, cfg, STEPS) * 0.1 for s in range(STEPS)]).prod()
    ours = store.hf_state_dict()
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.experts.gate_up_proj"
        for e in starved:
            torch.testing.assert_close(ours[name][e], w0[name][e] * decay, rtol=1e-6, atol=0)
        fed = [e for e in range(ours[name].shape[0]) if e not in starved]
        assert all(not torch.allclose(ours[name][e], w0[name][e] * decay) for e in fed)


def test_experts_run_transformers_grouped_mm(monkeypatch):
    """Every template's experts dispatch to transformers' grouped-mm code, which calls torch's grouped-mm
    kernel: two grouped matrix multiplies per MoE layer call (gate_up, down), not the per-expert loop."""
    name = "grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else None
    owner = torch.nn.functional if name else torch
    name = name or "_grouped_mm"
    calls = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    config = tiny_config("qwen2_moe", layers=3)  # layer 1 is dense (mlp_only_layers)
    store = build_store(config, torch.float32, seed=3)
    cfg = TrainConfig(steps=1, lr=1e-3, grad_accum=1, eps=1e-6)
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=1, overlap_optimizer=False)
    experts = [m for t in engine.templates.all() for m in t.modules() if hasattr(m, "has_gate")]
    assert experts and all(m.config._experts_implementation == "grouped_mm" for m in experts)
    engine.step(random_batches(config.vocab_size, 1, 1, batch=2, seq=SEQ)[0], 1e-3)
    engine.close()
    assert len(calls) == 2 * 2 * 2  # 2 MoE layers x (forward + recompute) x 2 projections


def test_dense_models_have_no_router_loss():
    store = build_store(tiny_config("qwen3", layers=2), torch.float32, seed=3)
    engine = make_engine(store, TrainConfig(steps=1), device="cpu", checkpoint_interval=1, overlap_optimizer=False)
    assert engine.moe is None and engine.router is None
    engine.close()


def test_long_context_path_chunks_only_the_dense_layers():
    """The lean plan's chunked MLP goes into dense layers (Qwen2-MoE's layer 1); routed layers run whole;
    checkpoints offloaded; the step still equals HF's with the aux loss."""
    from megatrain_cli.engine import lean_layers
    from megatrain_cli.engine.plan.lean import GiB, plan_long_context

    config = tiny_config("qwen2_moe", layers=3)
    plan = plan_long_context(config, SEQ, batch=2 * ACCUM, device_budget_bytes=GiB, mlp_chunk_tokens=5,
                             chunk_mlp=True, loss_chunk_tokens=7, offload=False, lean_norms=True)
    plan.offloaded_checkpoints = 2
    store, ref, ref_losses, results = run_both(config, lean=plan, interval=1)
    assert_parity(store, ref, ref_losses, results)
    engine_templates = make_engine(store, TrainConfig(steps=1), device="cpu", lean=plan,
                                   overlap_optimizer=False).templates
    chunked = {type(t.mlp).__name__: lean_layers.mlp_chunk_tokens(t) for t in engine_templates.all()}
    assert chunked == {"Qwen2MoeMLP": 5, "Qwen2MoeSparseMoeBlock": None}


# ---------------------------------------------------------------------------------------------- presets, plans, FLOPs

# Published totals and active parameters per token. Qwen and Mixtral count the embedding among the active
# ones, OpenAI does not (gpt-oss model card / report: 20.91B and 116.83B total, 3.61B and 5.13B active).
MOE_PUBLISHED = {
    "qwen3-30b-a3b": (30.5e9, 3.3e9, True, "Qwen/Qwen3-30B-A3B model card: 30.5B, 3.3B activated"),
    "qwen3-235b-a22b": (235e9, 22e9, True, "Qwen/Qwen3-235B-A22B model card: 235B, 22B activated"),
    "mixtral-8x7b": (46.7e9, 12.9e9, True, "Mixtral of Experts paper: 47B total, 13B active (46.7B / 12.9B)"),
    "gpt-oss-20b": (20.91e9, 3.61e9, False, "gpt-oss model card: 20.91B total, 3.61B active"),
    "gpt-oss-120b": (116.83e9, 5.13e9, False, "gpt-oss model card: 116.83B total, 5.13B active"),
}


@pytest.mark.parametrize("name", sorted(MOE_PUBLISHED))
def test_moe_preset_counts_total_and_active_parameters(name):
    """The preset builds the published shape (total within 1%), and the FLOPs formula counts its ACTIVE
    parameters (within 3%: the published figures are rounded)."""
    from megatrain_cli.metrics.flops import matmul_params
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.presets import PRESETS
    from megatrain_cli.store.tiles import HostStore

    total, active, with_embedding, source = MOE_PUBLISHED[name]
    store = HostStore(ModelAdapter(PRESETS[name].hf_config()), torch.bfloat16, allocate=False)
    assert store.num_params() == pytest.approx(total, rel=0.01), source
    counted = matmul_params(store) + (store.layouts["embed"].numel if with_embedding else 0)
    assert counted == pytest.approx(active, rel=0.03), source


@pytest.mark.parametrize("family", MOE)
def test_plan_counts_what_a_real_moe_layer_saves(family):
    """lean_terms' per-layer terms (routed experts: top-k picks per token, not every expert) against the
    bytes autograd keeps for an HF MoE layer in bf16 on HF's grouped-mm experts, plus the router logits
    the aux loss keeps (w * E per token). gpt-oss runs HF's eager attention (sinks), whose [T, T] scores
    the SDPA-sized terms do not describe (memory.py adds them): its MoE block is measured alone."""
    from megatrain_cli.engine.plan.lean_terms import ModelShape, layer_saved_bytes
    from megatrain_cli.engine.templates import run_bound
    from megatrain_cli.models import families
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.store.tiles import TileLayout

    config = tiny_config(family, layers=1, hidden=64, heads=8, kv_heads=2, inter=40)
    adapter = ModelAdapter(config)
    layout = TileLayout.from_specs(adapter.layer_specs(0))
    flat = (torch.randn(layout.numel, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
    template = adapter.make_layer_template(0)
    families.grouped_experts(template)
    weights = {k: v.detach().requires_grad_() for k, v in layout.views(flat).items()}
    x = torch.randn(1, 96, adapter.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(96)[None]
    cos_sin = tuple(t.to(torch.bfloat16) for t in adapter.make_rotary(torch.device("cpu"))(x, pos))
    shape = ModelShape.of(adapter)
    planned = layer_saved_bytes(shape, 96, 2, mlp_chunked=False, lean_norms=False)
    if family == "gpt_oss":
        mlp_weights = {k[4:]: v for k, v in weights.items() if k.startswith("mlp.")}
        kept = saved_bytes(lambda: run_bound(template.mlp, mlp_weights, x), exclude=[x, flat, *cos_sin])
        planned = planned["MLP intermediates (routed experts + router)"]
    else:
        kept = saved_bytes(lambda: run_bound(template, weights, x, attention_mask=None, position_ids=pos,
                                             position_embeddings=cos_sin), exclude=[x, flat, *cos_sin])
        planned = (sum(planned.values()) - planned["layer input (the checkpoint, now a leaf)"]
                   - planned["layer output"])
    measured = kept + 96 * 2 * shape.experts  # + the router logits the aux loss keeps
    assert measured == pytest.approx(planned, rel=0.03)


def test_moe_dry_run_plans_the_real_parameter_count(capsys):
    """`megatrain train recipes/gpt-oss-120b.yaml --dry-run`: the plan holds every expert (14 B/param of
    116.8B) and its device activations count top-k experts per token, not all 128."""
    from megatrain_cli.recipe.load import load_recipe
    from megatrain_cli.train.loop import run_training

    r = load_recipe("recipes/gpt-oss-120b.yaml")
    run_training(r, dry_run=True)
    out = capsys.readouterr().out
    assert "memory plan for 116.829 B parameters" in out
    assert re.search(r"total\s+1523\.\d\d GiB\s+14\.00 B/param", out)
    recomputed = float(re.search(r"recomputed block activations \(estimate\)\s+([\d.]+) GiB", out).group(1))
    assert 20 < recomputed < 80  # 16 micro-batches of 4096 tokens through one layer; all experts would be ~30x


# ---------------------------------------------------------------------------------------------- gpt-oss MXFP4


def test_mxfp4_experts_dequantise_at_load(tmp_path):
    """A gpt-oss checkpoint with MXFP4 experts (blocks + scales, as openai/gpt-oss-* ship them) loads into
    plain masters equal to transformers' own dequantisation, through transformers' conversion rules with
    the dequantising quantizer of families.checkpoint_quantizer (models/convert.py asks for it)."""
    import json

    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from megatrain_cli.models import families

    config = tiny_config("gpt_oss", layers=1, hidden=64, inter=64)
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    plain = build_store(config, torch.float32, seed=3).hf_state_dict()
    g = torch.Generator().manual_seed(0)
    e, h, i = 4, 64, 64
    tensors = {k: v.to(torch.bfloat16) for k, v in plain.items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    expected = {}
    for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 130, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
        tensors[f"model.layers.0.mlp.experts.{proj}_blocks"] = blocks
        tensors[f"model.layers.0.mlp.experts.{proj}_scales"] = scales
        expected[f"model.layers.0.mlp.experts.{proj}"] = convert_moe_packed_tensors(blocks, scales,
                                                                                    dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))

    loaded = build_store(config, torch.float32, weights_path=str(tmp_path)).hf_state_dict()
    for name, want in expected.items():
        assert loaded[name].shape == plain[name].shape
        torch.testing.assert_close(loaded[name], want.float(), rtol=0, atol=0)  # exact: MXFP4 values fit bf16
    sinks = "model.layers.0.self_attn.sinks"  # the rest loads as it was saved (bf16)
    torch.testing.assert_close(loaded[sinks], plain[sinks].to(torch.bfloat16).float())
    assert families.checkpoint_quantizer(tiny_config("gpt_oss", layers=1)) is None
