"""The up-front checks of a run: every input looked at before anything big is allocated or any step runs.

A mistake found after the host store is built (tens of GiB, minutes) or after training (the eval's
settings) costs the user that time, and one found half-way can leave files behind. These checks read
little: a model folder's config.json, index and safetensors headers (train/model_files.py), directory
metadata, free disk space, the data's first records (all of them with eval on: the held-out split and its
gold answers depend on the whole set). Each raises TrainingError
with one message naming the recipe key (or option) and the fix: exit 2 for a bad input; a disk too
small for a checkpoint is a "would not fit" problem (exit 3, `--force` overrides), listed with the plan's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from megatrain_cli.recipe import Recipe
from megatrain_cli.train.errors import TrainingError
from megatrain_cli.train.model_files import check_model_dir

DATA_SAMPLE = 64  # records read up front when the whole data set is not needed (eval off)


def check_inputs(r: Recipe, *, dry_run: bool) -> None:
    """Everything about `r` that can be checked without a plan: model files, paths, data, eval settings.
    A dry run skips what reads records (the data) or needs optional packages (tensorboard, wandb, mlflow)."""
    from megatrain_cli.data.errors import DataError
    from megatrain_cli.data.sources import check_source

    if r.model.path is not None:
        check_model_dir(r.model.path, "model.path", r.model.trust_remote_code)
    if r.model.tokenizer is not None and not Path(r.model.tokenizer).is_dir():
        raise TrainingError(f"model.tokenizer: {r.model.tokenizer} is not a folder", 2)
    try:
        check_source(r.data.source, "data.source")
        if r.data.test_source:
            check_source(r.data.test_source, "data.test_source")
    except DataError as err:
        raise TrainingError(str(err), 2) from None
    cache = r.data.cache_dir
    if cache not in ("auto", "off") and Path(cache).exists() and not Path(cache).is_dir():
        raise TrainingError(f"data.cache_dir: {cache} is a file; give a folder, auto or off", 2)
    if cache not in ("auto", "off"):  # written after tokenising: a read-only one would be found mute
        check_output_dir(cache, "data.cache_dir", "pick another data.cache_dir, or data.cache_dir=off (no cache)")
    check_resume(r.checkpoint.resume)
    check_output_dir(r.output_dir, "output_dir")
    check_tier_folder(r.store.disk)
    from megatrain_cli.train.sinks import path_problems

    taken = path_problems(r.logging, Path(r.output_dir))
    if taken:
        raise TrainingError("\n".join(taken), 2)
    if dry_run:
        return
    from megatrain_cli.metrics.trackers import server_problem
    from megatrain_cli.train.sinks import missing_packages

    missing = missing_packages(r.logging)  # tensorboard, wandb, mlflow: optional extras
    if missing:
        raise TrainingError("\n".join(missing), 2)
    uri = r.logging.mlflow_tracking_uri
    unreachable = server_problem(uri) if r.logging.mlflow and uri else ""
    if unreachable:
        raise TrainingError(f"logging.mlflow_tracking_uri: {uri}: {unreachable}; start it or fix the URI, or set "
                            f"logging.mlflow=false. Nothing was written", 2)
    check_data(r)


def check_resume(resume: str | None) -> None:
    """checkpoint.resume: 'auto', null, or a complete checkpoint (its manifest and file sizes: stats only)."""
    if resume in (None, "auto"):
        return
    from megatrain_cli.checkpoint.format import CheckpointError
    from megatrain_cli.checkpoint.layout import read_manifest

    if not Path(resume).is_dir():
        raise TrainingError(f"checkpoint.resume: no checkpoint at {resume}", 2)
    try:
        read_manifest(Path(resume))
    except CheckpointError as err:
        raise TrainingError(f"checkpoint.resume: {err}", 2) from None


def check_data(r: Recipe) -> None:
    """The data reads in its format now, not after the model is built. With eval on, the whole source is
    read (the held-out split and its gold answers depend on all of it: a second read of the data, which
    training reads again); otherwise its first DATA_SAMPLE records."""
    import dataclasses

    from megatrain_cli.data import load_examples
    from megatrain_cli.eval.run import select_examples

    cfg = r.data
    # A preference method's pairs are read whole and tokenised before anything is written (train/preference.py);
    # its eval scores held-out pairs, not gold answers: here its first records, in its format.
    preference = r.train.method not in ("sft", "grpo")
    if not r.eval.enabled or preference:
        cfg = dataclasses.replace(cfg, max_samples=min(cfg.max_samples or DATA_SAMPLE, DATA_SAMPLE))
    try:
        if preference:
            from megatrain_cli.data.preference import load_preference_examples

            examples = load_preference_examples(cfg, r.train.method)
        elif r.train.method == "grpo":  # prompts with gold answers: a {prompt, answer} file too
            from megatrain_cli.data.rollout_prompts import load_prompt_examples

            examples = load_prompt_examples(cfg)
        else:
            examples = load_examples(cfg)
    except ValueError as err:  # the data itself, not the eval: training would fail on it too
        raise TrainingError(f"data.source: {err}", 2) from None
    check_images_fit_model(r, examples)
    if not r.eval.enabled or preference:
        return
    try:
        select_examples(r.data, "test", r.eval.limit, examples)
    except ValueError as err:
        raise TrainingError(f"eval.enabled: the end-of-training eval could not run: {err}. Fix the data keys "
                            f"(data.test_fraction, data.test_source, data.fields) or set eval.enabled=false", 2) \
            from None


def check_images_fit_model(r: Recipe, examples) -> None:
    """Data with images needs a vision-language model (its config has a vision_config)."""
    import json

    from megatrain_cli.data.sources import RecordPlace
    from megatrain_cli.models.vision import PACKING_BIDIRECTIONAL, bidirectional_images
    from megatrain_cli.presets import PRESETS, is_vision_preset

    first = next((ex for ex in examples if getattr(ex, "images", None)), None)
    if first is None:
        return
    if r.model.path is not None:
        config = json.loads((Path(r.model.path) / "config.json").read_text())
        vision, kind = "vision_config" in config, config.get("model_type", "?")
        model_type = kind
    else:
        vision, kind = is_vision_preset(r.model.preset), r.model.preset
        model_type = PRESETS[kind].model_type if kind in PRESETS else "?"
    where = RecordPlace(r.data.source)(first.record)
    if not vision:
        raise TrainingError(f"data.source: {where} has images but the model ({kind!r}) has no vision tower; train a "
                            f"vision-language model (e.g. model.preset=qwen2-vl-tiny) or remove the images from the "
                            f"data", 2)
    if r.data.packing and bidirectional_images(model_type):  # Gemma 3: docs/vlm.md
        raise TrainingError(PACKING_BIDIRECTIONAL, 2)
    if r.eval.every_n_steps:  # the forward-only passes do not take images yet
        raise TrainingError(f"eval.every_n_steps: data with images ({where}) has no validation loss yet "
                            f"(docs/vlm.md); set eval.every_n_steps=null", 2)


def read_model_config(r: Recipe, tokenizer):
    """train/setup.model_config, and train.seq_len checked against the model's max_position_embeddings
    (a model.path's positions past it were never trained)."""
    from megatrain_cli.train.setup import model_config

    config = model_config(r, tokenizer)  # a config.json transformers refuses was answered by check_inputs
    limit = getattr(config, "max_position_embeddings", None)
    if r.model.path is not None and isinstance(limit, int) and r.train.seq_len > limit:
        raise TrainingError(f"train.seq_len: {r.train.seq_len} is above the model's max_position_embeddings {limit} "
                            f"({Path(r.model.path) / 'config.json'}); use train.seq_len <= {limit} (or raise it in "
                            f"config.json if the model's rope scaling supports longer sequences)", 2)
    return config


# ---------------------------------------------------------------- output folders and disk space
def check_output_dir(path: str | Path, key: str, fix: str | None = None) -> Path:
    """`path` is a folder, or can be made, and can be written; returns the nearest existing folder at or
    above it. Nothing is created there but a probe folder, removed at once (a permission bit, a read-only
    mount and root's exemptions all answer to a real attempt). `fix`: what to do (default: pick another `key`)."""
    p = Path(path)
    fix = fix or f"pick another {key}"
    if p.exists() and not p.is_dir():
        raise TrainingError(f"{key}: {p} is a file, not a folder; {fix}", 2)
    anchor = existing_parent(p)
    if not anchor.is_dir():
        raise TrainingError(f"{key}: {anchor} is a file, so {p} cannot be made under it; {fix}", 2)
    try:
        if not os.access(anchor, os.W_OK | os.X_OK):
            raise PermissionError(13, "permission denied")
        os.rmdir(tempfile.mkdtemp(prefix=".megatrain-write-test-", dir=anchor))
    except OSError as err:
        raise TrainingError(f"{key}: cannot write in {anchor} ({err.strerror or err}); "
                            f"{fix if fix != f'pick another {key}' else f'pick a writable {key}'}", 2) from None
    return anchor


def check_tier_folder(folder: str | None) -> None:
    """store.disk: an existing folder this user can write in (not made here: a mistyped path would put the
    state on whatever disk holds its parent)."""
    if folder is None:
        return
    p = Path(folder)
    if not p.exists():
        raise TrainingError(f"store.disk: {p} does not exist; create the folder on a local disk (an NVMe) or point "
                            "store.disk at one", 2)
    if not p.is_dir():
        raise TrainingError(f"store.disk: {p} is a file, not a folder; point store.disk at a folder on a local disk", 2)
    check_output_dir(p, "store.disk", "point store.disk at a folder this user can write in")


def check_tier_space(r: Recipe, disk_bytes: int) -> None:
    """The disk tier's files fit store.disk's filesystem (their space is reserved when the store is built)."""
    if r.store.disk is None or not disk_bytes:
        return
    free = free_bytes(Path(r.store.disk))
    if disk_bytes > free:
        raise TrainingError(f"store.disk: the disk tier needs {_gib(disk_bytes)} (store.disk_state "
                            f"{r.store.disk_state}) and {r.store.disk} has {_gib(free)} free; free space there, "
                            "point store.disk at a larger disk, or keep less on disk (store.disk_state=moments, "
                            "smaller train.optimizer_state)", 2)


def check_export(checkpoint: Path, out: Path, dtype, *, force: bool) -> None:
    """`megatrain export CHECKPOINT OUT`: the checkpoint is a folder; OUT is new, empty, or a previous
    export (replaced only with `force`): never a file, never a folder of other files; and its disk holds
    the weights in `dtype` (the model's size read from the checkpoint's config.json, nothing loaded)."""
    from megatrain_cli.checkpoint.export import INDEX_NAME, WEIGHTS_NAME
    from megatrain_cli.checkpoint.layout import MANIFEST, latest_checkpoint

    if not checkpoint.exists():
        raise TrainingError(f"CHECKPOINT: checkpoint not found: {checkpoint}", 2)
    if not checkpoint.is_dir():
        raise TrainingError(f"CHECKPOINT: {checkpoint} is a file; give a step_N checkpoint folder", 2)
    if out.exists() and not out.is_dir():
        raise TrainingError(f"OUT: {out} is a file; export writes a folder: give a new folder name", 2)
    if out.is_dir() and any(out.iterdir()):
        previous = (out / "config.json").is_file() and ((out / WEIGHTS_NAME).is_file() or (out / INDEX_NAME).is_file())
        if not previous:
            raise TrainingError(f"OUT: {out} is not empty and holds no previous export; give a new or empty folder "
                                f"(nothing in it is touched)", 2)
        if not force:
            raise TrainingError(f"OUT: {out} holds a previous export; --force replaces it", 2)
    check_output_dir(out, "OUT")
    source = checkpoint if (checkpoint / MANIFEST).is_file() else latest_checkpoint(checkpoint)
    if source is not None and (source / "config.json").is_file():
        from megatrain_cli.models.adapter import ModelAdapter
        from megatrain_cli.models.loader import load_hf_config
        from megatrain_cli.store.tiles import HostStore

        params = HostStore(ModelAdapter(load_hf_config(source)), dtype, allocate=False).num_params()
        problem = disk_problem("OUT", out, params * dtype.itemsize, "the export")
        if problem:
            raise TrainingError(problem, 3)


def check_eval(model: str, output_dir: str | Path) -> None:
    """`megatrain eval --model MODEL --output-dir OUT`: MODEL is a usable model folder (preset:NAME, random
    weights, has none) and OUT can be written (the recipe's keys were checked by load_recipe)."""
    from megatrain_cli.eval.source import PRESET_PREFIX

    if not model.startswith(PRESET_PREFIX):
        check_model_dir(model, "--model")
    check_output_dir(output_dir, "--output-dir")


def check_output_file(path: str | Path, key: str) -> None:
    """A file a command writes at its end (bench --output, --frame) can be written: checked first, so a
    measurement is never lost to a typo in its destination."""
    p = Path(path)
    if p.is_dir():
        raise TrainingError(f"{key}: {p} is a folder; give a file name", 2)
    if not p.parent.is_dir():
        raise TrainingError(f"{key}: the folder {p.parent} does not exist; create it first", 2)
    if not os.access(p.parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise TrainingError(f"{key}: {p} cannot be written (permission denied)", 2)


def existing_parent(p: Path) -> Path:
    """`p` if it exists, else its nearest existing ancestor (what a mkdir -p of `p` would start from)."""
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: Path) -> int:
    """Free bytes on `path`'s filesystem for this user."""
    return shutil.disk_usage(path).free


def disk_problem(key: str, path: str | Path, need: int, what: str) -> str:
    """'' when `need` bytes fit on the filesystem `path` is (or will be) on, else the problem with both figures."""
    where = existing_parent(Path(path))
    free = free_bytes(where)
    if need <= free:
        return ""
    return (f"disk: {what} needs about {_gib(need)} in {key} {path}, and its filesystem ({where.resolve()}) has "
            f"{_gib(free)} free; free space there or point {key} at a larger disk")


def run_disk_problem(r: Recipe, config) -> str:
    """What a run writes at once, against free space under output_dir: a resumable checkpoint (every run ends
    with one, train/loop.py), asked as its writer asks (checkpoint_bytes: masters, moments, room for the side
    files), and with export_final, final/ (the weights in model.dtype) beside it; '' when it fits."""
    from megatrain_cli.checkpoint.layout import checkpoint_bytes
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.store.tiles import MASTER_DTYPES, HostStore
    from megatrain_cli.train.setup import DTYPES

    store = HostStore(ModelAdapter(config), DTYPES[r.model.dtype], allocate=False,
                      master_dtype=MASTER_DTYPES[r.train.master_weights])
    need, what = checkpoint_bytes(store), "a checkpoint (masters, Adam moments, config and tokenizer)"
    if r.checkpoint.export_final:
        need += store.num_params() * DTYPES[r.model.dtype].itemsize
        what += " and final/ (the exported weights)"
    return disk_problem("output_dir", r.output_dir, need, what)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
