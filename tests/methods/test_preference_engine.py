"""A preference step through the streamed engine must equal the plain-PyTorch one (tests/preference_reference.py:
an HF model scoring every sequence by a forward of its own, the five losses written out from their papers,
torch AdamW set up as megatrain's), on the CPU in fp32, for each method.

The engine's reference is the reference pass (train/reference_pass.score_data: streamed, no autograd, the
preference head's pass 1) over the initial weights; the plain one a frozen copy of the HF model. Step 0 of DPO
is ln 2 exactly (the policy's sums are the reference pass's bit for bit). Three steps of two micro-batches
(gradient accumulation 2) whose rows hold 2 or 3 pairs each, so the mean over the step's pairs is not the
mean of the micro-batches' means; clipping active. Then the same on two ranks (gloo), one micro-batch each.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from megatrain_cli.methods import make_method
from megatrain_cli.models.loader import build_sharded_store, build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import DataConfig, TrainConfig
from megatrain_cli.recipe.schema import PreferenceConfig
from megatrain_cli.train.preference import PreferenceRun
from megatrain_cli.train.reference_pass import score_data
from tests.engines import make_engine
from tests.preference_reference import Hyper, reference_preference_train, units_of
from tests.reference import reference_model, tiny_config

STEPS, ACCUM, SEQ = 3, 2, 320  # 320 tokens: rows of 2 or 3 pairs (sequences of 46 to 68 tokens)
METHODS = ("dpo", "ipo", "simpo", "orpo", "kto")
# Each method's settings off TRL's defaults where the default would hide a term (IPO's 1/(2 beta) target,
# SimPO's gamma, ORPO's lambda, KTO's weights), and label smoothing on for DPO.
SETTINGS = {"dpo": dict(beta=0.5, label_smoothing=0.1), "ipo": dict(beta=0.5),
            "simpo": dict(beta=2.0, simpo_gamma=0.8, label_smoothing=0.05), "orpo": dict(orpo_lambda=0.5),
            "kto": dict(beta=0.5, desirable_weight=1.2, undesirable_weight=0.8)}
# Adam's eps as test_parity's. A pair's chosen and rejected sequences pull its shared tokens (the prompt's
# embedding rows, the LM-head rows of tokens both predict) in opposite directions: their gradient cancels to
# the noise of fp32 sums in another order, which Adam turns into updates of ~1e-6. So weights compare to 1e-5
# (the bound), where the SFT parity tests reach 1e-6.
ADAM_EPS = 1e-6


def train_cfg() -> TrainConfig:
    return TrainConfig(steps=STEPS, lr=2e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, grad_accum=ACCUM,
                       eps=ADAM_EPS, seq_len=SEQ, micro_batch_size=1)


@pytest.fixture(scope="module")
def pairs():
    """The bundled tokenizer and 30 bundled pairs in rows of SEQ tokens (packed), and a tiny model's config."""
    from megatrain_cli.data.preference import load_preference_examples
    from megatrain_cli.data.preference_rows import build_preference_data
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer

    tok = load_bundled_tokenizer()
    data_cfg = DataConfig(source="builtin:sample_math_pref", max_samples=30, cache_dir="off")
    examples = load_preference_examples(data_cfg, "dpo")
    return lambda: build_preference_data(examples, tok, data_cfg, SEQ, seed=0), tiny_config(vocab=len(tok), layers=3)


def engine_run(store, data, method_name: str, dist=None):
    """The engine's three steps (with `dist`: this rank's share of each): the reference pass, then the steps."""
    from megatrain_cli.engine.dist import split_micro_batches

    cfg = train_cfg()
    method = make_method(method_name, PreferenceConfig(**SETTINGS[method_name]))
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=2, loss_chunk_tokens=100,
                         overlap_optimizer=False, method=method, dist=dist)
    run = PreferenceRun(method, data, None)
    if method.needs_reference:
        run.reference = score_data(engine, data, micro_batch_size=1, group=1, dist=dist)
    steps, results = [], []
    for s in range(STEPS):
        mbs = data.next_step(1, ACCUM)
        steps.append(mbs)
        mine = split_micro_batches(mbs, dist.rank, dist.world) if dist is not None else mbs
        results.append(engine.step(run.attach(mine), lr_at(s, cfg, STEPS)))
    engine.close()
    return steps, results


def reference_run(model, steps, method_name: str):
    hp = Hyper(**SETTINGS[method_name])
    units = [[units_of(mb, method_name) for mb in mbs] for mbs in steps]
    return reference_preference_train(model, units, method_name, hp, train_cfg(), STEPS)


def assert_same_params(ours: dict, ref):
    for name, expected in ref.state_dict().items():
        torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("method_name", METHODS)
def test_three_steps_equal_the_plain_pytorch_reference(pairs, method_name):
    make_data, config = pairs
    store = build_store(config, torch.float32, seed=3)
    ref = reference_model(store, config)
    steps, results = engine_run(store, make_data(), method_name)
    history = reference_run(ref, steps, method_name)
    unit_counts = [[len(u) for u in step] for step in history]
    assert any(a != b for a, b in unit_counts), f"micro-batches of unequal units: {unit_counts}"
    for s, (res, expected) in enumerate(zip(results, history)):
        assert not res.skipped and res.grad_norm > 0.5, "clipping must be active in this test"
        for ours, theirs in zip(res.losses, expected):  # each micro-batch's mean over its own units
            assert ours == pytest.approx(sum(theirs) / len(theirs), rel=1e-5, abs=1e-7), f"step {s}"
        every = [v for mb in expected for v in mb]
        assert res.loss == pytest.approx(sum(every) / len(every), rel=1e-5, abs=1e-7), f"step {s}: the units' mean"
        assert set(res.metrics) >= {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                                    "logps/rejected"}
    if method_name == "dpo":  # the policy is the reference: every pair's log-ratio is 0, its loss ln 2 exactly
        first = results[0]
        assert [first.metrics[k] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins",
                                           "rewards/accuracies")] == [0.0] * 4
        assert first.losses == [math.log(2)] * ACCUM  # each micro-batch's mean of ln 2s
        assert abs(first.loss - math.log(2)) <= math.ulp(math.log(2))  # (2 ln 2 + 3 ln 2) / 5, rounded once
    assert_same_params(store.hf_state_dict(), ref)


