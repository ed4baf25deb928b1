"""A dataset registry: names for datasets, so a recipe says `registry:NAME` (or lists names in
data.datasets) instead of repeating where a dataset lives and how its fields are called.

The file (`data.registry`, YAML or JSON) maps each name to an entry:

    my_chats:
      path: chats.jsonl          # a local file or folder, relative to the registry file's folder
      format: messages           # auto, metamathqa, gsm8k, alpaca, messages (sharegpt / openai: messages)
      columns: {messages: conversations, system: sys}   # canonical name -> the dataset's field
    gsm8k:
      hub: openai/gsm8k          # or a Hugging Face dataset (exactly one of path / hub)
      subset: main               # its config
      split: train
      max_samples: 5000

LLaMA-Factory's dataset_info.json reads as it is where it describes the same things: `file_name`,
`hf_hub_url`, `subset`, `split`, `num_samples`, `formatting` (alpaca / sharegpt; alpaca when left out, as
LLaMA-Factory reads it), its alpaca columns (prompt / query / response / system / history) and `tags` with the two chat layouts' own names. Its preference
entries read too: `ranking: true` with columns chosen / rejected (format `preference`), and KTO's `kto_tag`
column (format `unpaired_preference`), in either formatting (data/preference.py reads the records). Anything
else (tools, images, custom role names) is refused by name, never ignored. Reading the file costs a YAML
parse per resolution; datasets are read only when loaded.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.formats import PREFERENCE_FORMATS, REQUIRED_FIELDS, valid_field_keys
from megatrain_cli.recipe.checks import REGISTRY_PREFIX as PREFIX
from megatrain_cli.recipe.load import not_utf8, read_utf8

KEYS = ("path", "hub", "subset", "split", "format", "columns", "max_samples")
# LLaMA-Factory's names for the same keys.
KEY_ALIASES = {"file_name": "path", "hf_hub_url": "hub", "formatting": "format", "num_samples": "max_samples"}
FORMAT_ALIASES = {"sharegpt": "messages", "openai": "messages"}
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output"}  # LLaMA-Factory -> ours
# LLaMA-Factory's preference / KTO columns -> ours (prompt, chosen, rejected, messages, system keep their names).
PREFERENCE_COLUMNS = {"query": "input", "response": "completion", "kto_tag": "label"}
# Tags LLaMA-Factory writes for ShareGPT / OpenAI chats, which formats.py reads by itself.
DEFAULT_TAGS = {"role_tag": ("from", "role"), "content_tag": ("value", "content"), "user_tag": ("human", "user"),
                "assistant_tag": ("gpt", "assistant"), "system_tag": ("system",)}


@dataclass(frozen=True)
class DatasetSpec:
    """One registry entry, resolved: what `sources.read_records` and `formats.records_to_examples` need."""
    name: str
    source: str  # an absolute path, or a hub id (`owner/name[:config]`)
    format: str
    fields: dict
    split: str | None
    max_samples: int | None


def registry_name(source: str) -> str | None:
    """NAME of a `registry:NAME` source, else None."""
    return source[len(PREFIX):] if source.startswith(PREFIX) else None


def read_registry(path: str | None, key: str) -> dict[str, dict]:
    """The registry's entries by name (unvalidated). `key` names the setting that needed it."""
    if not path:
        raise DataError(f"{key}: names a registry dataset, but data.registry (the registry file) is not set")
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"data.registry: file not found: {file}")
    try:
        entries = yaml.safe_load(read_utf8(file))  # YAML reads JSON too
    except UnicodeDecodeError as err:
        raise DataError(f"data.registry: {not_utf8(file, file.read_bytes(), err)}") from None
    except yaml.YAMLError as err:
        raise DataError(f"data.registry: {file} is not valid YAML or JSON ({err})") from None
    if not isinstance(entries, dict) or not entries:
        raise DataError(f"data.registry: {file} should map dataset names to entries ({{path or hub, format, "
                        f"columns}}), got {type(entries).__name__}")
    return {str(name): entry for name, entry in entries.items()}


