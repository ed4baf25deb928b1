"""Record formats: detecting which one a data set uses and turning its records into `Example`s.

Each format names its fields canonically (MetaMathQA `query`/`response`, GSM8K `question`/`answer`,
Alpaca `instruction`/`input`/`output`, chat `messages`); `data.fields` maps a canonical name to the
data set's own field name. One extra key, `gold`, names a field holding the final answer directly
(otherwise it is read from the response: 'The answer is: X', '#### X', or its last number); another,
`system`, a field holding the record's system prompt (read when present, in every format).

Chats come in two layouts, both read as format `messages`: OpenAI's `messages` of {role, content}
(system / user / assistant) and ShareGPT's `conversations` of {from, value} (system / human / gpt).

Preference data (`preference`: chosen / rejected; `unpaired_preference`: a labelled completion) is read by
data/preference.py for the preference methods; here, on the supervised path, it is refused by name.
"""

from __future__ import annotations

import math

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.data.answers import extract_answer
from megatrain_cli.data.images import has_images, image_turns, source_dir
from megatrain_cli.data.sources import RecordPlace

REQUIRED_FIELDS = {
    "metamathqa": ("query", "response"),
    "gsm8k": ("question", "answer"),
    "alpaca": ("instruction", "output"),
    "messages": ("messages",),
}
OPTIONAL_FIELDS = {"alpaca": ("input", "history")}  # history: earlier [instruction, output] pairs (LLaMA-Factory's)
SYSTEM_KEY = "system"
DETECTION_ORDER = ("messages", "metamathqa", "gsm8k", "alpaca")
GOLD_KEY = "gold"
# ShareGPT-style chats use other names for the same things.
MESSAGE_FIELD_ALIASES = ("messages", "conversations")
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
ROLES = ("system", "user", "assistant", "tool")
# Preference data (TRL's names): the fields that tell it apart, and every canonical field its readers take.
PREFERENCE_FORMATS = {"preference": ("chosen", "rejected"), "unpaired_preference": ("completion", "label")}
PREFERENCE_FIELD_KEYS = ("prompt", "chosen", "rejected", "completion", "label")
PREFERENCE_METHODS = "train.method dpo, ipo, simpo, orpo or kto"


def valid_field_keys() -> list[str]:
    keys = {k for fields in REQUIRED_FIELDS.values() for k in fields}
    keys |= {k for fields in OPTIONAL_FIELDS.values() for k in fields} | set(PREFERENCE_FIELD_KEYS)
    return sorted(keys) + [GOLD_KEY, SYSTEM_KEY]


def check_field_overrides(fields: dict, label: str) -> None:
    unknown = [k for k in fields if k not in valid_field_keys()]
    if unknown:
        raise DataError(f"{label}: data.fields has unknown key(s) {', '.join(map(repr, unknown))} "
                        f"(canonical names: {', '.join(valid_field_keys())})")
    for key, value in fields.items():
        if not isinstance(value, str):
            raise DataError(f"{label}: data.fields.{key} must be a field name (a string), got {value!r}")


def field_name(fmt: str, canonical: str, fields: dict, record: dict | None = None) -> str:
    """The data set's name for a canonical field (override, alias, or the canonical name itself)."""
    if canonical in fields:
        return fields[canonical]
    if fmt == "messages" and canonical == "messages" and record is not None:
        for alias in MESSAGE_FIELD_ALIASES:
            if alias in record:
                return alias
    return canonical


def detect_preference_format(record: dict, fields: dict) -> str | None:
    """'preference' when the record has a chosen or a rejected field (one missing is then named), else
    'unpaired_preference' when it has a completion and a label, else None (field names after overrides)."""
    if any(fields.get(k, k) in record for k in PREFERENCE_FORMATS["preference"]):
        return "preference"
    if all(fields.get(k, k) in record for k in PREFERENCE_FORMATS["unpaired_preference"]):
        return "unpaired_preference"
    return None


