"""The bundled offline tokenizer, tokenizer loading from directories, and the bundled sample data."""

from __future__ import annotations

import json
import re

import pytest

from megatrain_cli.data.sample_math import SAMPLE_MATH_PATH, generate_sample_math
from megatrain_cli.models.tokenizer import (BUNDLED_TOKENIZER_PATH, EOS_TOKEN, PAD_TOKEN, load_bundled_tokenizer,
                                            load_tokenizer, sample_texts, train_bundled_tokenizer)
from megatrain_cli.recipe import ModelConfig


@pytest.fixture(scope="module")
def tok():
    return load_bundled_tokenizer()


def test_preset_gets_the_bundled_tokenizer_with_eos_and_pad(tok):
    t = load_tokenizer(ModelConfig(preset="tiny"))
    assert len(t) == len(tok)
    assert 258 <= len(t) <= 1026  # 256 bytes + 2 specials at least, the trained bound at most
    assert t.eos_token == EOS_TOKEN and t.pad_token == PAD_TOKEN
    assert t.eos_token_id is not None and t.pad_token_id is not None and t.eos_token_id != t.pad_token_id


@pytest.mark.parametrize("text", [
    "Tom has 127 apples and -3.5 pears; 1,000,000 is $9.99.",
    "Question: What is 48 / 6?\nAnswer: 48 / 6 = 8.\nThe answer is: 8",
    "  leading spaces, tabs\tand unicode: 日本語 ü ∑ 🙂",
])
def test_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_digits_are_single_tokens(tok):
    ids = tok("1234567890", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids] == list("1234567890")


def test_sample_words_are_whole_tokens(tok):
    # Trained on the sample: its frequent words cost one token, so rows hold many examples.
    ids = tok("Question: How many apples", add_special_tokens=False)["input_ids"]
    assert len(ids) <= 6


def test_shipped_tokenizer_is_what_the_build_produces():
    rebuilt = json.loads(train_bundled_tokenizer(sample_texts()).to_str())
    shipped = json.loads(BUNDLED_TOKENIZER_PATH.read_text())
    assert rebuilt["model"]["vocab"] == shipped["model"]["vocab"]
    assert rebuilt["model"]["merges"] == shipped["model"]["merges"]


def test_directory_tokenizer_round_trips_through_save(tmp_path, tok):
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(ModelConfig(path=str(tmp_path)))
    text = "Sam has 12 cards."
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.eos_token_id == tok.eos_token_id and loaded.pad_token_id == tok.pad_token_id


def test_tokenizer_key_overrides_model_path(tmp_path, tok):
    tok.save_pretrained(tmp_path / "tk")
    (tmp_path / "model").mkdir()  # no tokenizer files here
    loaded = load_tokenizer(ModelConfig(path=str(tmp_path / "model"), tokenizer=str(tmp_path / "tk")))
    assert len(loaded) == len(tok)


def test_missing_tokenizer_paths_are_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        load_tokenizer(ModelConfig(path=str(missing)))
    with pytest.raises(ValueError, match=f"no tokenizer in {re.escape(str(tmp_path))}"):
        load_tokenizer(ModelConfig(path=str(tmp_path)))


# ---------------------------------------------------------------- the bundled sample
def test_shipped_sample_is_what_the_generator_produces():
    from megatrain_cli.data.sources import BUILTIN_SOURCES

    assert BUILTIN_SOURCES["sample_math"] == SAMPLE_MATH_PATH
    lines = SAMPLE_MATH_PATH.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == generate_sample_math()
    assert 1000 <= len(lines) <= 3000
    assert SAMPLE_MATH_PATH.stat().st_size < 1_000_000


def test_sample_answers_agree_with_their_worked_line():
    records = generate_sample_math()
    assert len({r["query"] for r in records}) == len(records)
    for r in records:
        worked, answer_line = r["response"].rsplit("\n", 1)
        answer = re.fullmatch(r"The answer is: (\d+)", answer_line).group(1)
        # Every worked line ends its last equation with the answer.
        assert re.findall(r"= (\d+)", worked)[-1] == answer, r
        assert 0 <= int(answer) <= 200  # small: learnable by a tiny model


def test_sample_generation_depends_on_the_seed():
    assert generate_sample_math(50, seed=1) == generate_sample_math(50, seed=1)
    assert generate_sample_math(50, seed=1) != generate_sample_math(50, seed=2)
