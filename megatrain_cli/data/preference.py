"""Preference data: records -> `PreferenceExample`s (a prompt with its chosen and rejected completions, or
KTO's one labelled completion), for the preference methods (train.method; docs/preference.md).

Layouts (TRL's names; `data.fields` maps a canonical name to the data set's own):
- `preference`, {prompt, chosen, rejected}: text; or chat: the prompt a list of messages ending with the
  user's, chosen / rejected each a list holding the assistant's one message (TRL's conversational layout) or
  that message alone (LLaMA-Factory's ranking layout, whose prompt is a `conversations` list or an alpaca
  `instruction` + `input`). Without a prompt, chosen and rejected as whole conversations: the messages they
  start with in common are the prompt (TRL's implicit prompt).
- `unpaired_preference`, {prompt, completion, label} (KTO), label true or false; or LLaMA-Factory's KTO
  layout: a conversation ending in the assistant's reply (the completion) and a kto_tag (the label).
A `system` field adds a system prompt, as for SFT (formats.py). Paired data also trains KTO: a pair is then
one desirable and one undesirable example, as in TRL.

Every problem is a DataError naming the record (by its line in a .jsonl file), the field and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.data.formats import (MESSAGE_FIELD_ALIASES, PREFERENCE_FORMATS, SYSTEM_KEY, check_field_overrides,
                                        detect_format, detect_preference_format, read_message)
from megatrain_cli.data.load import split_examples, with_system_prompt
from megatrain_cli.data.mixing import mix, parse_datasets
from megatrain_cli.data.registry import registry_name, resolve
from megatrain_cli.data.sources import RecordPlace, read_records
from megatrain_cli.recipe import DataConfig

PAIRED_METHODS = ("dpo", "ipo", "simpo", "orpo")
PREFERENCE_SOURCE = "builtin:sample_math_pref"  # named in messages as a preference set to start from


@dataclass
class PreferenceExample:
    """A prompt with its completions: (chosen, rejected) of a pair, or KTO's one completion."""
    prompt: str  # the last user turn, before any template
    completions: tuple[str, ...]
    desirable: tuple[bool, ...]  # (True, False) for a pair; KTO's label
    history: list[dict] = field(default_factory=list)  # earlier turns, a system prompt first
    chat: bool = False  # read from chat messages: rendered with a chat template
    place: RecordPlace | None = None
    record: int = 0

    @property
    def where(self) -> str:
        return self.place(self.record) if self.place is not None else f"record {self.record}"

    def sequences(self) -> list[Example]:
        """One Example per completion: the prompt and its turns, then the completion (the only labels)."""
        return [Example(self.prompt, c, history=list(self.history), chat=self.chat) for c in self.completions]


def load_preference_examples(data_cfg: DataConfig, method: str, *,
                             default_split: str = "train") -> list[PreferenceExample]:
    """Every example of the data for `method` (the first `max_samples` when that is set)."""
    if data_cfg.datasets:
        parsed = parse_datasets(data_cfg.datasets)
        groups = [_load_spec(data_cfg, name, f"data.datasets[{i}].name", method, default_split, None)
                  for i, (name, _) in enumerate(parsed)]
        examples = mix(groups, [w for _, w in parsed], data_cfg.split_seed, data_cfg.mix_size, data_cfg.max_samples)
    elif registry_name(data_cfg.source) is not None:
        examples = _load_spec(data_cfg, registry_name(data_cfg.source), "data.source", method, default_split,
                              data_cfg.max_samples)
    else:
        records, label = read_records(data_cfg.source, data_cfg.split, default_split=default_split,
                                      max_records=data_cfg.max_samples)
        examples = records_to_preference(records, data_cfg.format, dict(data_cfg.fields or {}), RecordPlace(label),
                                         method)
    return with_system_prompt(examples, data_cfg.system_prompt)


def _load_spec(data_cfg: DataConfig, name: str, key: str, method: str, default_split: str,
               max_samples: int | None) -> list[PreferenceExample]:
    spec = resolve(data_cfg.registry, name, key)
    limits = [n for n in (spec.max_samples, max_samples) if n is not None]
    records, label = read_records(spec.source, spec.split, default_split=default_split,
                                  max_records=min(limits) if limits else None)
    return records_to_preference(records, spec.format, dict(spec.fields),
                                 RecordPlace(f"{label} (registry: {spec.name})", label), method)


def split_preference_examples(examples: list[PreferenceExample], data_cfg: DataConfig,
                              method: str) -> tuple[list[PreferenceExample], list[PreferenceExample]]:
    """(train, test): `data.test_source` read as preference data, else load.py's seeded random hold-out."""
    if data_cfg.test_source:
        test_cfg = dataclasses.replace(data_cfg, source=data_cfg.test_source, split=None, max_samples=None,
                                       datasets=[], mix_size=None)
        return list(examples), load_preference_examples(test_cfg, method, default_split="test")
    return split_examples(examples, dataclasses.replace(data_cfg, test_source=None))