def detect_format(record: dict, fields: dict, label: str) -> str:
    """The first format whose required fields (after overrides) the record has; preference data is refused
    first (a ShareGPT ranking record has `conversations` too)."""
    preference = detect_preference_format(record, fields)
    if preference is not None:
        _refuse_preference(preference, label, f"record 0 has the fields of {preference} data")
    for fmt in DETECTION_ORDER:
        if all(field_name(fmt, c, fields, record) in record for c in REQUIRED_FIELDS[fmt]):
            return fmt
    expected = "; ".join(f"{fmt}: {', '.join(REQUIRED_FIELDS[fmt])}" for fmt in DETECTION_ORDER)
    raise DataError(f"{label}: cannot tell the format from the fields {', '.join(map(str, record)) or '(none)'} "
                    f"(expected one of: {expected}); set data.format, or map your field names with "
                    f"data.fields, e.g. {{query: problem, response: solution}}")


def records_to_examples(records: list[dict], fmt: str, fields: dict, label: str) -> list[Example]:
    check_field_overrides(fields, label)
    if fmt == "auto":
        fmt = detect_format(records[0], fields, label)
    if fmt in PREFERENCE_FORMATS:
        _refuse_preference(fmt, label, f"format {fmt}")
    if fmt not in REQUIRED_FIELDS:
        raise DataError(f"{label}: unknown format {fmt!r} (known: auto, {', '.join(REQUIRED_FIELDS)})")
    convert = {"metamathqa": _prompt_response("query", "response"), "gsm8k": _prompt_response("question", "answer"),
               "alpaca": _alpaca, "messages": _messages}[fmt]
    gold_field = fields.get(GOLD_KEY)
    system_field = fields.get(SYSTEM_KEY, SYSTEM_KEY)
    examples = []
    place, base = RecordPlace(label), source_dir(label)
    for i, record in enumerate(records):
        where = f"{label}: record {i}"
        if not isinstance(record, dict):
            raise DataError(f"{where} is a {type(record).__name__}, expected an object with fields")
        try:
            if fmt == "messages" and has_images(record, field_name(fmt, "messages", fields, record)):
                example = _image_messages(record, fields, place(i), base)  # data/images.py
            else:
                example = convert(record, fmt, fields, where)
        except _NotText as err:  # JSON's NaN / Infinity (or a parquet null float) where text belongs
            examples.append(Example("", "", record=i, unusable=f"field {err.args[0]!r} is {err.args[1]}, not text"))
            continue
        example.record = i
        system = record.get(system_field)
        if isinstance(system, str) and system.strip() and not any(t["role"] == "system" for t in example.history):
            example.history.insert(0, {"role": "system", "content": system})
        elif system_field != SYSTEM_KEY and system_field not in record:
            raise DataError(f"{where}: missing field {system_field!r} (data.fields.system)")
        if gold_field is not None:
            example.answer = _gold(record, gold_field, where)
        else:  # a question about images: its reply is the gold (eval/images.py's exact match)
            example.answer = example.response.strip() if example.images else extract_answer(example.response)
        examples.append(example)
    return examples


def _refuse_preference(fmt: str, label: str, what: str) -> None:
    methods = "train.method kto" if fmt == "unpaired_preference" else PREFERENCE_METHODS
    raise DataError(f"{label}: {what} ({', '.join(PREFERENCE_FORMATS[fmt])}: preference data), not prompt / "
                    f"response pairs: it trains with {methods}, not with supervised fine-tuning (train.method sft)")


# ---------------------------------------------------------------- per-format conversion
class _NotText(Exception):
    """(field name, value): a NaN or infinite number where a text field belongs; the record is left out."""


def _get_text(record: dict, fmt: str, canonical: str, fields: dict, where: str, required: bool = True) -> str:
    name = field_name(fmt, canonical, fields, record)
    if name not in record or record[name] is None:
        if not required:
            return ""
        override = "" if canonical in fields else f"; if it has another name, set data.fields.{canonical}"
        raise DataError(f"{where}: missing field {name!r} (format {fmt}; fields present: "
                        f"{', '.join(map(str, record)) or '(none)'}){override}")
    value = record[name]
    if isinstance(value, float) and not math.isfinite(value):
        raise _NotText(name, value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} should be text, got {type(value).__name__}")
    return value


def _prompt_response(prompt_key: str, response_key: str):
    def convert(record: dict, fmt: str, fields: dict, where: str) -> Example:
        return Example(_get_text(record, fmt, prompt_key, fields, where),
                       _get_text(record, fmt, response_key, fields, where))
    return convert


def _alpaca(record: dict, fmt: str, fields: dict, where: str) -> Example:
    instruction = _get_text(record, fmt, "instruction", fields, where)
    extra = _get_text(record, fmt, "input", fields, where, required=False)
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return Example(prompt, _get_text(record, fmt, "output", fields, where), history=_alpaca_history(record, fields,
                                                                                                    where))


