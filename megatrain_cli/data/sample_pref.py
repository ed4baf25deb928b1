"""The bundled preference sets, made on the fly from `builtin:sample_math` (no file of their own):

- `builtin:sample_math_pref`: {prompt, chosen, rejected}, chosen the correct worked answer, rejected the same
  working with a wrong result: the last `= N` of the working and the final answer both off by 1 to 3.
- `builtin:sample_math_kto`: {prompt, completion, label}, the same problems, even ones with the correct
  answer (label true) and odd ones with the wrong one (false): balanced, as KTO wants.

The wrong result depends only on the problem's position and its answer (a hash, not a random stream), so
the sets are the same on every machine and for any `max_samples`. Costs one pass over 2000 short strings.
"""

from __future__ import annotations

import hashlib
import re

from megatrain_cli.data.sample_math import generate_sample_math

ANSWER_LINE = "\nThe answer is: "
_LAST_RESULT = re.compile(r"= (\d+)(?!.*= \d)", re.DOTALL)  # the last `= N` of the working
OFFSETS = (-3, -2, -1, 1, 2, 3)


def wrong_answer(index: int, answer: int) -> int:
    """A positive number off `answer` by 1 to 3, fixed by (index, answer)."""
    digest = hashlib.sha256(f"sample_math_pref:{index}:{answer}".encode()).digest()
    options = [answer + d for d in OFFSETS if answer + d > 0]
    return options[digest[0] % len(options)]


def worked_pair(index: int, response: str) -> tuple[str, str]:
    """(correct, wrong) worked answers of one sample_math response ('working\\nThe answer is: N')."""
    working, answer = response.rsplit(ANSWER_LINE, 1)
    wrong = wrong_answer(index, int(answer))
    match = _LAST_RESULT.search(working)
    if match is None or int(match.group(1)) != int(answer):
        raise ValueError(f"sample_math record {index}: the working does not end in '= {answer}': {working!r}")
    wrong_working = f"{working[:match.start(1)]}{wrong}{working[match.end(1):]}"
    return response, f"{wrong_working}{ANSWER_LINE}{wrong}"


def sample_math_pref() -> list[dict]:
    return [{"prompt": r["query"], "chosen": good, "rejected": bad}
            for i, r in enumerate(generate_sample_math()) for good, bad in [worked_pair(i, r["response"])]]


def sample_math_kto() -> list[dict]:
    return [{"prompt": p["prompt"], "completion": p["chosen"] if i % 2 == 0 else p["rejected"], "label": i % 2 == 0}
            for i, p in enumerate(sample_math_pref())]


GENERATED = {"sample_math_pref": sample_math_pref, "sample_math_kto": sample_math_kto}
