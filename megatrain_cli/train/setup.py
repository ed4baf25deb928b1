"""The one build path: recipe -> model config -> plan -> host store -> engine. `train` and `bench` both
build through here, so a setting means the same in both and reaches the engine in one place.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

from megatrain_cli.engine.plan.step_plan import DTYPES, StepPlan
from megatrain_cli.recipe import Recipe
from megatrain_cli.store.tiles import MASTER_DTYPES
from megatrain_cli.train.errors import TrainingError


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("engine.device is 'cuda' but no CUDA device is available (use 'auto' or 'cpu')", 2)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_config(r: Recipe, tokenizer=None):
    """The HF config of model.path, or of model.preset (its vocabulary: the preset's, else the tokenizer's)."""
    from megatrain_cli.models.adapter import check_architecture
    from megatrain_cli.models.loader import load_hf_config
    from megatrain_cli.presets import PRESETS

    if r.model.path is not None:
        config = load_hf_config(r.model.path, r.model.trust_remote_code)
    else:
        p = PRESETS[r.model.preset]
        vocab = p.vocab_size or (len(tokenizer) if tokenizer is not None else 1024)
        config = p.hf_config(vocab_size=vocab, max_position_embeddings=max(p.max_position_embeddings, r.train.seq_len))
    try:
        warning = check_architecture(config, r.model.allow_unverified)
    except ValueError as err:
        raise TrainingError(f"model: {err}", 2) from None
    if warning:
        print(warning, file=sys.stderr)
    vocab = config.get_text_config().vocab_size  # a VLM's decoder's; the model's own otherwise
    if tokenizer is not None and len(tokenizer) > vocab:
        raise TrainingError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                            f"{vocab}: they do not belong together", 2)
    if (r.model.freeze_vision or r.model.freeze_projector) and getattr(config, "vision_config", None) is None:
        raise TrainingError(f"model.freeze_vision / model.freeze_projector: {config.model_type!r} has no vision "
                            f"tower; remove them (they apply to vision-language models)", 2)
    return config


def build_store(r: Recipe, config, dist=None, disk_state: str | None = None):
    """The host store (masters as train.master_weights says, moments as train.optimizer_state says, gradients;
    14 bytes/param with bf16 compute, 12 with bf16 masters, ~6 with bf16 masters and int8 moments): the model's
    weights read tensor by tensor, or the preset's seeded random init. `dist`: this rank's 1/N shard.
    `disk_state`: what the disk tier under store.disk holds (the plan's StepPlan.disk_state; None: no tier)."""
    from megatrain_cli.models.loader import build_sharded_store, build_store as build_whole
    from megatrain_cli.store.disk import DiskTier, TierError

    dtype, master = DTYPES[r.model.dtype], MASTER_DTYPES[r.train.master_weights]
    try:
        tier = DiskTier(r.store.disk, disk_state, r.store.disk_in_flight) if disk_state else None
    except TierError as err:
        raise TrainingError(str(err), 2) from None
    try:
        if dist is None:
            return build_whole(config, dtype, weights_path=r.model.path, seed=r.model.seed, master_dtype=master,
                               moments=r.train.optimizer_state, tier=tier)
        return build_sharded_store(config, dtype, dist.rank, dist.world, weights_path=r.model.path,
                                   seed=r.model.seed, cpu_group=dist.cpu_group, master_dtype=master,
                                   moments=r.train.optimizer_state, tier=tier)
    except BaseException as err:  # a full disk, a bad weights file: no tier threads or descriptors left behind
        if tier is not None:
            tier.close()
        if isinstance(err, TierError):
            raise TrainingError(str(err), 2) from None
        raise


def lean_allocator(device: torch.device) -> str:
    """On a lean path, multi-GiB activations of varying size fragment the caching allocator; expandable
    segments avoid it. Set here unless PYTORCH_CUDA_ALLOC_CONF (torch's own setting) says otherwise.
    Returns what the allocator runs with."""
    if device.type != "cuda":
        return ""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if conf:
        return conf
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        return "expandable_segments:True"
    except Exception as err:  # noqa: BLE001 - private API; the run goes on without it
        return f"default (could not set expandable_segments: {err})"


def build_engine(r: Recipe, store, plan: StepPlan, device: torch.device, dist=None, method=None):
    """The engine for `store` as `plan` and the recipe's engine settings say. What a run takes of them on
    this machine is decided here, once, and nowhere else: the Engine runs what it is given (tests drive the
    host optimizer's thread on the CPU). `method`: a preference method (methods/), None for SFT."""
    from megatrain_cli.engine.step import Engine

    # The host optimizer's thread on CUDA only: on the CPU it would compete with the compute for the same cores.
    settings = dataclasses.replace(r.engine, overlap_optimizer=r.engine.overlap_optimizer and device.type == "cuda")
    if dist is not None:  # a data-parallel rank holds a shard of each layer: none stays resident on its device
        plan = dataclasses.replace(plan, resident_layers=0)
    vision = store.adapter.vision  # a VLM's parts that model.freeze_vision / freeze_projector keep as they are
    frozen = vision.frozen_tiles(r.model.freeze_vision, r.model.freeze_projector) if vision else frozenset()
    return Engine(store, plan, settings, r.train, device=device, dist=dist, method=method, frozen=frozen)
