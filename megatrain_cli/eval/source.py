"""What `megatrain eval --model` names, and the two ways to run it.

A model is an HF directory (a checkpoint's final/ is one) or `preset:NAME`: random-init weights of a
bench preset, to measure generation speed without any checkpoint (its answers are noise). It runs
resident (the whole model on the device, HF `generate`) or streamed (weights in a HostStore, layers
streamed to the device every step: `streamed.StreamedModel`); `choose_mode` picks for `auto`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PRESET_PREFIX = "preset:"
MODES = ("auto", "resident", "streamed")
PRESET_SEED = 0  # the same random weights in both modes, so their outputs can be compared
GIB = 1024 ** 3
HOST_HEADROOM = 0.95  # as the training plan: a need past 95% of the free host memory is refused


class WouldNotFit(ValueError):
    """The generation's host memory need is past the smallest host limit (exit 3 from `megatrain eval`)."""


@dataclass
class ModelSource:
    name: str  # as given: a directory, or 'preset:7b'
    config: Any  # the transformers config
    directory: Path | None  # where the weights are; None = random init (a preset)


def resolve_model(name: str, tokenizer_size: int, max_positions: int) -> ModelSource:
    """The config of `name`. A preset takes the tokenizer's size as vocabulary only when it has none of its
    own (`tiny`); the others keep theirs, so the model is the published shape and ids past the tokenizer
    decode to nothing. `max_positions` (longest prompt + new tokens) raises a preset's context if needed."""
    if name.startswith(PRESET_PREFIX):
        from megatrain_cli.presets import PRESETS

        preset = name.removeprefix(PRESET_PREFIX)
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        p = PRESETS[preset]
        config = p.hf_config(vocab_size=p.vocab_size or tokenizer_size,
                             max_position_embeddings=max(p.max_position_embeddings, max_positions))
        return ModelSource(name, config, None)
    from megatrain_cli.models.loader import load_hf_config

    config = load_hf_config(name)
    if config.vocab_size < tokenizer_size:
        raise ValueError(f"{name}: the model has {config.vocab_size} token embeddings but its tokenizer "
                         f"{tokenizer_size} tokens; they do not belong together")
    return ModelSource(name, config, Path(name))


def model_eos_ids(source: ModelSource) -> list[int]:
    """The model's own end tokens (instruct models often end turns with a token besides eos): what
    `from_pretrained` would put in its generation config."""
    if source.directory is None:
        return []
    from transformers import GenerationConfig

    if (source.directory / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(str(source.directory), local_files_only=True)
    else:
        generation = GenerationConfig.from_model_config(source.config)
    ids = generation.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


# ---------------------------------------------------------------- choosing resident or streamed
def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"--mode: expected one of {', '.join(MODES)}, got {mode!r}")


def num_params(config) -> int | None:
    """Parameters of the model (a tied head counted once); None if it is not one we can stream."""
    from megatrain_cli.models.adapter import ModelAdapter, UnsupportedArchitecture
    from megatrain_cli.store.tiles import HostStore

    try:
        return HostStore(ModelAdapter(config), torch.float32, allocate=False).num_params()
    except UnsupportedArchitecture:
        return None


def resident_bytes(config, params: int, dtype: torch.dtype, batch_size: int, max_positions: int) -> int:
    """An estimate of device memory for resident generation: weights, the KV cache of a full batch, and a
    margin for activations and logits (1 GiB + 10% of the weights)."""
    size = torch.empty((), dtype=dtype).element_size()
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    kv_cache = int(config.num_hidden_layers) * 2 * kv_heads * head_dim * batch_size * max_positions * size
    weights = params * size
    return weights + kv_cache + GIB + weights // 10


