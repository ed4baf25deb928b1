"""Reading a recipe: YAML, dotted overrides, every key and type checked against the schema.

`load_recipe` reads YAML, applies dotted overrides (`train.lr=1e-5`, `~eval` to delete a key), checks
every key and type against recipe/schema.py, and raises `RecipeError` listing *all* problems at once
with their dotted paths and a did-you-mean for near misses. `render_yaml` and `schema_help` print the
resolved recipe and the schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megatrain_cli.recipe.schema import Recipe, RecipeError

# ---------------------------------------------------------------- type checking
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check `value` against `tp`; returns (ok, value), converting an int to float where a float is due."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and ("off" if not value else "on") in choices:
            return True, "off" if not value else "on"  # YAML 1.1 reads a bare off / on as a boolean
        return value in choices, value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v = _coerce(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 1e-5, without a dot, as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if tp in (list, dict):
        return isinstance(value, tp), value
    return isinstance(value, tp), value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, data: Any, path: str, problems: list[str]) -> Any:
    """Build dataclass `cls` from a mapping, appending every problem found to `problems`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{path or '<root>'}: expected a mapping, got {type(data).__name__}")
        return cls()
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in hints:
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean '{path + '.' if path else ''}{near[0]}'?" if near else ""
            problems.append(f"{dotted}: unknown key{hint} (valid: {', '.join(names)})")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, dotted, problems)
            continue
        ok, coerced = _coerce(value, tp)
        if not ok:
            problems.append(f"{dotted}: expected {_type_name(tp)}, got {value!r}")
            continue
        kwargs[key] = coerced
    return cls(**kwargs)


# ---------------------------------------------------------------- cross-field checks
def _check_semantics(r: Recipe, problems: list[str]) -> None:
    from megatrain_cli.presets import PRESETS

    m, t, e = r.model, r.train, r.engine
    if (m.path is None) == (m.preset is None):
        problems.append("model: set exactly one of model.path and model.preset")
    if m.preset is not None and m.preset not in PRESETS:
        near = difflib.get_close_matches(m.preset, list(PRESETS), n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        problems.append(f"model.preset: unknown preset '{m.preset}'{hint} (known: {', '.join(PRESETS)})")
    if (t.steps is None) == (t.epochs is None):
        problems.append("train: set exactly one of train.steps and train.epochs")
    for name in ("steps", "micro_batch_size", "grad_accum", "seq_len"):
        value = getattr(t, name)
        if value is not None and value < 1:
            problems.append(f"train.{name}: must be >= 1, got {value}")
    if t.epochs is not None and t.epochs <= 0:
        problems.append(f"train.epochs: must be > 0, got {t.epochs}")
    if t.lr <= 0:
        problems.append(f"train.lr: must be > 0, got {t.lr}")
    if len(t.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in t.betas):
        problems.append(f"train.betas: expected two numbers in [0, 1), got {t.betas!r}")
    if t.max_grad_norm is not None and t.max_grad_norm <= 0:
        problems.append(f"train.max_grad_norm: must be > 0 or null, got {t.max_grad_norm}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        problems.append(f"train.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
    if t.warmup_steps < 0:
        problems.append(f"train.warmup_steps: must be >= 0, got {t.warmup_steps}")
    if e.checkpoint_interval < 1:
        problems.append(f"engine.checkpoint_interval: must be >= 1, got {e.checkpoint_interval}")
    if e.grad_slabs < 1:
        problems.append(f"engine.grad_slabs: must be >= 1, got {e.grad_slabs}")
    if e.layer_slots < 2:
        problems.append(f"engine.layer_slots: must be >= 2, got {e.layer_slots}")
    for name in ("packer_threads", "adamw_threads"):
        value = getattr(e, name)
        if value is not None and value < 1:
            problems.append(f"engine.{name}: must be >= 1 or null, got {value}")
    if e.long_context_min_seq is not None and e.long_context_min_seq < 1:
        problems.append(f"engine.long_context_min_seq: must be >= 1 or null, got {e.long_context_min_seq}")
    if not (e.keep_activations == "auto" or (isinstance(e.keep_activations, int) and e.keep_activations >= 0)):
        problems.append(f"engine.keep_activations: expected 'auto' or an int >= 0, got {e.keep_activations!r}")
    if e.loss_chunk_tokens < 1:
        problems.append(f"engine.loss_chunk_tokens: must be >= 1, got {e.loss_chunk_tokens}")
    if e.max_gpu_mem is not None:
        try:
            parse_bytes(e.max_gpu_mem)
        except ValueError as err:
            problems.append(f"engine.max_gpu_mem: {err}")
    if not 0.0 <= r.data.test_fraction < 1.0:
        problems.append(f"data.test_fraction: must be in [0, 1), got {r.data.test_fraction}")
    if r.checkpoint.keep_last_n < 1:
        problems.append(f"checkpoint.keep_last_n: must be >= 1, got {r.checkpoint.keep_last_n}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'24GiB' -> 25769803776; plain integers pass through."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot read {text!r} as a size (use e.g. 24GiB, 512MiB, 80GB)")
    return int(float(num) * _UNITS[unit])


# ---------------------------------------------------------------- overrides
def apply_overrides(data: dict, overrides: list[str], problems: list[str]) -> dict:
    """`a.b=value` sets (value parsed as YAML), `~a.b` deletes."""
    for item in overrides:
        if item.startswith("~"):
            keys = item[1:].split(".")
            node = data
            for k in keys[:-1]:
                node = node.get(k, {}) if isinstance(node, dict) else {}
            if isinstance(node, dict):
                node.pop(keys[-1], None)
            continue
        if "=" not in item:
            problems.append(f"override '{item}': expected key.sub=value or ~key.sub")
            continue
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        keys = key.strip().split(".")
        node = data
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value
    return data


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe (or start from defaults when path is None), apply overrides, validate."""
    problems: list[str] = []
    data: dict = {}
    source = str(path) if path else "recipe"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise RecipeError([f"recipe file not found: {p}"], source)
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise RecipeError([f"not valid YAML: {err}"], source) from err
        if not isinstance(data, dict):
            raise RecipeError(["the top level must be a mapping"], source)
    data = apply_overrides(data, list(overrides), problems)
    recipe = _build(Recipe, data, "", problems)
    if not problems:
        _check_semantics(recipe, problems)
    if problems:
        raise RecipeError(problems, source)
    return recipe


# ---------------------------------------------------------------- rendering
def to_dict(recipe: Any) -> dict:
    return dataclasses.asdict(recipe)


def render_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, each key followed by its doc as a comment."""
    lines: list[str] = []

    def walk(obj: Any, indent: int) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            pad = "  " * indent
            if dataclasses.is_dataclass(value):
                lines.append(f"{pad}{f.name}:  # {f.metadata.get('doc', '')}")
                walk(value, indent + 1)
            else:
                dumped = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
                if dumped.endswith("\n...") or dumped.endswith("..."):
                    dumped = dumped.replace("\n...", "").replace("...", "").strip()
                lines.append(f"{pad}{f.name}: {dumped}  # {f.metadata.get('doc', '')}")

    walk(recipe, 0)
    return "\n".join(lines) + "\n"


def schema_help() -> str:
    """Every recipe key with its type, default and doc: the `--help` epilogue."""
    lines = []

    def walk(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"{prefix}{f.name} ({_type_name(tp)}, default {default!r}): {f.metadata['doc']}")

    walk(Recipe, "")
    return "\n".join(lines)
