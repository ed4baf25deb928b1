"""The data path: sources, formats, errors, the seeded split, prompts, tokenisation, packing, resume."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from megatrain_cli.data import (DataError, Example, build_train_data, encode_prompt, load_examples, render_prompt,
                                split_examples)
from megatrain_cli.data import tokenize as tokenize_module
from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.models.tokenizer import load_bundled_tokenizer
from megatrain_cli.recipe import DataConfig

FIXTURES = Path(__file__).parents[1] / "fixtures" / "data"


def cfg(source, **kw) -> DataConfig:
    return DataConfig(source=str(source), **kw)


@pytest.fixture(scope="module")
def tok():
    return load_bundled_tokenizer()


@pytest.fixture(scope="module")
def sample():
    return load_examples(DataConfig())


def expected_ids(tok, ex: Example, template="auto") -> tuple[list[int], list[int]]:
    """What one example must become: prompt ids, then response ids + eos."""
    prompt = encode_prompt(tok, render_prompt(tok, ex.prompt, template, ex.history))
    return prompt, tok(ex.response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


# ---------------------------------------------------------------- formats
def test_metamathqa_jsonl():
    exs = load_examples(cfg(FIXTURES / "metamath.jsonl"))
    assert len(exs) == 6  # the blank line is skipped
    assert exs[0] == Example("Ivy has 4 kites and gets 3 more. How many kites does she have?",
                             "She has 4 + 3 = 7 kites.\nThe answer is: 7", "7")
    assert [e.answer for e in exs] == ["7", "850", "-3", "\\frac{1}{4}", "$5.00", "30"]


def test_gsm8k_json_reads_the_hash_answer():
    exs = load_examples(cfg(FIXTURES / "gsm8k.json"))
    assert [e.answer for e in exs] == ["24", "27", "5,000"]
    assert exs[0].prompt.startswith("Nora bakes") and exs[0].response.endswith("#### 24")


def test_alpaca_joins_instruction_and_input_and_reads_splits():
    train = load_examples(cfg(FIXTURES / "alpaca_splits.json"))
    assert [e.prompt for e in train] == ["Add the numbers.\n\n2 and 9", "What is 5 times 5?"]
    assert [e.answer for e in train] == ["11", "25"]
    test = load_examples(cfg(FIXTURES / "alpaca_splits.json", split="test"))
    assert [(e.prompt, e.answer) for e in test] == [("Subtract 4 from 10.", "6")]


def test_messages_keep_history_and_sharegpt_names():
    exs = load_examples(cfg(FIXTURES / "messages.jsonl"))
    assert [(e.prompt, e.response, e.answer) for e in exs] == [
        ("What is 3 + 4?", "3 + 4 = 7. The answer is: 7", "7"),
        ("And 2 + 3?", "The answer is: 5", "5"),
        ("What is 9 - 1?", "The answer is: 8", "8")]
    assert exs[0].history == [{"role": "system", "content": "You solve sums."}]
    assert [t["role"] for t in exs[1].history] == ["user", "assistant"]


def test_field_overrides_and_gold_field():
    exs = load_examples(cfg(FIXTURES / "custom_fields.jsonl",
                            fields={"query": "problem", "response": "solution", "gold": "final"}))
    assert [e.prompt[:8] for e in exs] == ["Sam has ", "Each box"]
    # The gold field wins over the response's last number ('about 40').
    assert [e.answer for e in exs] == ["6", "42"]
    with pytest.raises(DataError, match="cannot tell the format"):
        load_examples(cfg(FIXTURES / "custom_fields.jsonl"))


def test_parquet_and_max_samples(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    exs = load_examples(cfg(tmp_path / "d.parquet", max_samples=3))
    assert [e.answer for e in exs] == ["1", "2", "3"]


def test_saved_datasets_directory_and_missing_split(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = {"query": ["What is 1 + 2?", "What is 2 + 5?"], "response": ["The answer is: 3", "The answer is: 7"]}
    DatasetDict({"train": Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "saved"))
    exs = load_examples(cfg(tmp_path / "saved"))
    assert [e.answer for e in exs] == ["3", "7"]
    with pytest.raises(DataError, match=r"no split 'validation' \(available: train\)") as err:
        load_examples(cfg(tmp_path / "saved", split="validation"))
    assert str(tmp_path / "saved") in str(err.value)


# ---------------------------------------------------------------- errors name the file and the field
def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nowhere.jsonl"
    with pytest.raises(DataError, match=f"not found: {re.escape(str(path))}"):
        load_examples(cfg(path))


def test_missing_field_names_file_record_and_field():
    with pytest.raises(DataError) as err:
        load_examples(cfg(FIXTURES / "missing_field.jsonl"))
    msg = str(err.value)
    assert "missing_field.jsonl: record 1" in msg and "'response'" in msg and "reply" in msg


def test_explicit_format_missing_its_field():
    with pytest.raises(DataError, match=r"gsm8k\.json: record 0: missing field 'query'"):
        load_examples(cfg(FIXTURES / "gsm8k.json", format="metamathqa"))


def test_empty_broken_and_split_errors():
    with pytest.raises(DataError, match=r"empty\.jsonl: no records"):
        load_examples(cfg(FIXTURES / "empty.jsonl"))
    with pytest.raises(DataError, match=r"broken\.jsonl line 2: not valid JSON"):
        load_examples(cfg(FIXTURES / "broken.jsonl"))
    with pytest.raises(DataError, match=r"alpaca_splits\.json: no split 'dev' \(available: train, test\)"):
        load_examples(cfg(FIXTURES / "alpaca_splits.json", split="dev"))
    with pytest.raises(DataError, match=r"metamath\.jsonl: a single file has no split 'test'"):
        load_examples(cfg(FIXTURES / "metamath.jsonl", split="test"))
    with pytest.raises(DataError, match="unknown key.*'answr'"):
        load_examples(cfg(FIXTURES / "metamath.jsonl", fields={"answr": "x"}))
    with pytest.raises(DataError, match="builtin:sample_math"):
        load_examples(cfg("builtin:nope"))


# ---------------------------------------------------------------- split
def test_split_is_seeded_disjoint_and_complete(sample):
    train, test = split_examples(sample, DataConfig())
    assert (len(train), len(test)) == (1400, 600)
    again = split_examples(sample, DataConfig())
    assert (train, test) == again
    prompts_train, prompts_test = {e.prompt for e in train}, {e.prompt for e in test}
    assert not prompts_train & prompts_test
    assert prompts_train | prompts_test == {e.prompt for e in sample}
    other_train, other_test = split_examples(sample, DataConfig(split_seed=7))
    assert {e.prompt for e in other_test} != prompts_test
    assert len(split_examples(sample, DataConfig(test_fraction=0.1))[1]) == 200


def test_split_small_sets_keep_both_sides_and_zero_fraction():
    exs = [Example(f"p{i}", f"r{i}") for i in range(3)]
    train, test = split_examples(exs, DataConfig(test_fraction=0.05))
    assert (len(train), len(test)) == (2, 1)
    assert split_examples(exs, DataConfig(test_fraction=0.0)) == (exs, [])


def test_explicit_test_source():
    data = cfg(FIXTURES / "metamath.jsonl", test_source=str(FIXTURES / "gsm8k.json"))
    train, test = split_examples(load_examples(data), data)
    assert len(train) == 6 and [e.answer for e in test] == ["24", "27", "5,000"]


# ---------------------------------------------------------------- prompts
def test_plain_and_chat_templates(tok):
    assert render_prompt(tok, "What is 2 + 2?", "auto") == "Question: What is 2 + 2?\nAnswer: "
    chatty = load_bundled_tokenizer()
    chatty.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert render_prompt(chatty, "hi", "auto") == "<user>hi\n<assistant>"
    system = [{"role": "system", "content": "s"}]
    assert render_prompt(chatty, "hi", "chat", system) == "<system>s\n<user>hi\n<assistant>"
    assert render_prompt(chatty, "hi", "plain") == "Question: hi\nAnswer: "
    # Asking for the chat template of a tokenizer without one is refused, naming the key and the tokenizer.
    with pytest.raises(DataError, match=r"data.template=chat needs the tokenizer's chat template, and the bundled "
                                        r"tokenizer .* has none.*data.template=plain"):
        render_prompt(tok, "hi", "chat")


def bos_tokenizer():
    """The bundled tokenizer plus a BOS that it prepends by default, as Llama-style tokenizers do."""
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from megatrain_cli.models.tokenizer import BUNDLED_TOKENIZER_PATH

    inner = Tokenizer.from_file(str(BUNDLED_TOKENIZER_PATH))
    inner.add_special_tokens([AddedToken("<s>", special=True)])
    inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", inner.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>")


def test_prompts_get_one_bos_whether_or_not_the_template_writes_it(tok):
    btok = bos_tokenizer()
    bos, body = btok.bos_token_id, tok("Question: hi", add_special_tokens=False)["input_ids"]
    assert encode_prompt(btok, "Question: hi") == [bos, *body]
    assert encode_prompt(btok, "<s>Question: hi") == [bos, *body]  # a chat template wrote it: not twice
    assert encode_prompt(tok, "Question: hi") == body  # no BOS in the bundled tokenizer
    data = build_train_data([Example("hi", "The answer is: 1")], btok, DataConfig(), seq_len=32, seed=0)
    ids, labels, _ = data.build_row(0)
    assert ids[0] == bos and (ids == bos).sum() == 1 and labels[0] == IGNORE_INDEX


# ---------------------------------------------------------------- training rows
def test_unpacked_rows_label_only_the_response(tok):
    exs = load_examples(cfg(FIXTURES / "metamath.jsonl"))
    data = build_train_data(exs, tok, cfg(FIXTURES / "metamath.jsonl", packing=False), seq_len=96, seed=0)
    assert data.num_rows == 6 and data.truncated == 0
    total_loss = 0
    for row, ex in enumerate(exs):
        ids, labels, pos = data.build_row(row)
        prompt, response = expected_ids(tok, ex)
        n_p, n = len(prompt), len(prompt) + len(response)
        assert ids[:n].tolist() == prompt + response
        assert (labels[:n_p] == IGNORE_INDEX).all() and (labels[n:] == IGNORE_INDEX).all()
        assert labels[n_p:n].tolist() == response and response[-1] == tok.eos_token_id
        assert (ids[n:] == tok.pad_token_id).all()
        assert pos.tolist() == list(range(96))  # one document: no reset, so no mask needed
        total_loss += len(response)
    assert data.loss_tokens == total_loss


def segments(data) -> list[list[int]]:
    """Every example's tokens as found in the rows, split where positions restart."""
    found = []
    for r in range(data.num_rows):
        ids, labels, pos = data.build_row(r)
        starts = (pos == 0).nonzero().flatten().tolist()
        n_real = sum(len(data.tokens[data.offsets[e]:data.offsets[e + 1]]) for e in data.rows[r])
        assert (ids[n_real:] == data.pad_token_id).all() and (labels[n_real:] == IGNORE_INDEX).all()
        for a, b in zip(starts, starts[1:] + [n_real]):
            found.append(ids[a:b].tolist())
    return found


