"""GRPO's pieces below the loop: the sampler (temperature, top-p, a seeded generator), rollouts that read the
trainer's store as it is now, the rows they train as, the built-in rewards, and the prompts' order and data."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.data.errors import DataError
from megatrain_cli.data.rewards import RewardError, exact_match, format_reward, resolve_rewards, score
from megatrain_cli.data.rollout_prompts import PromptOrder, encode_prompts, load_prompt_examples, usable
from megatrain_cli.eval.generate import Sampler
from megatrain_cli.recipe import DataConfig


def draws(sampler: Sampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([sampler(logits) for _ in range(n)])


def test_top_p_keeps_the_nucleus_and_renormalises():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    sampler = Sampler(1.0, 0.7, torch.Generator().manual_seed(0))
    got = draws(sampler, probs.log().expand(4000, 4), 1).reshape(-1)
    assert set(got.tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3: the nucleus is the first two tokens
    assert (got == 0).double().mean().item() == pytest.approx(0.5 / 0.8, abs=0.03)
    everything = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))(probs.log().expand(4000, 4))
    assert set(everything.tolist()) == {0, 1, 2, 3}


def test_temperature_sharpens_and_the_seed_repeats():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(4000, 3)
    cold = Sampler(0.25, 1.0, torch.Generator().manual_seed(1))(logits)
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 0.25, 0)[0].item()
    assert (cold == 0).double().mean().item() == pytest.approx(expected, abs=0.02)
    a, b = (Sampler(1.0, 0.9, torch.Generator().manual_seed(5))(logits) for _ in range(2))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="temperature > 0 and top_p in"):
        Sampler(0.0, 1.0, torch.Generator())


def test_rollouts_read_the_store_as_it_is_now_and_become_rows():
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer
    from megatrain_cli.train.rollout import rollout_rows, sample
    from tests.reference import tiny_config

    tok = load_bundled_tokenizer()
    store = build_store(tiny_config(vocab=len(tok), layers=2), torch.float32, seed=3)
    prompts = [tok("Question: 2 + 2?\nAnswer: ")["input_ids"], tok("Question: 10 - 3?\nAnswer: ")["input_ids"]]

    def run(seed):
        return sample(store, torch.device("cpu"), tok, prompts, 3, Sampler(1.0, 1.0, torch.Generator().manual_seed(seed)),
                      max_new_tokens=6, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, stop=[])

    first = run(0)
    assert first.completion_ids == run(0).completion_ids  # the same weights and seed: the same completions
    assert first.prompt_ids == [prompts[0]] * 3 + [prompts[1]] * 3 and len(first.texts) == 6
    assert all(1 <= len(c) <= 6 for c in first.completion_ids) and first.new_tokens > 0
    store.tiles["head"].master.mul_(3.0)  # what a step does to the masters: the next rollout samples from them
    assert run(0).completion_ids != first.completion_ids

    adv = torch.tensor([[1.0, -1.0, 0.5], [0.0, 2.0, -2.0]])
    mbs = rollout_rows(first, adv, 4, tok.pad_token_id)
    assert [mb.input_ids.shape[0] for mb in mbs] == [4, 2]
    rows = [(mb, i) for mb in mbs for i in range(mb.input_ids.shape[0])]
    for k, (mb, i) in enumerate(rows):
        p, c = first.prompt_ids[k], first.completion_ids[k]
        assert mb.input_ids[i, :len(p) + len(c)].tolist() == p + c
        labelled = mb.labels[i] != IGNORE_INDEX
        assert mb.labels[i][labelled].tolist() == c and labelled.nonzero()[0].item() == len(p)
        assert mb.advantages[i][labelled].tolist() == [adv.reshape(-1)[k].item()] * len(c)
        assert not mb.advantages[i][~labelled].any()


class _Ex:
    def __init__(self, answer, record=0):
        self.answer, self.record = answer, record


def test_built_in_rewards_read_answers_as_the_eval_does():
    assert exact_match("q", "3 + 4 = 7 apples.\nThe answer is: 7", _Ex("7")) == 1.0
    assert exact_match("q", "so 1,200 in all", _Ex("1200")) == 1.0  # flexible: the last number, normalised
    assert exact_match("q", "The answer is 8", _Ex("7")) == 0.0
    assert format_reward("q", "#### 12", _Ex("7")) == 1.0 and format_reward("q", "it is 12", _Ex("12")) == 0.0
    total, problems = score(resolve_rewards(["exact_match", "format"]), "q", "The answer is: 7", _Ex("7"))
    assert (total, problems) == (2.0, [])


def test_a_reward_that_cannot_be_imported_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('at import')\nvalue = 3\n")
    (tmp_path / "some_rewards.py").write_text("value = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"^grpo.rewards: 'some_rewards:nope': module 'some_rewards' has no 'nope'$"):
        resolve_rewards(["some_rewards:nope"])
    with pytest.raises(RewardError, match=r"^grpo.rewards: 'some_rewards:value' is a int, not a function of "):
        resolve_rewards(["some_rewards:value"])
    with pytest.raises(RewardError, match=r"^grpo.rewards: 'broken_rewards:f': importing 'broken_rewards' failed: "
                                          r"RuntimeError: at import$"):
        resolve_rewards(["broken_rewards:f"])
    total, problems = score([("inf", lambda p, c, e: math.inf)], "a long prompt " * 10, "x", _Ex("1", record=4))
    assert math.isnan(total) and problems[0].describe().startswith(
        "reward inf returned inf on example record 4 ('a long prompt a long prompt a long prompt a long prompt "
        "a...'); that prompt's completions get advantage 0 this step")


def test_prompt_answer_files_gold_answers_and_too_long_prompts(tmp_path):
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer

    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": 5}) + "\n" +
                    json.dumps({"prompt": "Spell cat " * 40, "answer": "cat"}) + "\n")
    examples = load_prompt_examples(DataConfig(source=str(path), cache_dir="off"))
    assert [(ex.prompt, ex.answer, ex.record) for ex in examples][0] == ("What is 2 + 3?", "5", 0)
    prompts, too_long = encode_prompts(examples, load_bundled_tokenizer(), DataConfig(), 64)
    assert too_long == 1 and prompts[0].text == "Question: What is 2 + 3?\nAnswer: "
    gsm = load_prompt_examples(DataConfig(source="builtin:sample_math", max_samples=3))
    assert all(ex.answer for ex in gsm)  # 'The answer is: N' read as the gold answer
    assert usable(gsm, "x", need_answers=True) == (gsm, 0)
    with pytest.raises(DataError, match=r"^x: no example has a gold answer"):
        usable([type(gsm[0])("p", "r", None)], "x", need_answers=True)


def test_the_prompt_order_resumes_where_it_stopped():
    a = PromptOrder(5, seed=3)
    first = a.take(7)  # into the second epoch
    assert sorted(first[:5]) == [0, 1, 2, 3, 4]
    b = PromptOrder(5, seed=3)
    b.load_state_dict(a.state_dict())
    assert b.take(6) == a.take(6)
    with pytest.raises(DataError, match="written over 5 GRPO prompts, this data has 4"):
        PromptOrder(4, seed=3).load_state_dict(a.state_dict())


def test_resident_layers_are_read_in_place_and_sample_what_the_masters_would():
    """A trainer keeping layer 0 (and the head) on the device: the rollout reads their device weights in place
    (their host masters stale), the rest from the host masters, and samples exactly what a feed of the masters
    alone does once they are brought home."""
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer
    from megatrain_cli.recipe import TrainConfig
    from megatrain_cli.train.rollout import sample
    from tests.engines import make_engine
    from tests.reference import random_batches, tiny_config

    tok = load_bundled_tokenizer()
    store = build_store(tiny_config(vocab=len(tok), layers=2), torch.float32, seed=3)
    engine = make_engine(store, TrainConfig(steps=1, lr=1e-2), device="cpu", resident_layers=1,
                         overlap_optimizer=False)
    engine.step(random_batches(len(tok), 1, 1, 2, 16)[0], 1e-2)  # the resident layer moves on the device
    engine.synchronize(masters=False)  # what GRPO's next_step does first: the host masters of layer 0 and the
    read = []  # head stay behind
    weights = engine.resident.weights
    engine.resident.weights = lambda tile: read.append(tile) or weights(tile)
    prompts = [tok("Question: 2 + 2?\nAnswer: ")["input_ids"]]

    def run(**kw):
        return sample(store, torch.device("cpu"), tok, prompts, 4, Sampler(1.0, 1.0, torch.Generator().manual_seed(0)),
                      max_new_tokens=5, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, stop=[], **kw)

    in_place = run(engine=engine)
    assert read and set(read) == {"layers.0", "head"}
    stale = run()  # the host masters of layer 0 and the head are the step's start: other samples
    engine.synchronize()  # the masters home: now a feed of the masters alone samples what the rollout did
    assert in_place.completion_ids == run().completion_ids != stale.completion_ids
    engine.close()


def test_a_row_stopped_by_a_stop_string_ends_there_when_the_pad_id_is_the_eos_id():
    """Rows a stop string ended are filled with pad ids; a tokenizer without a pad token of its own pads with
    eos: the completion (what is trained on) ends at the model's last own token, not at a filler eos."""
    from megatrain_cli.eval.generate import StopOnStrings, left_pad
    from megatrain_cli.eval.streamed import StreamedModel
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer
    from megatrain_cli.train.rollout import sample
    from tests.reference import tiny_config

    tok = load_bundled_tokenizer()
    store = build_store(tiny_config(vocab=len(tok), layers=1), torch.float32, seed=3)
    stop_ids = tok("\nQ", add_special_tokens=False)["input_ids"]
    script = [tok("7", add_special_tokens=False)["input_ids"][0], *stop_ids, 11, 12, 13, 14, 15, 16]

    class Scripted:  # row 0 writes '7' then the stop string; row 1 never stops
        step = 0

        def __call__(self, logits):
            ids = torch.tensor([script[self.step], 20 + self.step])
            self.step += 1
            return ids

    eos = tok.eos_token_id
    prompt = tok("Question: 3 + 4?\nAnswer: ")["input_ids"]
    new, lengths = StreamedModel(store, torch.device("cpu")).decode_batch(
        *left_pad([prompt, prompt], eos), max_new_tokens=8, eos_ids=[eos], pad_id=eos,
        stop_criteria=[StopOnStrings(tok, ["\nQ"], len(prompt))], pick=Scripted())
    assert lengths.tolist() == [1 + len(stop_ids), 8]
    assert new[0, :lengths[0]].tolist() == script[:1 + len(stop_ids)] and (new[0, lengths[0]:] == eos).all()
    out = sample(store, torch.device("cpu"), tok, [prompt], 2, Scripted(), max_new_tokens=8, eos_ids=[eos],
                 pad_id=eos, stop=["\nQ"])
    assert out.completion_ids[0] == script[:1 + len(stop_ids)] and out.texts[0] == "7"
    assert out.completion_ids[1] == list(range(20, 28))


