"""Reading a recipe: YAML, dotted overrides, every key and type checked against the schema.

`load_recipe` reads YAML, applies dotted overrides (`train.lr=1e-5`, `~eval` to delete a key), checks
every key and type against recipe/schema.py, and raises `RecipeError` listing *all* problems at once
with their dotted paths and a did-you-mean for near misses (the value rules: recipe/checks.py). `render_yaml` and `schema_help` print the
resolved recipe and the schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megatrain_cli.recipe.checks import check_semantics, non_finite
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
        if non_finite(coerced):
            problems.append(f"{dotted}: must be a finite number, got {value!r}")
            continue
        kwargs[key] = coerced
    return cls(**kwargs)


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


def _not_a_file(p: Path) -> str:
    """What a recipe path that is not a file is: a folder, a link that leads nowhere, or nothing."""
    if p.is_dir():
        yamls = sorted(x.name for x in p.glob("*.y*ml"))[:3]
        return (f"{p} is a folder, not a recipe file; give a YAML file" +
                (f" in it ({', '.join(yamls)})" if yamls else ""))
    if p.is_symlink():
        try:
            os.stat(p)
        except OSError as err:
            if err.errno == errno.ELOOP:
                return f"{p} is a symbolic link loop (it leads back to itself: {p} -> {os.readlink(p)}); fix the link"
            return f"{p} is a symbolic link to {os.readlink(p)}, which does not exist"
    if p.exists():
        return f"{p} is not a regular file; give a YAML file"
    return f"recipe file not found: {p}"


def read_utf8(path: Path) -> str:
    """A text file every user of it reads as UTF-8, whatever the machine's locale (UnicodeDecodeError: not_utf8
    says where)."""
    return path.read_bytes().decode("utf-8")


def not_utf8(path: str | Path, data: bytes, err: UnicodeDecodeError, first_line: int = 1) -> str:
    """Where `data` (the bytes of `path` from line `first_line` on) stops being UTF-8, and the fix: a file saved
    in Latin-1 or another code page, or a binary file given as text."""
    line = first_line + data.count(b"\n", 0, err.start)
    column = err.start - data.rfind(b"\n", 0, err.start)
    return (f"{path} line {line}: not UTF-8 text (byte {data[err.start]:#04x} at column {column}); save the file "
            f"as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")


def load_recipe(path: str | Path | None, overrides: list[str] = (), *, for_training: bool = True) -> Recipe:
    """Read a YAML recipe (or start from defaults when path is None), apply overrides, validate.
    `for_training` False: a recipe without a model or a run length passes (recipe/checks.py)."""
    problems: list[str] = []
    data: dict = {}
    source = str(path) if path else "recipe"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise RecipeError([_not_a_file(p)], source)
        try:
            data = yaml.safe_load(read_utf8(p)) or {}
        except UnicodeDecodeError as err:
            raise RecipeError([not_utf8(p, p.read_bytes(), err)], source) from None
        except yaml.YAMLError as err:
            raise RecipeError([f"not valid YAML: {err}"], source) from err
        if not isinstance(data, dict):
            raise RecipeError(["the top level must be a mapping"], source)
    data = apply_overrides(data, list(overrides), problems)
    recipe = _build(Recipe, data, "", problems)
    if not problems:
        check_semantics(recipe, problems, for_training=for_training)
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
