"""Dropped activation checkpoints (issue #22): when host memory cannot hold the checkpoints the device
cannot, the lean plan drops some and the backward rebuilds each from the one before (engine/rebuild.py).

On the CPU with tiny models: a step with dropped checkpoints is the same step, bit for bit; the planner
drops the fewest that fit and says so (plan text, path line, dry run); the schedule's weight transfers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatrain_cli.engine.plan.lean import HOST_MARGIN, GiB, choose_plan, plan_long_context, refusal
from megatrain_cli.engine.schedule import build_schedule, fetch_order, transfers_per_layer
from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.reference import random_batches, tiny_config

STEPS, SEQ, BATCH = 2, 16, 2


def lean_plan(config, accum, *, lean=True, offloaded=0, dropped=(), interval=1):
    """A lean plan forced to `offloaded` checkpoints in host memory and `dropped` ones rebuilt (MLP chunks of
    5 tokens, a 7-token loss chunk), whatever the budgets would choose."""
    plan = plan_long_context(config, SEQ, batch=BATCH * accum, device_budget_bytes=GiB, mlp_chunk_tokens=5,
                             chunk_mlp=True, loss_chunk_tokens=7, offload=False, lean_norms=lean)
    return dataclasses.replace(plan, offloaded_checkpoints=offloaded, dropped_checkpoints=tuple(dropped),
                               checkpoint_interval=interval)


def train(config, accum, plan, **engine_kwargs):
    """STEPS steps on the CPU: (store, engine, results, ops seen by on_op)."""
    store = build_store(config, torch.float32, seed=3)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, grad_accum=accum,
                      eps=1e-6)
    engine = make_engine(store, cfg, device="cpu", lean=plan, overlap_optimizer=False, **engine_kwargs)
    seen = []
    engine.on_op = seen.append
    batches = random_batches(config.vocab_size, STEPS, accum, batch=BATCH, seq=SEQ, seed=5)
    results = [engine.step(mbs, lr_at(s, cfg, STEPS)) for s, mbs in enumerate(batches)]
    engine.synchronize()
    return store, engine, results, seen


@pytest.mark.parametrize("arch,tied,layers,accum,offloaded,dropped,interval,resident", [
    ("Qwen2ForCausalLM", False, 4, 2, 0, (1, 3), 1, 0),  # every stored checkpoint on the device
    ("Qwen2ForCausalLM", False, 5, 1, 2, (1,), 1, 0),  # 1 rebuilt from offloaded 0; 2 offloaded too
    ("Qwen2ForCausalLM", True, 5, 2, 3, (2, 4), 1, 0),  # rebuilt from offloaded 1 and from device 3; tied head
    ("Qwen3ForCausalLM", False, 5, 1, 2, (1, 3), 1, 2),  # first 2 layers resident: rebuilt from resident weights
    ("Qwen2ForCausalLM", False, 6, 1, 1, (1,), 2, 1),  # interval 2: block 1 rebuilt by running layers 0, 1 again
    ("qwen2_moe", False, 4, 2, 1, (1, 3), 1, 0),  # routed experts: the rebuild neither counts nor keeps routing
])
def test_a_step_with_dropped_checkpoints_is_bit_identical(arch, tied, layers, accum, offloaded, dropped, interval,
                                                         resident):
    config = tiny_config(arch, tied=tied, layers=layers)
    kw = dict(resident_layers=resident)
    ref_store, ref_engine, ref, _ = train(config, accum, lean_plan(config, accum, offloaded=offloaded,
                                                                   interval=interval), **kw)
    plan = lean_plan(config, accum, offloaded=offloaded, dropped=dropped, interval=interval)
    store, engine, results, seen = train(config, accum, plan, **kw)

    for res, want in zip(results, ref):
        assert res.losses == want.losses and res.grad_norm == want.grad_norm and not res.skipped
    ours, theirs = store.hf_state_dict(), ref_store.hf_state_dict()
    assert all(torch.equal(ours[name], w) for name, w in theirs.items())

    # The rebuilds ran (each layer of the block before, once per dropped checkpoint per step) and count as
    # recomputed layers; the offloaded checkpoints (the first stored ones) went out and came back, all prefetched.
    rebuilds = [op for op in seen if op is not None and op.kind == "rebuild"]
    assert len(rebuilds) == STEPS * len(dropped) * interval
    assert engine.recomputed_layers() == ref_engine.recomputed_layers() + len(dropped) * interval
    assert list(engine.offloader.offload_keys) == plan.offload_keys
    assert not set(plan.offload_keys) & set(dropped) and len(plan.offload_keys) == offloaded
    one = accum * BATCH * SEQ * config.hidden_size * 4
    off = engine.offloader
    assert off.d2h_bytes == off.h2d_bytes == STEPS * offloaded * one and off.late_gets == 0
    # The weights the streamer moved are the schedule's count for two slots (resident layers are never streamed).
    layers = lambda counts: {t: n for t, n in counts.items() if t.startswith("layers.")}  # noqa: E731
    streamed = {t: n for t, n in transfers_per_layer(engine.ops, 2).items() if t not in engine.resident}
    assert layers(results[-1].h2d_count) == layers(streamed)
    engine.close()
    ref_engine.close()


def test_rebuild_ops_come_right_before_the_dropped_blocks_recompute():
    ops = build_schedule(6, 1, dropped=frozenset({1, 3}))
    backward = [(o.kind, o.layer) for o in ops[ops.index(next(o for o in ops if o.kind == "head")) + 1:]]
    assert backward[:6] == [("recompute", 5), ("backward", 5), ("recompute", 4), ("backward", 4),
                            ("rebuild", 2), ("recompute", 3)]
    assert ("rebuild", 0) in backward and backward.index(("rebuild", 0)) + 1 == backward.index(("recompute", 1))
    assert [o.block for o in ops if o.kind == "rebuild"] == [3, 1]
    assert not any(o.checkpoint for o in ops if o.kind != "forward")
    two = build_schedule(6, 2, dropped=frozenset({2}))
    assert [(o.kind, o.layer) for o in two if o.kind == "rebuild"] == [("rebuild", 2), ("rebuild", 3)]
    for bad in ({0}, {2, 3}, {6}):  # nothing before it, the one before dropped too, no such block
        with pytest.raises(ValueError, match="cannot be dropped"):
            build_schedule(6, 1, dropped=frozenset(bad))
    with pytest.raises(ValueError, match="cannot be dropped"):
        build_schedule(6, 1, keep_blocks=frozenset({2}), dropped=frozenset({3}))


def test_schedule_counts_the_rebuilds_weight_transfers():
    plain, dropped = build_schedule(8, 1), build_schedule(8, 1, dropped=frozenset({1, 3, 5}))
    # The rebuild's layer is fetched before the dropped layer and is still in a slot for its own recompute:
    # with 2 slots no layer crosses more often than without drops.
    assert transfers_per_layer(dropped, 2) == transfers_per_layer(plain, 2)
    order = fetch_order(dropped)
    assert order[order.index("head") + 1:][:6] == ["layers.7", "layers.6", "layers.4", "layers.5", "layers.4",
                                                    "layers.2"]
    # With one slot the dropped layer evicts the rebuilt-from layer: one more transfer of each layer rebuilt from.
    one, base = transfers_per_layer(dropped, 1), transfers_per_layer(plain, 1)
    assert {t: one[t] - base[t] for t in base if one[t] != base[t]} == {"layers.0": 1, "layers.2": 1, "layers.4": 1}


# ---------------------------------------------------------------------------------------------- planner
def qwen7b():
    from tests.engine.test_lean_layers import qwen25_7b

    return qwen25_7b()


BUDGET = int(139.8 * GiB)


def plan_7b(**kw):
    return plan_long_context(qwen7b(), 512 * 1024, device_budget_bytes=BUDGET, **kw)


@pytest.mark.parametrize("lean", [False, True])
def test_short_host_drops_the_fewest_checkpoints_that_fit(lean):
    free = plan_7b(lean_norms=lean)  # no host budget: as many offloaded as the device needs, none dropped
    U, wanted = free.checkpoint_bytes, free.offloaded_checkpoints
    assert free.fits and wanted > 2 and free.dropped_checkpoints == ()
    # Enough host: the very same plan.
    enough = plan_7b(lean_norms=lean, host_budget_bytes=wanted * U)
    assert (enough.offloaded_checkpoints, enough.dropped_checkpoints, enough.predicted_peak, enough.fits) == \
        (wanted, (), free.predicted_peak, True)
    assert "recomputed" not in enough.render() + enough.summary() and "rebuild" not in enough.render()

    for host in (wanted * U - 1, (wanted - 3) * U + U // 2, U - 1, 0):
        plan = plan_7b(lean_norms=lean, host_budget_bytes=host)
        d = len(plan.dropped_checkpoints)
        assert plan.fits and d > 0 and plan.host_pinned_bytes <= host and plan.predicted_peak <= plan.usable
        assert plan.dropped_checkpoints == tuple(range(1, 2 * d, 2))  # each one's predecessor stored
        assert not set(plan.offload_keys) & set(plan.dropped_checkpoints)
        assert plan.offloads_wanted == wanted
        # The fewest: with one drop fewer no number of offloads fits both the device and this host.
        fewer = plan_7b(lean_norms=lean, host_budget_bytes=host, drop=d - 1)
        assert not fewer.fits
        assert plan_7b(lean_norms=lean, host_budget_bytes=host, drop=d).fits
        # The device counts the rebuild: a phase of its own, with the held checkpoint and the forward's temporaries.
        rebuild = plan.phases["rebuild of a dropped checkpoint (no autograd)"]
        assert rebuild["the rebuilt checkpoint (the layer's outputs)"] == U
        assert any(k.startswith("one layer's temporaries") and v > 0 for k, v in rebuild.items())
        assert plan.device_checkpoints == plan.num_checkpoints - plan.offloaded_checkpoints - d

    # Says what it chose and why.
    plan = plan_7b(lean_norms=lean, host_budget_bytes=(wanted - 3) * U + U // 2)
    d, k = len(plan.dropped_checkpoints), plan.offloaded_checkpoints
    choice = (f"host memory short ({(wanted - 3) * U / GiB + U / 2 / GiB:.2f} GiB free for checkpoints, "
              f"{wanted * U / GiB:.2f} GiB needed): {d} of 28 checkpoints recomputed from the one before "
              f"(+{d} layer forwards per step), {k} offloaded to pinned host memory")
    assert plan.recompute_choice() == choice
    assert choice in plan.render() and choice in plan.summary()
    assert f"{d} rebuilt in the backward ({', '.join(map(str, plan.dropped_checkpoints))})" in plan.render()
    assert refusal(plan) == ""


def test_the_training_host_budget_leaves_out_every_pinned_buffer_the_memory_plan_counts():
    """At 512K tokens the step's embedding rows pin a 2 GiB block (every vocabulary row, rounded up): the
    checkpoints' host budget must leave it out, as it leaves out the staging and the gradient slabs."""
    from megatrain_cli.engine.plan.lean import plan_for_training
    from megatrain_cli.engine.plan.memory import make_plan
    from megatrain_cli.models.adapter import ModelAdapter

    adapter, seq, free = ModelAdapter(qwen7b()), 512 * 1024, 30 * GiB
    plan = plan_for_training(adapter, seq_len=seq, micro_batch_size=1, grad_accum=1, dtype=torch.bfloat16,
                             device_type="cuda", device_budget=BUDGET, host_available=free)
    pinned = make_plan(adapter, torch.bfloat16, micro_batch_size=1, seq_len=seq, grad_accum=1,
                       checkpoint_interval=1, grad_slabs=12).pinned
    assert pinned["embedding rows in / gradients out (power of 2)"] == 2 * GiB
    assert plan.host_budget == free - sum(pinned.values()) - HOST_MARGIN