def test_a_reward_past_floats_range_or_of_numpys_types_is_scored_not_raised():
    """score() is called on a user's values: an int past float's range is reported (it raised OverflowError
    outside the reward's own try), numpy's bools and floats are numbers."""
    import numpy as np

    ex = _Ex("4", record=7)
    for value, total in [(np.bool_(True), 1.0), (np.float32(0.5), 0.5), (True, 1.0), (3, 3.0)]:
        assert score([("r", lambda p, c, e, v=value: v)], "p", "c", ex) == (total, [])
    got, problems = score([("r", lambda p, c, e: 10 ** 400)], "p", "c", ex)
    assert math.isnan(got) and [(x.reward, x.record, x.what[:13]) for x in problems] == [("r", 7, "returned 1000")]


def test_the_first_rollout_loads_the_resident_layers_before_any_step():
    """A run's first rollout (and a resume's) comes before the engine's first step: it loads the resident layers
    then and reads them in place, as every later rollout does; the step after it keeps them (not loaded twice)
    and equals the step of an engine that never sampled. Before, the first rollout streamed every layer from
    its master at every token (H200, 7B, 64 x 256 tokens: 155.7 s against 7.0 s for the next)."""
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer
    from megatrain_cli.recipe import TrainConfig
    from megatrain_cli.train.rollout import sample
    from tests.engines import make_engine
    from tests.reference import random_batches, tiny_config

    tok = load_bundled_tokenizer()
    batch = random_batches(len(tok), 1, 1, 2, 16)[0]
    results = []
    for sampled in (True, False):
        store = build_store(tiny_config(vocab=len(tok), layers=2), torch.float32, seed=3)
        engine = make_engine(store, TrainConfig(steps=1, lr=1e-2), device="cpu", resident_layers=1,
                             overlap_optimizer=False)
        loads, read = [], []
        load, weights = engine.resident.load, engine.resident.weights
        engine.resident.load = lambda **kw: loads.append(kw) or load(**kw)
        engine.resident.weights = lambda tile: read.append(tile) or weights(tile)
        if sampled:
            sample(store, torch.device("cpu"), tok, [tok("2 + 2 = ")["input_ids"]], 2,
                   Sampler(1.0, 1.0, torch.Generator().manual_seed(0)), max_new_tokens=3, eos_ids=[tok.eos_token_id],
                   pad_id=tok.pad_token_id, stop=[], engine=engine)
            assert loads == [{}] and {"layers.0", "head"} <= set(read)
        results.append(engine.step(batch, 1e-2).loss)
        engine.synchronize()
        results.append([t.master.clone() for t in store.tiles.values()])
        assert len(loads) == 1
        engine.close()
    assert results[0] == results[2]
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[3]))


