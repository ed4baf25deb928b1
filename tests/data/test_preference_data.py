"""Preference data: the layouts (text, TRL's conversational and implicit-prompt ones, LLaMA-Factory's ranking and
KTO entries, unpaired), tokens and labels against the templates' own rendering, rows that keep a pair whole,
the layout each micro-batch carries, determinism and resume, the bundled sets, and every bad input's message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.data import DataError, encode_prompt, load_examples, render_prompt
from megatrain_cli.data.preference import load_preference_examples, split_preference_examples
from megatrain_cli.data.preference_rows import build_preference_data
from megatrain_cli.data.sample_math import generate_sample_math
from megatrain_cli.data.sample_pref import sample_math_kto, sample_math_pref
from megatrain_cli.methods.sequences import sequence_index
from megatrain_cli.models.tokenizer import load_bundled_tokenizer
from megatrain_cli.recipe import DataConfig
from tests.data.test_chat_data import TEMPLATES, chat_tokenizer

PAIRS = [{"prompt": "2 + 2?", "chosen": "2 + 2 = 4.\nThe answer is: 4", "rejected": "2 + 2 = 5.\nThe answer is: 5"},
         {"prompt": "3 * 3?", "chosen": "3 * 3 = 9.\nThe answer is: 9", "rejected": "3 * 3 = 6.\nThe answer is: 6"},
         {"prompt": "Half of 8?", "chosen": "8 / 2 = 4.\nThe answer is: 4",
          "rejected": "8 / 2 = 16, since halving doubles.\nThe answer is: 16"}]


@pytest.fixture(scope="module")
def tok():
    return load_bundled_tokenizer()


def write_jsonl(path: Path, records: list, blank_after: int | None = None) -> Path:
    lines = [json.dumps(r) for r in records]
    if blank_after is not None:
        lines.insert(blank_after, "")  # a blank line: later records sit one line further down
    path.write_text("\n".join(lines) + "\n")
    return path


def cfg(source, **kw) -> DataConfig:
    return DataConfig(source=str(source), cache_dir="off", **kw)


def build(tok, source, method="dpo", seq_len=256, **kw):
    examples = load_preference_examples(cfg(source, **kw), method)
    return examples, build_preference_data(examples, tok, cfg(source, **kw), seq_len, seed=0)


def sequences_of(data) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of every sequence in the data's own order, read back from the rows."""
    out = {}
    for r in range(data.num_rows):
        ids, labels, pos = data.build_row(r)
        starts = (pos == 0).nonzero().flatten().tolist() + [int(sum(int(data.offsets[s + 1] - data.offsets[s])
                                                                    for s in data.rows[r]))]
        for s, lo, hi in zip(data.rows[r], starts, starts[1:]):
            out[s] = (ids[lo:hi].tolist(), labels[lo:hi].tolist())
    return [out[s] for s in range(data.num_sequences)]