def test_packing_resets_positions_and_keeps_every_example(tok, sample):
    exs = sample[:200]
    data = build_train_data(exs, tok, DataConfig(), seq_len=256, seed=0)
    assert data.num_rows < len(exs) / 3  # several examples per row
    assert data.stats()["fill"] > 0.85
    want = collections.Counter(tuple(p + r) for p, r in (expected_ids(tok, e) for e in exs))
    assert collections.Counter(map(tuple, segments(data))) == want
    assert data.real_tokens == sum(len(s) for s in segments(data))
    for r in range(data.num_rows):
        ids, labels, pos = data.build_row(r)
        assert ids.shape == (256,)
        # Each example restarts at 0 and counts up; labels are -100 on its prompt only.
        at = 0
        for e in data.rows[r]:
            prompt, response = expected_ids(tok, exs[e])
            n = len(prompt) + len(response)
            assert pos[at:at + n].tolist() == list(range(n))
            assert (labels[at:at + len(prompt)] == IGNORE_INDEX).all()
            assert labels[at + len(prompt):at + n].tolist() == response
            at += n


def test_truncation_and_dropping_are_counted(tok):
    long_response = Example("What is 1 + 1?", "One and one make two. " * 30 + "The answer is: 2", "2")
    long_prompt = Example("word " * 200, "The answer is: 3", "3")
    short = Example("What is 2 + 2?", "The answer is: 4", "4")
    data = build_train_data([long_response, long_prompt, short], tok, DataConfig(), seq_len=48, seed=0)
    assert (data.truncated, data.dropped, data.num_examples) == (1, 1, 2)
    kept = [s for s in segments(data)]
    assert max(map(len, kept)) == 48
    assert tuple(sum(expected_ids(tok, short), [])) in {tuple(s) for s in kept}
    with pytest.raises(DataError, match="raise train.seq_len"):
        build_train_data([long_prompt], tok, DataConfig(), seq_len=48, seed=0)


