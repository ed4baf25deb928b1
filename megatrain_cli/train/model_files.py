"""Is a model directory whole? config.json parses, every shard is there and none is cut short.

`check_model_dir` answers before anything is built, for `train` (model.path) and `eval` (--model): a
download that stopped half-way, a shard lost from the index, a config.json edited into invalid JSON or
values transformers refuses (or takes but training cannot: a NaN, more experts per token than experts), a
training checkpoint (step_N) where an exported model was meant. It reads config.json (and builds its config
object), the index and each shard's safetensors header (8 bytes plus a JSON header of a few KiB per shard;
no tensor is read), and compares each shard's size with what its header promises. One message names the
file and the fix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatrain_cli.checkpoint.layout import MANIFEST  # what a training checkpoint has and a model has not
from megatrain_cli.train.errors import TrainingError

INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors reader's own limit: a larger length means a corrupted file


def _fail(message: str) -> None:
    raise TrainingError(message, 2)


def check_model_dir(path: str | Path, key: str, trust_remote_code: bool = False) -> dict:
    """The parsed config.json of a usable model directory; TrainingError (exit 2) naming `key`, the file
    and the fix otherwise. `trust_remote_code`: model.trust_remote_code (the config may be the model's code)."""
    p = Path(path)
    if not p.exists():
        _fail(f"{key}: {p} does not exist")
    if not p.is_dir():
        _fail(f"{key}: {p} is a file; give the model's folder (config.json, *.safetensors, tokenizer)")
    if (p / MANIFEST).is_file():
        _fail(f"{key}: {p} is a training checkpoint, not a model: export it first with `megatrain export {p} OUT` "
              f"and use OUT, or use the run's final/ folder")
    config_file = p / "config.json"
    if not config_file.is_file():
        final = p / "final" / "config.json"
        hint = f"; did you mean {p / 'final'} (the run's exported model)?" if final.is_file() else ""
        _fail(f"{key}: no config.json in {p}: not a Hugging Face model folder{hint}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        _fail(f"{key}: {config_file} is not valid JSON ({err}); restore it from the model's source")
    if not isinstance(config, dict):
        _fail(f"{key}: {config_file} holds a {type(config).__name__}, not a JSON object; restore it from the "
              f"model's source")
    for problem in config_value_problems(config):
        _fail(f"{key}: {config_file}: {problem}; restore it from the model's source")
    try:  # what transformers makes of it: a config object, no weights (a wrong type or value fails here)
        from megatrain_cli.models.loader import load_hf_config

        load_hf_config(p, trust_remote_code)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a bad config, all the user's
        text = " ".join(str(err).split())
        _fail(f"{key}: {config_file} is not a usable model config ({type(err).__name__}: "
              f"{text[:300]}{'...' if len(text) > 300 else ''}); restore it from the model's source")
    for shard in shard_files(p, key):
        problem = safetensors_problem(shard)
        if problem:
            _fail(f"{key}: {problem}; fetch that file again (the download may have stopped part-way)")
    return config


# The expert counts of the mixture-of-experts families (Qwen-MoE: num_experts; Mixtral, gpt-oss: num_local_experts;
# DeepSeek: n_routed_experts), each with how many a token is routed to.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def config_value_problems(config: dict, where: str = "") -> list[str]:
    """What transformers takes without a word but training cannot: a NaN or infinite number (JSON's NaN /
    Infinity, which Python's reader accepts: router_aux_loss_coef NaN makes every step's loss NaN), and a
    token routed to more experts than there are (a traceback deep in the router otherwise)."""
    problems = []
    for name, value in config.items():
        if isinstance(value, dict):
            problems += config_value_problems(value, f"{where}{name}.")
        elif any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, list) else [value])):
            problems.append(f"{where}{name} is {value}, not a finite number")
    experts = next(((k, config[k]) for k in EXPERT_KEYS if isinstance(config.get(k), int) and config[k] > 0), None)
    per_token = config.get("num_experts_per_tok")
    if experts and isinstance(per_token, int) and per_token > experts[1]:
        problems.append(f"{where}num_experts_per_tok is {per_token}, more than the {experts[1]} experts of "
                        f"{where}{experts[0]} (a token is routed to num_experts_per_tok of them)")
    return problems


def shard_files(p: Path, key: str) -> list[Path]:
    """The shards the index names (each must exist), else every *.safetensors file of the folder."""
    index = p / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
            _fail(f"{key}: {index} is not a valid safetensors index ({type(err).__name__}: {err}); restore it "
                  f"from the model's source")
        missing = [n for n in names if not (p / str(n)).is_file()]
        if missing:
            _fail(f"{key}: {INDEX} names {len(missing)} shard(s) missing from {p}: {', '.join(map(str, missing[:3]))}"
                  f"{' ...' if len(missing) > 3 else ''}; the download is incomplete, fetch them again")
        return [p / str(n) for n in names]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        pickles = list(p.glob("*.bin")) + list(p.glob("*.pt"))
        hint = " (only pickle checkpoints: convert them to safetensors first)" if pickles else ""
        _fail(f"{key}: no *.safetensors files in {p}{hint}")
    return files


def safetensors_problem(file: Path) -> str:
    """What is wrong with a safetensors file's framing ('' when nothing): its header must parse and the
    file must end exactly where the header's last tensor does."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{file} has {size} bytes, too few for a safetensors file (truncated)"
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            return f"{file}: its header length ({n} bytes) runs past the end of the file ({size} bytes): truncated " \
                   f"or not a safetensors file"
        raw = f.read(n)
    try:
        header = json.loads(raw)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, UnicodeDecodeError):
        return f"{file}: the header is not a safetensors header (corrupted or not a safetensors file)"
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        return f"{file} has {size} bytes, its header promises {expected} ({'truncated' if size < expected else 'extra bytes'})"
    return ""