# ---------------------------------------------------------------- layouts and tokens
def test_text_pairs_are_the_prompt_then_each_completion_labelled(tok, tmp_path):
    examples, data = build(tok, write_jsonl(tmp_path / "p.jsonl", PAIRS), packing=False)
    assert [ex.completions for ex in examples] == [(p["chosen"], p["rejected"]) for p in PAIRS]
    assert all(ex.desirable == (True, False) and not ex.chat for ex in examples)
    seqs = sequences_of(data)
    for i, p in enumerate(PAIRS):
        prompt = encode_prompt(tok, render_prompt(tok, p["prompt"], "auto"))
        for j, key in enumerate(("chosen", "rejected")):
            completion = tok(p[key], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert seqs[2 * i + j] == (prompt + completion, [IGNORE_INDEX] * len(prompt) + completion)
    assert data.stats()["examples"] == 3 and data.stats()["sequences"] == 6 and data.num_rows == 3


@pytest.mark.parametrize("layout", ["explicit", "implicit", "sharegpt"])
def test_chat_pairs_label_the_reply_and_its_end_of_turn(layout, tmp_path):
    tok = chat_tokenizer("chatml")
    prompt = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2 + 2?"},
              {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"}]
    good, bad = {"role": "assistant", "content": "3 + 3 = 6."}, {"role": "assistant", "content": "3 + 3 = 7."}
    record = {"explicit": {"prompt": prompt, "chosen": [good], "rejected": [bad]},
              "implicit": {"chosen": prompt + [good], "rejected": prompt + [bad]},
              "sharegpt": {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                              "value": m["content"]} for m in prompt],
                           "chosen": {"from": "gpt", "value": good["content"]},
                           "rejected": {"from": "gpt", "value": bad["content"]}}}[layout]
    (ex,), data = build(tok, write_jsonl(tmp_path / "c.jsonl", [record]))
    assert ex.chat and ex.prompt == "And 3 + 3?" and [t["role"] for t in ex.history] == ["system", "user", "assistant"]
    end = TEMPLATES["chatml"][2]
    for (ids, labels), reply in zip(sequences_of(data), (good, bad)):
        whole = tok(tok.apply_chat_template(prompt + [reply], tokenize=False), add_special_tokens=False)["input_ids"]
        label_ids = tok(reply["content"] + end, add_special_tokens=False)["input_ids"]
        n = len(tok(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"])
        tail = len(whole) - n - len(label_ids)  # the template's layout after the end of turn: not a label
        assert ids == whole and 0 <= tail <= 1
        assert labels == [IGNORE_INDEX] * n + label_ids + [IGNORE_INDEX] * tail  # the earlier reply: context


def test_unpaired_examples_and_paired_data_for_kto(tok, tmp_path):
    records = [{"prompt": "2 + 2?", "completion": "4", "label": True}, {"prompt": "3 + 3?", "completion": "7",
                                                                       "label": False}]
    examples, data = build(tok, write_jsonl(tmp_path / "u.jsonl", records), method="kto")
    assert [(ex.completions, ex.desirable) for ex in examples] == [(("4",), (True,)), (("7",), (False,))]
    (mb,) = data.next_step(2, 1)
    assert mb.layout.desirable.tolist() == [data.desirable[s] for s in mb.layout.sequences.tolist()]
    assert mb.layout.chosen.numel() == 0
    _, paired = build(tok, write_jsonl(tmp_path / "p.jsonl", PAIRS), method="kto")
    assert paired.desirable.tolist() == [True, False] * 3 and paired.num_units == 3


def test_llama_factory_ranking_and_kto_entries(tok, tmp_path):
    write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Add.", "input": "2 and 2", "chosen": "4",
                                             "rejected": "5"}])
    write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": [{"from": "human", "value": "2 + 2?"}],
                                               "chosen": {"from": "gpt", "value": "4"},
                                               "rejected": {"from": "gpt", "value": "5"}, "system": "Be brief."}])
    write_jsonl(tmp_path / "kto.jsonl", [{"messages": [{"role": "user", "content": "2 + 2?"},
                                                       {"role": "assistant", "content": "5"}], "tag": False}])
    write_jsonl(tmp_path / "kto_alpaca.jsonl", [{"instruction": "Add 2 and 2.", "output": "4", "kto_tag": True}])
    registry = tmp_path / "dataset_info.json"
    registry.write_text(json.dumps({
        "lf_alpaca": {"file_name": "alpaca.jsonl", "ranking": True,
                      "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                  "rejected": "rejected"}},
        "lf_sharegpt": {"file_name": "sharegpt.jsonl", "formatting": "sharegpt", "ranking": True,
                        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                                    "system": "system"}},
        "lf_kto": {"file_name": "kto.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages",
                                                                                  "kto_tag": "tag"}},
        "lf_kto_alpaca": {"file_name": "kto_alpaca.jsonl", "columns": {"prompt": "instruction", "response": "output",
                                                                     "kto_tag": "kto_tag"}}}))

    def one(name, method="dpo"):
        (ex,) = load_preference_examples(DataConfig(source=f"registry:{name}", registry=str(registry)), method)
        return ex

    alpaca = one("lf_alpaca")
    assert (alpaca.prompt, alpaca.completions, alpaca.chat) == ("Add.\n\n2 and 2", ("4", "5"), False)
    sharegpt = one("lf_sharegpt")
    assert (sharegpt.prompt, sharegpt.completions, sharegpt.chat) == ("2 + 2?", ("4", "5"), True)
    assert sharegpt.history == [{"role": "system", "content": "Be brief."}]
    kto = one("lf_kto", "kto")
    assert (kto.prompt, kto.completions, kto.desirable, kto.history) == ("2 + 2?", ("5",), (False,), [])
    assert one("lf_kto_alpaca", "kto").completions == ("4",)
    with pytest.raises(DataError, match=r"kto\.jsonl \(registry: lf_kto\): unpaired_preference data .* kto only; dpo "
                                        r"needs pairs"):
        one("lf_kto")
    with pytest.raises(DataError, match=r"format preference \(chosen, rejected: preference data\), not prompt / "
                                        r"response pairs: it trains with train\.method dpo, ipo, simpo, orpo or kto"):
        load_examples(DataConfig(source="registry:lf_alpaca", registry=str(registry)))


