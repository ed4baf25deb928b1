"""Exact-match eval: extraction, scoring, generation details, and `run_eval` end to end on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatrain_cli.data import DataError, load_examples, split_examples
from megatrain_cli.eval import run as run_module
from megatrain_cli.data.answers import answers_match, extract_answer, normalize_number
from megatrain_cli.eval.generate import Generation, StopOnStrings, _finish, generate_greedy
from megatrain_cli.eval.run import run_eval
from megatrain_cli.eval.settings import eval_recipe
from megatrain_cli.models.tokenizer import load_bundled_tokenizer
from megatrain_cli.recipe import DataConfig, Recipe

FIXTURES = Path(__file__).parents[1] / "fixtures" / "data"
RESULT_KEYS = {"accuracy", "correct", "total", "unparseable", "generated_tokens", "tokens_per_s", "generation_s",
               "model_path", "data_source", "split", "limit", "template", "device", "dtype", "scores", "protocol"}
PREDICTION_KEYS = {"prompt", "output", "extracted", "gold", "correct"}


# ---------------------------------------------------------------- extraction and scoring
@pytest.mark.parametrize("text, answer", [
    ("3 + 4 = 7.\nThe answer is: 7", "7"),
    ("The answer is: -12", "-12"),
    ("The answer is 1,234.", "1,234"),
    ("So it costs $5.\nThe answer is: $5.50", "$5.50"),
    ("The answer is: 8 apples", "8"),
    ("The answer is: \\frac{3}{4}", "\\frac{3}{4}"),
    ("The answer is: 5\\sqrt{2}", "5\\sqrt{2}"),
    ("first the answer is: 1, then\nThe answer is: 2", "2"),
    ("She bakes <<3*8=24>>24.\n#### 24", "24"),
    ("#### -3.5", "-3.5"),
    ("so we get \\boxed{\\frac{1}{2}} in the end", "\\frac{1}{2}"),
    ("he had 3 then 10 and finally 2.5 cups", "2.5"),
    ("a loss of -$40 overall", "-$40"),
    ("one half is 1/2", "1/2"),
    ("no number at all", None),
    ("The answer is:", None),
    ("", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-7", -7.0), ("1,234,567", 1234567.0), ("$1,234.50", 1234.5), ("3.", 3.0),
    (" 0.25 ", 0.25), ("1/4", 0.25), ("-3/4", -0.75), ("\\frac{1}{2}", 0.5), ("-\\dfrac{3}{2}", -1.5),
    ("50%", 50.0), ("\\$12", 12.0), (".5", 0.5),
    ("1,2", None), ("abc", None), ("nan", None), ("inf", None), ("1/0", None), ("", None), (None, None),
])
def test_normalize_number(text, value):
    assert normalize_number(text) == value


@pytest.mark.parametrize("pred, gold, same", [
    ("1,000", "1000", True), ("$5.00", "5", True), ("0.5", "\\frac{1}{2}", True), ("-3", "-3.0", True),
    ("7.0000001", "7", True), ("7.01", "7", False), ("-3", "3", False), ("2/3", "0.6666667", True),
    ("(1, 2)", "(1,2)", True), ("\\text{Monday}", "monday", True), ("5\\sqrt{2}", "5\\sqrt{3}", False),
    (None, "4", False), ("4", None, False),
])
def test_answers_match(pred, gold, same):
    assert answers_match(pred, gold) is same


# ---------------------------------------------------------------- generation pieces
@pytest.fixture(scope="module")
def tok():
    return load_bundled_tokenizer()


def test_finish_cuts_at_eos_and_ignores_padding(tok):
    body = tok("The answer is: 12", add_special_tokens=False)["input_ids"]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    got = _finish(tok, body + [eos, pad, pad], [eos], pad, [])
    assert got == Generation("The answer is: 12", len(body) + 1)
    # Stopped by a stop string: the text is cut there, the trailing pads are not counted.
    tail = tok("\nQuestion: next", add_special_tokens=False)["input_ids"]
    got = _finish(tok, body + tail + [pad, pad], [eos], pad, ["\nQuestion:"])
    assert got == Generation("The answer is: 12", len(body) + len(tail))


def test_stop_on_strings_marks_only_rows_that_hit_one(tok):
    prompt = tok("Question: hi\nAnswer: ", add_special_tokens=False)["input_ids"]
    done = tok("7\nQuestion:", add_special_tokens=False)["input_ids"]
    going = tok("7 and some", add_special_tokens=False)["input_ids"]
    width = max(len(done), len(going))
    rows = [prompt + done + [tok.pad_token_id] * (width - len(done)), prompt + going + [0] * (width - len(going))]
    # Stop strings only count in the new text: the prompt itself contains 'Question:'.
    crit = StopOnStrings(tok, ["\nQuestion:"], len(prompt))
    assert crit(torch.tensor(rows)).tolist() == [True, False]


def make_model(tok, path: Path | None = None, init_range: float = 0.02):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=64, vocab_size=len(tok),
                                  max_position_embeddings=512, tie_word_embeddings=True, initializer_range=init_range)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if path is not None:
        model.save_pretrained(path)
    return model


def test_left_padded_batches_generate_what_single_prompts_do(tok):
    # Large init so the output depends on the prompt (the default 0.02 repeats one token).
    model = make_model(tok, init_range=0.3)
    texts = ["Question: What is 2 + 2?\nAnswer: ", "Question: Lucy has 13 coins and Emma has 6. How many?\nAnswer: ",
             "Question: 7\nAnswer: "]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    kw = dict(eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, stop=[], max_new_tokens=6)
    batched, _ = generate_greedy(model, tok, prompts, batch_size=3, **kw)
    singles = [generate_greedy(model, tok, [p], batch_size=1, **kw)[0][0] for p in prompts]
    assert batched == singles
    assert len({g.text for g in singles}) == 3


# ---------------------------------------------------------------- run_eval end to end
def settings(*overrides: str) -> Recipe:
    """What `megatrain eval key=value ...` runs with: no recipe file (the schema's defaults), then `overrides`."""
    return eval_recipe(list(overrides))


def read_outputs(out: Path) -> tuple[dict, list[dict]]:
    results = json.loads((out / "results.json").read_text())
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    return results, predictions


# The 17 options `megatrain eval` had before it took the recipe (issue 29).
OLD_OPTIONS = ["--model", "--data", "--split", "--limit", "--batch-size", "--max-new-tokens", "--mode", "--output-dir",
               "--device", "--prompt", "--num-fewshot", "--fewshot-seed", "--extract", "--test-data", "--registry",
               "--system-prompt", "--debug"]


def test_eval_takes_the_recipe_schema():
    """No RECIPE: the schema's defaults, one per key (eval.limit 64, as the trainer's eval; null: every
    example), without the model and run length only training needs; the values checked by load_recipe.
    `eval --help` lists the recipe keys, and every old option is a measurement flag or names its key."""
    from typer.testing import CliRunner

    from megatrain_cli.cli import app
    from megatrain_cli.eval.settings import MOVED_FLAGS
    from megatrain_cli.recipe import EvalConfig, RecipeError

    r = eval_recipe([])
    assert (r.data, r.eval, r.engine) == (Recipe().data, Recipe().eval, Recipe().engine)
    assert r.eval.limit == EvalConfig().limit == 64 and r.data.source == "builtin:sample_math"
    assert eval_recipe(["eval.limit=null"]).eval.limit is None
    for override, problem in (("eval.prompt=fancy", "eval.prompt: expected 'auto' | 'chat' | 'plain', got 'fancy'"),
                              ("eval.limit=0", "eval.limit: must be >= 1 or null, got 0")):
        with pytest.raises(RecipeError) as err:
            eval_recipe([override])
        assert err.value.problems == [problem]
    result = CliRunner().invoke(app, ["eval", "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for key in ("eval.limit (int | null, default 64)", "eval.batch_size", "eval.num_fewshot", "data.source",
                "data.test_source", "engine.device", "train.lr"):
        assert key in text, key
    flags = [f for f in OLD_OPTIONS if f not in MOVED_FLAGS]
    assert flags == ["--model", "--split", "--mode", "--output-dir", "--debug"]
    assert all(f in text for f in flags) and all(f"{f} -> {MOVED_FLAGS[f][1].split()[0]}" in text for f in MOVED_FLAGS)
    assert sorted(MOVED_FLAGS) == sorted(set(OLD_OPTIONS) - set(flags))


def test_run_eval_end_to_end_with_bundled_tokenizer(tmp_path, tok):
    make_model(tok, tmp_path / "model")  # no tokenizer files: eval falls back to the bundled one
    returned = run_eval(settings("eval.limit=5", "eval.batch_size=2", "eval.max_new_tokens=8", "engine.device=cpu"),
                        str(tmp_path / "model"), output_dir=str(tmp_path / "out"), log=None)
    results, predictions = read_outputs(tmp_path / "out")
    assert results == returned
    assert RESULT_KEYS <= set(results)
    assert (results["total"], results["split"], results["template"], results["device"]) == (5, "test", "plain", "cpu")
    assert len(predictions) == 5 and all(set(p) == PREDICTION_KEYS for p in predictions)
    assert results["correct"] == sum(p["correct"] for p in predictions)
    assert results["unparseable"] == sum(p["extracted"] is None for p in predictions)
    assert results["accuracy"] == results["correct"] / 5
    assert 0 < results["generated_tokens"] <= 5 * 8
    # The golds are the first five of the trainer's held-out split, in order.
    data = DataConfig()
    _, test = split_examples(load_examples(data), data)
    assert [p["gold"] for p in predictions] == [e.answer for e in test[:5]]
    assert predictions[0]["prompt"] == f"Question: {test[0].prompt}\nAnswer: "


def test_run_eval_splits_and_scoring(tmp_path, tok, monkeypatch):
    tok.save_pretrained(tmp_path / "model")
    make_model(tok, tmp_path / "model")
    source = str(FIXTURES / "metamath.jsonl")
    golds = {e.prompt: e.answer for e in load_examples(DataConfig(source=source))}

    # A model that always answers right: checks that extraction and scoring are wired to the golds.
    def perfect(model, tokenizer, prompts, **kw):
        texts = [tokenizer.decode(p) for p in prompts]
        answers = [golds[t.removeprefix("Question: ").removesuffix("\nAnswer: ")] for t in texts]
        return [Generation(f"Easy.\nThe answer is: {a}", 3) for a in answers], 0.5

    monkeypatch.setattr(run_module, "generate_greedy", perfect)
    counts = {}
    for split in ("test", "train", "all"):
        results = run_eval(settings(f"data.source={source}", "engine.device=cpu"), str(tmp_path / "model"),
                           split=split, output_dir=str(tmp_path / split), log=None)
        counts[split] = results["total"]
        assert results["accuracy"] == 1.0 and results["unparseable"] == 0
        assert results["tokens_per_s"] == 3 * results["total"] / 0.5
    assert counts == {"test": 2, "train": 4, "all": 6}


def test_run_eval_refuses_data_without_gold_answers(tmp_path, tok):
    make_model(tok, tmp_path / "model")
    with pytest.raises(DataError, match="no gold answer"):
        run_eval(settings(f"data.source={FIXTURES / 'no_gold.jsonl'}"), str(tmp_path / "model"), split="all",
                 output_dir=str(tmp_path), log=None)
    with pytest.raises(ValueError, match="split"):
        run_eval(settings(), str(tmp_path / "model"), split="dev", log=None)
    assert not (tmp_path / "results.json").exists()
