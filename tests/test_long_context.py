"""The engine's long-context path (issue #9) on the CPU: with a LongContextPlan (tiled MLP, lean norms,
checkpoints through the offloader, the plan's loss chunk) a step is the same arithmetic as without
one; bench_long_context runs a step of the tiny preset and refuses a plan that does not fit.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.engine import tiling
from megatrain_cli.engine.long_context import GiB, choose_plan, plan_long_context
from megatrain_cli.engine.step import Engine
from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.cpu_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from tests.reference import random_batches, tiny_config

STEPS = 2
SEQ, BATCH = 16, 2


def train(config, accum, **engine_kwargs):
    store = build_store(config, torch.float32, seed=3)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1,
                      grad_accum=accum, eps=1e-6)
    engine = Engine(store, cfg, device=torch.device("cpu"), checkpoint_interval=1, **engine_kwargs)
    batches = random_batches(config.vocab_size, STEPS, accum, batch=BATCH, seq=SEQ, seed=5)
    results = [engine.step(mbs, lr_at(s, cfg, STEPS)) for s, mbs in enumerate(batches)]
    engine.close()
    return store, engine, results


def forced_plan(config, accum, *, lean, offloaded, tile=5, chunk=7):
    """Small MLP tiles (32 tokens per micro-batch: 7 tiles, the last short), a loss chunk that does not
    divide the tokens, and `offloaded` checkpoints in host memory, whatever the budget would choose."""
    plan = plan_long_context(config, SEQ, batch=BATCH * accum, device_budget_bytes=GiB, mlp_tile_tokens=tile,
                             tile_mlp=True, loss_chunk_tokens=chunk, offload=False, lean_norms=lean)
    plan.offloaded_checkpoints = offloaded
    return plan


@pytest.mark.parametrize("arch,tied,accum,lean,offloaded,keep", [
    ("Qwen2ForCausalLM", False, 2, False, 2, frozenset()),  # 2 of 3 checkpoints offloaded, grad accumulation
    ("Qwen2ForCausalLM", True, 1, True, 3, frozenset()),  # all offloaded, lean norms, tied head
    ("Qwen3ForCausalLM", False, 1, True, 1, frozenset({2})),  # q/k norms lean; the last block keeps its graph
])
def test_long_context_engine_trains_like_the_plain_one(monkeypatch, arch, tied, accum, lean, offloaded, keep):
    config = tiny_config(arch, tied=tied, layers=3)
    ref_store, _, ref_results = train(config, accum, loss_chunk_tokens=7, keep_blocks=keep)

    tiled_calls = []
    plain_tiled_mlp = tiling.tiled_mlp
    monkeypatch.setattr(tiling, "tiled_mlp", lambda *a, **k: tiled_calls.append(1) or plain_tiled_mlp(*a, **k))
    plan = forced_plan(config, accum, lean=lean, offloaded=offloaded)
    store, engine, results = train(config, accum, loss_chunk_tokens=4096, keep_blocks=keep, long_context=plan)

    # The plan's pieces are what ran.
    assert engine.chunk == 7 and all(tiling.mlp_tile_tokens(t) == 5 for t in engine.templates.all())
    assert tiled_calls  # forward (no grad) and recompute of every layer went through the tiled MLP
    norms_slim = ["forward" in m.__dict__ for t in engine.templates.all() for m in t.modules()
                  if type(m).__name__.endswith("RMSNorm")]
    assert norms_slim and all(x == lean for x in norms_slim)
    assert ("forward" in engine.norm_template.__dict__) == lean
    off = engine.offloader
    recomputed_offloaded = [b for b in range(offloaded) if b not in keep]
    expected_bytes = STEPS * len(recomputed_offloaded) * accum * BATCH * SEQ * config.hidden_size * 4
    assert off.d2h_bytes == off.h2d_bytes == expected_bytes  # CPU "offload": plain host copies, both ways
    assert off.late_gets == 0  # every offloaded checkpoint was prefetched one block ahead

    for res, ref in zip(results, ref_results):
        assert res.losses == pytest.approx(ref.losses, rel=1e-5)
        assert res.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
    ours, theirs = store.hf_state_dict(), ref_store.hf_state_dict()
    for name, expected in theirs.items():
        torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_long_context_plan_must_match_the_engines_interval():
    config = tiny_config(layers=2)
    store = build_store(config, torch.float32, seed=0)
    plan = forced_plan(config, 1, lean=False, offloaded=0)
    with pytest.raises(ValueError, match="checkpoint_interval"):
        Engine(store, TrainConfig(), device=torch.device("cpu"), checkpoint_interval=2, long_context=plan)
    with pytest.raises(ValueError, match="SDPA backend"):
        Engine(store, TrainConfig(), device=torch.device("cpu"), sdpa="fastest")


def test_choose_plan_takes_lean_norms_only_when_hf_does_not_fit():
    from tests.test_tiling import qwen25_7b

    config, budget = qwen25_7b(), int(139.8 * GiB)
    assert not choose_plan(config, 256 * 1024, device_budget_bytes=budget).lean_norms  # fits as it is
    # 512K with 25 GiB of host memory free: HF norms offload 31.5 GiB of checkpoints, lean ones 21 GiB.
    hf = plan_long_context(config, 512 * 1024, device_budget_bytes=budget, host_budget_bytes=25 * GiB)
    chosen = choose_plan(config, 512 * 1024, device_budget_bytes=budget, host_budget_bytes=25 * GiB)
    assert not hf.fits and chosen.fits and chosen.lean_norms
    assert chosen.offloaded_checkpoints < hf.offloaded_checkpoints
    none_fit = choose_plan(config, 512 * 1024, device_budget_bytes=budget, host_budget_bytes=GiB)
    assert not none_fit.fits and not none_fit.lean_norms


# ---------------------------------------------------------------------------------------------- bench


def test_bench_long_context_runs_a_step_of_tiny_on_cpu():
    from megatrain_cli.bench_long import bench_long_context

    lines = []
    res = bench_long_context("tiny", 256, device="cpu", steps=1, mlp_tile_tokens=64, tile_mlp=True, offload=True,
                             log=lines.append)
    assert res.steps == 1 and res.step_time_s > 0 and res.tokens_per_s == pytest.approx(256 / res.step_time_s)
    assert res.model_tflops > 0 and res.executed_tflops > res.model_tflops
    assert {"forward", "head", "backward", "optimizer"} <= set(res.split) and len(res.losses) == 1
    assert "per layer: forward" in res.notes and "offloaded 4/4 checkpoints" in res.notes
    assert "late gets 0" in res.notes
    text = "\n".join(lines)
    assert "long-context plan: 1 x 256 tokens" in text and "[bench-long] step 0:" in text


def test_bench_long_context_refuses_a_plan_that_does_not_fit():
    from megatrain_cli.bench_long import bench_long_context

    lines = []
    res = bench_long_context("tiny", 256, device="cpu", device_budget=2**20, log=lines.append)
    assert res.notes.startswith("does not fit: predicted device peak") and res.tokens_per_s == 0
    assert res.steps == 0 and "DOES NOT FIT" in "\n".join(lines)


def test_packed_long_rows_are_refused_before_the_mask_is_built(monkeypatch):
    from megatrain_cli.engine import step as step_module

    monkeypatch.setattr(step_module, "MAX_LONG_CONTEXT_MASK", 2 * SEQ * SEQ - 1)
    config = tiny_config(layers=2)
    store = build_store(config, torch.float32, seed=0)
    engine = Engine(store, TrainConfig(), device=torch.device("cpu"), long_context=forced_plan(config, 1, lean=False,
                                                                                                offloaded=1))
    (mbs,) = random_batches(config.vocab_size, 1, 1, batch=BATCH, seq=SEQ, seed=0)
    engine.forward_backward(mbs)  # one document per row: no mask, whatever the length
    mbs[0].position_ids = torch.cat([torch.arange(9), torch.arange(7)]).expand(BATCH, SEQ).clone()
    with pytest.raises(ValueError, match="data.packing=false"):
        engine.forward_backward(mbs)
    engine.close()


def test_plan_for_training():
    from megatrain_cli.engine.long_context import plan_for_training
    from megatrain_cli.models.adapter import ModelAdapter

    adapter = ModelAdapter(tiny_config(layers=2))
    args = dict(micro_batch_size=1, grad_accum=2, dtype=torch.bfloat16, device_budget=10 * GiB, device_type="cuda")
    assert plan_for_training(adapter, seq_len=4096, **args) is None
    plan = plan_for_training(adapter, seq_len=65536, **args)
    assert plan.tokens == 2 * 65536 and plan.checkpoint_interval == 1 and plan.fits
    with pytest.raises(ValueError, match="max_gpu_mem"):
        plan_for_training(adapter, seq_len=65536, **{**args, "device_budget": None})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_long_context_on_cuda_trains_like_the_plain_cuda_engine():
    """fp32 on the GPU: checkpoints through pinned buffers on the offloader's side streams, brought back
    one block ahead; tiled MLP, lean norms. MATH attention on both sides so only the path differs."""
    config = tiny_config("Qwen2ForCausalLM", layers=4, hidden=64, inter=192)
    accum, dev = 2, torch.device("cuda")

    def run(plan):
        store = build_store(config, torch.float32, seed=3)
        cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1,
                          grad_accum=accum, eps=1e-6)
        engine = Engine(store, cfg, device=dev, checkpoint_interval=1, loss_chunk_tokens=7, overlap_optimizer=True,
                        grad_slabs=3, long_context=plan, sdpa="math" if plan else "auto")
        pinned = engine.reserve_checkpoint_buffers([(BATCH, SEQ)] * accum)
        batches = random_batches(config.vocab_size, STEPS, accum, batch=BATCH, seq=SEQ, seed=5)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            results = [engine.step(mbs, lr_at(s, cfg, STEPS)) for s, mbs in enumerate(batches)]
        engine.synchronize()
        stats = (pinned, engine.offloader.d2h_bytes, engine.offloader.late_gets) if plan else None
        engine.close()
        return store, results, stats

    ref_store, ref_results, _ = run(None)
    store, results, (pinned, d2h, late) = run(forced_plan(config, accum, lean=True, offloaded=2))
    checkpoint = BATCH * SEQ * config.hidden_size * 4
    assert pinned == 2 * accum * checkpoint and d2h == STEPS * 2 * accum * checkpoint and late == 0
    for res, ref in zip(results, ref_results):
        assert res.losses == pytest.approx(ref.losses, rel=1e-5)
    for name, tile in ref_store.tiles.items():
        torch.testing.assert_close(store.tiles[name].master, tile.master, rtol=1e-5, atol=1e-6)
