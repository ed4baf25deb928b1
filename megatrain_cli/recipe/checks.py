"""What a recipe's values must satisfy beyond their types: ranges, finiteness, contradictions between keys.

Part of the schema (schema.py holds the keys, this their rules): `check_semantics` appends one problem
per broken rule, each starting with the dotted key and saying what to write instead, so `load_recipe`
refuses a recipe with every problem listed at once. Pure: reads no file (the pre-flight check of
train/preflight.py looks at paths, model files and the machine).
"""

from __future__ import annotations

import difflib
import math
import re

from megatrain_cli.recipe.schema import DataConfig, PreferenceConfig, Recipe

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


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


def parse_duration(text: str) -> float:
    """'3h50m' -> 13800.0, '90s' -> 90.0, '1.5h' -> 5400.0: numbers each followed by d, h, m or s."""
    s = str(text).strip().lower().replace(" ", "")
    if not s or _DURATION.sub("", s):
        raise ValueError(f"cannot read {text!r} as a duration (use e.g. 3h50m, 90s, 2h)")
    return sum(float(n) * _SECONDS[u] for n, u in _DURATION.findall(s))


def non_finite(value) -> bool:
    """NaN or +-inf: a float setting that would train on garbage (a NaN lr writes NaN weights, exit 0)."""
    return isinstance(value, float) and not math.isfinite(value)


def check_semantics(r: Recipe, problems: list[str], *, for_training: bool = True) -> None:
    """Every rule the types cannot say, each broken one appended to `problems`. `for_training` False (`megatrain
    eval`: --model names the model, nothing trains): the recipe need not choose a model nor a run length."""
    _check_model(r, problems, for_training)
    _check_train(r, problems, for_training)
    _check_engine(r, problems)
    _check_outputs(r, problems)
    _check_data(r, problems)
    _check_preference(r, problems)
    _at_least(problems, "bench.doc_len_mean", r.bench.doc_len_mean, 1)
    if non_finite(r.bench.doc_len_spread) or r.bench.doc_len_spread < 0:
        problems.append(f"bench.doc_len_spread: must be a finite number >= 0 (0: every document the same length), "
                        f"got {r.bench.doc_len_spread}")


def _at_least(problems: list[str], key: str, value, low: int, *, nullable: bool = False) -> None:
    if value is not None and value < low:
        problems.append(f"{key}: must be >= {low}{' or null' if nullable else ''}, got {value}")