# ---------------------------------------------------------------- rows and micro-batches
def test_packing_keeps_each_pair_whole_and_the_layout_names_every_sequence(tok):
    data_cfg = cfg("builtin:sample_math_pref", max_samples=200)
    examples = load_preference_examples(data_cfg, "dpo")
    data = build_preference_data(examples, tok, data_cfg, 256, seed=3)
    assert data.num_rows == 100 and {len(row) for row in data.rows} == {4}  # two pairs of ~115 tokens a row
    for row in data.rows:  # each pair's chosen right before its rejected, in one row
        assert [int(data.unit_of[s]) for s in row[::2]] == [int(data.unit_of[s]) for s in row[1::2]]
        assert all(data.desirable[s] and not data.desirable[s + 1] for s in row[::2])
    seen = []
    for mb in data.next_step(4, 3):
        layout = mb.layout
        index, n = sequence_index(mb.position_ids)
        assert n == layout.sequences.numel() == 2 * layout.chosen.numel()
        for local, s in enumerate(layout.sequences.tolist()):  # the layout's order is the position resets'
            lo, hi = int(data.offsets[s]), int(data.offsets[s + 1])
            assert mb.input_ids[index == local].tolist()[:hi - lo] == data.tokens[lo:hi].tolist()
        assert (layout.desirable[layout.chosen]).all() and not (layout.desirable[layout.rejected]).any()
        assert (data.unit_of[layout.sequences[layout.chosen]] == data.unit_of[layout.sequences[layout.rejected]]).all()
        seen += layout.sequences.tolist()
    assert len(seen) == len(set(seen))
    scored = [s for mb in data.scoring_batches(8) for s in mb.layout.sequences.tolist()]
    assert sorted(scored) == list(range(data.num_sequences)) and data.cursor == (12 % data.num_rows)


def test_order_is_seeded_and_resume_continues_the_same_batches(tok):
    data_cfg = cfg("builtin:sample_math_pref", max_samples=60)
    examples = load_preference_examples(data_cfg, "dpo")

    def fresh(seed=0):
        return build_preference_data(examples, tok, data_cfg, 256, seed=seed)

    a = fresh()
    a.next_step(2, 2)
    state = a.state_dict()
    b = fresh()
    b.load_state_dict(state)
    for _ in range(5):  # across an epoch boundary
        for x, y in zip(a.next_step(2, 2), b.next_step(2, 2)):
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
            assert torch.equal(x.layout.sequences, y.layout.sequences)
    assert [mb.layout.sequences.tolist() for mb in fresh(1).next_step(2, 2)] != \
        [mb.layout.sequences.tolist() for mb in fresh(0).next_step(2, 2)]
    swapped = [type(ex)(ex.prompt, ex.completions, (False, True)) for ex in examples]
    other = build_preference_data(swapped, tok, data_cfg, 256, seed=0)
    assert other.fingerprint() != a.fingerprint()
    with pytest.raises(ValueError, match="the training data differs from the checkpoint's"):
        other.load_state_dict(state)


