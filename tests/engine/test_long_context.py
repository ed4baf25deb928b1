"""The engine's long-context path (issue #9) on the CPU: with a LeanPlan (chunked MLP, lean norms,
checkpoints through the offloader, the plan's loss chunk) a step is the same arithmetic as without
one; the bench's long-context path runs a step of the tiny preset and refuses a plan that does not fit.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.engine import lean_layers
from megatrain_cli.engine.plan.lean import GiB, choose_plan, plan_long_context
from megatrain_cli.engine.step import Engine
from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.reference import random_batches, tiny_config

STEPS = 2
SEQ, BATCH = 16, 2


def train(config, accum, **engine_kwargs):
    store = build_store(config, torch.float32, seed=3)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1,
                      grad_accum=accum, eps=1e-6)
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=1, overlap_optimizer=False, **engine_kwargs)
    batches = random_batches(config.vocab_size, STEPS, accum, batch=BATCH, seq=SEQ, seed=5)
    results = [engine.step(mbs, lr_at(s, cfg, STEPS)) for s, mbs in enumerate(batches)]
    engine.close()
    return store, engine, results


def forced_plan(config, accum, *, lean, offloaded, mlp_chunk=5, chunk=7):
    """Small MLP chunks (32 tokens per micro-batch: 7 chunks, the last short), a loss chunk that does not
    divide the tokens, and `offloaded` checkpoints in host memory, whatever the budget would choose."""
    plan = plan_long_context(config, SEQ, batch=BATCH * accum, device_budget_bytes=GiB, mlp_chunk_tokens=mlp_chunk,
                             chunk_mlp=True, loss_chunk_tokens=chunk, offload=False, lean_norms=lean)
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

    chunked_calls = []
    plain_chunked_mlp = lean_layers.chunked_mlp
    monkeypatch.setattr(lean_layers, "chunked_mlp", lambda *a, **k: chunked_calls.append(1) or plain_chunked_mlp(*a, **k))
    plan = forced_plan(config, accum, lean=lean, offloaded=offloaded)
    store, engine, results = train(config, accum, loss_chunk_tokens=4096, keep_blocks=keep, lean=plan)

    # The plan's pieces are what ran.
    assert engine.chunk == 7 and all(lean_layers.mlp_chunk_tokens(t) == 5 for t in engine.templates.all())
    assert chunked_calls  # forward (no grad) and recompute of every layer went through the chunked MLP
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


def test_an_unknown_sdpa_backend_is_refused():
    config = tiny_config(layers=2)
    store = build_store(config, torch.float32, seed=0)
    with pytest.raises(ValueError, match="SDPA backend"):
        make_engine(store, TrainConfig(), device="cpu", checkpoint_interval=1, overlap_optimizer=False, sdpa="fastest")


def test_choose_plan_takes_lean_norms_only_when_hf_does_not_fit():
    from tests.engine.test_lean_layers import qwen25_7b

    config, budget = qwen25_7b(), int(139.8 * GiB)
    assert not choose_plan(config, 256 * 1024, device_budget_bytes=budget).lean_norms  # fits as it is
    # 512K with 25 GiB of host memory free: HF norms offload 31.5 GiB of checkpoints, lean ones 21 GiB.
    hf = plan_long_context(config, 512 * 1024, device_budget_bytes=budget, host_budget_bytes=25 * GiB, drop=0)
    chosen = choose_plan(config, 512 * 1024, device_budget_bytes=budget, host_budget_bytes=25 * GiB)
    assert not hf.fits and chosen.fits and chosen.lean_norms
    assert chosen.offloaded_checkpoints < hf.offloaded_checkpoints
    # HF norms would fit by recomputing 2 checkpoints (tests/engine/test_rebuild.py); lean norms need none: lean.
    assert plan_long_context(config, 512 * 1024, device_budget_bytes=budget,
                             host_budget_bytes=25 * GiB).dropped_checkpoints == (1, 3)
    assert chosen.dropped_checkpoints == ()
    none_fit = choose_plan(config, 512 * 1024, device_budget_bytes=budget, host_budget_bytes=GiB, drop=0)
    assert not none_fit.fits and not none_fit.lean_norms


# ---------------------------------------------------------------------------------------------- bench
def long_recipe(*overrides: str, seq: int = 256):
    """The bench's recipe for the tiny preset on the CPU (fp32), one sequence of `seq` tokens per step on the
    long-context path."""
    from megatrain_cli.bench.settings import bench_recipe

    return bench_recipe(["model.preset=tiny", "model.dtype=fp32", "engine.device=cpu", "train.micro_batch_size=1",
                         f"train.seq_len={seq}", f"engine.long_context_min_seq={seq}", *overrides])


def plan_defaults(monkeypatch, **defaults):
    """The long-context planner's own knobs (not recipe keys: MLP chunk size, forced chunking or offload), set
    for this test so the tiny model's 256 tokens exercise the chunked MLP and the offloader."""
    from megatrain_cli.engine.plan import lean

    for key, value in defaults.items():
        monkeypatch.setitem(lean.plan_long_context.__kwdefaults__, key, value)