def _alpaca_history(record: dict, fields: dict, where: str) -> list[dict]:
    """LLaMA-Factory's alpaca `history`: earlier [instruction, output] pairs, as user / assistant turns."""
    name = field_name("alpaca", "history", fields)
    pairs = record.get(name)
    if pairs is None:
        return []
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                              and all(isinstance(t, str) for t in p) for p in pairs):
        raise DataError(f"{where}: field {name!r} should be a list of [instruction, output] pairs of text "
                        f"(LLaMA-Factory's alpaca history), got {str(pairs)[:80]}")
    return [{"role": role, "content": text} for pair in pairs for role, text in zip(("user", "assistant"), pair)]


def _messages(record: dict, fmt: str, fields: dict, where: str) -> Example:
    name = field_name(fmt, "messages", fields, record)
    turns = record.get(name)
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field {name!r} should be a non-empty list of {{role, content}} messages")
    messages = [read_message(turn, f"{where}, {name}[{j}]") for j, turn in enumerate(turns)]
    late_system = [j for j, m in enumerate(messages) if m["role"] == "system" and j > 0]
    if late_system:
        raise DataError(f"{where}: {name}[{late_system[0]}] is a system message after the conversation started "
                        f"(a system prompt goes first)")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message of {name!r} should be the assistant's reply (the target), "
                        f"got role {messages[-1]['role']!r}")
    if len(messages) < 2 or messages[-2]["role"] != "user":
        raise DataError(f"{where}: the assistant's reply in {name!r} should follow a user message")
    return Example(messages[-2]["content"], messages[-1]["content"], history=messages[:-2], chat=True)


def _image_messages(record: dict, fields: dict, where: str, base) -> Example:
    """A chat with images: placeholders in its text, the images' paths checked (data/images.py)."""
    name = field_name("messages", "messages", fields, record)
    turns, images = image_turns(record, name, where, base)
    example = _messages({**record, name: turns}, "messages", fields, where)
    example.images = images
    return example


def read_message(turn, where: str) -> dict:
    """One chat message ({role, content} or ShareGPT's {from, value}) with its role's canonical name."""
    if not isinstance(turn, dict):
        raise DataError(f"{where}: expected an object with role and content, got {type(turn).__name__}")
    role_key = next((k for k in ("role", "from") if k in turn), None)
    content_key = next((k for k in ("content", "value") if k in turn), None)
    if role_key is None or content_key is None:
        missing = "'role' (or 'from')" if role_key is None else "'content' (or 'value')"
        raise DataError(f"{where}: missing field {missing} (fields present: {', '.join(map(str, turn)) or 'none'})")
    role, content = turn[role_key], turn[content_key]
    if isinstance(content, list):  # OpenAI's content parts: [{type: text, text: ...}, ...]
        content = _text_parts(content, f"{where}.{content_key}")
    if not isinstance(role, str):
        raise DataError(f"{where}: field {role_key!r} should be text, got {type(role).__name__}")
    if not isinstance(content, str):
        raise DataError(f"{where}: field {content_key!r} should be text or a list of text parts, got "
                        f"{type(content).__name__} {str(content)[:40]}")
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise DataError(f"{where}: unknown role {role!r} (known: {', '.join(ROLES)}; ShareGPT's "
                        f"{', '.join(ROLE_ALIASES)} are read as user / assistant)")
    return {"role": role, "content": content}


def _text_parts(parts: list, where: str) -> str:
    """A message's content given as parts: the text parts joined as chat templates join them (one after the
    other); any other part (an image, audio) is refused by its type, since training reads text only."""
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "text":
            raise DataError(f"{where}[{k}]: a text part needs a 'text' field of text")
        else:
            raise DataError(f"{where}[{k}]: a part of type {kind!r}; only text parts ({{type: text, text: ...}}) "
                            f"can be trained on: remove the others or the record")
    return "".join(texts)


def _gold(record: dict, gold_field: str, where: str) -> str | None:
    if gold_field not in record:
        raise DataError(f"{where}: missing field {gold_field!r} (data.fields.gold; fields present: "
                        f"{', '.join(map(str, record))})")
    value = record[gold_field]
    return None if value is None else str(value).strip()