def test_the_split_is_seeded_and_a_test_source_is_read_as_preference_data(tmp_path):
    data_cfg = cfg("builtin:sample_math_pref", max_samples=100)
    examples = load_preference_examples(data_cfg, "dpo")
    train, test = split_preference_examples(examples, data_cfg, "dpo")
    assert (len(train), len(test)) == (70, 30)
    assert [ex.prompt for ex in split_preference_examples(examples, data_cfg, "dpo")[1]] == [ex.prompt for ex in test]
    held = write_jsonl(tmp_path / "held.jsonl", PAIRS)
    _, test = split_preference_examples(examples, cfg("builtin:sample_math_pref", test_source=str(held)), "dpo")
    assert [ex.prompt for ex in test] == [p["prompt"] for p in PAIRS]


# ---------------------------------------------------------------- the bundled sets
def test_the_bundled_preference_sets_are_made_from_the_math_problems():
    problems = generate_sample_math()
    pairs = sample_math_pref()
    assert len(pairs) == len(problems) and pairs == sample_math_pref()
    for p, q in zip(pairs, problems):
        assert p["prompt"] == q["query"] and p["chosen"] == q["response"]
        working, good = p["chosen"].rsplit("\nThe answer is: ", 1)
        wrong_working, bad = p["rejected"].rsplit("\nThe answer is: ", 1)
        assert 1 <= abs(int(bad) - int(good)) <= 3 and int(bad) > 0
        head, tail = working.rsplit(f"= {good}", 1)  # the working's last result is the wrong answer too
        assert wrong_working == f"{head}= {bad}{tail}"
    kto = sample_math_kto()
    assert sum(r["label"] for r in kto) == len(kto) // 2
    assert all(r["completion"] == (p["chosen"] if r["label"] else p["rejected"]) for r, p in zip(kto, pairs))


# ---------------------------------------------------------------- bad inputs
def problem(tok, tmp_path, records, method="dpo", seq_len=256, blank_after=None, **kw) -> str:
    path = write_jsonl(tmp_path / "bad.jsonl", records, blank_after)
    with pytest.raises(DataError) as err:
        examples = load_preference_examples(cfg(path, **kw), method)
        build_preference_data(examples, tok, cfg(path, **kw), seq_len, seed=0)
    return str(err.value).replace(str(tmp_path) + "/", "")


def test_a_missing_rejected_names_the_line_and_the_field(tok, tmp_path):
    records = [PAIRS[0], {"prompt": "1 + 1?", "chosen": "2"}]
    assert problem(tok, tmp_path, records, blank_after=1) == (
        "bad.jsonl line 3: missing field 'rejected' (format preference: prompt, chosen, rejected; fields present: "
        "prompt, chosen); if it has another name, set data.fields.rejected")


def test_an_empty_completion_is_refused(tok, tmp_path):
    assert problem(tok, tmp_path, [PAIRS[0], {**PAIRS[1], "chosen": "  "}]) == (
        "bad.jsonl line 2: field 'chosen' is empty: there is no completion to score; fill it in or remove the record")
    message = problem(tok, tmp_path, [{"prompt": [{"role": "user", "content": "x"}], "chosen": [],
                                       "rejected": [{"role": "assistant", "content": "y"}]}])
    assert message == ("bad.jsonl line 1: field 'chosen' should hold one assistant message (the reply to the "
                       "prompt), got 0 message(s) with role(s) none")