def layer_lines(lines: list[str]) -> list[str]:
    """The per-layer progress lines (LayerClock), without their times: 'step 0 layer 3 forward', ..."""
    import re

    return [m.group(1) for m in (re.match(r"\[bench-long\] (step \d+ (?:layer \d+ \w+|head))", x) for x in lines) if m]


def test_bench_long_context_runs_a_step_of_tiny_on_cpu(monkeypatch):
    from megatrain_cli.bench.runner import run_bench
    from megatrain_cli.bench.settings import BenchRun
    from tests.bench.test_bench import plain_engine_losses

    plan_defaults(monkeypatch, mlp_chunk_tokens=64, chunk_mlp=True, offload=True)
    lines = []
    res = run_bench(long_recipe(), BenchRun(steps=2, warmup=1), log=lines.append)
    assert res.model == "tiny" and res.extrapolated == {}
    assert res.steps == 2 and res.step_time_s > 0 and res.tokens_per_s == pytest.approx(256 / res.step_time_s)
    assert res.model_tflops > 0 and res.executed_tflops > res.model_tflops
    assert {"forward", "head", "backward", "optimizer"} <= set(res.split)
    # The shared loop ran the warm-up and the timed steps a plain engine runs (same batches, same losses).
    assert res.losses == pytest.approx(plain_engine_losses("tiny", 1, 256, steps=3), rel=1e-5)
    assert "per layer: forward" in res.notes and "offloaded 4/4 checkpoints" in res.notes
    assert "medians of 8 layer passes" in res.notes  # 4 layers x 2 timed steps, the warm-up left out
    assert "late gets 0" in res.notes and "checkpoint offload D2H 0.0 GiB/step" in res.notes
    text = "\n".join(lines)
    assert "long-context plan: 1 x 256 tokens" in text and "[bench-long] step 0 (warm-up):" in text
    # Every layer's forward, then the head, then every layer's recompute + backward, as each completes,
    # before the step's own line.
    one_step = [f"layer {i} forward" for i in range(4)] + ["head"] + \
        [f"layer {i} recompute" for i in reversed(range(4))]
    assert layer_lines(lines) == [f"step {s} {x}" for s in range(3) for x in one_step]
    first_step_line = next(i for i, x in enumerate(lines) if x.startswith("[bench-long] step 0 (warm-up)"))
    assert lines[first_step_line - 1].startswith("[bench-long] step 0 layer 0 recompute + backward ")


def test_bench_long_context_layers_extrapolates_to_the_whole_model(monkeypatch):
    from megatrain_cli.bench.long_context import format_extrapolation
    from megatrain_cli.bench.runner import run_bench
    from megatrain_cli.bench.settings import BenchRun, bench_model_config
    from megatrain_cli.engine.plan.step_plan import plan_step
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.models.loader import build_store
    from tests.bench.test_bench import plain_engine_losses

    # Headroom 0.2 stands in for the 1 GiB a CUDA device keeps back: at tiny's size on the CPU, a budget small
    # enough to make the whole model offload would otherwise chunk both models by the 10%-of-budget rule.
    plan_defaults(monkeypatch, mlp_chunk_tokens=64, headroom=0.2)
    store = build_store(bench_model_config(long_recipe(), 2), torch.float32, seed=0)
    whole = ModelAdapter(bench_model_config(long_recipe()))
    # A device budget at which the whole model's plan chunks the MLP and a 2-layer model's own plan would not:
    # the run must take the whole model's choice, so its layers run what they would in the whole model.
    options = dict(batch=1, host_budget_bytes=GiB, dtype=torch.float32, device_type="cpu")
    budget = next(b for b in range(2**25, 2**27, 2**12)
                  if choose_plan(whole, 256, device_budget_bytes=b, **options).mlp_chunk_tokens
                  and not choose_plan(store.adapter, 256, device_budget_bytes=b, **options).mlp_chunk_tokens)
    lines = []
    r = long_recipe(f"engine.max_gpu_mem={budget}B")
    res = run_bench(r, BenchRun(steps=1, layers=2), store=store, log=lines.append)
    assert res.model == "tiny[2 of 4 layers]" and res.steps == 1
    assert res.losses == pytest.approx(plain_engine_losses("tiny", 1, 256, steps=1, layers=2), rel=1e-5)
    assert layer_lines(lines) == ["step 0 layer 0 forward", "step 0 layer 1 forward", "step 0 head",
                                  "step 0 layer 1 recompute", "step 0 layer 0 recompute"]
    x = res.extrapolated
    assert x["layers"] == 4 and x["measured_layers"] == 2 and x["per_layer_samples"] == 2
    assert x["measured_step_time_s"] == res.step_time_s
    per_layer = x["per_layer_forward_s"] + x["per_layer_backward_s"]
    assert per_layer > 0 and x["step_time_s"] == pytest.approx(res.step_time_s + 2 * per_layer)
    assert x["once_per_step_s"] == pytest.approx(res.step_time_s - 2 * per_layer)
    assert x["model_tflops"] > 0 and x["tokens_per_s"] == pytest.approx(256 / x["step_time_s"])
    # The whole model's plan, computed with the run's budgets, and the truncated run took its choices.
    full = plan_step(r, whole, torch.device("cpu")).lean
    assert full.num_checkpoints == 4 and x["planned_peak_device_bytes"] == full.predicted_peak
    assert x["planned_host_pinned_bytes"] == full.host_pinned_bytes and x["plan_fits"]
    assert x["measured_layers_planned_peak_device_bytes"] < full.predicted_peak
    assert x["measured_peak_device_bytes"] is None  # CPU
    assert full.mlp_chunk_tokens == 64 and "MLP chunk 64," in res.notes
    text = format_extrapolation(x)
    assert text.startswith("extrapolated to 4 layers (NOT measured: 2 of 4 layers ran)")
    assert "step(L) = step(N) + (L - N) x (forward + recompute/backward per layer)" in text
    assert "planned peak" in text and "measured n/a (cpu)" in text
    assert "[bench-long] extrapolated to 4 layers" in "\n".join(lines)


