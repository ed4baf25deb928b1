"""How a prompt becomes text and tokens: one place, so training and eval see exactly the same ids.

Prompt and response are tokenised separately and concatenated (never re-tokenised together): the
model is trained on precisely the prompt ids it is later given at eval time, whatever BPE would
have merged across the boundary.
"""

from __future__ import annotations

from megatrain_cli.data.errors import DataError

TEMPLATES = ("auto", "chat", "plain")
PLAIN_TEMPLATE = "Question: {prompt}\nAnswer: "
# Where a plain-template model that does not stop at eos starts inventing the next question.
PLAIN_STOP_STRINGS = ("\nQuestion:",)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def uses_chat_template(tokenizer, template: str, chat_data: bool = False, key: str = "data.template",
                       evaluating: bool = False) -> bool:
    """Whether prompts go through the tokenizer's chat template. 'chat', and chat data (a messages /
    conversations layout) under 'auto', need one: without it the run is refused (DataError naming `key`
    and the tokenizer), never quietly rendered as Question/Answer text; 'plain' says that is wanted.
    `evaluating`: `megatrain eval`'s refusal, whose fixes are eval's (--model, eval.prompt)."""
    if template not in TEMPLATES:
        raise ValueError(f"{key}: expected 'auto', 'chat' or 'plain', got {template!r}")
    if template == "plain":
        return False
    if has_chat_template(tokenizer):
        return True
    if template == "chat" or chat_data:
        why = f"{key}={template}" if template == "chat" else "chat data (a messages / conversations layout)"
        other = ("evaluate a model whose tokenizer has one (--model: an instruct / chat model)" if evaluating else
                 "use a model whose tokenizer has one (an instruct / chat model, or model.tokenizer pointing at one)")
        plain = "eval.prompt=plain (or data.template=plain)" if evaluating else f"{key}=plain"
        raise DataError(f"{key}: {why} needs the tokenizer's chat template, and {tokenizer_name(tokenizer)} "
                        f"has none (no chat_template in its tokenizer_config.json or chat_template.jinja); "
                        f"{other}, or set {plain} to render the turns as 'Question: ... Answer: ' text")
    return False


def tokenizer_name(tokenizer) -> str:
    """The tokenizer as messages name it: its model directory, or the bundled one (presets use it)."""
    path = getattr(tokenizer, "name_or_path", "")
    return f"the tokenizer of {path}" if path else "the bundled tokenizer (model presets use it)"


def render_prompt(tokenizer, prompt: str, template: str, history: list[dict] | None = None,
                  chat_data: bool = False) -> str:
    """The prompt text the model sees, up to where its answer starts.

    `history` holds earlier turns of a chat ({role, content}); the chat template renders them as
    they are, the plain template as earlier Question/Answer pairs.
    """
    history = history or []
    if uses_chat_template(tokenizer, template, chat_data):
        messages = [*history, {"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = []
    for turn in history:
        if turn["role"] == "system":
            parts.append(f"{turn['content']}\n\n")
        elif turn["role"] == "assistant":
            parts.append(f"Answer: {turn['content']}\n\n")
        else:
            parts.append(f"Question: {turn['content']}\n")
    return "".join(parts) + PLAIN_TEMPLATE.format(prompt=prompt)


def stop_strings(tokenizer, template: str, chat_data: bool = False) -> list[str]:
    """Text after which generation is over, beyond the eos token."""
    return [] if uses_chat_template(tokenizer, template, chat_data) else list(PLAIN_STOP_STRINGS)


def default_prefix_ids(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text by default (a BOS for Llama-style ones, none for Qwen)."""
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    n = len(with_special) - len(plain)
    if n > 0 and with_special[n:] == plain:
        return list(with_special[:n])
    return []  # nothing added before, or only after (a trailing eos does not belong on a prompt)


def encode_prompt(tokenizer, text: str, prefix_ids: list[int] | None = None) -> list[int]:
    """Prompt ids: the text's tokens, after the default prefix unless the text already starts with it
    (chat templates write the BOS themselves)."""
    prefix = default_prefix_ids(tokenizer) if prefix_ids is None else prefix_ids
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if ids[:len(prefix)] == prefix else [*prefix, *ids]


def eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos token: the model could not learn "
                         f"where an answer ends")
    return tokenizer.eos_token_id


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id(tokenizer)
