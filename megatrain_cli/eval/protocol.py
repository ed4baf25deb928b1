"""The eval protocol: what decides a score besides the model, applied the same way every time and written
into results.json, so two scores can be compared (ours with ours, ours with lm-evaluation-harness's).

The settings (EvalConfig: prompt, num_fewshot, fewshot_seed, extract) mirror the standard GSM8K ones:
- few-shot: `num_fewshot` solved problems before each question, drawn from the train split (the other
  side of the trainer's seeded split, or the whole source when data.test_source holds the test set) by a
  generator seeded with (fewshot_seed, the question's index), so a question's examples do not depend on
  `limit` or on the questions before it (lm-evaluation-harness draws them per question too, from one
  generator seeded 1234). Plain prompts put them as 'Question: ... Answer: ...' blocks, chat prompts as
  earlier user / assistant turns (the harness's --fewshot_as_multiturn);
- prompt: the chat template or the plain 'Question: ... Answer: ' text (the harness's plain GSM8K prompt
  ends in 'Answer:' without the space, and its few-shot answers are the full '#### N' solutions);
- extract: 'strict' reads only a marked answer, 'flexible' also the last number (the harness's
  strict-match reads only '#### N', its flexible-extract the last number). Both scores are reported.
Costs nothing measurable: one sample per question, one extra extraction pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

from megatrain_cli.data.answers import EXTRACT_MODES, TOLERANCE, answers_match, extract_answer
from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.data.prompts import PLAIN_TEMPLATE
from megatrain_cli.recipe import DataConfig, EvalConfig

MARKERS = ["The answer is", "####", "\\boxed{}"]


def template(eval_cfg: EvalConfig, data_cfg: DataConfig) -> str:
    """The prompt template: the eval's own choice, or the data's ('auto': what training used)."""
    return data_cfg.template if eval_cfg.prompt == "auto" else eval_cfg.prompt


def with_fewshot(examples: list[Example], pool: list[Example], k: int, seed: int) -> list[Example]:
    """Each example with `k` solved examples of `pool` as earlier turns (after its system prompt, if any)."""
    if k == 0:
        return examples
    if len(pool) < k + 1:
        raise DataError(f"num_fewshot={k}: the train split has only {len(pool)} examples to draw from")
    shot = []
    for i, ex in enumerate(examples):
        rng = random.Random(f"megatrain-fewshot:{seed}:{i}")
        drawn = [s for s in rng.sample(pool, k + 1) if s.prompt != ex.prompt][:k]  # never the question itself
        turns = [t for s in drawn for t in ({"role": "user", "content": s.prompt},
                                            {"role": "assistant", "content": s.response})]
        system = [t for t in ex.history if t["role"] == "system"]
        rest = [t for t in ex.history if t["role"] != "system"]
        shot.append(dataclasses.replace(ex, history=[*system, *turns, *rest]))
    return shot


def score(outputs: list[str], golds: list[str | None]) -> dict[str, list[tuple[str | None, bool]]]:
    """(extracted answer, correct) of every output, under each extraction mode."""
    return {mode: [(got, answers_match(got, gold)) for got, gold in
                   zip((extract_answer(text, mode) for text in outputs), golds)] for mode in EXTRACT_MODES}


def describe(eval_cfg: EvalConfig, data_cfg: DataConfig, *, chat: bool, tokenizer, split: str, total: int,
             source: str, stop: list[str], stop_ids: list[int], dtype: str) -> dict:
    """Every setting that changes the score, for results.json."""
    prompt_format = ("the tokenizer's chat template (sha256 "
                     f"{hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:16]})" if chat
                     else PLAIN_TEMPLATE.replace("{prompt}", "{question}"))
    return {
        "task": "exact match of the final answer (GSM8K / MetaMathQA style)",
        "prompt": "chat" if chat else "plain", "prompt_format": prompt_format,
        "system_prompt": data_cfg.system_prompt,
        "num_fewshot": eval_cfg.num_fewshot, "fewshot_seed": eval_cfg.fewshot_seed,
        "fewshot_split": "train", "fewshot_as_multiturn": chat,
        "fewshot_format": None if chat else "Question: {question}\nAnswer: {solution}\n\n",
        "extract": eval_cfg.extract,
        "extract_markers": MARKERS + (["the last number"] if eval_cfg.extract == "flexible" else []),
        "match": f"numeric within {TOLERANCE:g} (relative above 1), else normalised text",
        "decoding": "greedy", "max_new_tokens": eval_cfg.max_new_tokens, "stop_strings": stop,
        "stop_token_ids": stop_ids, "dtype": dtype, "batch_size": eval_cfg.batch_size,
        "data": source, "split": split, "limit": eval_cfg.limit, "examples": total,
        "test_source": data_cfg.test_source, "test_fraction": data_cfg.test_fraction,
        "split_seed": data_cfg.split_seed,
    }
