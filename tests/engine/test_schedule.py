from megatrain_cli.engine.schedule import blocks, build_schedule, fetch_order, transfers_per_layer


def test_blocks_cover_every_layer_once():
    for n, c in [(5, 2), (6, 3), (7, 7), (4, 1), (28, 4)]:
        covered = [i for b in blocks(n, c) for i in b]
        assert covered == list(range(n))


def test_schedule_backward_walks_blocks_in_reverse_with_recompute_first():
    ops = build_schedule(5, 2)
    kinds = [(o.kind, o.layer) for o in ops]
    assert kinds[:5] == [("forward", i) for i in range(5)]
    assert kinds[5] == ("head", -1)
    assert kinds[6:8] == [("recompute", 4), ("backward", 4)]
    assert kinds[8:12] == [("recompute", 2), ("recompute", 3), ("backward", 3), ("backward", 2)]
    assert kinds[-1] == ("embed_backward", -1)
    assert [o.layer for o in ops if o.checkpoint] == [0, 2, 4]


def test_two_transfers_per_layer_when_the_block_fits_the_slots():
    counts = transfers_per_layer(build_schedule(8, 2), resident_buffers=2)
    # the last block is still resident when the forward ends: it needs no second transfer
    assert [counts[f"layers.{i}"] for i in range(8)] == [2, 2, 2, 2, 2, 2, 1, 1]


def test_three_transfers_when_the_block_is_larger_than_the_slots():
    counts = transfers_per_layer(build_schedule(8, 4), resident_buffers=2)
    # the last two layers of each block are still resident when its backward starts
    assert [counts[f"layers.{i}"] for i in range(8)] == [3, 3, 2, 2, 3, 3, 2, 2]
    counts = transfers_per_layer(build_schedule(8, 4), resident_buffers=4)
    assert [counts[f"layers.{i}"] for i in range(8)] == [2, 2, 2, 2, 1, 1, 1, 1]


def test_kept_blocks_skip_recompute():
    ops = build_schedule(4, 2, keep_blocks=frozenset({1}))
    assert not any(o.kind == "recompute" and o.block == 1 for o in ops)
    assert all(o.grad for o in ops if o.kind == "forward" and o.block == 1)
    counts = transfers_per_layer(ops, resident_buffers=2)
    assert counts["layers.3"] == 1 and counts["layers.0"] == 2
    assert fetch_order(ops).count("layers.0") == 3  # forward, recompute, backward (still resident)


def test_the_engine_reports_each_op_of_its_schedule_in_order():
    import torch

    from megatrain_cli.models.loader import build_store
    from megatrain_cli.recipe import TrainConfig
    from tests.engines import make_engine
    from tests.reference import random_batches, tiny_config

    store = build_store(tiny_config("Qwen2ForCausalLM", layers=4), torch.float32, seed=0)
    engine = make_engine(store, TrainConfig(lr=1e-3), device="cpu", checkpoint_interval=2, overlap_optimizer=False)
    seen = []
    engine.on_op = seen.append
    (mbs,) = random_batches(store.adapter.vocab_size, 1, 1, batch=1, seq=8, seed=0)
    engine.step(mbs, 1e-3)
    engine.close()
    assert seen == [None, *engine.ops]