def test_extrapolate_scales_the_layer_passes_and_keeps_the_rest():
    from megatrain_cli.bench.long_context import extrapolate

    x = extrapolate(step_time=10.0, measured_layers=2, full_layers=28, forward_per_layer=1.0, backward_per_layer=3.0,
                    samples=2, tokens=1000, full_flops=2.28e15, full_executed_flops=3.42e15)
    assert x["step_time_s"] == pytest.approx(10 + 26 * 4) and x["once_per_step_s"] == pytest.approx(2.0)
    assert x["model_tflops"] == pytest.approx(20.0) and x["executed_tflops"] == pytest.approx(30.0)
    assert x["tokens_per_s"] == pytest.approx(1000 / 114)
    # A rebuilt checkpoint is one more layer forward: the whole model's 3 against the run's 1.
    x = extrapolate(step_time=10.0, measured_layers=2, full_layers=28, forward_per_layer=1.0, backward_per_layer=3.0,
                    samples=2, tokens=1000, full_flops=2.28e15, full_executed_flops=3.42e15, measured_rebuilds=1,
                    full_rebuilds=3)
    assert x["step_time_s"] == pytest.approx(10 + 26 * 4 + 2 * 1) and x["once_per_step_s"] == pytest.approx(1.0)


def test_a_step_that_fails_midway_leaves_its_per_layer_lines(monkeypatch):
    """A run stopped in the middle of a step (here an out-of-memory error in layer 1's backward; a time limit
    alike) has already logged every layer pass that finished."""
    from megatrain_cli.bench.runner import run_bench
    from megatrain_cli.bench.settings import BenchRun

    real = Engine._backward_layer

    def backward_until_layer_1(self, i, *a, **k):
        if i == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(self, i, *a, **k)

    monkeypatch.setattr(Engine, "_backward_layer", backward_until_layer_1)
    lines = []
    plan_defaults(monkeypatch, mlp_chunk_tokens=64)
    res = run_bench(long_recipe(), BenchRun(steps=1), log=lines.append)
    assert res.steps == 0 and res.notes.startswith("out of memory: CUDA out of memory") and res.extrapolated == {}
    assert layer_lines(lines) == [f"step 0 layer {i} forward" for i in range(4)] + [
        "step 0 head", "step 0 layer 3 recompute", "step 0 layer 2 recompute"]