def resolve(registry: str | None, name: str, key: str = "data.source") -> DatasetSpec:
    """The entry `name` of the registry file, checked and with its path made absolute."""
    entries = read_registry(registry, key)
    if name not in entries:
        near = difflib.get_close_matches(name, list(entries), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise DataError(f"{key}: no dataset {name!r} in the registry {Path(registry).expanduser()}{hint} (known: "
                        f"{', '.join(sorted(entries))})")
    return _spec(name, entries[name], Path(registry).expanduser(), f"data.registry: {registry}: {name}")


def _spec(name: str, entry, file: Path, where: str) -> DatasetSpec:
    if not isinstance(entry, dict):
        raise DataError(f"{where}: expected a mapping (path or hub, format, columns), got {entry!r}")
    entry = dict(entry)
    tags = entry.pop("tags", None) or {}
    ranking = entry.pop("ranking", False)
    if not isinstance(ranking, bool):
        raise DataError(f"{where}: ranking should be true or false, got {ranking!r}")
    if "format" not in entry and "formatting" not in entry and any(k in entry for k in ("file_name", "hf_hub_url")):
        entry["formatting"] = "alpaca"  # a LLaMA-Factory entry: its formatting defaults to alpaca
    entry = {KEY_ALIASES.get(k, k): v for k, v in entry.items()}
    unknown = [k for k in entry if k not in KEYS]
    if unknown:
        raise DataError(f"{where}: unsupported key(s) {', '.join(map(repr, unknown))} (known: {', '.join(KEYS)}, "
                        f"or LLaMA-Factory's {', '.join(KEY_ALIASES)}, tags)")
    for tag, value in tags.items():
        if value not in DEFAULT_TAGS.get(tag, ()):
            raise DataError(f"{where}: tags.{tag}={value!r} is not supported (chats are read with their own "
                            f"names: role/content, user/assistant/system or from/value, human/gpt/system)")
    if ("path" in entry) == ("hub" in entry):
        raise DataError(f"{where}: give exactly one of path (a local file or folder) and hub (a Hugging Face "
                        f"dataset)")
    for k in ("path", "hub", "subset", "split"):
        if k in entry and (not isinstance(entry[k], str) or not entry[k].strip()):
            raise DataError(f"{where}: {k} should be a non-empty string, got {entry[k]!r}")
    fmt = FORMAT_ALIASES.get(entry.get("format", "auto"), entry.get("format", "auto"))
    if fmt != "auto" and fmt not in REQUIRED_FIELDS and fmt not in PREFERENCE_FORMATS:
        raise DataError(f"{where}: unknown format {entry.get('format')!r} (known: auto, {', '.join(REQUIRED_FIELDS)}, "
                        f"{', '.join(PREFERENCE_FORMATS)}, {', '.join(FORMAT_ALIASES)})")
    columns = entry.get("columns") or {}
    if ranking or fmt in PREFERENCE_FORMATS or (isinstance(columns, dict) and "kto_tag" in columns):
        fmt, columns = _preference(ranking, fmt, columns, where)
    max_samples = entry.get("max_samples")
    if max_samples is not None and (not isinstance(max_samples, int) or isinstance(max_samples, bool)
                                    or max_samples < 1):
        raise DataError(f"{where}: max_samples should be an integer >= 1, got {max_samples!r}")
    if "path" in entry:
        path = Path(entry["path"]).expanduser()
        source = str(path if path.is_absolute() else (file.parent / path).resolve())
    else:
        source = entry["hub"] + (f":{entry['subset']}" if entry.get("subset") else "")
    return DatasetSpec(name, source, fmt, _columns(columns, fmt, where), entry.get("split"), max_samples)


def _preference(ranking: bool, fmt: str, columns, where: str) -> tuple[str, dict]:
    """(format, columns in our names) of a preference entry: LLaMA-Factory's ranking (pairs) or kto_tag
    (labelled completions), alpaca or sharegpt alike (the reader tells a prompt from a conversation), or our own
    format preference / unpaired_preference."""
    if not isinstance(columns, dict):
        return fmt, columns  # _columns names the problem
    unpaired = "kto_tag" in columns or fmt == "unpaired_preference"
    if unpaired and (ranking or fmt == "preference"):
        raise DataError(f"{where}: pairs (ranking: true, or format preference) and KTO's labelled single completions "
                        f"(kto_tag, or format unpaired_preference) at once; an entry is one or the other")
    return ("unpaired_preference" if unpaired else "preference"), {PREFERENCE_COLUMNS.get(k, k): v
                                                                   for k, v in columns.items()}


def _columns(columns, fmt: str, where: str) -> dict:
    if not isinstance(columns, dict) or not all(isinstance(v, str) for v in columns.values()):
        raise DataError(f"{where}: columns should map canonical names to field names, got {columns!r}")
    if fmt == "alpaca":
        columns = {ALPACA_COLUMNS.get(k, k): v for k, v in columns.items()}
    unknown = [k for k in columns if k not in valid_field_keys()]
    if unknown:
        known = dict.fromkeys([*valid_field_keys(), *(ALPACA_COLUMNS if fmt == "alpaca" else ())])
        raise DataError(f"{where}: unsupported column(s) {', '.join(map(repr, unknown))} (known for format {fmt}: "
                        f"{', '.join(known)})")
    return dict(columns)
