"""Reading raw records (dicts) from wherever `data.source` points.

Order of resolution: `builtin:NAME` (a bundled file, or a set made on the fly: data/sample_pref.py); an
existing file (.json / .jsonl / .parquet); an existing directory (saved by `datasets.save_to_disk`, or
holding data files); otherwise a Hugging Face dataset name, optionally `name:config` (e.g.
`openai/gsm8k:main`). `datasets` is imported only on the last two paths: the GPU machine may lack it, and
plain files do not need it.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.sample_pref import GENERATED
from megatrain_cli.recipe.checks import REGISTRY_PREFIX
from megatrain_cli.recipe.load import not_utf8, read_utf8

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
BUILTIN_SOURCES = {"sample_math": ASSETS_DIR / "sample_math.jsonl",  # made by data/sample_math.py
                   "sample_vlm": ASSETS_DIR / "vlm_sample" / "data.jsonl"}  # chats about the PNGs beside it
BUILTIN_NAMES = (*BUILTIN_SOURCES, *GENERATED)  # GENERATED (data/sample_pref.py): made when read, no file
FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
# Files `datasets.save_to_disk` writes: a Dataset writes state.json, a DatasetDict dataset_dict.json.
SAVED_DATASET_MARKERS = ("dataset_dict.json", "state.json")


def read_records(source: str, split: str | None = None, *, default_split: str = "train",
                 max_records: int | None = None) -> tuple[list[dict], str]:
    """The source's records and a label naming it for error messages.

    `split` is the split asked for explicitly (None: `default_split` where the source has splits).
    Single files have no splits, so an explicit split other than 'train' is an error rather than
    silently handing back the training data.
    """
    if source.startswith("builtin:"):
        name = source[len("builtin:"):]
        if name not in BUILTIN_NAMES:
            raise DataError(f"data.source: unknown built-in data set {source!r} "
                            f"(known: {', '.join('builtin:' + k for k in BUILTIN_NAMES)})")
        if name in GENERATED:
            _no_splits(Path(source), split)
            return _check_records(GENERATED[name]()[:max_records], source), source
        return _check_records(_read_file(BUILTIN_SOURCES[name], split, max_records), source), source
    path = Path(source).expanduser()
    if path.is_file():
        return _check_records(_read_file(path, split, max_records), str(path)), str(path)
    if path.is_dir():
        return _check_records(_read_directory(path, split, default_split, max_records), str(path)), str(path)
    if _looks_like_path(source):
        raise DataError(f"data file not found: {path}")
    records = _read_hub(source, split or default_split, max_records)
    return _check_records(records, source), source


def check_source(source: str, key: str = "data.source") -> None:
    """Raise DataError, naming `key`, when `source` cannot be there: an unknown built-in or a local path
    that does not exist. Reads no record (the pre-flight check runs it before anything is built); a hub
    name is left to the loader, which may need the network, and a `registry:NAME` to the registry (load.py),
    which needs data.registry."""
    if source.startswith(REGISTRY_PREFIX):
        return
    if source.startswith("builtin:"):
        if source[len("builtin:"):] not in BUILTIN_NAMES:
            raise DataError(f"{key}: unknown built-in data set {source!r} "
                            f"(known: {', '.join('builtin:' + k for k in BUILTIN_NAMES)})")
        return
    path = Path(source).expanduser()
    if not path.exists() and _looks_like_path(source):
        raise DataError(f"{key}: data file not found: {path}")


def _looks_like_path(source: str) -> bool:
    """A name that can only be meant as a local path (a hub name is `owner/name`, no suffix)."""
    return (source.startswith((".", "/", "~")) or source.lower().endswith(FILE_SUFFIXES + (".csv",))
            or source.count("/") > 1 or "\\" in source)


def _check_records(records: list, label: str) -> list[dict]:
    if not records:
        raise DataError(f"{label}: no records (empty data set)")
    for i, rec in enumerate(records[:1000]):  # a cheap sample; conversion checks every record's fields
        if not isinstance(rec, dict):
            raise DataError(f"{label}: record {i} is a {type(rec).__name__}, expected an object with fields")
    return records


def _no_splits(path: Path, split: str | None) -> None:
    if split not in (None, "train"):
        raise DataError(f"{path}: a single file has no split {split!r} (only the whole file, 'train'); "
                        f"use data.test_source for a separate test file")


class RecordPlace:
    """How messages name a source's record i: 'FILE line N' for a .jsonl file (the line table is read only
    when a message needs it), else 'LABEL record i'."""

    def __init__(self, label: str, file: str | None = None):
        self.label = label
        path = Path(file or label)
        self.file = path if path.suffix.lower() == ".jsonl" and path.is_file() else None

    @cached_property
    def _lines(self) -> list[int]:
        with open(self.file, encoding="utf-8") as f:  # the non-blank lines, as _read_jsonl reads them
            return [n for n, line in enumerate(f, 1) if line.strip()]

    def line(self, i: int) -> int | None:
        """Record i's line in the .jsonl file; None for other sources."""
        return self._lines[i] if self.file is not None else None

    def __call__(self, i: int) -> str:
        return f"{self.label} line {self.line(i)}" if self.file is not None else f"{self.label} record {i}"


