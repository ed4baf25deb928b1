"""GRPO's data (train.method grpo): prompts with a gold answer, as token ids through the chat template, and the
seeded, resumable order they are drawn in.

Any supervised format whose examples carry a gold answer (GSM8K's '#### N', MetaMathQA's 'The answer is: N',
`builtin:sample_math`, data.fields.gold) and a `{"prompt", "answer"}` file (the answer is the gold itself).
A source in which no example has a gold answer is refused by name (DataError: exit 2) when a reward reads it
(exact_match); single examples without one are left out and counted. A prompt goes through `render_prompt`
/ `encode_prompt`, the eval's own ids; one longer than train.seq_len - grpo.max_new_tokens is left out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.data.formats import check_field_overrides
from megatrain_cli.data.load import load_examples, with_system_prompt
from megatrain_cli.data.prompts import default_prefix_ids, encode_prompt, render_prompt
from megatrain_cli.data.registry import registry_name
from megatrain_cli.data.sources import read_records
from megatrain_cli.recipe import DataConfig

PROMPT_ANSWER = ("prompt", "answer")  # the plain GRPO layout: the question and its final answer


def load_prompt_examples(cfg: DataConfig) -> list[Example]:
    """Every example of the data, a {prompt, answer} file read as prompt + gold answer."""
    if cfg.format == "auto" and not cfg.datasets and registry_name(cfg.source) is None:
        records, label = read_records(cfg.source, cfg.split, max_records=cfg.max_samples)
        if records and isinstance(records[0], dict) and all(k in records[0] for k in PROMPT_ANSWER):
            check_field_overrides(dict(cfg.fields or {}), label)
            return with_system_prompt([_prompt_answer(rec, i, label) for i, rec in enumerate(records)],
                                      cfg.system_prompt)
    return load_examples(cfg)


def _prompt_answer(record, i: int, label: str) -> Example:
    if not isinstance(record, dict) or not all(isinstance(record.get(k), (str, int, float)) for k in PROMPT_ANSWER):
        raise DataError(f"{label}: record {i}: expected {{\"prompt\": text, \"answer\": text or number}}, got "
                        f"{record!r:.80}")
    answer = str(record["answer"]).strip()
    return Example(str(record["prompt"]), answer, answer=answer or None, record=i)


def usable(examples: list[Example], label: str, need_answers: bool) -> tuple[list[Example], int]:
    """(the examples GRPO can train on, how many were left out for want of a gold answer). None at all with
    an answer, when a reward reads it: refused."""
    kept = [ex for ex in examples if not ex.unusable and (ex.answer is not None or not need_answers)]
    if need_answers and examples and not kept:
        raise DataError(f"{label}: no example has a gold answer, which the exact_match reward of train.method grpo "
                        f"compares with: give records {{\"prompt\", \"answer\"}}, GSM8K's '#### N' or MetaMathQA's "
                        f"'The answer is: N' solutions, or name the answer's field with data.fields.gold")
    return kept, len(examples) - len(kept)


@dataclass
class Prompt:
    example: Example
    text: str  # the prompt as the model sees it (chat template applied)
    ids: list[int]


def encode_prompts(examples: list[Example], tokenizer, cfg: DataConfig, max_len: int) -> tuple[list[Prompt], int]:
    """(each example's prompt as text and ids, how many were longer than `max_len` tokens and left out)."""
    prefix = default_prefix_ids(tokenizer)
    out, too_long = [], 0
    for ex in examples:
        text = render_prompt(tokenizer, ex.prompt, cfg.template, ex.history, ex.chat)
        ids = encode_prompt(tokenizer, text, prefix)
        if len(ids) > max_len:
            too_long += 1
            continue
        out.append(Prompt(ex, text, ids))
    return out, too_long


class PromptOrder:
    """Which prompts each step samples for: every prompt once per epoch, in an order seeded by (seed, epoch);
    its position is the whole state (`state_dict`), so a resumed run draws what the uninterrupted one would."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise DataError("train.method grpo: no prompt left to train on")
        self.n, self.seed = n, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(f"megatrain-grpo:{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        out = []
        while len(out) < count:
            if self.cursor == self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self._order[self.cursor])
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "prompts": self.n}

    def load_state_dict(self, state: dict) -> None:
        if int(state["prompts"]) != self.n:
            raise DataError(f"the checkpoint was written over {state['prompts']} GRPO prompts, this data has {self.n}: "
                            f"resume with the data it was trained on")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._shuffled(self.epoch)
