"""One training / eval example, whatever format it came from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Example:
    prompt: str  # the user turn, before any template
    response: str  # the target text (loss is taken on it, plus eos)
    answer: str | None = None  # the gold final answer for exact-match eval, when one could be read
    # Earlier turns of a multi-turn `messages` record ({role, content}), rendered before `prompt`.
    history: list[dict] = field(default_factory=list)