# ---------------------------------------------------------------- files
def _read_file(path: Path, split: str | None, max_records: int | None) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        _no_splits(path, split)
        return _read_jsonl(path, max_records)
    if suffix == ".json":
        return _read_json(path, split, max_records)
    if suffix == ".parquet":
        _no_splits(path, split)
        return _read_parquet(path, max_records)
    raise DataError(f"{path}: unsupported file type {suffix!r} (use {', '.join(FILE_SUFFIXES)}, a directory "
                    f"saved by `datasets`, or a Hugging Face dataset name)")


def _read_jsonl(path: Path, max_records: int | None) -> list[dict]:
    records = []
    with open(path, "rb") as f:  # bytes, decoded line by line: a line that is not UTF-8 is named
        for line_no, raw in enumerate(f, 1):
            if max_records is not None and len(records) >= max_records:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(not_utf8(path, raw, err, line_no)) from None
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {line_no}: not valid JSON ({err.msg})") from None
    return records


def _read_json(path: Path, split: str | None, max_records: int | None) -> list[dict]:
    try:
        text = read_utf8(path)
    except UnicodeDecodeError as err:
        raise DataError(not_utf8(path, path.read_bytes(), err)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # JSON lines under a .json name (as `datasets` writes them)
            _no_splits(path, split)
            return _read_jsonl(path, max_records)
        raise DataError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if isinstance(data, dict):
        # {"train": [...], "test": [...]}: the keys holding lists of records are the splits.
        splits = {k: v for k, v in data.items() if isinstance(v, list)}
        if not splits:
            raise DataError(f"{path}: expected a list of records, or an object whose values are lists "
                            f"(one per split); found keys {', '.join(map(str, data)) or 'none'}")
        if split is None and len(splits) == 1:
            data = next(iter(splits.values()))
        else:
            want = split or "train"
            if want not in splits:
                raise DataError(f"{path}: no split {want!r} (available: {', '.join(splits)})")
            data = splits[want]
    elif isinstance(data, list):
        _no_splits(path, split)
    else:
        raise DataError(f"{path}: expected a list of records, got a JSON {type(data).__name__}")
    return data[:max_records] if max_records is not None else data


def _read_parquet(path: Path, max_records: int | None) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(path)
    if max_records is not None:
        table = table.slice(0, max_records)
    return table.to_pylist()


# ---------------------------------------------------------------- datasets (saved, local dirs, hub)
def _import_datasets(label: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{label}: reading this source needs the `datasets` package (pip install datasets)") \
            from None
    return datasets


def _read_directory(path: Path, split: str | None, default_split: str, max_records: int | None) -> list[dict]:
    datasets = _import_datasets(str(path))
    if any((path / m).is_file() for m in SAVED_DATASET_MARKERS):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            want = split or default_split
            if want not in loaded:
                raise DataError(f"{path}: no split {want!r} (available: {', '.join(loaded)})")
            loaded = loaded[want]
        return _dataset_records(loaded, max_records)
    if not any(p.suffix.lower() in FILE_SUFFIXES + (".csv", ".arrow") for p in path.rglob("*") if p.is_file()):
        raise DataError(f"{path}: neither a directory saved by `datasets` (no {' / '.join(SAVED_DATASET_MARKERS)}) "
                        f"nor one holding data files ({', '.join(FILE_SUFFIXES)})")
    return _load_dataset(datasets, str(path), None, split or default_split, max_records, str(path))


def _read_hub(source: str, split: str, max_records: int | None) -> list[dict]:
    datasets = _import_datasets(source)
    name, _, config = source.partition(":")
    return _load_dataset(datasets, name, config or None, split, max_records, source)


def _load_dataset(datasets, name: str, config: str | None, split: str, max_records: int | None,
                  label: str) -> list[dict]:
    try:
        loaded = datasets.load_dataset(name, config, split=split)
    except ValueError as err:
        if "split" in str(err).lower():
            raise DataError(f"{label}: no split {split!r} ({err})") from err
        raise DataError(f"{label}: cannot load data set ({err})") from err
    except Exception as err:  # network, unknown name, missing config: one clear line, the cause chained
        raise DataError(f"{label}: cannot load data set ({type(err).__name__}: {err})") from err
    return _dataset_records(loaded, max_records)


def _dataset_records(ds, max_records: int | None) -> list[dict]:
    if max_records is not None and max_records < len(ds):
        ds = ds.select(range(max_records))
    return ds.to_list()