def _check_model(r: Recipe, problems: list[str], for_training: bool) -> None:
    from megatrain_cli.presets import PRESETS

    m = r.model
    if for_training and (m.path is None) == (m.preset is None):
        problems.append("model: set exactly one of model.path and model.preset")
    if m.preset is not None and m.preset not in PRESETS:
        near = difflib.get_close_matches(m.preset, list(PRESETS), n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        problems.append(f"model.preset: unknown preset '{m.preset}'{hint} (known: {', '.join(PRESETS)})")
    for key, value in (("model.path", m.path), ("model.tokenizer", m.tokenizer), ("data.source", r.data.source),
                       ("data.test_source", r.data.test_source), ("checkpoint.resume", r.checkpoint.resume),
                       ("output_dir", r.output_dir), ("data.cache_dir", r.data.cache_dir)):
        if value is not None and not str(value).strip():
            problems.append(f"{key}: empty; give a value or null")


def _check_train(r: Recipe, problems: list[str], for_training: bool) -> None:
    t, d = r.train, r.data
    if for_training and (t.steps is None) == (t.epochs is None):
        problems.append("train: set exactly one of train.steps and train.epochs")
    for name in ("steps", "micro_batch_size", "grad_accum"):
        _at_least(problems, f"train.{name}", getattr(t, name), 1)
    if t.seq_len < 2:  # a row needs a token and the token after it
        problems.append(f"train.seq_len: must be >= 2, got {t.seq_len}")
    if t.epochs is not None and t.epochs <= 0:
        problems.append(f"train.epochs: must be > 0, got {t.epochs}")
    if t.lr <= 0:
        problems.append(f"train.lr: must be > 0, got {t.lr}")
    if t.weight_decay < 0:
        problems.append(f"train.weight_decay: must be >= 0 (0 turns it off), got {t.weight_decay}")
    if t.eps <= 0:
        problems.append(f"train.eps: must be > 0 (it keeps Adam's division finite), got {t.eps}")
    if len(t.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in t.betas):
        problems.append(f"train.betas: expected two numbers in [0, 1), got {t.betas!r}")
    if t.max_grad_norm is not None and t.max_grad_norm <= 0:
        problems.append(f"train.max_grad_norm: must be > 0 or null, got {t.max_grad_norm}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        problems.append(f"train.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
    _at_least(problems, "train.warmup_steps", t.warmup_steps, 0)
    if not 0.0 <= t.max_skipped_fraction <= 1.0:
        problems.append(f"train.max_skipped_fraction: must be in [0, 1] (1: no limit), got {t.max_skipped_fraction}")
    _at_least(problems, "train.max_skipped_steps", t.max_skipped_steps, 1, nullable=True)
    _positive_amount(problems, "train.max_wall_time", t.max_wall_time, parse_duration, "; null: no limit")
    if t.master_weights == "bf16" and r.model.dtype == "fp32":
        problems.append("train.master_weights: bf16 masters need model.dtype bf16 (with model.dtype fp32 the "
                        "gradients are fp32 and the weights would compute in fp32 from bf16 values); set "
                        "model.dtype=bf16 or train.master_weights=fp32")
    if r.store.disk is None and r.store.disk_state != "auto":
        problems.append(f"store.disk_state: {r.store.disk_state} puts state on disk but store.disk is null; set "
                        "store.disk to a folder on a local disk, or store.disk_state=auto")
    _at_least(problems, "store.disk_in_flight", r.store.disk_in_flight, 1)
    if not 0.0 <= d.test_fraction < 1.0:
        problems.append(f"data.test_fraction: must be in [0, 1), got {d.test_fraction}")
    _at_least(problems, "data.num_proc", d.num_proc, 1)
    _at_least(problems, "data.max_samples", d.max_samples, 1, nullable=True)


def _positive_amount(problems: list[str], key: str, value, parse, hint: str = "") -> None:
    """A duration or a size written as text ('3h50m', '24GiB'): readable, and more than 0 (None passes)."""
    if value is None:
        return
    try:
        if parse(value) <= 0:
            problems.append(f"{key}: must be more than 0, got {value!r}")
    except ValueError as err:
        problems.append(f"{key}: {err}{hint}")


def _check_engine(r: Recipe, problems: list[str]) -> None:
    e = r.engine
    _at_least(problems, "engine.checkpoint_interval", e.checkpoint_interval, 1)
    _at_least(problems, "engine.grad_slabs", e.grad_slabs, 1)
    _at_least(problems, "engine.layer_slots", e.layer_slots, 2)
    _at_least(problems, "engine.packer_threads", e.packer_threads, 1, nullable=True)
    _at_least(problems, "engine.adamw_threads", e.adamw_threads, 1, nullable=True)
    _at_least(problems, "engine.long_context_min_seq", e.long_context_min_seq, 1, nullable=True)
    if not (e.keep_activations == "auto" or (isinstance(e.keep_activations, int) and e.keep_activations >= 0)):
        problems.append(f"engine.keep_activations: expected 'auto' or an int >= 0, got {e.keep_activations!r}")
    if not (e.resident_layers == "auto" or (isinstance(e.resident_layers, int) and e.resident_layers >= 0)):
        problems.append(f"engine.resident_layers: expected 'auto' or an int >= 0, got {e.resident_layers!r}")
    _at_least(problems, "engine.loss_chunk_tokens", e.loss_chunk_tokens, 1)
    _positive_amount(problems, "engine.max_gpu_mem", e.max_gpu_mem, parse_bytes)


def _check_outputs(r: Recipe, problems: list[str]) -> None:
    c, lg, ev = r.checkpoint, r.logging, r.eval
    _at_least(problems, "checkpoint.every_n_steps", c.every_n_steps, 1, nullable=True)
    _at_least(problems, "checkpoint.keep_last_n", c.keep_last_n, 1)
    _at_least(problems, "logging.every_n_steps", lg.every_n_steps, 1)
    _at_least(problems, "eval.limit", ev.limit, 1, nullable=True)
    _at_least(problems, "eval.batch_size", ev.batch_size, 1)
    _at_least(problems, "eval.max_new_tokens", ev.max_new_tokens, 1)
    _at_least(problems, "eval.every_n_steps", ev.every_n_steps, 1, nullable=True)
    _at_least(problems, "eval.val_batches", ev.val_batches, 1)
    if ev.enabled and not c.export_final and r.train.method in ("sft", "grpo"):  # a preference eval scores in the engine
        problems.append("eval.enabled: the end-of-training eval reads output_dir/final/, which "
                        "checkpoint.export_final=false does not write; set checkpoint.export_final=true or "
                        "eval.enabled=false")


REGISTRY_PREFIX = "registry:"  # data.source / data.test_source naming a data.registry entry


def parse_datasets(entries: list, problems: list[str]) -> list[tuple[str, float | None]]:
    """data.datasets as (name, weight or None); entries are {name, weight} mappings or bare names. Each
    broken rule is appended to `problems` (data/mixing.py raises them; load_recipe lists them)."""
    parsed = []
    for i, entry in enumerate(entries):
        where = f"data.datasets[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"].strip():
            problems.append(f"{where}: expected a registry name or {{name: NAME, weight: W}}, got {entry!r}")
            continue
        unknown = sorted(map(str, set(entry) - {"name", "weight"}))
        if unknown:
            problems.append(f"{where}: unknown key(s) {', '.join(unknown)} (known: name, weight)")
        weight = entry.get("weight")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                   or not math.isfinite(weight) or weight <= 0):
            problems.append(f"{where}.weight: must be a number > 0 (or left out), got {weight!r}")
            continue
        parsed.append((entry["name"], None if weight is None else float(weight)))
    names = [n for n, _ in parsed]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        problems.append(f"data.datasets: {', '.join(twice)} listed more than once")
    if len({w is None for _, w in parsed}) > 1:
        problems.append("data.datasets: give every dataset a weight, or none (then every example of each is used)")
    return parsed