def test_7b_plans_fit_one_h200_and_a_256_gib_host():
    """`megatrain bench --model 7b --seq 32k..512k` on one H200 (139.8 GiB) of a host with 256 GiB: the plans
    the bench would choose, with the host budget it would read after the 7B store (14 bytes/param)."""
    from megatrain_cli.bench.settings import bench_model_config, bench_recipe
    from megatrain_cli.engine.plan.lean import host_budget_bytes
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.store.tiles import HostStore

    device, expected = int(139.8 * GiB), {32: (22.7, 0), 128: (45.8, 0), 256: (82.1, 0), 512: (130.5, 9)}
    for k, (peak_gib, offloaded) in expected.items():
        config = bench_model_config(bench_recipe(["model.preset=7b", f"train.seq_len={k * 1024}"]))
        store = HostStore(ModelAdapter(config), torch.bfloat16, allocate=False)
        engine_pinned = 14 * store.largest_layer_numel() * 2
        host = host_budget_bytes(engine_pinned, available=250 * GiB) - store.host_bytes()  # MemAvailable < total
        plan = choose_plan(store.adapter, k * 1024, device_budget_bytes=device, host_budget_bytes=host)
        assert plan.fits and not plan.lean_norms, (k, plan.render())
        assert plan.predicted_peak / GiB == pytest.approx(peak_gib, abs=0.05)
        assert plan.offloaded_checkpoints == offloaded
    assert store.host_bytes() / GiB == pytest.approx(99.3, abs=0.05)
    assert plan.host_pinned_bytes / GiB == pytest.approx(31.5, abs=0.05) and plan.host_pinned_bytes < host


def test_bench_long_context_refuses_a_plan_that_does_not_fit():
    from megatrain_cli.bench.runner import run_bench
    from megatrain_cli.bench.settings import BenchRun

    lines = []
    res = run_bench(long_recipe("engine.max_gpu_mem=1MiB"), BenchRun(steps=1), log=lines.append)
    assert res.notes.startswith("does not fit: predicted device peak") and res.tokens_per_s == 0
    assert res.steps == 0 and "DOES NOT FIT" in "\n".join(lines)


def test_long_rows_build_no_mask_and_only_an_unpacked_window_is_refused(monkeypatch):
    """Past the mask limit (lowered here to below these rows) the long-context path runs packed rows (no mask:
    their documents go to the attention, models/attention.py) and one document per row; it refuses only a
    row of one document whose sliding window is shorter than the row (its dense window mask)."""
    from megatrain_cli.engine import inputs as inputs_module

    monkeypatch.setattr(inputs_module, "MAX_LONG_CONTEXT_MASK", 2 * SEQ * SEQ - 1)
    config = tiny_config(layers=2)
    store = build_store(config, torch.float32, seed=0)
    engine = make_engine(store, TrainConfig(), device="cpu", lean=forced_plan(config, 1, lean=False, offloaded=1),
                         overlap_optimizer=False)
    (mbs,) = random_batches(config.vocab_size, 1, 1, batch=BATCH, seq=SEQ, seed=0)
    engine.forward_backward(mbs)  # one document per row: no mask, whatever the length
    mbs[0].position_ids = torch.cat([torch.arange(9), torch.arange(7)]).expand(BATCH, SEQ).clone()
    engine.forward_backward(mbs)  # packed rows: no mask either
    calls = [engine.layer_inputs(torch.zeros(BATCH, SEQ, config.hidden_size), mbs[0].position_ids)]
    assert calls[0].masks() == [] and calls[0].kwargs[0]["cu_seq_lens_q"].tolist() == [0, 9, 16, 25, 32]
    engine.close()

    windowed = tiny_config("mistral", layers=2)  # a window of 6 < 16 tokens
    store = build_store(windowed, torch.float32, seed=0)
    engine = make_engine(store, TrainConfig(), device="cpu", lean=forced_plan(windowed, 1, lean=False, offloaded=1),
                         overlap_optimizer=False)
    (mbs,) = random_batches(windowed.vocab_size, 1, 1, batch=BATCH, seq=SEQ, seed=0)
    with pytest.raises(ValueError, match=r"sliding window \(6 tokens\) is shorter than train.seq_len \(16\)"):
        engine.forward_backward(mbs)
    mbs[0].position_ids = torch.cat([torch.arange(9), torch.arange(7)]).expand(BATCH, SEQ).clone()
    engine.forward_backward(mbs)  # the same rows packed: the window goes to the attention, no mask
    engine.close()


def test_plan_for_training():
    from megatrain_cli.engine.plan.lean import plan_for_training
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
    one block ahead; chunked MLP, lean norms. MATH attention on both sides so only the path differs."""
    config = tiny_config("Qwen2ForCausalLM", layers=4, hidden=64, inter=192)
    accum, dev = 2, torch.device("cuda")

    def run(plan):
        store = build_store(config, torch.float32, seed=3)
        cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1,
                          grad_accum=accum, eps=1e-6)
        engine = make_engine(store, cfg, device=dev, checkpoint_interval=1, loss_chunk_tokens=7, overlap_optimizer=True,
                             grad_slabs=3, lean=plan, sdpa="math" if plan else "auto", kernels="torch")
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