def test_next_step_shapes_and_epochs_visit_every_row_once(tok, sample):
    data = build_train_data(sample[:120], tok, DataConfig(), seq_len=128, seed=3)
    step = data.next_step(micro_batch_size=2, grad_accum=3)
    assert len(step) == 3
    for mb in step:
        for t in (mb.input_ids, mb.labels, mb.position_ids):
            assert t.shape == (2, 128) and t.dtype == torch.int64
    data.load_state_dict({**data.state_dict(), "epoch": 0, "cursor": 0})
    rows = {r: tuple(data.build_row(r)[0].tolist()) for r in range(data.num_rows)}
    epochs = []
    for _ in range(2):
        seen = [tuple(data.next_step(1, 1)[0].input_ids[0].tolist()) for _ in range(data.num_rows)]
        assert sorted(seen) == sorted(rows.values())
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    assert data.state_dict()["epoch"] == 2
    assert data.steps_per_epoch(4, 2) == -(-data.num_rows // 8)


def test_resume_gives_identical_batches(tok, sample):
    data_cfg = DataConfig()
    first = build_train_data(sample[:150], tok, data_cfg, seq_len=128, seed=11)
    for _ in range(first.steps_per_epoch(2, 2) - 1):  # stop just before an epoch boundary
        first.next_step(2, 2)
    state = json.loads(json.dumps(first.state_dict()))
    expected = [first.next_step(2, 2) for _ in range(4)]
    resumed = build_train_data(sample[:150], tok, data_cfg, seq_len=128, seed=11)
    resumed.load_state_dict(state)
    got = [resumed.next_step(2, 2) for _ in range(4)]
    for step_a, step_b in zip(expected, got):
        for a, b in zip(step_a, step_b):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
            assert torch.equal(a.position_ids, b.position_ids)
    changed = build_train_data(sample[:149], tok, data_cfg, seq_len=128, seed=11)
    with pytest.raises(ValueError, match="differs from the checkpoint"):
        changed.load_state_dict(state)


def test_seed_changes_the_order(tok, sample):
    a = build_train_data(sample[:150], tok, DataConfig(), seq_len=128, seed=1)
    b = build_train_data(sample[:150], tok, DataConfig(), seq_len=128, seed=2)
    assert a.fingerprint() == b.fingerprint()  # same rows...
    order_a = [a.next_step(1, 1)[0].input_ids for _ in range(5)]
    order_b = [b.next_step(1, 1)[0].input_ids for _ in range(5)]
    assert not all(torch.equal(x, y) for x, y in zip(order_a, order_b))  # ...visited in another order


def tokenize_all(examples, tok, num_proc: int) -> tuple[list, list]:
    """(ids, loss mask) of every example, in order."""
    ids, masks = [], []
    for i, m in tokenize_module.iter_tokenized(examples, tok, "auto", "all_assistant", num_proc):
        ids += i
        masks += m
    return ids, masks


def test_parallel_tokenisation_matches_in_process(tok, sample, monkeypatch):
    exs = sample[:64]
    plain = tokenize_all(exs, tok, num_proc=1)
    monkeypatch.setattr(tokenize_module, "PARALLEL_MIN_EXAMPLES", 0)
    calls = []
    real = tokenize_module._map_with_datasets
    monkeypatch.setattr(tokenize_module, "_map_with_datasets",
                        lambda *a: calls.append(a[2]) or real(*a))
    parallel = tokenize_all(exs, tok, num_proc=2)
    assert calls == [2]  # the datasets.map path ran, with two processes
    assert parallel == plain


def test_works_without_the_datasets_package(tok, sample, monkeypatch, tmp_path):
    # The GPU machine has no `datasets`: files, builtins and tokenisation must not need it.
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    monkeypatch.setattr(tokenize_module, "PARALLEL_MIN_EXAMPLES", 0)
    assert len(load_examples(DataConfig())) == 2000
    data = build_train_data(sample[:40], tok, DataConfig(num_proc=2), seq_len=128, seed=0)
    assert data.num_examples == 40
    (tmp_path / "state.json").write_text("{}")  # looks like a saved data set
    with pytest.raises(DataError, match="needs the `datasets` package"):
        load_examples(cfg(tmp_path))


def test_tokenisation_is_cached_on_disk_and_keyed_by_data_tokenizer_and_template(tok, sample, tmp_path,
                                                                                  monkeypatch):
    from megatrain_cli.data import token_cache

    exs = sample[:50]
    first = build_train_data(exs, tok, DataConfig(cache_dir=str(tmp_path)), seq_len=128, seed=0)
    entries = list(tmp_path.glob("*.safetensors"))
    assert len(entries) == 1

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenised again despite a cache entry")

    monkeypatch.setattr(tokenize_module, "tokenize_batch", no_tokenizing)
    again = build_train_data(exs, tok, DataConfig(cache_dir=str(tmp_path)), seq_len=128, seed=0)
    assert torch.equal(again.tokens, first.tokens) and torch.equal(again.offsets, first.offsets)
    # The same entry serves another seq_len (it holds untruncated ids).
    shorter = build_train_data(exs, tok, DataConfig(cache_dir=str(tmp_path)), seq_len=64, seed=0)
    assert shorter.num_examples <= first.num_examples
    # Other data, another template, another train_on, a system prompt: other keys, so these must tokenise
    # (and fail here).
    assert token_cache.cache_key(exs, tok, "auto", "all_assistant") == entries[0].stem
    system = [dataclasses.replace(e, history=[{"role": "system", "content": "Be brief."}]) for e in exs]
    for other_exs, template, train_on in ((exs[:49], "auto", "all_assistant"), (exs, "plain", "all_assistant"),
                                          (exs, "auto", "last_assistant"), (system, "auto", "all_assistant")):
        assert token_cache.cache_key(other_exs, tok, template, train_on) != entries[0].stem
        with pytest.raises(AssertionError, match="tokenised again"):
            build_train_data(other_exs, tok, DataConfig(cache_dir=str(tmp_path), template=template,
                                                        train_on=train_on), seq_len=128, seed=0)
    monkeypatch.undo()
    # A damaged entry is rebuilt, never trusted.
    entries[0].write_bytes(b"not a safetensors file")
    rebuilt = build_train_data(exs, tok, DataConfig(cache_dir=str(tmp_path)), seq_len=128, seed=0)
    assert torch.equal(rebuilt.tokens, first.tokens)
    # 'off' writes nothing; 'auto' writes under the user's cache directory, megatrain/tokenized.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "env"))
    build_train_data(exs, tok, DataConfig(cache_dir="off"), seq_len=128, seed=0)
    assert not (tmp_path / "env").exists()
    build_train_data(exs, tok, DataConfig(cache_dir="auto"), seq_len=128, seed=0)
    assert len(list((tmp_path / "env" / "megatrain" / "tokenized").glob("*.safetensors"))) == 1
