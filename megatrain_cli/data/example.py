"""One training / eval example, whatever format it came from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Example:
    prompt: str  # the user turn, before any template
    response: str  # the target text (loss is taken on it, plus its end of turn)
    answer: str | None = None  # the gold final answer for exact-match eval, when one could be read
    # Earlier turns ({role, content}), rendered before `prompt`: a system prompt, earlier user and assistant
    # turns of a multi-turn chat (supervised too with data.train_on all_assistant), few-shot examples.
    history: list[dict] = field(default_factory=list)
    chat: bool = False  # read from a chat layout (messages / conversations): rendered with a chat template
    record: int = field(default=-1, compare=False)  # its record's index in the source (named when left out)
    # Why the record cannot be read (a NaN where text belongs); '' when it can. Kept in place so the seeded
    # split stays the same; training and eval leave it out, and training says so.
    unusable: str = ""
    # A vision-language chat's images (resolved paths), one per IMAGE placeholder in its text, in order
    # (data/images.py); empty for text.
    images: list[str] = field(default_factory=list)

    def messages(self) -> list[dict]:
        """The whole conversation, ending in the reply."""
        return [*self.history, {"role": "user", "content": self.prompt},
                {"role": "assistant", "content": self.response}]
