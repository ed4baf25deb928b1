"""The GSM8K eval protocol: few-shot examples from the train split, chat vs plain prompts, strict vs flexible
answer extraction, and every setting that changes the score written into results.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from megatrain_cli.cli import app
from tests.data.test_data import sample, tok  # noqa: F401 (the same module-scoped fixtures)
from megatrain_cli.data import render_prompt, split_examples
from megatrain_cli.data.answers import extract_answer
from megatrain_cli.eval import protocol
from megatrain_cli.eval import run as run_module
from megatrain_cli.eval.generate import Generation
from megatrain_cli.eval.run import run_eval
from megatrain_cli.models.tokenizer import load_bundled_tokenizer
from megatrain_cli.recipe import DataConfig, RecipeError, load_recipe
from tests.data.test_chat_data import chat_tokenizer
from tests.eval.test_eval import make_model, settings

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_KEYS = {"prompt", "prompt_format", "system_prompt", "num_fewshot", "fewshot_seed", "fewshot_split",
                 "fewshot_as_multiturn", "extract", "extract_markers", "match", "decoding", "max_new_tokens",
                 "stop_strings", "stop_token_ids", "dtype", "data", "split", "limit", "test_fraction", "split_seed"}




@pytest.mark.parametrize("text, strict, flexible", [
    ("She has 4 + 3 = 7 kites.", None, "7"),  # no marker: only flexible guesses the last number
    ("#### 15", "15", "15"),
    ("The answer is 6, which is the count.", "6", "6"),
    ("so it is \\boxed{12} in all", "12", "12"),
    ("The answer is: 5\nbut maybe 6", "5", "5"),  # a marker beats a later bare number in both modes
])
def test_strict_reads_only_marked_answers(text, strict, flexible):
    assert (extract_answer(text, "strict"), extract_answer(text, "flexible")) == (strict, flexible)


def test_fewshot_examples_come_from_the_train_split_seeded_per_question(sample):
    train, test = split_examples(sample, DataConfig())
    shot = protocol.with_fewshot(test[:6], train, 3, seed=1234)
    train_prompts = {ex.prompt for ex in train}
    for ex, orig in zip(shot, test[:6]):
        users = [t["content"] for t in ex.history if t["role"] == "user"]
        assert len(users) == 3 and set(users) <= train_prompts and ex.prompt == orig.prompt
        assert orig.history == []  # copies: the examples read are unchanged
    assert len({tuple(t["content"] for t in ex.history) for ex in shot}) == 6  # each question its own draw
    # Deterministic; a question's examples depend on the seed, not on the questions before it or the limit.
    assert protocol.with_fewshot(test[:6], train, 3, seed=1234) == shot
    assert protocol.with_fewshot(test[:2], train, 3, seed=1234) == shot[:2]
    assert protocol.with_fewshot(test[:6], train, 3, seed=1) != shot
    # Plain: lm-evaluation-harness's blocks; chat: earlier turns after the system prompt.
    tok = load_bundled_tokenizer()
    first = shot[0]
    pairs = [(first.history[i]["content"], first.history[i + 1]["content"]) for i in (0, 2, 4)]
    assert render_prompt(tok, first.prompt, "plain", first.history) == "".join(
        f"Question: {q}\nAnswer: {a}\n\n" for q, a in pairs) + f"Question: {first.prompt}\nAnswer: "
    system = [{"role": "system", "content": "Be brief."}]
    with_system, = protocol.with_fewshot([type(first)(first.prompt, first.response, history=system)], train, 2, 5)
    chatml = chat_tokenizer("chatml")
    text = render_prompt(chatml, with_system.prompt, "chat", with_system.history)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert text.count("<|im_start|>assistant\n") == 3 and text.endswith("<|im_start|>assistant\n")


def fake_generate(answer_for):
    """generate_greedy replaced by a model that writes answer_for(question) for each prompt."""
    def generate(model, tokenizer, prompts, **kw):
        generate.stop_ids = kw["eos_ids"]
        return [Generation(answer_for(tokenizer.decode(p)), 4) for p in prompts], 0.5
    return generate


def test_results_record_the_protocol_and_both_scores(tmp_path, tok, sample, monkeypatch):
    make_model(tok, tmp_path / "model")
    _, test = split_examples(sample, DataConfig())
    golds = {ex.prompt: ex.answer for ex in test}
    # A model that knows every answer but writes no marker: right when read flexibly, unreadable strictly.
    last_question = lambda text: text.rsplit("Question: ", 1)[1].removesuffix("\nAnswer: ")  # noqa: E731
    monkeypatch.setattr(run_module, "generate_greedy", fake_generate(lambda t: f"I get {golds[last_question(t)]}"))
    common = ("eval.limit=4", "eval.max_new_tokens=16", "engine.device=cpu")
    strict = run_eval(settings(*common, "eval.num_fewshot=2", "eval.extract=strict"), str(tmp_path / "model"),
                      output_dir=str(tmp_path / "strict"), log=None)
    assert (strict["accuracy"], strict["scores"], strict["unparseable"]) == (0.0, {"strict": 0.0, "flexible": 1.0}, 4)
    proto = strict["protocol"]
    assert PROTOCOL_KEYS <= set(proto)
    assert (proto["num_fewshot"], proto["fewshot_seed"], proto["extract"], proto["prompt"]) == (2, 1234, "strict",
                                                                                                 "plain")
    assert proto["extract_markers"] == ["The answer is", "####", "\\boxed{}"]
    assert proto["stop_strings"] == ["\nQuestion:"] and proto["stop_token_ids"] == [tok.eos_token_id]
    assert json.loads((tmp_path / "strict" / "results.json").read_text()) == strict
    predictions = [json.loads(line) for line in (tmp_path / "strict" / "predictions.jsonl").read_text().splitlines()]
    assert all(p["prompt"].count("Question: ") == 3 for p in predictions)  # two examples, then the question
    flexible = run_eval(settings(*common, "eval.num_fewshot=2"), str(tmp_path / "model"),
                        output_dir=str(tmp_path / "flexible"), log=None)
    assert (flexible["accuracy"], flexible["protocol"]["extract"]) == (1.0, "flexible")
    assert flexible["protocol"]["extract_markers"][-1] == "the last number"
    with pytest.raises(ValueError, match="the eval split must be test"):
        run_eval(settings("eval.num_fewshot=1"), str(tmp_path / "model"), split="all", output_dir=str(tmp_path),
                 log=None)


def test_chat_prompts_stop_at_the_templates_end_of_turn(tmp_path, monkeypatch):
    chatml = chat_tokenizer("chatml")
    chatml.save_pretrained(tmp_path / "model")
    make_model(chatml, tmp_path / "model")
    generate = fake_generate(lambda t: "The answer is: 1")
    monkeypatch.setattr(run_module, "generate_greedy", generate)
    results = run_eval(settings("eval.limit=2", "engine.device=cpu", "eval.num_fewshot=1", "eval.prompt=auto"),
                       str(tmp_path / "model"), output_dir=str(tmp_path / "out"), log=None)
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    assert results["template"] == results["protocol"]["prompt"] == "chat" and results["protocol"]["fewshot_as_multiturn"]
    assert im_end in generate.stop_ids and results["protocol"]["stop_strings"] == []
    # The same model asked in plain text: another protocol, recorded as such.
    plain = run_eval(settings("eval.limit=2", "engine.device=cpu", "eval.prompt=plain"), str(tmp_path / "model"),
                     output_dir=str(tmp_path / "plain"), log=None)
    assert plain["protocol"]["prompt"] == "plain" and im_end not in generate.stop_ids


def test_recipe_eval_keys_and_cli_options():
    r = load_recipe(ROOT / "recipes" / "tiny.yaml", ["eval.num_fewshot=5", "eval.extract=strict", "eval.prompt=chat",
                                                     "eval.fewshot_seed=7"])
    assert (r.eval.num_fewshot, r.eval.extract, r.eval.prompt, r.eval.fewshot_seed) == (5, "strict", "chat", 7)
    for override, problem in (("eval.num_fewshot=-1", "eval.num_fewshot: must be >= 0"),
                              ("eval.extract=loose", "eval.extract: expected 'strict' | 'flexible'")):
        with pytest.raises(RecipeError) as err:
            load_recipe(ROOT / "recipes" / "tiny.yaml", [override])
        assert any(p.startswith(problem) for p in err.value.problems), err.value.problems
    runner = CliRunner()
    for args, message in ((["eval.num_fewshot=2", "--split", "all"],
                           "eval.num_fewshot: the few-shot examples come from the train split, so the eval split "
                           "must be test (--split test), got 'all'"),
                          (["eval.extract=loose"], "eval.extract: expected 'strict' | 'flexible'"),
                          (["data.source=registry:x"], "set data.registry to the registry file"),
                          (["--num-fewshot", "2"], "--num-fewshot: now a recipe key: eval.num_fewshot=N")):
        result = runner.invoke(app, ["eval", "--model", "preset:tiny", *args])
        assert result.exit_code == 2 and message in result.output, result.output