def _check_data(r: Recipe, problems: list[str]) -> None:
    d = r.data
    if d.registry is not None and not d.registry.strip():
        problems.append("data.registry: empty; give the registry file or null")
    if d.system_prompt is not None and not d.system_prompt.strip():
        problems.append("data.system_prompt: empty; give the text or null")
    for key, value in (("data.source", d.source), ("data.test_source", d.test_source)):
        if value is not None and value.startswith(REGISTRY_PREFIX):
            if not value[len(REGISTRY_PREFIX):].strip():
                problems.append(f"{key}: 'registry:' needs a dataset name, e.g. registry:my_chats")
            elif d.registry is None:
                problems.append(f"{key}: {value!r} names a registry dataset; set data.registry to the registry file")
    _at_least(problems, "data.mix_size", d.mix_size, 1, nullable=True)
    parsed = parse_datasets(d.datasets, problems)
    if d.datasets:
        if d.registry is None:
            problems.append("data.datasets: names registry datasets; set data.registry to the registry file")
        if d.source != DataConfig().source:
            problems.append(f"data.datasets: replaces data.source ({d.source!r}); set one of the two")
        if d.mix_size is not None and parsed and parsed[0][1] is None:
            problems.append("data.mix_size: needs weights on data.datasets (without them every example is used)")
    elif d.mix_size is not None:
        problems.append("data.mix_size: sizes a mixture of data.datasets, which is empty")
    from_registry = bool(d.datasets) or d.source.startswith(REGISTRY_PREFIX)
    plain_test = d.test_source is not None and not d.test_source.startswith(REGISTRY_PREFIX)
    if from_registry and not plain_test:
        for key, value, default in (("data.format", d.format, "auto"), ("data.fields", d.fields, {})):
            if value != default:
                problems.append(f"{key}: does not apply to registry datasets (their entries give format and "
                                f"columns); remove it")
    _at_least(problems, "eval.num_fewshot", r.eval.num_fewshot, 0)


# The preference settings each method reads (the others, set, are refused rather than ignored).
PREFERENCE_KEYS = {"sft": (), "dpo": ("beta", "label_smoothing"), "ipo": ("beta",),
                   "simpo": ("beta", "simpo_gamma", "label_smoothing"), "orpo": ("orpo_lambda",),
                   "kto": ("beta", "desirable_weight", "undesirable_weight"), "grpo": ()}
SFT_FORMATS = ("metamathqa", "gsm8k", "alpaca", "messages")
PREFERENCE_FORMATS = ("preference", "unpaired_preference")