def choose_mode(mode: str, source: ModelSource, params: int | None, device: torch.device, dtype: torch.dtype,
                batch_size: int, max_positions: int) -> tuple[str, str]:
    """('resident' | 'streamed', why). `auto` is resident on CPU (streaming buys nothing where the weights
    already are), and on CUDA when `resident_bytes` fits in free device memory. `params` is `num_params`."""
    check_mode(mode)
    if mode != "auto":
        return mode, "asked for"
    if device.type != "cuda":
        return "resident", "auto, on CPU"
    if params is None:
        return "resident", "auto, an architecture that cannot stream"
    need = resident_bytes(source.config, params, dtype, batch_size, max_positions)
    free, _total = torch.cuda.mem_get_info(device)
    chosen = "resident" if need < free else "streamed"
    return chosen, f"auto: resident needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB free"


def host_bytes(mode: str, source: ModelSource, params: int | None, device: torch.device, dtype: torch.dtype,
               batch_size: int, max_positions: int) -> int | None:
    """Host memory the generation takes, None when it cannot be told (an architecture we cannot count).
    Streamed: the fp32 masters of a HostStore (4 B/param; the optimizer sections are never touched).
    Resident on the CPU: the model, its KV cache and a margin (resident_bytes). Resident on CUDA: the
    weights pass through host memory once, in `dtype` from a folder, as fp32 masters for a preset."""
    if params is None:
        return None
    if mode == "streamed" or (device.type == "cuda" and source.directory is None):
        return params * 4 + GIB // 2
    if device.type == "cuda":
        return params * torch.empty((), dtype=dtype).element_size() + GIB // 2
    return resident_bytes(source.config, params, dtype, batch_size, max_positions)


def check_host_memory(mode: str, need: int | None) -> None:
    """Raise WouldNotFit when `need` bytes are past the smallest host limit (/proc or a cgroup's)."""
    from megatrain_cli.machine import effective_host_limit

    limit = effective_host_limit()
    if need is not None and limit.available and need > HOST_HEADROOM * limit.available:  # 0: unknown
        raise WouldNotFit(f"eval: {mode} generation needs about {need / GIB:.2f} GiB of host memory, more than "
                          f"the smallest host limit allows ({limit.describe()}). Use a machine or job with more "
                          f"memory, or a smaller eval.batch_size or eval.max_new_tokens (the KV cache)")


# ---------------------------------------------------------------- loading
def host_store(source: ModelSource, dtype: torch.dtype):
    """The model's weights in a HostStore (fp32 masters): read from the directory or random-initialised.

    Unlike `loader.build_store` this leaves the optimizer sections untouched, so their pages are never
    committed: generation needs 4 bytes/param of host memory, not the 14 training does.
    """
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.models.loader import load_weights, random_init
    from megatrain_cli.store.tiles import HostStore

    store = HostStore(ModelAdapter(source.config), dtype)
    if source.directory is not None:
        load_weights(store, source.directory)
    else:
        random_init(store, PRESET_SEED)
    return store


def load_resident(source: ModelSource, device: torch.device, dtype: torch.dtype):
    """An HF model on `device`, in `dtype`, ready for `generate`."""
    from transformers import AutoModelForCausalLM

    if source.directory is not None:
        model = AutoModelForCausalLM.from_pretrained(str(source.directory), local_files_only=True, dtype=dtype)
        return model.to(device).eval()
    return resident_from_store(host_store(source, dtype), device, dtype)


def resident_from_store(store, device: torch.device, dtype: torch.dtype):
    """An HF model on `device` holding the store's weights, built without a host copy of the model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(store.adapter.config, dtype=dtype)
    model = model.to_empty(device=device)
    state = model.state_dict()
    for hf_name, tile, slot in store.hf_items():
        state[hf_name].copy_(store.master_view(tile, slot))
    if store.adapter.tied:
        model.tie_weights()
    # to_empty left the rotary inv_freq uninitialised; a fresh one is computed in fp32 on the host,
    # as from_pretrained's is (and the streamed path's), so both modes rotate identically.
    model.model.rotary_emb = store.adapter.make_rotary(device)
    return model.eval()


def load_streamed(source: ModelSource, device: torch.device, dtype: torch.dtype):
    from megatrain_cli.eval.streamed import StreamedModel

    return StreamedModel(host_store(source, dtype), device)
