"""Validation loss (engine/validate.py, train/validation.py): a forward-only pass over held-out rows.

It must equal a plain forward of the same model (the store's masters loaded into plain HF) on the same rows
(CPU, fp32, 1e-5), leave every byte of host state (masters, Adam moments, gradients, step counts) as it was,
and leave training where it was: steps with validation passes between them equal steps without.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.engine.schedule import build_schedule
from megatrain_cli.engine.step import Engine
from megatrain_cli.engine.validate import forward_order, validation_loss
from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.reference import random_batches, reference_model, tiny_config

CPU = torch.device("cpu")
CFG = TrainConfig(steps=3, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, grad_accum=2)


def engine_for(config, *, interval: int = 2, worker: bool = False, resident: int = 0) -> Engine:
    store = build_store(config, torch.float32, seed=3)
    return make_engine(store, CFG, device=CPU, checkpoint_interval=interval, loss_chunk_tokens=7,
                       overlap_optimizer=worker, resident_layers=resident)


def train(engine: Engine, steps, validate_after=(), held_out=None) -> list[float]:
    losses = []
    for s, mbs in enumerate(steps):
        losses.append(engine.step(mbs, lr_at(s, CFG, len(steps))).loss)
        if s in validate_after:
            validation_loss(engine, held_out, group=2)
    engine.synchronize()
    return losses


def plain_loss(model, micro_batches) -> float:
    """Token-mean cross-entropy of a plain HF forward over the rows (labels shifted as HF does)."""
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for mb in micro_batches:
            kw = {"position_ids": mb.position_ids} if mb.position_ids is not None else {}
            logits = model(input_ids=mb.input_ids, use_cache=False, **kw).logits.float()
            labels = mb.labels[:, 1:]
            loss_sum += float(torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                reduction="sum"))
            tokens += int((labels != IGNORE_INDEX).sum())
    return loss_sum / tokens


SECTIONS = ("master", "exp_avg", "exp_avg_sq", "grad")


def snapshot(store) -> dict[str, dict]:
    """Every tile's sections (master, exp_avg, exp_avg_sq, gradient), its whole allocation (the same
    store's padding included) and its optimizer step count."""
    return {name: {"step": tile.step, "buffer": tile.buffer.clone(),
                   **{s: getattr(tile, s).clone() for s in SECTIONS}} for name, tile in store.tiles.items()}


def assert_same_state(a: dict, b: dict, *, whole_buffer: bool = True) -> None:
    """Bit-identical. `whole_buffer`: also the alignment padding between sections (never written, so only
    comparable within one store)."""
    assert list(a) == list(b)
    for name in a:
        assert a[name]["step"] == b[name]["step"], f"{name}: optimizer step count changed"
        for section in (*SECTIONS, "buffer") if whole_buffer else SECTIONS:
            assert torch.equal(a[name][section], b[name][section]), f"{name}.{section} changed"


@pytest.mark.parametrize("arch,tied,packed,interval", [
    ("Qwen2ForCausalLM", False, False, 2),
    ("LlamaForCausalLM", True, True, 3),  # tied head (the embedding tile), packed rows (block-causal)
    ("gemma2", False, False, 1),  # final-logit softcap, scaled embeddings, sliding window
    ("qwen3_moe", False, False, 2),  # routed experts: the router's hooks record nothing in the pass
])
def test_validation_loss_equals_a_plain_forward_of_the_same_model(arch, tied, packed, interval):
    config = tiny_config(arch, tied=tied, layers=4)
    engine = engine_for(config, interval=interval)
    train(engine, random_batches(config.vocab_size, 2, 2, batch=2, seq=16, seed=5))  # not the init weights
    held_out = random_batches(config.vocab_size, 1, 3, batch=2, seq=16, seed=9)[0]
    if packed:
        for mb in held_out:  # two documents per row: positions restart at 0 at token 9
            mb.position_ids = torch.cat([torch.arange(9), torch.arange(7)]).expand_as(mb.input_ids).clone()
    counted = engine.router.picks.clone() if engine.router is not None else None
    ours, tokens = validation_loss(engine, held_out, group=2)  # 3 micro-batches: passes of 2 and 1
    if engine.router is not None:  # the router loss's hooks saw the pass but recorded nothing
        assert torch.equal(engine.router.picks, counted) and engine.router.kept == {}
    assert tokens == sum(int((mb.labels[:, 1:] != IGNORE_INDEX).sum()) for mb in held_out)
    expected = plain_loss(reference_model(engine.store, config).eval(), held_out)
    assert ours == pytest.approx(expected, rel=1e-5)
    engine.close()


def test_a_validation_pass_leaves_every_byte_of_host_state_as_it_was():
    """With the background optimizer (the CUDA path's worker): its pending updates land first, as before a
    checkpoint; from there the pass writes nothing: masters, moments, gradients and step counts are the
    same bytes after it."""
    config = tiny_config("Qwen2ForCausalLM", layers=3)
    engine = engine_for(config, worker=True)
    for s, mbs in enumerate(random_batches(config.vocab_size, 2, 2, batch=2, seq=16, seed=5)):
        engine.step(mbs, lr_at(s, CFG, 3))  # the last step's updates may still be running
    held_out = random_batches(config.vocab_size, 1, 2, batch=2, seq=16, seed=9)[0]
    engine.synchronize()
    before = snapshot(engine.store)
    first, _ = validation_loss(engine, held_out, group=2)
    assert_same_state(before, snapshot(engine.store))
    second, _ = validation_loss(engine, held_out, group=1)  # and it reads what it left
    assert second == pytest.approx(first, rel=1e-6)
    engine.close()