def _check_preference(r: Recipe, problems: list[str]) -> None:
    p, method, fmt = r.preference, r.train.method, r.data.format
    if p.beta <= 0:
        problems.append(f"preference.beta: must be > 0, got {p.beta}")
    if not 0.0 <= p.label_smoothing < 0.5:
        problems.append(f"preference.label_smoothing: must be in [0, 0.5) (the probability a label is flipped), "
                        f"got {p.label_smoothing}")
    for key in ("simpo_gamma", "orpo_lambda"):
        if getattr(p, key) < 0:
            problems.append(f"preference.{key}: must be >= 0, got {getattr(p, key)}")
    for key in ("desirable_weight", "undesirable_weight"):
        if getattr(p, key) <= 0:
            problems.append(f"preference.{key}: must be > 0, got {getattr(p, key)}")
    if not str(p.reference_cache).strip():
        problems.append("preference.reference_cache: empty; give 'auto', a directory or off")
    defaults = PreferenceConfig()
    for key in ("beta", "label_smoothing", "simpo_gamma", "orpo_lambda", "desirable_weight", "undesirable_weight"):
        if getattr(p, key) != getattr(defaults, key) and key not in PREFERENCE_KEYS[method]:
            users = [m for m, keys in PREFERENCE_KEYS.items() if key in keys]
            if method == "sft":
                problems.append(f"preference.{key}: train.method is sft, which reads no preference setting; set "
                                f"train.method ({', '.join(users)} read{'s' if len(users) == 1 else ''} it) or remove "
                                f"preference.{key}")
            else:
                problems.append(f"preference.{key}: train.method {method} does not read it (only "
                                f"{', '.join(users)}); remove it")
    if method == "grpo":
        _check_grpo(r, problems)
    elif method == "sft" and fmt in PREFERENCE_FORMATS:
        methods = "kto" if fmt == "unpaired_preference" else "dpo, ipo, simpo, orpo or kto"
        problems.append(f"data.format: {fmt} is preference data, which train.method sft (the default) does not "
                        f"read; set train.method to {methods}")
    elif method != "sft" and fmt in SFT_FORMATS:
        unpaired = " or unpaired_preference ({prompt, completion, label})" if method == "kto" else ""
        problems.append(f"data.format: {fmt} is supervised (prompt / response) data; train.method {method} trains on "
                        f"preference data: data.format preference (records {{prompt, chosen, rejected}}){unpaired}, "
                        f"or auto")
    elif method not in ("sft", "kto") and fmt == "unpaired_preference":
        problems.append(f"data.format: unpaired_preference (single completions labelled good or bad) trains with "
                        f"train.method kto only; {method} needs pairs (data.format preference)")


GRPO_REWARDS = ("exact_match", "format")


def _check_grpo(r: Recipe, problems: list[str]) -> None:
    """train.method grpo: its section's values, and data with gold answers (docs/grpo.md)."""
    g, t, fmt = r.grpo, r.train, r.data.format
    if g.num_generations < 2:
        problems.append(f"grpo.num_generations: must be >= 2 (advantages are relative to the other completions of "
                        f"the same prompt), got {g.num_generations}")
    _at_least(problems, "grpo.max_new_tokens", g.max_new_tokens, 1)
    if non_finite(g.temperature) or g.temperature <= 0:
        problems.append(f"grpo.temperature: must be a finite number > 0, got {g.temperature}")
    if non_finite(g.top_p) or not 0 < g.top_p <= 1:
        problems.append(f"grpo.top_p: must be in (0, 1], got {g.top_p}")
    if non_finite(g.epsilon) or g.epsilon <= 0:
        problems.append(f"grpo.epsilon: must be a finite number > 0, got {g.epsilon}")
    if non_finite(g.beta) or g.beta < 0:
        problems.append(f"grpo.beta: must be a finite number >= 0 (0: no KL term), got {g.beta}")
    if not g.rewards:
        problems.append("grpo.rewards: empty; name at least one reward: exact_match, format or module:function")
    for name in g.rewards:
        if not isinstance(name, str) or (name not in GRPO_REWARDS and not _module_function(name)):
            problems.append(f"grpo.rewards: {name!r} is not a reward; give exact_match, format or a Python "
                            f"function as module:function (e.g. my_rewards:length_penalty)")
    rows = t.micro_batch_size * t.grad_accum
    if g.num_generations >= 2 and rows % g.num_generations:
        problems.append(f"train.micro_batch_size: a GRPO step trains on train.micro_batch_size x train.grad_accum = "
                        f"{rows} completions, not a multiple of grpo.num_generations={g.num_generations} (every "
                        f"prompt's completions train in the same step); make it one")
    if r.eval.every_n_steps is not None:
        problems.append("eval.every_n_steps: train.method grpo has no validation loss; remove it (eval.enabled "
                        "scores held-out problems by exact match at the end)")
    if fmt in PREFERENCE_FORMATS:
        problems.append(f"data.format: {fmt} is preference data; train.method grpo samples its own completions of "
                        f"prompts with a gold answer: data.format gsm8k, metamathqa, or auto (a {{prompt, answer}} "
                        f"file too)")


def _module_function(name: str) -> bool:
    module, _, function = name.partition(":")
    return bool(module.strip()) and function.isidentifier()
