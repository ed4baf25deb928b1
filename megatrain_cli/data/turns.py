"""An example as the model reads it: text segments, each supervised (it carries loss) or not.

Chat template: the conversation is rendered whole, once, and every supervised reply's span in that text
is found by rendering two prefixes of it: the turns before the reply with the generation prompt (where
the reply starts) and the turns through it (where it ends). The span is the reply as the template writes
it, end-of-turn token included, without the whitespace after that token (the next turn's layout, which
the model never has to produce). Costs one render per supervised reply plus one for the whole: Jinja on
short strings, small next to tokenisation.

A template that rewrites earlier turns once later ones exist (one that drops an old reply's reasoning,
say) has prefixes that are not prefixes of the whole; its turns cannot be masked one by one, and such an
example is refused with `data.train_on: last_assistant` as the way out (that needs only the last reply's
prefix).

Plain template: the text of prompts.render_prompt ('Question: ... Answer: '), each reply supervised and
an eos after the last one (plain text has no end-of-turn token of its own).

Segments are tokenised one by one and concatenated (tokenize.py), never re-tokenised together: a prompt's
ids are then exactly those eval gives the model. Adjacent segments of one kind are merged first, so a
prompt is one segment whatever the number of earlier turns it holds.
"""

from __future__ import annotations

from typing import NamedTuple

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.data.prompts import PLAIN_TEMPLATE, tokenizer_name, uses_chat_template

TRAIN_ON = ("all_assistant", "last_assistant")


class Segment(NamedTuple):
    text: str
    supervised: bool


def render_segments(tokenizer, ex: Example, template: str, train_on: str) -> tuple[list[Segment], bool]:
    """(segments in order, whether an eos id follows the last one): the example's text as the model reads
    it, split where loss starts and stops."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"data.train_on: expected one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    if uses_chat_template(tokenizer, template, ex.chat):
        return _merge(_chat_segments(tokenizer, ex.messages(), train_on)), False
    return _merge(_plain_segments(ex, train_on)), True


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # noqa: BLE001 - Jinja's own errors (roles out of order, ...): one clear line
        raise DataError(f"the chat template of {tokenizer_name(tokenizer)} cannot render a conversation with roles "
                        f"{' / '.join(m['role'] for m in messages)} ({type(err).__name__}: {err})") from err


def _chat_segments(tokenizer, messages: list[dict], train_on: str) -> list[Segment]:
    whole = _render(tokenizer, messages, False)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last_assistant":
        replies = replies[-1:]
    segments, at = [], 0
    for i in replies:
        start = _prefix_length(tokenizer, whole, messages[:i], True, train_on)
        end = len(whole) if i == len(messages) - 1 else _prefix_length(tokenizer, whole, messages[:i + 1], False,
                                                                        train_on)
        reply = whole[start:end].rstrip()
        if not reply:
            continue  # an empty reply that the template writes nothing for: nothing to learn
        segments += [Segment(whole[at:start], False), Segment(reply, True)]
        at = start + len(reply)
    segments.append(Segment(whole[at:], False))
    return segments


def _prefix_length(tokenizer, whole: str, messages: list[dict], generation_prompt: bool, train_on: str) -> int:
    prefix = _render(tokenizer, messages, generation_prompt)
    if not whole.startswith(prefix):
        fix = "" if train_on == "last_assistant" else "; data.train_on=last_assistant supervises only the last reply"
        raise DataError(f"the chat template of {tokenizer_name(tokenizer)} renders the first {len(messages)} turns "
                        f"differently once later turns follow, so a reply's tokens cannot be told apart from the "
                        f"text around them{fix}")
    return len(prefix)


def _plain_segments(ex: Example, train_on: str) -> list[Segment]:
    segments = []
    for turn in ex.history:
        if turn["role"] == "system":
            segments.append(Segment(f"{turn['content']}\n\n", False))
        elif turn["role"] == "assistant":
            segments += [Segment("Answer: ", False), Segment(turn["content"], train_on == "all_assistant"),
                         Segment("\n\n", False)]
        else:
            segments.append(Segment(f"Question: {turn['content']}\n", False))
    segments += [Segment(PLAIN_TEMPLATE.format(prompt=ex.prompt), False), Segment(ex.response, True)]
    return segments


def _merge(segments: list[Segment]) -> list[Segment]:
    merged: list[Segment] = []
    for seg in segments:
        if not seg.text:
            continue
        if merged and merged[-1].supervised == seg.supervised:
            merged[-1] = Segment(merged[-1].text + seg.text, seg.supervised)
        else:
            merged.append(seg)
    return merged


def end_of_turn_id(tokenizer) -> int | None:
    """The token a chat template closes a reply with (ChatML's <|im_end|>, Llama 3's <|eot_id|>), when it is
    one special token: generation stops there too, as training taught it to (some base models' eos is
    another token)."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        replies = [s.text for s in _chat_segments(tokenizer, probe, "last_assistant") if s.supervised]
    except DataError:  # a template that wants more than one exchange: no end-of-turn stop, eos still is
        return None
    ids = tokenizer(replies[-1], add_special_tokens=False)["input_ids"] if replies else []
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return ids[-1] if len(ids) > 1 and ids[-1] in special else None