def test_sft_is_the_default_method_and_reports_no_preference_metrics(pairs):
    from megatrain_cli.methods import SFT
    from tests.reference import random_batches

    _, config = pairs
    store = build_store(config, torch.float32, seed=3)
    engine = make_engine(store, train_cfg(), device="cpu", overlap_optimizer=False)
    assert isinstance(engine.method, SFT)
    res = engine.step(random_batches(config.vocab_size, 1, 1, batch=2, seq=16)[0], 1e-3)
    assert res.metrics == {}
    engine.close()


def test_the_reference_pass_tops_up_the_last_micro_batch(pairs):
    """12 rows in micro-batches of 5: the last one is topped up with repeats (dropped); the scores are those of
    micro-batches of 1 row, and a preference step's own first pass (engine/preference_head.score)."""
    make_data, config = pairs
    data = make_data()
    store = build_store(config, torch.float32, seed=3)
    engine = make_engine(store, train_cfg(), device="cpu", overlap_optimizer=False)
    one = score_data(engine, data, micro_batch_size=1, group=3)
    five = score_data(engine, data, micro_batch_size=5, group=2)
    assert data.num_rows == 12 and bool((one.tokens > 0).all())
    assert torch.equal(one.tokens, five.tokens)
    torch.testing.assert_close(one.logps, five.logps, rtol=1e-6, atol=1e-6)
    seen = []
    score_data(engine, data, micro_batch_size=4, group=1, progress=lambda done, rows: seen.append((done, rows)))
    assert seen == [(4, 12), (8, 12), (12, 12)]
    engine.close()


# ---------------------------------------------------------------- two ranks (gloo)
DIST_METHODS = ("dpo", "kto")  # KTO: its reference point is the step's, all-reduced with the units


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, config, seq: int) -> None:
    import torch.distributed as dist

    from megatrain_cli.engine.dist import init_distributed, leave_process_group

    torch.set_num_threads(1)
    ctx = init_distributed("cpu", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out = {}
    for method_name in DIST_METHODS:
        store = build_sharded_store(config, torch.float32, rank, world, seed=3)
        steps, results = engine_run(store, _data(seq), method_name, dist=ctx)
        state = {k: v.clone() for k, v in store.hf_state_dict().items()}  # a collective: every rank
        out[method_name] = {"results": [(r.loss, r.grad_norm, len(r.losses), r.metrics) for r in results],
                            "state": state if rank == 0 else None}
    # The reference pass on ranks: 3 micro-batches of 5 rows (the last topped up), rank 1 a dummy for its second
    store = build_sharded_store(config, torch.float32, rank, world, seed=3)
    engine = make_engine(store, train_cfg(), device="cpu", overlap_optimizer=False, dist=ctx)
    out["scores"] = score_data(engine, _data(seq), micro_batch_size=5, group=1, dist=ctx)
    engine.close()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    leave_process_group()


def _data(seq: int):
    from megatrain_cli.data.preference import load_preference_examples
    from megatrain_cli.data.preference_rows import build_preference_data
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer

    data_cfg = DataConfig(source="builtin:sample_math_pref", max_samples=30, cache_dir="off")
    return build_preference_data(load_preference_examples(data_cfg, "dpo"), load_bundled_tokenizer(), data_cfg, seq,
                                 seed=0)


@pytest.fixture(scope="module")
def ranks(pairs, tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("pref-dist")
    mp.spawn(_rank_main, args=(2, str(tmp / "init"), str(tmp), pairs[1], SEQ), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_the_reference_pass_on_two_ranks_scores_every_sequence_once(pairs, ranks):
    make_data, config = pairs
    store = build_store(config, torch.float32, seed=3)
    engine = make_engine(store, train_cfg(), device="cpu", overlap_optimizer=False)
    alone = score_data(engine, make_data(), micro_batch_size=5, group=1)
    engine.close()
    for out in ranks:
        assert torch.equal(out["scores"].tokens, alone.tokens)
        torch.testing.assert_close(out["scores"].logps, alone.logps, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method_name", DIST_METHODS)
def test_two_ranks_normalise_per_pair_like_the_reference(pairs, ranks, method_name):
    make_data, config = pairs
    store = build_store(config, torch.float32, seed=3)
    ref = reference_model(store, config)
    steps = []
    data = make_data()
    for _ in range(STEPS):
        steps.append(data.next_step(1, ACCUM))
    history = reference_run(ref, steps, method_name)
    for out in ranks:
        for s, ((loss, norm, n_mb, metrics), expected) in enumerate(zip(out[method_name]["results"], history)):
            assert n_mb == 1, "one micro-batch per rank"
            every = [v for mb in expected for v in mb]
            assert loss == pytest.approx(sum(every) / len(every), rel=1e-5, abs=1e-7), f"step {s}: every rank's"
            assert norm > 0.5
            assert "rewards/chosen" in metrics
    assert any(len(a) != len(b) for a, b in history), "the ranks' micro-batches hold unequal units"
    assert_same_params(ranks[0][method_name]["state"], ref)
