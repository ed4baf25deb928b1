"""A streamed step must equal a plain step: plain HF model + torch AdamW on the same batches.

CPU, fp32, tiny models of each supported architecture (GQA everywhere: 4 heads over 2 KV heads; tied
embeddings in some), checkpoint intervals 1, 2 and one that does not divide the layer count; 3
optimizer steps with gradient accumulation 2 and clipping active (max_grad_norm below the norms).
"""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.reference import random_batches, reference_model, reference_train, tiny_config

CASES = [
    # (architecture, tied, layers, checkpoint_interval)
    ("Qwen2ForCausalLM", False, 3, 1),
    ("Qwen2ForCausalLM", True, 4, 2),
    ("LlamaForCausalLM", False, 5, 2),
    ("LlamaForCausalLM", True, 5, 3),  # 3 does not divide 5
    ("MistralForCausalLM", False, 4, 3),
    ("Qwen3ForCausalLM", True, 3, 2),
]

STEPS, ACCUM = 3, 2
# Adam divides by sqrt(v) + eps: an element whose gradient is ~1e-9 (cancellation noise, different in
# the last bits for any two summation orders) would get a near-sign update at eps=1e-8. eps=1e-6 keeps
# the comparison about the engine, not about the noise floor of fp32 reductions.
ADAM_EPS = 1e-6


def run_both(arch, tied, layers, interval, *, packed=False, chunk=7, keep_blocks=frozenset()):
    config = tiny_config(arch, tied=tied, layers=layers)
    store = build_store(config, torch.float32, seed=3)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1,
                      grad_accum=ACCUM, eps=ADAM_EPS)
    ref = reference_model(store, config)
    batches = random_batches(config.vocab_size, STEPS, ACCUM, batch=2, seq=16, seed=5)
    if packed:
        for mbs in batches:
            for mb in mbs:  # two documents per row: positions restart at 0 at token 9
                pos = torch.cat([torch.arange(9), torch.arange(7)]).expand_as(mb.input_ids).clone()
                mb.position_ids = pos
    ref_losses = reference_train(ref, batches, cfg, STEPS)
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=interval, loss_chunk_tokens=chunk,
                         keep_blocks=keep_blocks, overlap_optimizer=False)
    results = [engine.step(mbs, lr_at(s, cfg, STEPS)) for s, mbs in enumerate(batches)]
    return store, ref, ref_losses, results


def assert_same_params(store, ref, tied):
    ours = store.hf_state_dict()
    for name, expected in ref.state_dict().items():
        if tied and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        # 1e-5 relative; the 1e-6 absolute floor covers zero-initialised biases whose gradient is
        # mathematically zero (a key bias shifts every score equally) and numerically just noise.
        torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch,tied,layers,interval", CASES)
def test_parity_three_steps(arch, tied, layers, interval):
    store, ref, ref_losses, results = run_both(arch, tied, layers, interval)
    for step, (res, expected) in enumerate(zip(results, ref_losses)):
        assert len(res.losses) == ACCUM
        for ours, theirs in zip(res.losses, expected):
            assert ours == pytest.approx(theirs, rel=1e-5), f"step {step} micro-batch loss"
        assert res.grad_norm > 0.5, "clipping must be active in this test"
        assert not res.skipped
    assert_same_params(store, ref, tied)


def test_parity_packed_rows_use_block_causal_attention():
    store, ref, ref_losses, results = run_both("Qwen2ForCausalLM", False, 3, 2, packed=True)
    for res, expected in zip(results, ref_losses):
        assert res.losses == pytest.approx(expected, rel=1e-5)
    assert_same_params(store, ref, tied=False)


def test_parity_moments_match_torch_adamw():
    """The host Adam state equals torch AdamW's after the same three steps."""
    from tests.reference import param_groups

    store, _, _, _ = run_both("LlamaForCausalLM", False, 3, 1)
    config = tiny_config("LlamaForCausalLM", layers=3)
    model = reference_model(build_store(config, torch.float32, seed=3), config)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, grad_accum=ACCUM,
                      eps=ADAM_EPS)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, eps=ADAM_EPS, foreach=False)
    batches = random_batches(config.vocab_size, STEPS, ACCUM, batch=2, seq=16, seed=5)
    for s, mbs in enumerate(batches):  # the reference loop again, keeping its optimizer to read the state
        for g in opt.param_groups:
            g["lr"] = lr_at(s, cfg, STEPS)
        n = sum(int((mb.labels[:, 1:] != -100).sum()) for mb in mbs)
        for mb in mbs:
            logits = model(input_ids=mb.input_ids).logits
            torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                              mb.labels[:, 1:].reshape(-1), reduction="sum").div(n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    tile = store.tiles["layers.1"]
    ref_param = dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    torch.testing.assert_close(tile.layout.views(tile.exp_avg_sq)["mlp.down_proj.weight"],
                               opt.state[ref_param]["exp_avg_sq"], rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(tile.layout.views(tile.exp_avg)["mlp.down_proj.weight"],
                               opt.state[ref_param]["exp_avg"], rtol=1e-4, atol=1e-9)
    assert tile.step == STEPS


def test_unsupported_architecture_is_refused():
    from transformers import AutoConfig
    from megatrain_cli.models.adapter import ModelAdapter, UnsupportedArchitecture

    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=4, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel.*besides them it holds.*wpe"):
        ModelAdapter(config)


@pytest.mark.parametrize("keep", [frozenset({1}), frozenset({0, 1, 2})])
def test_parity_with_kept_activations(keep):
    """Memory-adaptive recompute: blocks that keep their activations skip the recompute, same math."""
    store, ref, ref_losses, results = run_both("LlamaForCausalLM", False, 5, 2, keep_blocks=keep)
    for res, expected in zip(results, ref_losses):
        assert res.losses == pytest.approx(expected, rel=1e-5)
    assert_same_params(store, ref, tied=False)