def test_training_with_validation_passes_equals_training_without():
    """Passes after steps 1 and 2 (optimizer worker on, clipping active) change no later step: the same
    losses and the same bytes of host state after step 3."""
    config = tiny_config("Qwen2ForCausalLM", layers=3)
    steps = random_batches(config.vocab_size, 3, 2, batch=2, seq=16, seed=5)
    held_out = random_batches(config.vocab_size, 1, 3, batch=2, seq=16, seed=9)[0]
    plain, with_val = engine_for(config, worker=True), engine_for(config, worker=True)
    assert train(plain, steps) == train(with_val, steps, validate_after=(0, 1), held_out=held_out)
    assert_same_state(snapshot(plain.store), snapshot(with_val.store), whole_buffer=False)
    plain.close()
    with_val.close()


def test_validation_reads_resident_layers_in_place():
    """With resident layers (engine.resident_layers) the pass reads their device state where it is: the same
    loss as the all-streamed engine after the same steps, and the host copies are not brought home for it."""
    config = tiny_config("Qwen2ForCausalLM", layers=3)
    steps = random_batches(config.vocab_size, 2, 2, batch=2, seq=16, seed=5)
    held_out = random_batches(config.vocab_size, 1, 2, batch=2, seq=16, seed=9)[0]
    losses = []
    for resident in (0, 2):
        engine = engine_for(config, resident=resident)
        for s, mbs in enumerate(steps):
            engine.step(mbs, lr_at(s, CFG, 3))
        stale = engine.store.tiles["layers.0"].master.clone()
        losses.append(validation_loss(engine, held_out, group=2)[0])
        if resident:  # the host copy of a resident layer is still the one loaded before the first step
            assert torch.equal(engine.store.tiles["layers.0"].master, stale)
            assert engine.store.tiles["layers.0"].step == 0
        engine.close()
    assert losses[1] == losses[0]


def test_the_forward_only_order_is_the_step_forward_order_without_the_backward():
    ops = build_schedule(5, 2, keep_blocks=frozenset({1}))
    assert forward_order(ops) == ["layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "head"]


def held_out_recipe(*extra: str):
    from pathlib import Path

    from megatrain_cli.recipe import load_recipe

    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"
    return load_recipe(tiny, ["train.seq_len=64", "train.micro_batch_size=2", "train.grad_accum=3", *extra])


def test_held_out_rows_are_the_test_split_in_order_the_same_every_time():
    from megatrain_cli.data import build_train_data, load_examples, split_examples
    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.train.validation import HeldOut

    r = held_out_recipe("eval.every_n_steps=5", "eval.val_batches=3")
    tokenizer = load_tokenizer(r.model)
    _, test = split_examples(load_examples(r.data), r.data)
    held = HeldOut.build(r, test, tokenizer)
    rows = build_train_data(test, tokenizer, r.data, 64, r.train.seed)
    assert [mb.input_ids.shape for mb in held.micro_batches] == [(2, 64)] * 3 and held.rows == 6
    for i, mb in enumerate(held.micro_batches):  # rows 0..5 of the test split, in their stored order
        for j in range(2):
            ids, labels, pos = rows.build_row(2 * i + j)
            assert torch.equal(mb.input_ids[j], ids) and torch.equal(mb.labels[j], labels)
    assert held.group == 3  # a pass holds as many micro-batches as a step
    assert [s for s in range(1, 13) if held.due(s, 12)] == [5, 10, 12]  # and after the last step
    # Two ranks: each keeps every other micro-batch, the same count on both (an odd one left out).
    shares = [HeldOut.build(r, test, tokenizer, SimpleNamespace(rank=k, world=2)) for k in (0, 1)]
    assert [len(s.micro_batches) for s in shares] == [1, 1] and [s.group for s in shares] == [2, 2]
    assert torch.equal(shares[1].micro_batches[0].input_ids, held.micro_batches[1].input_ids)
    assert HeldOut.build(held_out_recipe("eval.every_n_steps=null"), test, tokenizer) is None  # off


def test_validation_without_held_out_rows_or_with_a_zero_interval_is_refused():
    from megatrain_cli.train.errors import TrainingError
    from megatrain_cli.train.validation import HeldOut

    with pytest.raises(TrainingError, match="eval.every_n_steps=5 needs held-out rows") as err:
        HeldOut.build(held_out_recipe("eval.every_n_steps=5"), [], tokenizer=None)
    assert err.value.code == 2 and "data.test_fraction" in str(err.value)
    from megatrain_cli.recipe import RecipeError

    with pytest.raises(RecipeError, match="eval.every_n_steps: must be >= 1 or null, got 0"):
        held_out_recipe("eval.every_n_steps=0")  # refused when the recipe loads, before anything runs
