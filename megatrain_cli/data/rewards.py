"""GRPO's rewards: plain functions of (prompt, completion, example) -> float, summed per completion. Data code:
a reward compares a completion with what the example says (data/answers.py), and knows no model.

Built in: `exact_match` (1.0 when the completion's final answer, read as the eval reads it, data/answers.py
flexible extraction and comparison, matches the example's gold answer; else 0.0) and `format` (1.0 when the
completion states its answer after a marker, 'The answer is', '####' or \\boxed{}: the eval's strict extraction
finds one). A user reward is `module:function` (imported at the start of the run; one that cannot be is a bad
input, exit 2). A reward that raises, or returns NaN, an infinity or a non-number, does not stop the run: the
completion's reward is NaN, the caller gives its whole group advantage 0 for the step (nothing is learnt from a
broken score) and reports the problem with the example.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable

from megatrain_cli.data.answers import answers_match, extract_answer

RewardFn = Callable[[str, str, object], float]


def exact_match(prompt: str, completion: str, example) -> float:
    return float(answers_match(extract_answer(completion, "flexible"), example.answer))


def format_reward(prompt: str, completion: str, example) -> float:
    return float(extract_answer(completion, "strict") is not None)


BUILT_IN: dict[str, RewardFn] = {"exact_match": exact_match, "format": format_reward}


class RewardError(ValueError):
    """A reward named in the recipe that cannot be used (exit 2 at the start of the run)."""


def resolve_rewards(names: list[str]) -> list[tuple[str, RewardFn]]:
    """(name, function) of every reward of grpo.rewards: a built-in or an imported module:function."""
    out = []
    for name in names:
        if name in BUILT_IN:
            out.append((name, BUILT_IN[name]))
            continue
        module, _, function = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), function)
        except ImportError as err:
            raise RewardError(f"grpo.rewards: {name!r}: cannot import module {module!r} ({err}); put it on the "
                              f"Python path (the directory you run megatrain from is on it)") from None
        except AttributeError:
            raise RewardError(f"grpo.rewards: {name!r}: module {module!r} has no {function!r}") from None
        except Exception as err:  # the module's own code failed while importing
            raise RewardError(f"grpo.rewards: {name!r}: importing {module!r} failed: "
                              f"{type(err).__name__}: {err}") from None
        if not callable(fn):
            raise RewardError(f"grpo.rewards: {name!r} is a {type(fn).__name__}, not a function of (prompt, "
                              f"completion, example) -> float")
        out.append((name, fn))
    return out


@dataclass
class RewardProblem:
    reward: str  # its name in grpo.rewards
    record: int  # the example's record in the source
    prompt: str
    what: str  # 'raised ValueError: ...', 'returned nan', 'returned a str ('...')'

    def describe(self) -> str:
        short = self.prompt if len(self.prompt) <= 60 else self.prompt[:57] + "..."
        return (f"reward {self.reward} {self.what} on example record {self.record} ({short!r}); that prompt's "
                f"completions get advantage 0 this step (nothing is learnt from them)")


def score(rewards: list[tuple[str, RewardFn]], prompt: str, completion: str,
          example) -> tuple[float, list[RewardProblem]]:
    """The summed reward of one completion (NaN when any reward failed on it) and what failed."""
    total, problems = 0.0, []
    for name, fn in rewards:
        try:
            value = fn(prompt, completion, example)
        except Exception as err:  # a user's function: any error is reported, never a crash of the run
            problems.append(RewardProblem(name, example.record, prompt, f"raised {type(err).__name__}: {err}"))
            continue
        try:  # int, float, bool, numpy's scalars and bools; an int past float's range is reported, not raised
            number = None if isinstance(value, str) or not hasattr(value, "__float__") else float(value)
        except (OverflowError, TypeError, ValueError):
            number = math.inf
        if number is None:
            what = f"returned a {type(value).__name__} ({value!r:.40}), not a number"
            problems.append(RewardProblem(name, example.record, prompt, what))
        elif not math.isfinite(number):
            problems.append(RewardProblem(name, example.record, prompt, f"returned {value!r:.40}"))
        else:
            total += number
    return (math.nan if problems else total), problems