def test_chosen_equal_to_rejected_is_refused(tok, tmp_path):
    assert problem(tok, tmp_path, [{**PAIRS[0], "rejected": PAIRS[0]["chosen"]}]) == (
        "bad.jsonl line 1: fields 'chosen' and 'rejected' are the same completion: such a pair teaches nothing (its "
        "gradient is zero); fix one of them or remove the record")


def test_a_pair_longer_than_seq_len_names_both_lengths(tok, tmp_path):
    long = {"prompt": "Count.", "chosen": " ".join(["1"] * 40), "rejected": " ".join(["2"] * 30)}
    message = problem(tok, tmp_path, [PAIRS[0], long, long], seq_len=120)
    (ids_c, _), (ids_r, _) = sequences_of(build_preference_data(
        load_preference_examples(cfg(tmp_path / "bad.jsonl"), "dpo")[1:2], tok, cfg(tmp_path / "bad.jsonl"), 4096, 0))
    a, b = len(ids_c), len(ids_r)
    assert a + b > 120 > len(ids_c)
    assert message == (f"bad.jsonl line 2: the pair is {a + b} tokens (chosen {a}, rejected {b}, each with its "
                       f"prompt), more than train.seq_len=120: a pair is scored whole, in one row (1 more too long, "
                       f"the longest {a + b} tokens); raise train.seq_len to {a + b}, or shorten or remove the records")
    kto = problem(tok, tmp_path, [{"prompt": "Count.", "completion": long["chosen"], "label": True}], "kto",
                  seq_len=40)
    assert kto == (f"bad.jsonl line 1: the example is {a} tokens with its prompt, more than train.seq_len=40; raise "
                   f"train.seq_len to {a}, or shorten or remove the record")


def test_supervised_data_with_a_preference_method_and_the_reverse(tok, tmp_path):
    sft = [{"query": "2 + 2?", "response": "The answer is: 4"}]
    assert problem(tok, tmp_path, sft) == (
        "bad.jsonl line 1 (fields query, response): the records are supervised data (format metamathqa), not "
        "preference data; train.method dpo "
        "trains on records {prompt, chosen, rejected} (data.format preference): use a preference data set "
        "(builtin:sample_math_pref is a small one), or train.method sft to fine-tune on this one")
    assert "or {prompt, completion, label} (unpaired_preference)" in problem(tok, tmp_path, sft, "kto")
    with pytest.raises(DataError) as err:
        load_examples(cfg(write_jsonl(tmp_path / "pairs.jsonl", PAIRS)))
    assert str(err.value) == (
        f"{tmp_path}/pairs.jsonl: record 0 has the fields of preference data (chosen, rejected: preference data), not "
        f"prompt / response pairs: it trains with train.method dpo, ipo, simpo, orpo or kto, not with supervised "
        f"fine-tuning (train.method sft)")
    with pytest.raises(DataError, match="it trains with train.method kto, not with supervised"):
        load_examples(cfg("builtin:sample_math_kto"))
    with pytest.raises(DataError, match=r"builtin:sample_math record 0 \(fields .*\): the records are supervised data"):
        load_preference_examples(cfg("builtin:sample_math"), "dpo")


