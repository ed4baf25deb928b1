"""The recipe: one typed schema, from which validation, `--help`, the resolved print and the
commented example YAML all come.

Every field is a dataclass field with a `doc` in its metadata. `load_recipe` reads YAML, applies
dotted overrides (`train.lr=1e-5`, `~eval` to delete a key), checks every key and type against the
schema, and raises `RecipeError` listing *all* problems at once with their dotted paths and a
did-you-mean for near misses.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


def doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    """A dataclass field carrying its documentation (the schema's single source of truth)."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass
class ModelConfig:
    path: Optional[str] = doc("Local Hugging Face model directory (config.json, *.safetensors, tokenizer). "
                              "Exactly one of path / preset.", None)
    preset: Optional[str] = doc("Named random-init shape instead of a path: tiny, 0.5b, 1.5b, 3b, 7b, 14b, "
                                "32b, 72b (Qwen2.5-shaped) or llama3-8b.", None)
    dtype: Literal["bf16", "fp32"] = doc("Compute dtype on the device (master weights are always fp32).", "bf16")
    trust_remote_code: bool = doc("Allow model code shipped inside the model directory. Off unless you trust it.",
                                  False)
    tokenizer: Optional[str] = doc("Tokenizer directory; default: the model path, or the bundled offline "
                                   "tokenizer for presets.", None)
    seed: int = doc("Seed for random init of presets.", 0)


@dataclass
class DataConfig:
    source: str = doc("A dataset: 'builtin:sample_math' (bundled), a local .json/.jsonl/.parquet file, a "
                      "directory saved by `datasets`, or a Hugging Face dataset name.", "builtin:sample_math")
    format: Literal["auto", "metamathqa", "gsm8k", "alpaca", "messages"] = doc(
        "Record format; 'auto' detects it from the fields.", "auto")
    fields: dict = doc("Field-name overrides, e.g. {query: question, response: answer}.", factory=dict)
    template: Literal["auto", "chat", "plain"] = doc(
        "Prompt template: the tokenizer's chat template when it has one ('auto'), or the plain one.", "auto")
    split: Optional[str] = doc("Dataset split to read (for hub / saved datasets); None takes 'train'.", None)
    test_fraction: float = doc("Held-out fraction for the seeded random train/test split (paper: 0.3).", 0.3)
    test_source: Optional[str] = doc("An explicit test set instead of the random split.", None)
    split_seed: int = doc("Seed of the train/test split.", 1234)
    max_samples: Optional[int] = doc("Use at most this many records (before splitting).", None)
    packing: bool = doc("Pack several examples per row (block-causal attention, positions reset) so no "
                        "FLOPs go to padding.", True)
    num_proc: int = doc("Processes for tokenisation.", 1)
    cache_dir: str = doc("Cache of tokenised examples (keyed by the data, tokenizer and template): 'auto' "
                         "(~/.cache/megatrain/tokenized, or $MEGATRAIN_CACHE/tokenized), a directory, or 'off'.",
                         "auto")


@dataclass
class TrainConfig:
    steps: Optional[int] = doc("Optimizer steps; exactly one of steps / epochs.", None)
    epochs: Optional[float] = doc("Passes over the training split; exactly one of steps / epochs.", None)
    micro_batch_size: int = doc("Sequences per micro-batch.", 1)
    grad_accum: int = doc("Micro-batches per optimizer step.", 1)
    seq_len: int = doc("Tokens per sequence (packed rows are this long).", 2048)
    lr: float = doc("Peak learning rate.", 1e-5)
    min_lr_ratio: float = doc("Final learning rate as a fraction of lr (cosine / linear schedules).", 0.0)
    weight_decay: float = doc("AdamW weight decay, applied to matrices only (not norms or biases).", 0.0)
    betas: list = doc("AdamW betas.", factory=lambda: [0.9, 0.999])
    eps: float = doc("AdamW epsilon.", 1e-8)
    warmup_steps: int = doc("Linear warm-up steps.", 0)
    schedule: Literal["cosine", "linear", "constant"] = doc("Learning-rate schedule after warm-up.", "cosine")
    max_grad_norm: Optional[float] = doc("Global gradient-norm clip; None disables clipping.", 1.0)
    seed: int = doc("Seed for data order.", 42)
    nan_policy: Literal["skip", "stop"] = doc("On a NaN/Inf loss or gradient: skip the step (counted) or stop.",
                                              "skip")


@dataclass
class EngineConfig:
    device: Literal["auto", "cpu", "cuda"] = doc("Where layers compute; 'auto' takes cuda when present.", "auto")
    checkpoint_interval: int = doc("Keep an activation checkpoint every N layers; backward recomputes each "
                                   "block of N layers from it.", 4)
    grad_slabs: int = doc("K pinned gradient slabs between the GPU and the host optimizer.", 12)
    staging_bytes: Union[int, str] = doc("Bytes of each pinned weight staging buffer; 'auto' = the largest "
                                         "layer tile.", "auto")
    loss_chunk_tokens: int = doc("Tokens per chunk of the LM-head loss, so full logits never exist.", 4096)
    max_gpu_mem: Optional[str] = doc("Device-memory budget (e.g. '24GiB'); None: what the device has.", None)
    double_buffer: bool = doc("Prefetch the next layer's weights while this one computes (CUDA).", True)
    overlap_optimizer: bool = doc("Run host AdamW in a background thread, overlapping the GPU (CUDA).", True)
    speculate_optimizer: bool = doc("Update each layer as its gradients land, before the global gradient norm "
                                    "is known; when the step turns out clipped they are corrected (exact to fp32 "
                                    "rounding), when it is not finite rolled back. Needs overlap_optimizer.", True)
    keep_activations: Union[int, str] = doc("Memory-adaptive recompute: how many of the last blocks keep their "
                                            "activations instead of being recomputed; 'auto' = as many as fit "
                                            "the device budget (0 on CPU).", "auto")
    kernels: Literal["auto", "torch", "triton"] = doc("Fused kernels: 'auto' uses Triton on CUDA, PyTorch on "
                                                      "CPU.", "auto")
    host_adamw: Literal["auto", "torch", "cpp"] = doc("Host AdamW code: 'cpp' (a C++ kernel compiled at first "
                                                      "use: one pass reading bf16 gradients, 1.37x torch's on the "
                                                      "H200), 'torch' (torch's fused CPU AdamW), 'auto' = cpp where "
                                                      "it compiles, else torch with one warning.", "auto")
    device_cast: bool = doc("Experimental: page-lock the fp32 master weights and cast them to bf16 on the GPU "
                            "(half the host memory traffic per weight transfer, twice the PCIe bytes) instead "
                            "of casting on the host into pinned staging. CUDA, one process. Measured slower on the H200 "
                            "(7B 8x4096: 6.65 against 5.14 s/step).", False)
    update_on_read: bool = doc("With deferred moments: the packer applies a clipped step's weight update to each "
                               "tile as the next forward streams it, casting the new weights straight into pinned "
                               "staging (20 instead of 24 bytes/param of host memory traffic where the forward "
                               "waits). One process, host casts. Bit-identical either way.", True)
    defer_moments: bool = doc("With the C++ kernel: an update that waits for the gradient norm (a clipped step) "
                              "stores the new weights first and the Adam moments later, off the next forward's "
                              "critical path. Bit-identical either way.", True)


@dataclass
class CheckpointConfig:
    every_n_steps: Optional[int] = doc("Write a resumable checkpoint every N steps; None: only at the end.",
                                       None)
    keep_last_n: int = doc("Keep this many step checkpoints.", 2)
    resume: Optional[str] = doc("'auto' (latest in output_dir), a checkpoint path, or None.", None)
    export_final: bool = doc("Write output_dir/final/ in Hugging Face format at the end.", True)


@dataclass
class LoggingConfig:
    every_n_steps: int = doc("Log a metrics line every N steps.", 1)
    dashboard: Literal["auto", "rich", "plain", "off"] = doc("Live view: 'auto' = rich on a terminal, plain "
                                                             "lines otherwise.", "auto")
    jsonl: bool = doc("Append every logged step to output_dir/metrics.jsonl.", True)
    tensorboard: bool = doc("Also write TensorBoard events when tensorboard is installed.", False)


@dataclass
class EvalConfig:
    enabled: bool = doc("Run exact-match eval on the held-out split at the end of training.", False)
    limit: Optional[int] = doc("Evaluate at most N examples.", 64)
    batch_size: int = doc("Prompts per generation batch.", 8)
    max_new_tokens: int = doc("Generation length limit.", 256)


@dataclass
class Recipe:
    model: ModelConfig = doc("What to train.", factory=ModelConfig)
    data: DataConfig = doc("What to train on.", factory=DataConfig)
    train: TrainConfig = doc("Optimisation.", factory=TrainConfig)
    engine: EngineConfig = doc("How layers stream.", factory=EngineConfig)
    checkpoint: CheckpointConfig = doc("Checkpoints and resume.", factory=CheckpointConfig)
    logging: LoggingConfig = doc("Metrics and the live view.", factory=LoggingConfig)
    eval: EvalConfig = doc("Held-out exact-match eval.", factory=EvalConfig)
    output_dir: str = doc("Where checkpoints, metrics and final/ go.", "runs/default")


class RecipeError(ValueError):
    """All problems found in a recipe, one per line, each with its dotted path."""

    def __init__(self, problems: list[str], source: str = "recipe"):
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))


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
        return value in typing.get_args(tp), value
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
    if isinstance(e.staging_bytes, str) and e.staging_bytes != "auto":
        problems.append(f"engine.staging_bytes: expected an int or 'auto', got {e.staging_bytes!r}")
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