def records_to_preference(records: list[dict], fmt: str, fields: dict, place: RecordPlace,
                          method: str) -> list[PreferenceExample]:
    check_field_overrides(fields, place.label)
    if fmt == "auto":
        fmt = detect_preference_format(records[0], fields) or _not_preference(records[0], fields, place, method)
    if fmt not in PREFERENCE_FORMATS:
        raise DataError(_supervised(place.label, f"data.format {fmt}", method))
    if fmt == "unpaired_preference" and method in PAIRED_METHODS:
        raise DataError(f"{place.label}: unpaired_preference data (single completions labelled true or false) "
                        f"trains with train.method kto only; {method} needs pairs {{prompt, chosen, rejected}} "
                        f"(data.format preference)")
    convert = _pair if fmt == "preference" else _unpaired
    examples = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{place(i)} is a {type(record).__name__}, expected an object with fields")
        example = convert(record, fields, _Where(place, i))
        example.place, example.record = place, i
        examples.append(example)
    return examples


class _Where:
    """A record's place, rendered only when a message is written (the line table costs a read of the file)."""

    def __init__(self, place: RecordPlace, i: int):
        self.place, self.i = place, i

    def __str__(self) -> str:
        return self.place(self.i)


def _not_preference(record, fields: dict, place: RecordPlace, method: str):
    """The first record is no preference record: say which line, with which fields, and what it is instead."""
    if not isinstance(record, dict):
        raise DataError(f"{place(0)} is a {type(record).__name__}, expected an object with fields")
    try:
        sft = detect_format(record, fields, place.label)
    except DataError:
        sft = None
    present = ", ".join(map(str, record)) or "(none)"
    if sft is not None:
        raise DataError(_supervised(f"{place(0)} (fields {present})", f"the records are supervised data (format "
                                                                      f"{sft})", method))
    raise DataError(f"{place(0)}: cannot tell the preference format from the fields {present} (expected "
                    f"preference: prompt, chosen, rejected; unpaired_preference: prompt, completion, label); set "
                    f"data.format, or map your field names with data.fields, e.g. {{chosen: better, rejected: worse}}")


def _supervised(label: str, what: str, method: str) -> str:
    unpaired = " or {prompt, completion, label} (unpaired_preference)" if method == "kto" else ""
    return (f"{label}: {what}, not preference data; train.method {method} trains on records {{prompt, chosen, "
            f"rejected}} (data.format preference){unpaired}: use a preference data set ({PREFERENCE_SOURCE} is a "
            f"small one), or train.method sft to fine-tune on this one")


# ---------------------------------------------------------------- one record
_FIELDS = {"preference": ("prompt", "chosen", "rejected"), "unpaired_preference": ("prompt", "completion", "label")}


def _pair(record: dict, fields: dict, where) -> PreferenceExample:
    raw = {k: _required(record, fields, k, "preference", where) for k in ("chosen", "rejected")}
    if raw["chosen"] == raw["rejected"]:
        _same(fields, where)
    prompt, history, chat, raw = _split_prompt(record, fields, where, raw, "preference")
    chosen, rejected = (_completion(raw[k], fields.get(k, k), where) for k in ("chosen", "rejected"))
    if chosen == rejected:
        _same(fields, where)
    chat = chat or any(not isinstance(v, str) for v in raw.values())
    return _with_system(PreferenceExample(prompt, (chosen, rejected), (True, False), history, chat), record, fields,
                        where)


def _unpaired(record: dict, fields: dict, where) -> PreferenceExample:
    name = fields.get("label", "label")
    label = _required(record, fields, "label", "unpaired_preference", where)
    if not isinstance(label, bool):
        raise DataError(f"{where}: field {name!r} should be true (a desirable completion) or false (an undesirable "
                        f"one), got {label!r}")
    completion_name = fields.get("completion", "completion")
    raw = {"completion": record[completion_name]} if record.get(completion_name) is not None else {}
    prompt, history, chat, raw = _split_prompt(record, fields, where, raw, "unpaired_preference")
    if "completion" not in raw:
        _required(record, fields, "completion", "unpaired_preference", where)
    completion = _completion(raw["completion"], completion_name, where)
    chat = chat or not isinstance(raw["completion"], str)
    return _with_system(PreferenceExample(prompt, (completion,), (label,), history, chat), record, fields, where)


def _required(record: dict, fields: dict, canonical: str, fmt: str, where):
    name = fields.get(canonical, canonical)
    if name not in record or record[name] is None:
        override = "" if canonical in fields else f"; if it has another name, set data.fields.{canonical}"
        raise DataError(f"{where}: missing field {name!r} (format {fmt}: {', '.join(_FIELDS[fmt])}; fields present: "
                        f"{', '.join(map(str, record)) or '(none)'}){override}")
    return record[name]