def test_other_bad_records(tok, tmp_path):
    assert problem(tok, tmp_path, [{"prompt": "x", "completion": "y", "label": "yes"}], "kto") == (
        "bad.jsonl line 1: field 'label' should be true (a desirable completion) or false (an undesirable one), "
        "got 'yes'")
    assert "unpaired_preference data (single completions labelled true or false) trains with train.method kto " \
           "only; simpo needs pairs" in problem(tok, tmp_path, [{"prompt": "x", "completion": "y", "label": True}],
                                                "simpo")
    assert problem(tok, tmp_path, [{"chosen": "a", "rejected": "b"}]) == (
        "bad.jsonl line 1: missing field 'prompt' (format preference: prompt, chosen, rejected; fields present: "
        "chosen, rejected); if it has another name, set data.fields.prompt")
    assert "the prompt in 'prompt' should end with the user's message" in problem(
        tok, tmp_path, [{"prompt": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"}])
    assert problem(tok, tmp_path, [{"a": 1}]).startswith("bad.jsonl line 1: cannot tell the preference format from the "
                                                         "fields a (expected preference: prompt, chosen, rejected;")
    fields = problem(tok, tmp_path, [{"q": "x", "good": "a", "bad": "b"}],
                     fields={"prompt": "q", "chosen": "good", "rejected": "bad", "system": "sys"})
    assert fields == "bad.jsonl line 1: missing field 'sys' (data.fields.system)"


def test_recipe_keys_follow_the_method():
    from megatrain_cli.recipe import RecipeError, load_recipe

    root = Path(__file__).resolve().parents[2] / "recipes"
    with pytest.raises(RecipeError) as err:
        load_recipe(root / "tiny.yaml", ["train.method=dpo", "data.format=gsm8k", "preference.simpo_gamma=1",
                                         "preference.beta=-1", "preference.label_smoothing=0.5"])
    assert err.value.problems == [
        "preference.beta: must be > 0, got -1.0",
        "preference.label_smoothing: must be in [0, 0.5) (the probability a label is flipped), got 0.5",
        "preference.simpo_gamma: train.method dpo does not read it (only simpo); remove it",
        "data.format: gsm8k is supervised (prompt / response) data; train.method dpo trains on preference data: "
        "data.format preference (records {prompt, chosen, rejected}), or auto"]
    with pytest.raises(RecipeError) as err:
        load_recipe(root / "tiny.yaml", ["data.format=preference", "preference.desirable_weight=2"])
    assert err.value.problems == [
        "preference.desirable_weight: train.method is sft, which reads no preference setting; set train.method (kto "
        "reads it) or remove preference.desirable_weight",
        "data.format: preference is preference data, which train.method sft (the default) does not read; set "
        "train.method to dpo, ipo, simpo, orpo or kto"]
    r = load_recipe(root / "tiny.yaml", ["train.method=kto", "data.source=builtin:sample_math_kto",
                                         "preference.desirable_weight=1.2"])
    assert (r.train.method, r.preference.desirable_weight, r.preference.reference_cache) == ("kto", 1.2, "auto")


# ---------------------------------------------------------------- the reference's score cache
def test_score_cache_round_trip_key_and_refusals(tmp_path, monkeypatch):
    from megatrain_cli.data.score_cache import ScoreCache, cache_key, default_cache_dir
    from megatrain_cli.methods import SequenceScores

    key = cache_key("data-fp", "tokenizer-fp", "model-fp", "bf16")
    assert key != cache_key("data-fp", "tokenizer-fp", "model-fp", "fp32")
    assert cache_key("ab", "c") != cache_key("a", "bc")
    scores = SequenceScores(torch.randn(6, dtype=torch.float64), torch.arange(1, 7))
    cache = ScoreCache(str(tmp_path / "ref"), key)
    assert cache.load(6) is None and cache.save(scores)
    again = ScoreCache(str(tmp_path / "ref"), key).load(6)
    assert torch.equal(again.logps, scores.logps) and torch.equal(again.tokens, scores.tokens)
    assert ScoreCache(str(tmp_path / "ref"), key).load(7) is None  # other data: not trusted
    assert ScoreCache(str(tmp_path / "ref"), cache_key("other")).load(6) is None
    cache.path.write_bytes(b"damaged")
    assert cache.load(6) is None
    off = ScoreCache("off", key)
    assert off.path is None and not off.save(scores) and off.load(6) is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ScoreCache("auto", key).path == tmp_path / "xdg" / "megatrain" / "reference" / f"{key}.safetensors"
    assert default_cache_dir() == tmp_path / "xdg" / "megatrain" / "reference"
