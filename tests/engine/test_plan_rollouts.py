"""GRPO's rollouts in the memory plan (engine/plan/rollout_memory.py): their KV caches and prefill counted
exactly as the static decoder allocates them, added to the short-context plan only beyond the step's
activations (they never live together), and kept room for beside the resident layers on every path: 'auto'
resident layers leave it, an explicit count that does not is refused with the fixes."""

from __future__ import annotations

import torch

from megatrain_cli.engine.plan.lean_terms import ModelShape
from megatrain_cli.engine.plan.memory import make_plan, resident_device_bytes
from megatrain_cli.engine.plan.rollout_memory import BESIDE, rollout_device_bytes, rollout_problem
from megatrain_cli.engine.plan.step_plan import plan_step
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.recipe import load_recipe
from tests.helpers_bad_inputs import ROOT

GRPO = ROOT / "recipes" / "grpo-tiny.yaml"
LINE = "GRPO rollouts: KV caches + prefill, beyond the step's activations"


def recipe(*keys):
    return load_recipe(GRPO, ["engine.checkpoint_interval=1", "engine.keep_activations=0", *keys])


def adapter_of(r):
    from megatrain_cli.bench.settings import bench_model_config

    return ModelAdapter(bench_model_config(r))


def test_the_caches_are_counted_as_the_decoder_allocates_them():
    r = recipe()
    adapter = adapter_of(r)
    s = ModelShape.of(adapter)
    rows, seq, new, w = 16, 160, 48, 2
    caches = s.layers * 2 * s.kv_heads * s.head_dim * rows * seq * w  # StaticKV: [rows, kv heads, capacity, head dim]
    got = rollout_device_bytes(adapter, w, rows=rows, seq_len=seq, max_new_tokens=new)
    prefill = rows * (seq - new) * (3 * s.intermediate + 2 * s.hidden + s.q_dim + 2 * s.kv_heads * s.head_dim) * w
    assert got == caches + prefill + rows * s.vocab * (w + 4)
    assert rollout_device_bytes(adapter, w, rows=2 * rows, seq_len=seq, max_new_tokens=new) == 2 * got


def test_the_plan_adds_only_what_the_rollouts_need_beyond_the_activations():
    r = recipe()
    adapter = adapter_of(r)
    args = dict(adapter=adapter, compute_dtype=torch.bfloat16, micro_batch_size=8, seq_len=160, grad_accum=2,
                checkpoint_interval=1, grad_slabs=2)
    plain = make_plan(**args)
    acts = sum(v for k, v in plain.device.items() if "activation" in k or "loss chunk" in k)
    small = make_plan(**args, rollout_bytes=acts)
    assert small.device == plain.device  # no more than the activations: nothing added
    big = make_plan(**args, rollout_bytes=acts + 12345)
    assert big.device[LINE] == 12345 and big.device_total == plain.device_total + 12345


def test_rollouts_need_room_beside_the_resident_layers_slots_and_head():
    device = {"layer weight slots (2 x largest layer)": 100, "head weights (norm + LM head)": 50,
              "LM head gradient (fp32)": 20, "kept activations, last 1 blocks = 2 layers (estimate)": 10**9}
    fits = int((1000 + 170 + 830) / 0.88) + 1  # 88% of it: 1000 resident + 170 beside + 830 of rollouts, just
    assert rollout_problem(device, 1000, 830, fits, rows=64, seq_len=512, resident=3) == ""
    assert rollout_problem(device, 1000, 830, fits - 2, rows=64, seq_len=512, resident=3) == (
        "device memory: GRPO's rollouts (64 completions in 512-token KV caches, with the prefill: about 0.00 GiB) do "
        "not fit beside 3 resident layers (0.00 GiB) and the layer slots and head (0.00 GiB) in 88% of the 0.00 GiB "
        "device budget. Use fewer engine.resident_layers (or 'auto'), a shorter train.seq_len / "
        "grpo.max_new_tokens, or fewer completions a step (train.micro_batch_size x train.grad_accum)")


def test_a_resident_count_that_leaves_no_room_for_the_rollouts_is_refused():
    from megatrain_cli.store.tiles import HostStore

    base = ["engine.device=cuda", "model.dtype=bf16", "engine.resident_layers=2"]
    r = recipe(*base)
    adapter, cuda = adapter_of(r), torch.device("cuda")
    store = HostStore(adapter, torch.bfloat16, allocate=False)
    plain = plan_step(r, adapter, cuda, store_built=True, budget=10**12).memory.device  # no resident line counted
    beside = sum(v for k, v in plain.items() if k.startswith(BESIDE))
    rollouts = rollout_device_bytes(adapter, 2, rows=16, seq_len=160, max_new_tokens=48)
    budget = int((beside + resident_device_bytes(store, 2, 2) + rollouts) / 0.88) - 1  # a byte short
    refused = plan_step(r, adapter, cuda, store_built=True, budget=budget)
    message = rollout_problem(plain, resident_device_bytes(store, 2, 2), rollouts, budget, rows=16, seq_len=160,
                              resident=2)
    assert message.startswith("device memory: GRPO's rollouts (16 completions in 160-token KV caches")
    assert message in refused.problems
    roomier = plan_step(r, adapter, cuda, store_built=True, budget=budget + 2)
    assert not any("GRPO's rollouts" in p for p in roomier.problems)
    sft = plan_step(recipe(*base, "train.method=sft"), adapter, cuda, store_built=True, budget=budget)
    assert not any("GRPO's rollouts" in p for p in sft.problems)