def test_the_sampler_draws_what_multinomial_draws_from_the_same_state():
    """Sampler's exponential race (no host syncs) is torch.multinomial's one-draw algorithm: the same ids and the
    same generator state after, so checkpoints written before it resume to the same draws."""
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(0)) * 3
    logits[:, :50] = -math.inf  # tokens top-p or a mask left out: never drawn
    for top_p in (1.0, 0.8):
        ours = Sampler(0.7, top_p, torch.Generator().manual_seed(9))
        theirs = torch.Generator().manual_seed(9)
        for _ in range(3):
            got = ours(logits)
            probs = torch.softmax(logits / 0.7, dim=-1)
            if top_p < 1:
                sorted_p, order = probs.sort(dim=-1, descending=True)
                kept = torch.where(sorted_p.cumsum(-1) - sorted_p < top_p, sorted_p, torch.zeros(()))
                probs = torch.zeros_like(probs).scatter_(-1, order, kept)
            assert torch.equal(got, torch.multinomial(probs, 1, generator=theirs)[:, 0])
            assert (got >= 50).all()
        assert torch.equal(ours.generator.get_state(), theirs.get_state())


def test_nan_logits_are_flagged_once_a_rollout_not_turned_into_tokens_silently():
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    logits = torch.randn(4, 30)
    logits[:, :3] = -math.inf  # masked tokens are fine
    sampler(logits)
    assert sampler.took_nan() is False
    logits[2, 5] = math.nan
    sampler(logits)
    sampler(torch.randn(4, 30))
    assert sampler.took_nan() is True and sampler.took_nan() is False  # read, then cleared
    sampler(torch.full((1, 30), math.inf))
    assert sampler.took_nan() is True