def _same(fields: dict, where) -> None:
    raise DataError(f"{where}: fields {fields.get('chosen', 'chosen')!r} and {fields.get('rejected', 'rejected')!r} "
                    f"are the same completion: such a pair teaches nothing (its gradient is zero); fix one of them or "
                    f"remove the record")


def _split_prompt(record: dict, fields: dict, where, raw: dict, fmt: str) -> tuple[str, list[dict], bool, dict]:
    """(prompt, earlier turns, chat, completions): from a prompt (text or messages), a conversation (ShareGPT:
    its last message is the prompt's, or for KTO the completion), or chosen / rejected's shared first messages."""
    # LLaMA-Factory's alpaca layout calls the prompt `instruction`, and its ShareGPT one has a conversation.
    alpaca = "prompt" not in record and "instruction" in record
    prompt_name = fields.get("prompt") or ("instruction" if alpaca else "prompt")
    conversation = fields.get("messages") or next((a for a in MESSAGE_FIELD_ALIASES if a in record), None)
    if record.get(prompt_name) is not None and "messages" not in fields:
        value = record[prompt_name]
        if isinstance(value, str):
            extra = record.get(fields.get("input", "input"))
            text = f"{value}\n\n{extra}" if isinstance(extra, str) and extra.strip() else value
            return text, [], False, raw
        if isinstance(value, list):
            history, prompt = _prompt_turns(_messages(value, prompt_name, where), prompt_name, where)
            return prompt, history, True, raw
        raise DataError(f"{where}: field {prompt_name!r} should be text or a list of {{role, content}} messages, got "
                        f"{type(value).__name__}")
    if conversation is not None and conversation in record:
        messages = _messages(record[conversation], conversation, where)
        if fmt == "unpaired_preference" and "completion" not in raw and messages[-1]["role"] == "assistant":
            raw = {"completion": [messages[-1]]}
            messages = messages[:-1]
        history, prompt = _prompt_turns(messages, conversation, where)
        return prompt, history, True, raw
    if fmt == "preference" and all(isinstance(v, list) for v in raw.values()):
        return _implicit_prompt(raw, fields, where)
    _required(record, fields, "prompt", fmt, where)
    raise AssertionError("unreachable")


def _implicit_prompt(raw: dict, fields: dict, where) -> tuple[str, list[dict], bool, dict]:
    chosen, rejected = (_messages(raw[k], fields.get(k, k), where) for k in ("chosen", "rejected"))
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if k == 0 or chosen[k - 1]["role"] != "user":
        raise DataError(f"{where}: no field 'prompt', and the conversations in 'chosen' and 'rejected' do not start "
                        f"with the same messages ending in a user turn (TRL's implicit prompt); give the prompt as a "
                        f"field of its own")
    history, prompt = _prompt_turns(chosen[:k], "chosen", where)
    return prompt, history, True, {"chosen": chosen[k:], "rejected": rejected[k:]}


def _messages(value, name: str, where) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {name!r} should be a non-empty list of {{role, content}} messages")
    return [read_message(turn, f"{where}, {name}[{j}]") for j, turn in enumerate(value)]


def _prompt_turns(messages: list[dict], name: str, where) -> tuple[list[dict], str]:
    if any(m["role"] == "system" for m in messages[1:]):
        raise DataError(f"{where}: field {name!r} has a system message after the conversation started (a system "
                        f"prompt goes first)")
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: the prompt in {name!r} should end with the user's message (the completions "
                        f"answer it), got role {messages[-1]['role']!r}")
    return messages[:-1], messages[-1]["content"]


def _completion(value, name: str, where) -> str:
    """A completion's text: a string, an assistant message, or a list holding one (TRL)."""
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list):
        messages = [read_message(turn, f"{where}, {name}[{j}]") for j, turn in enumerate(value)]
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            roles = " / ".join(m["role"] for m in messages) or "none"
            raise DataError(f"{where}: field {name!r} should hold one assistant message (the reply to the prompt), "
                            f"got {len(messages)} message(s) with role(s) {roles}")
        value = messages[0]["content"]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} should be text or an assistant message, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field {name!r} is empty: there is no completion to score; fill it in or remove "
                        f"the record")
    return value


def _with_system(example: PreferenceExample, record: dict, fields: dict, where) -> PreferenceExample:
    system_field = fields.get(SYSTEM_KEY, SYSTEM_KEY)
    system = record.get(system_field)
    if isinstance(system, str) and system.strip() and not any(t["role"] == "system" for t in example.history):
        example.history.insert(0, {"role": "system", "content": system})
    elif system_field != SYSTEM_KEY and system_field not in record:
        raise DataError(f"{where}: missing field {system_field!r} (data.fields.system)")
    return example

