"""Speculative host AdamW (optim/worker.py): updates that start before the global gradient norm is
known must give the optimizer's exact semantics — bit-identical when the step is not clipped, equal
to fp32 rounding after a correction when it is, and no change at all when the step is skipped."""

from __future__ import annotations

import math
import time

import pytest
import torch

from megatrain_cli.engine.step import Engine
from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import HostAdamW, lr_at
from megatrain_cli.optim.worker import OptimizerWorker
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.reference import random_batches, tiny_config

STEPS, ACCUM = 3, 2


def make_store(arch="Qwen2ForCausalLM", tied=False, layers=4):
    return build_store(tiny_config(arch, tied=tied, layers=layers), torch.float32, seed=3)


def snapshot(store):
    return {n: (t.master.clone(), t.exp_avg.clone(), t.exp_avg_sq.clone(), t.step) for n, t in store.tiles.items()}


def train(max_grad_norm, *, overlap, speculate=True, steps=STEPS, tied=False, first_step_speculates=True,
          **engine_kwargs):
    config = tiny_config("Qwen2ForCausalLM", tied=tied, layers=4)
    store = build_store(config, torch.float32, seed=3)
    cfg = TrainConfig(steps=steps, lr=1e-3, weight_decay=0.1, max_grad_norm=max_grad_norm, warmup_steps=1,
                      grad_accum=ACCUM, eps=1e-6)
    batches = random_batches(config.vocab_size, steps, ACCUM, batch=2, seq=16, seed=5)
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=2, loss_chunk_tokens=7,
                         overlap_optimizer=overlap, speculate_optimizer=speculate, **engine_kwargs)
    if overlap and first_step_speculates:
        engine.worker.last_clipped = False  # as if the step before had not been clipped
    results = [engine.step(mbs, lr_at(s, cfg, steps)) for s, mbs in enumerate(batches)]
    engine.close()
    return store, results


