"""Device-resident layers (engine.resident_layers, engine/resident.py): the first N layers keep their
optimizer state on the device and are updated there. Where the state lives changes how, never what:
the streamed step with resident layers equals plain HF + torch AdamW, and on the CPU it is bit-identical
to the same run with none resident; the host tiles are current after `synchronize`, so checkpoints
resume exactly; the planner counts the device bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain_cli.checkpoint import load_checkpoint, save_checkpoint
from megatrain_cli.engine.plan.memory import make_plan, resident_device_bytes
from megatrain_cli.engine.plan.step_plan import plan_step
from megatrain_cli.engine.step import Engine
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import RecipeError, TrainConfig, load_recipe
from megatrain_cli.store.tiles import HostStore
from tests.engines import make_engine
from tests.reference import random_batches, reference_model, reference_train, tiny_config
from tests.engine.test_parity import assert_same_params

STEPS, ACCUM = 3, 2
SECTIONS = ("master", "exp_avg", "exp_avg_sq")


def setup(dtype=torch.float32, layers=4, steps=STEPS, arch="LlamaForCausalLM", tied=False, master=None):
    config = tiny_config(arch, tied=tied, layers=layers)
    store = build_store(config, dtype, seed=3, master_dtype=master)
    cfg = TrainConfig(steps=steps, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1,
                      grad_accum=ACCUM, eps=1e-6)
    batches = random_batches(config.vocab_size, steps, ACCUM, batch=2, seq=16, seed=5)
    return config, store, cfg, batches


def run(store, cfg, batches, resident, first=0, total=STEPS, device="cpu", overlap_optimizer=False, **kwargs):
    engine = make_engine(store, cfg, device=device, checkpoint_interval=2, loss_chunk_tokens=7,
                         resident_layers=resident, overlap_optimizer=overlap_optimizer, kernels="torch", **kwargs)
    results = [engine.step(mbs, lr_at(first + s, cfg, total)) for s, mbs in enumerate(batches)]
    engine.close()  # synchronize: the resident layers' state comes home
    return engine, results


@pytest.mark.parametrize("resident,tied", [(1, False), (4, False), (2, True)])
def test_resident_layers_match_plain_hf_and_adamw(resident, tied):
    config, store, cfg, batches = setup(tied=tied)
    ref = reference_model(store, config)
    ref_losses = reference_train(ref, batches, cfg, STEPS)
    engine, results = run(store, cfg, batches, resident)
    assert engine.resident.names == (*[f"layers.{i}" for i in range(resident)], "head")
    for res, expected in zip(results, ref_losses):
        assert res.losses == pytest.approx(expected, rel=1e-5)
        assert res.grad_norm > 0.5, "clipping must be active in this test"
    assert_same_params(store, ref, tied=tied)
    # Resident layers and the head never cross to the device as transfers; the streamed ones still do.
    counted = results[-1].h2d_count
    assert not any(f"layers.{i}" in counted for i in range(resident)) and "head" not in counted
    assert all(f"layers.{i}" in counted for i in range(resident, 4))


@pytest.mark.parametrize("dtype,master,rounding", [
    (torch.float32, None, "stochastic"), (torch.bfloat16, None, "stochastic"),
    (torch.bfloat16, torch.bfloat16, "nearest"), (torch.bfloat16, torch.bfloat16, "stochastic")])
def test_resident_run_is_bit_identical_to_the_streamed_one_on_cpu(dtype, master, rounding):
    """The same arithmetic as the host kernel: fused AdamW, the gradient rounded to the tile's gradient
    dtype first (bf16 here as the D2H path rounds it), the same decay ranges, clip and bias corrections;
    bf16 masters (train.master_weights) widened, updated in fp32 and rounded to nearest even or stochastically
    (train.master_rounding, the default; fp32 masters take neither)."""
    stores, losses = [], []
    for resident in (0, 3):
        _, store, cfg, batches = setup(dtype, master=master)
        cfg = dataclasses.replace(cfg, master_rounding=rounding)
        _, results = run(store, cfg, batches, resident)
        stores.append(store)
        losses.append([r.losses for r in results])
    assert losses[0] == losses[1]
    for name, tile in stores[0].tiles.items():
        assert tile.step == stores[1].tiles[name].step == STEPS
        for section in SECTIONS:
            assert torch.equal(getattr(tile, section), getattr(stores[1].tiles[name], section)), (name, section)


def test_a_forward_only_pass_before_the_first_step_loads_the_resident_weights_alone():
    """The reference pass (engine/validate, before any step) loads the resident layers' weights only, and
    drops them after: its scores equal the all-streamed engine's, and the run after it is bit-identical to
    one without the pass (the first step loads masters and moments as always)."""
    from megatrain_cli.batch import MicroBatch
    from megatrain_cli.engine.validate import validation_loss

    outcomes = []
    for resident, scored in ((0, False), (3, False), (3, True)):
        _, store, cfg, batches = setup()
        engine = make_engine(store, cfg, device="cpu", checkpoint_interval=2, loss_chunk_tokens=7,
                             resident_layers=resident, overlap_optimizer=False, kernels="torch")
        seen = []
        if scored:
            load = engine.resident.load

            def spy(weights_only=False):
                load(weights_only=weights_only)
                seen.append((weights_only, engine.resident.device_bytes()))

            engine.resident.load = spy
        val = validation_loss(engine, [MicroBatch(mb.input_ids, mb.labels) for mb in batches[0]], group=ACCUM)
        loaded_after_pass = engine.resident.loaded
        results = [engine.step(mbs, lr_at(s, cfg, STEPS)) for s, mbs in enumerate(batches)]
        engine.close()
        outcomes.append((val, [r.losses for r in results], store))
        if scored:
            weights = sum(store.tiles[n].master.numel() for n in engine.resident.names) * 4  # fp32 compute
            assert seen[0] == (True, weights), "the pass loads the weights alone"
            assert seen[1][0] is False, "the first step loads the whole state"
            assert not loaded_after_pass
    (val0, losses0, store0), (val3, losses3, _), (_, losses3s, store3s) = outcomes
    assert val3 == val0 and losses3 == losses0 == losses3s
    for name, tile in store0.tiles.items():
        for section in SECTIONS:
            assert torch.equal(getattr(tile, section), getattr(store3s.tiles[name], section)), (name, section)


def test_host_tiles_are_stale_until_synchronize():
    _, store, cfg, batches = setup()
    before = store.tiles["layers.0"].master.clone()
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=2, loss_chunk_tokens=7, resident_layers=1,
                         overlap_optimizer=False)
    engine.step(batches[0], lr_at(0, cfg, STEPS))
    assert torch.equal(store.tiles["layers.0"].master, before), "the host copy waits for synchronize"
    assert store.tiles["layers.0"].step == 0
    engine.synchronize()
    assert not torch.equal(store.tiles["layers.0"].master, before)
    assert store.tiles["layers.0"].step == 1
    assert torch.equal(store.tiles["layers.0"].exp_avg, engine.resident._state["layers.0"].exp_avg)
    engine.close()


def test_a_skipped_step_leaves_resident_state_alone():
    _, store, cfg, batches = setup()
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=2, loss_chunk_tokens=7, resident_layers=2,
                         overlap_optimizer=False)
    engine.step(batches[0], lr_at(0, cfg, STEPS))
    engine.synchronize()
    before = {s: getattr(store.tiles["layers.1"], s).clone() for s in SECTIONS}
    engine.forward_backward = lambda mbs: _skipped(Engine.forward_backward(engine, mbs))
    assert engine.step(batches[1], lr_at(1, cfg, STEPS)).skipped
    engine.synchronize()
    for s in SECTIONS:
        assert torch.equal(getattr(store.tiles["layers.1"], s), before[s]), s
    assert store.tiles["layers.1"].step == 1
    engine.close()


def _skipped(res):
    res.skipped = True  # as a non-finite gradient norm would make it
    return res


def test_resume_with_resident_layers_is_exact(tmp_path):
    _, whole, cfg, batches = setup()
    run(whole, cfg, batches, resident=2)
    _, first, cfg, batches = setup()
    run(first, cfg, batches[:2], resident=2)
    path = save_checkpoint(first, tmp_path, step=2, trainer_state={"step": 2})
    _, resumed, cfg, batches = setup()
    engine = make_engine(resumed, cfg, device="cpu", checkpoint_interval=2, loss_chunk_tokens=7, resident_layers=2,
                         overlap_optimizer=False)
    load_checkpoint(resumed, path)  # after the engine exists, as train does: the resident copy loads lazily
    engine.step(batches[2], lr_at(2, cfg, STEPS))
    engine.close()
    for name, tile in whole.tiles.items():
        for section in SECTIONS:
            assert torch.equal(getattr(tile, section), getattr(resumed.tiles[name], section)), (name, section)


def test_plan_counts_resident_bytes_and_auto_fills_the_budget():
    config = tiny_config("LlamaForCausalLM", layers=6)
    adapter = ModelAdapter(config)
    args = dict(adapter=adapter, compute_dtype=torch.bfloat16, micro_batch_size=2, seq_len=64, grad_accum=1,
                checkpoint_interval=2, grad_slabs=2)
    store = HostStore(adapter, torch.bfloat16, allocate=False)
    layer, head = store.layouts["layers.0"].numel, store.layouts["head"].numel
    base, three = make_plan(**args), make_plan(**args, resident_layers=3)
    assert three.device_total - base.device_total == (3 * layer + head) * 16 + 2 * (1 << 24) * 4
    assert resident_device_bytes(store, 3, 2) == (3 * layer + head) * 16 + 2 * (1 << 24) * 4
    assert resident_device_bytes(store, 0, 2) == 0
    bf16_masters = make_plan(**args, resident_layers=3, master_dtype=torch.bfloat16)
    assert bf16_masters.device_total - make_plan(**args, master_dtype=torch.bfloat16).device_total == \
        (3 * layer + head) * 14 + 2 * (1 << 24) * 4
    assert three.h2d_per_layer < base.h2d_per_layer and three.resident_layers == 3
    # 'auto' on a CUDA plan with a budget: the most leading layers that fit 88% of it.
    keys = ["model.preset=tiny", "train.steps=1", "engine.keep_activations=0", "train.micro_batch_size=2",
            "train.seq_len=64", "engine.grad_slabs=2"]
    base = plan_step(load_recipe(None, keys), adapter, torch.device("cpu"), store_built=True).memory.device_total
    budget = int((base + resident_device_bytes(store, 4, 2)) / 0.88) + 1
    r = load_recipe(None, [*keys, f"engine.max_gpu_mem={budget}B", "engine.resident_layers=auto"])
    plan = plan_step(r, adapter, torch.device("cuda"), store_built=True)
    assert plan.resident_layers == 4
    assert plan.memory.device_total <= 0.88 * budget < plan.memory.device_total + layer * 16
    assert "first 4 layers resident on the device" in plan.path
    cpu = plan_step(r, adapter, torch.device("cpu"), store_built=True)
    assert cpu.resident_layers == 0, "'auto' keeps nothing resident on the CPU"


def test_bad_resident_setting_is_refused():
    with pytest.raises(RecipeError, match=r"engine.resident_layers: expected 'auto' or an int >= 0, got -1"):
        load_recipe(None, ["model.preset=tiny", "train.steps=1", "engine.resident_layers=-1"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_resident_layers_on_the_cuda_pipeline():
    """bf16 on the overlapped pipeline (worker, speculation, update on read): after one step the resident
    layers (CUDA's fused AdamW) hold the host kernel's update to fp32 rounding; after three, when the
    weights the later steps ran with differ in those last bits, every tile's update agrees within 1% of
    its size (bf16 gradients amplify the bits); the resident layers never cross the link."""
    for steps in (1, STEPS):
        runs = []
        for resident in (0, 2):
            _, store, cfg, batches = setup(torch.bfloat16, layers=5)
            start = {n: t.master.clone() for n, t in store.tiles.items()}
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                _, results = run(store, cfg, batches[:steps], resident, device="cuda", overlap_optimizer=True,
                                 grad_slabs=3)
            runs.append((results, store))
        (base, base_store), (res, res_store) = runs
        assert res[0].losses == base[0].losses  # the first forward reads the same weights
        assert not any(f"layers.{i}" in res[-1].h2d_count for i in range(2))
        assert res[-1].h2d_bytes < base[-1].h2d_bytes
        for name, tile in base_store.tiles.items():
            ours = res_store.tiles[name]
            assert ours.step == tile.step == steps
            if steps == 1:
                # CUDA's fused kernel against the host's, as tests/engine/test_cuda.py compares the two devices
                torch.testing.assert_close(ours.master, tile.master, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(ours.exp_avg_sq, tile.exp_avg_sq, rtol=1e-4, atol=1e-12)
            else:
                d_base, d_ours = tile.master - start[name], ours.master - start[name]
                rel = float((d_ours - d_base).norm() / d_base.norm())
                assert rel < 1e-2, f"{name}: update differs by {rel:.4f} of its size"


def test_auto_takes_more_resident_layers_on_the_memory_lean_path_at_the_same_compute():
    """7B preset, 8 x 4096, an H200's 139.8 GiB: the short-context plan (interval 4, nothing kept) fits 22
    resident layers; the memory-lean plan fits all 28 at interval 1 with nothing offloaded, the MLP whole and
    the loss chunk unchanged (every layer recomputed either way), so 'auto' takes it: the plan the H200 ran
    at 1.05-1.10x native (docs/benchmarks.md, session 8), the same as asking for 28."""
    from megatrain_cli.bench.settings import bench_model_config

    keys = ["engine.max_gpu_mem=139.8GiB"]
    r = load_recipe("recipes/bench.yaml", keys)
    adapter = ModelAdapter(bench_model_config(r))
    cuda = torch.device("cuda")
    auto = plan_step(r, adapter, cuda, store_built=True)
    assert auto.resident_layers == 28 and auto.fits and auto.lean is not None and auto.lean.label == "memory-lean"
    assert auto.path.endswith("engine.resident_layers auto: 28 layers resident on the memory-lean path, the "
                              "short-context plan's compute, rather than 22 on the short-context path")
    lean = auto.lean
    assert (lean.checkpoint_interval, lean.offloaded_checkpoints, lean.dropped_checkpoints, lean.mlp_chunk_tokens,
            lean.loss_chunk_tokens) == (1, 0, (), None, 8192)
    asked = plan_step(load_recipe("recipes/bench.yaml", [*keys, "engine.resident_layers=28"]), adapter, cuda,
                      store_built=True)
    # host_budget is the host memory free at each plan_step call (it moves between the two): not the plan's
    assert dataclasses.replace(asked.lean, host_budget=lean.host_budget) == lean and asked.resident_layers == 28
    # The short plan's figure (its 28 resident layers counted) is set against the whole device budget.
    assert asked.path.startswith("path: memory-lean engine (the short-context plan with 28 resident layers needs "
                                 "about 141.93 GiB of the 139.80 GiB device budget): checkpoint interval 1")
    # Without the fallback, or with a block kept (different compute), 'auto' stays on the short-context path.
    strict = plan_step(load_recipe("recipes/bench.yaml", [*keys, "engine.memory_fallback=false"]), adapter, cuda,
                       store_built=True)
    assert strict.lean is None and strict.resident_layers == 22
    kept = plan_step(load_recipe("recipes/bench.yaml", [*keys, "engine.keep_activations=1"]), adapter, cuda,
                     store_built=True)
    assert kept.lean is None and len(kept.keep_blocks) == 1
    # A data-parallel rank keeps no layer resident: 'auto' is 0 there, and the short-context plan stands.
    rank = plan_step(r, adapter, cuda, store_built=True, one_process=False)
    assert rank.lean is None and rank.resident_layers == 0 and "resident" not in rank.path