def test_no_drops_when_the_device_is_what_does_not_fit():
    # A device budget no plan fits: dropping checkpoints cannot help the host, and the refusal says it was tried.
    plan = plan_long_context(qwen7b(), 512 * 1024, device_budget_bytes=40 * GiB, host_budget_bytes=10 * GiB)
    assert not plan.fits and plan.dropped_checkpoints == ()
    assert "does not fit either" in refusal(plan)
    # drop=0: as before, refused for the host, nothing said about recompute.
    none = plan_7b(host_budget_bytes=10 * GiB, drop=0)
    assert not none.fits and "pinned host memory" in refusal(none) and "recomput" not in refusal(none)


def test_choose_plan_prefers_lean_norms_over_dropping():
    u = plan_7b().checkpoint_bytes
    lean_wants = plan_7b(lean_norms=True).offloaded_checkpoints
    # Enough host for the lean plan's offloads, not for the HF plan's: lean norms, nothing dropped.
    chosen = choose_plan(qwen7b(), 512 * 1024, device_budget_bytes=BUDGET, host_budget_bytes=lean_wants * u)
    assert chosen.fits and chosen.lean_norms and chosen.dropped_checkpoints == ()
    # Less than that: both drop; the lean plan drops fewer.
    chosen = choose_plan(qwen7b(), 512 * 1024, device_budget_bytes=BUDGET, host_budget_bytes=2 * u)
    hf = plan_7b(host_budget_bytes=2 * u)
    assert chosen.lean_norms and 0 < len(chosen.dropped_checkpoints) < len(hf.dropped_checkpoints)