def test_rollback_inverts_an_unclipped_update_to_fp32_rounding():
    store = make_store()
    tile = store.tiles["layers.1"]
    g = torch.Generator().manual_seed(0)
    tile.grad.copy_(torch.randn(tile.numel, generator=g) * 1e-2)
    opt = HostAdamW(TrainConfig(lr=1e-3, weight_decay=0.1, eps=1e-6))
    opt.update(tile, 1e-3)  # a first step, so the moments are not zero
    tile.grad.copy_(torch.randn(tile.numel, generator=g) * 1e-2)
    before = (tile.master.clone(), tile.exp_avg.clone(), tile.exp_avg_sq.clone(), tile.step)
    opt.update(tile, 1e-3, 1.0)
    assert not torch.equal(tile.master, before[0])
    opt.rollback(tile, 1e-3)
    assert tile.step == before[3]
    torch.testing.assert_close(tile.master, before[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(tile.exp_avg, before[1], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(tile.exp_avg_sq, before[2], rtol=1e-5, atol=1e-12)


def test_correct_turns_an_unclipped_update_into_the_clipped_one():
    store = make_store()
    a, b = store.tiles["layers.1"], store.tiles["layers.2"]
    g = torch.Generator().manual_seed(1)
    opt = HostAdamW(TrainConfig(lr=1e-3, weight_decay=0.1, eps=1e-6))
    b.master.copy_(a.master)
    for _ in range(2):  # two steps, so moments and bias corrections are not trivial
        grad = torch.randn(a.numel, generator=g) * 1e-2
        a.grad.copy_(grad)
        b.grad.copy_(grad)
        opt.update(a, 1e-3, 0.3)  # the exact clipped update
        opt.update(b, 1e-3, 1.0)  # speculative...
        opt.correct(b, 1e-3, 0.3)  # ...then corrected
    assert a.step == b.step == 2
    # atol: one ulp of a typical weight (|w| ~ 0.02 -> 1.9e-9): the correction passes through it.
    torch.testing.assert_close(b.master, a.master, rtol=1e-6, atol=2e-9)
    # m ~ (1-b1) g ~ 1e-3: a few ulp (1.2e-10 each) where the two routes round differently.
    torch.testing.assert_close(b.exp_avg, a.exp_avg, rtol=1e-5, atol=5e-10)
    torch.testing.assert_close(b.exp_avg_sq, a.exp_avg_sq, rtol=1e-5, atol=1e-14)


def test_unclipped_steps_are_bit_identical_to_updating_after_the_backward():
    plain, plain_res = train(1e9, overlap=False)
    spec, spec_res = train(1e9, overlap=True, speculate=True)
    for a, b in zip(plain_res, spec_res):
        assert a.losses == b.losses
        assert b.speculation["corrected"] == 0
        assert b.speculation["speculated"] == len(spec.tiles)  # decided at landing, not by timing
    for name, tile in plain.tiles.items():
        assert torch.equal(spec.tiles[name].master, tile.master), name
        assert torch.equal(spec.tiles[name].exp_avg_sq, tile.exp_avg_sq), name


@pytest.mark.parametrize("tied", [False, True])
def test_a_clipped_step_is_corrected_to_the_exact_update(tied):
    # Clip just below the first step's norm: the running norm crosses the threshold only with the
    # last tiles, so nearly every tile is speculated and then corrected and redone.
    _, probe = train(1e9, overlap=False, steps=1, tied=tied)
    max_norm = probe[0].grad_norm * 0.999
    plain, plain_res = train(max_norm, overlap=False, steps=1, tied=tied)
    spec, spec_res = train(max_norm, overlap=True, steps=1, tied=tied)
    info = spec_res[0].speculation
    assert info["corrected"] == info["speculated"] >= len(spec.tiles) - 2
    assert spec_res[0].losses == plain_res[0].losses
    for name, tile in plain.tiles.items():
        torch.testing.assert_close(spec.tiles[name].master, tile.master, rtol=1e-6, atol=2e-9)
        torch.testing.assert_close(spec.tiles[name].exp_avg, tile.exp_avg, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(spec.tiles[name].exp_avg_sq, tile.exp_avg_sq, rtol=1e-5, atol=1e-12)
        assert spec.tiles[name].step == tile.step == 1


def test_speculation_stops_once_the_running_norm_exceeds_the_threshold():
    spec, res = train(1e-3, overlap=True)  # every step heavily clipped
    assert res[0].speculation["speculated"] <= 1, "the first tile alone is over the threshold"
    for r in res[1:]:
        assert r.speculation["speculated"] == 0, "no speculation right after a clipped step"
    plain, _ = train(1e-3, overlap=False)
    for name, tile in plain.tiles.items():
        torch.testing.assert_close(spec.tiles[name].master, tile.master, rtol=1e-6, atol=2e-9)


def test_a_skipped_step_leaves_no_speculative_update_behind():
    store = make_store()
    for tile in store.tiles.values():
        tile.grad.normal_(0, 1e-3)
    before = snapshot(store)
    opt = HostAdamW(TrainConfig(lr=1e-3, weight_decay=0.1, eps=1e-6))
    order = ["embed", *store.layer_names, "head"]
    worker = OptimizerWorker(opt, store, forward_order=order, max_grad_norm=None, speculate=True,
                             assume_clipped=False)
    worker.begin_step(1e-3)
    for name in reversed(order):
        worker.landed(name, float(store.tiles[name].grad.square().sum()))
    info = worker.resolve(1.0, finite=False)  # e.g. a later micro-batch's loss was inf
    worker.close()
    assert info["corrected"] == info["speculated"] == len(order)
    for name, (master, m, v, step) in before.items():
        tile = store.tiles[name]
        assert tile.step == step == 0
        torch.testing.assert_close(tile.master, master, rtol=1e-6, atol=1e-9)
        # From zero moments, rounding leaves residues of about one ulp of the gradient's terms
        # (|g| ~ 1e-3: 1e-10 for m; g^2 ~ 1e-6 times 1e-3: 1e-16 for v).
        torch.testing.assert_close(tile.exp_avg, m, rtol=0, atol=1e-10)
        torch.testing.assert_close(tile.exp_avg_sq, v, rtol=0, atol=1e-15)


def test_a_non_finite_tile_is_never_speculated():
    store = make_store()
    for tile in store.tiles.values():
        tile.grad.normal_(0, 1e-3)
    opt = HostAdamW(TrainConfig(lr=1e-3))
    worker = OptimizerWorker(opt, store, forward_order=["embed", *store.layer_names, "head"],
                             max_grad_norm=None, speculate=True, assume_clipped=False)
    worker.begin_step(1e-3)
    worker.landed("head", math.inf)
    worker.landed("layers.3", 1.0)  # after a non-finite tile, nothing more is speculated either
    info = worker.resolve(1.0, finite=False)
    worker.close()
    assert info["speculated"] == 0


def test_clipped_steps_are_deterministic_whatever_the_thread_timing():
    runs = [train(0.5, overlap=True)[0] for _ in range(3)]
    for store in runs[1:]:
        for name, tile in runs[0].tiles.items():
            assert torch.equal(store.tiles[name].master, tile.master), name


def test_speculation_resumes_after_an_unclipped_verdict():
    store = make_store()
    for tile in store.tiles.values():
        tile.grad.normal_(0, 1e-3)
    order = ["embed", *store.layer_names, "head"]
    worker = OptimizerWorker(HostAdamW(TrainConfig(lr=1e-3)), store, forward_order=order, max_grad_norm=1.0,
                             assume_clipped=False)
    spoken = []
    for clip in (0.5, 1.0, 1.0):  # clipped, then unclipped twice
        worker.begin_step(1e-3)
        for name in reversed(order):
            worker.landed(name, 1e-6)
        spoken.append(worker.resolve(clip, finite=True)["speculated"])
    worker.close()
    assert spoken == [len(order), 0, len(order)]


def test_the_first_step_does_not_speculate_by_default():
    _, res = train(1e9, overlap=True, first_step_speculates=False)
    assert res[0].speculation["speculated"] == 0
    assert all(r.speculation["speculated"] > 0 for r in res[1:])


class _GatedMoments(HostAdamW):
    """Deferred moments whose pass waits for the test's go-ahead; records the order of the passes."""

    def __init__(self, cfg):
        super().__init__(cfg, kernel="torch")
        self.defer_moments, self.go, self.log = True, __import__("threading").Event(), []

    def update_weights(self, tile, lr, clip=1.0):
        self.log.append(("weights", tile.name))
        tile.step += 1

    def update_moments(self, tile, clip=1.0):
        self.go.wait()
        self.log.append(("moments", tile.name))


def clipped_step_with_gated_moments(*, gate_open: bool):
    """A worker that has resolved one clipped step (every update deferred) over a _GatedMoments optimizer."""
    store = make_store()
    for name, tile in store.tiles.items():
        tile.name = name
    order = ["embed", *store.layer_names, "head"]
    opt = _GatedMoments(TrainConfig(lr=1e-3))
    if gate_open:
        opt.go.set()
    worker = OptimizerWorker(opt, store, forward_order=order, max_grad_norm=1.0, speculate=False)
    worker.begin_step(1e-3)
    for name in reversed(order):
        worker.landed(name, 1e-6)
    worker.resolve(0.5, finite=True)
    return worker, opt, order


def test_deferred_moments_free_the_weights_first_and_the_gradient_last():
    worker, opt, order = clipped_step_with_gated_moments(gate_open=False)
    for name in order:
        worker.wait(name)  # the next forward's weights: ready while every moments pass is held back
    assert [k for k, _ in opt.log] == ["weights"] * len(order)
    assert [t for _, t in opt.log] == order
    assert not worker._done["head"].is_set()  # its gradient may not be replaced yet (wait_state blocks)
    opt.go.set()
    worker.begin_step(1e-3)  # the next step's forward runs: the moments stay held by the worker...
    time.sleep(0.2)
    assert [k for k, _ in opt.log] == ["weights"] * len(order)
    worker.release_moments()  # ...until its head (Engine.forward_backward)
    worker.wait_state("embed")
    # the moments in the order the next backward lands gradients: head first, embedding last
    assert [t for k, t in opt.log if k == "moments"] == list(reversed(order))
    worker.resolve(1.0, finite=False)
    worker.close()


def test_waiting_for_a_tiles_state_releases_held_moments():
    worker, opt, order = clipped_step_with_gated_moments(gate_open=True)
    worker.wait_state("layers.0")  # no release_moments call: must not hang
    worker.drain()
    assert sum(k == "moments" for k, _ in opt.log) == len(order)
    worker.close()


def test_the_engine_makes_the_gradient_lander_wait_for_deferred_moments():
    from megatrain_cli.engine.transfer.updates import NO_UPDATES, HostUpdates

    store = make_store()
    engine = make_engine(store, TrainConfig(lr=1e-3), device="cpu", checkpoint_interval=1, overlap_optimizer=True)
    try:  # the sink calls its updates' wait_state before it writes a tile's gradient (engine/transfer/updates.py)
        assert engine.sink.updates is engine.worker and engine.sink.updates.wait_state == engine.worker.wait_state
        assert engine.streamer.updates is engine.worker and isinstance(engine.worker, HostUpdates)
    finally:
        engine.close()
    plain = make_engine(store, TrainConfig(lr=1e-3), device="cpu", checkpoint_interval=1, overlap_optimizer=False)
    try:  # no thread beside the step: nothing to wait for
        assert plain.worker is None and plain.sink.updates is plain.streamer.updates is NO_UPDATES
        assert isinstance(NO_UPDATES, HostUpdates)
    finally:
        plain.close()