# ---------------------------------------------------------------------------------------------- dry run, train
ROOT = Path(__file__).resolve().parents[2]
LONG = ["train.steps=1", "train.seq_len=4096", "train.micro_batch_size=1", "train.grad_accum=3",
        "data.packing=false", "logging.dashboard=plain", "logging.every_n_steps=1", "train.warmup_steps=0",
        "eval.enabled=false", "checkpoint.every_n_steps=null", "checkpoint.export_final=false",
        "engine.long_context_min_seq=4096"]


def fake_host(monkeypatch, tmp_path, available: int) -> None:
    """This machine as a host with `available` bytes free (MemAvailable) and no cgroup limit."""
    from megatrain_cli import machine

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {(available + 2**30) // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    monkeypatch.setattr(machine, "PROC_MEMINFO", meminfo)
    monkeypatch.setattr(machine, "cgroup_limits", lambda *a, **k: [])


def tiny_plan(budget: int):
    """The tiny long-context recipe's lean plan for a device budget of `budget` bytes (this host's memory)."""
    from megatrain_cli.engine.plan.step_plan import plan_step
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.recipe import load_recipe
    from megatrain_cli.train.setup import model_config

    r = load_recipe(ROOT / "recipes" / "tiny.yaml", [*LONG, f"engine.max_gpu_mem={budget}B"])
    adapter = ModelAdapter(model_config(r, load_tokenizer(r.model)))
    return adapter, plan_step(r, adapter, torch.device("cpu")).lean


@pytest.fixture(scope="module")
def short_host(tmp_path_factory):
    """(recipe overrides, host bytes free, the plan there) for the tiny long-context recipe: a host with room
    for one checkpoint after the host store and the margin, and the largest device budget at which
    its plan drops a checkpoint (HF's and the lean RMSNorm's plans both want 2 or more in host memory)."""
    from megatrain_cli.store.tiles import HostStore

    adapter, free = tiny_plan(64 * GiB)
    store = HostStore(adapter, torch.float32, allocate=False).host_bytes()
    host = store + HOST_MARGIN + free.checkpoint_bytes * 3 // 2
    budget = int(free.predicted_peak / 0.95)
    with pytest.MonkeyPatch.context() as mp:
        fake_host(mp, tmp_path_factory.mktemp("host"), host)
        for _ in range(64):
            _, plan = tiny_plan(budget)
            if plan.dropped_checkpoints:
                break
            budget -= free.checkpoint_bytes // 4
    # One dropped checkpoint is one fewer on the device too: here no offload is left (the first one offloaded
    # would only pay for the one in flight).
    assert plan.fits and plan.dropped_checkpoints == (1,) and plan.offloads_wanted >= 2
    return [f"engine.max_gpu_mem={budget}B"], host, plan


def test_dry_run_names_the_recompute_choice(monkeypatch, tmp_path, capsys, short_host):
    from megatrain_cli.recipe import load_recipe
    from megatrain_cli.train.loop import run_training

    overrides, host, plan = short_host
    fake_host(monkeypatch, tmp_path, host)
    r = load_recipe(ROOT / "recipes" / "tiny.yaml", [*LONG, *overrides, f"output_dir={tmp_path / 'out'}"])
    assert run_training(r, dry_run=True) == 0
    out = capsys.readouterr().out
    path = next(line for line in out.splitlines() if line.startswith("path: long-context engine"))
    choice = plan.recompute_choice()
    assert choice.startswith("host memory short (") and " MiB free for checkpoints, " in choice
    assert choice.endswith("MiB needed): 1 of 4 checkpoints recomputed from the one before (+1 layer forward per "
                           f"step), {plan.offloaded_checkpoints} offloaded to pinned host memory")
    assert choice in path and f"  {choice}" in out  # the path line and the plan
    assert "rebuilt in the backward (1)" in out and "rebuild of a dropped checkpoint (no autograd)" in out
    assert "verdict for this machine: fits" in out


def test_training_on_a_short_host_rebuilds_and_matches_the_unstarved_run(monkeypatch, tmp_path, short_host):
    import contextlib
    import io
    import json

    from megatrain_cli.engine import step as engine_step
    from megatrain_cli.recipe import load_recipe
    from megatrain_cli.train.loop import run_training

    overrides, host, _ = short_host
    runs = {}
    for name, free in (("starved", host), ("ample", host + GiB)):
        engines, real_step = [], engine_step.Engine.step
        with monkeypatch.context() as mp:
            fake_host(mp, tmp_path, free)
            mp.setattr(engine_step.Engine, "step",
                       lambda self, *a, **k: engines.append(self) or real_step(self, *a, **k))
            log = io.StringIO()
            out = tmp_path / name
            with contextlib.redirect_stdout(log):
                assert run_training(load_recipe(ROOT / "recipes" / "tiny.yaml",
                                                [*LONG, *overrides, f"output_dir={out}"])) == 0
        metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        runs[name] = (engines[0], log.getvalue(), metrics)
    starved, ample = runs["starved"], runs["ample"]
    assert starved[0].plan.lean.dropped_checkpoints == (1,) and ample[0].plan.lean.dropped_checkpoints == ()
    assert any(op.kind == "rebuild" for op in starved[0].ops)
    assert "1 of 4 checkpoints recomputed from the one before" in starved[1]
    assert "recomputed" not in ample[1]
    assert starved[2]["loss"] == ample[2]["loss"] and starved[2]["grad_norm"] == ample[2]["grad_norm"]


# ---------------------------------------------------------------------------------------------- data parallel
DIST_LAYERS, DIST_ACCUM = 4, 2


def _dist_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One gloo rank: STEPS steps of its share of the micro-batches, checkpoints 1 and 3 dropped, 1 offloaded."""
    import os

    import torch.distributed as dist

    from megatrain_cli.engine.dist import init_distributed, leave_process_group, split_micro_batches
    from megatrain_cli.models.loader import build_sharded_store

    torch.set_num_threads(1)
    ctx = init_distributed("cpu", init_method=f"file://{init_file}", rank=rank, world_size=world)
    config = tiny_config(layers=DIST_LAYERS)
    store = build_sharded_store(config, torch.float32, rank, world, seed=3)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1,
                      grad_accum=DIST_ACCUM, eps=1e-6)
    # The plan is for a rank's micro-batches (one of the 2): its checkpoints hold one micro-batch each.
    plan = lean_plan(config, 1, offloaded=1, dropped=(1, 3))
    engine = make_engine(store, cfg, device="cpu", lean=plan, overlap_optimizer=False, dist=ctx)
    batches = random_batches(config.vocab_size, STEPS, DIST_ACCUM, batch=BATCH, seq=SEQ, seed=5)
    results = [engine.step(split_micro_batches(mbs, rank, world), lr_at(s, cfg, STEPS)) for s, mbs in
               enumerate(batches)]
    rebuilds = sum(op.kind == "rebuild" for op in engine.ops)
    engine.close()
    state = {k: v.clone() for k, v in store.hf_state_dict().items()}  # a collective: every rank
    torch.save({"results": [(r.loss, r.grad_norm) for r in results], "rebuilds": rebuilds,
                "state": state if rank == 0 else None}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    leave_process_group()


def test_two_ranks_with_dropped_checkpoints_train_like_one_process(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_dist_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    config = tiny_config(layers=DIST_LAYERS)
    ref_store, ref_engine, ref, _ = train(config, DIST_ACCUM, lean_plan(config, DIST_ACCUM, offloaded=1))
    ref_engine.close()
    for out in ranks:
        assert out["rebuilds"] == 2
        for (loss, norm), want in zip(out["results"], ref):  # as tests/engine/test_data_parallel.py compares them
            assert loss == pytest.approx(want.loss, rel=1e-5) and norm == pytest.approx(want.grad_norm, rel=1e-5)
    ours, theirs = ranks[0]["state"], ref_store.hf_state_dict()
    for name, expected in theirs.items():
        torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
