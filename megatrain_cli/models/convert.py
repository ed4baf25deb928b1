"""Checkpoint keys -> the model's parameter names, through transformers' own conversion rules.

`from_pretrained` does not map checkpoint keys 1:1 onto parameters: it renames legacy names
(`LayerNorm.gamma`, a multimodal prefix), adds or strips the base model's prefix (a `LlamaModel`
checkpoint loads into `LlamaForCausalLM`), merges per-expert tensors into one (Mixtral, Qwen2-MoE) and
splits fused ones. Those rules live in transformers (`conversion_mapping.get_model_conversion_mapping`,
applied by `core_model_loading.convert_and_load_state_dict_in_model`); here we ask transformers for the
same rules, on a meta-device model of the config (no weights, no memory), and apply them the way
`from_pretrained` does: every key through `rename_source_key` in transformers' key order, the keys one
converter consumes collected into one group, the group converted by that converter's own operations.

What it costs: a meta model (a second or so for a 70B config), a read of the checkpoint's key names,
and at most ONE GROUP of tensors in memory at a time (a renamed tensor alone; for a merge, the tensors
of one target parameter, e.g. one layer's experts of one projection) - never a second copy of the model.
Works with transformers 5.x (the same calls exist from 5.0; checked against 5.17 and 5.24).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from megatrain_cli.models import families


class ConversionError(ValueError):
    pass


@dataclass
class TensorGroup:
    """Checkpoint keys that make one or more parameters: one key (perhaps renamed), or the sources of one
    transformers converter (`converter` is then a fresh copy of it, as from_pretrained makes per target)."""

    target: str  # the (first) parameter name the group produces
    sources: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint key, matched pattern)
    converter: Any = None  # a transformers WeightConverter, or None for a plain (renamed) tensor

    def describe(self) -> str:
        keys = [k for k, _ in self.sources]
        shown = ", ".join(keys[:3]) + (f" ... ({len(keys)} keys)" if len(keys) > 3 else "")
        return f"{self.target} <- {shown}"


@dataclass
class KeyPlan:
    groups: list[TensorGroup]
    unexpected: list[str]  # checkpoint keys with no place in the model, as `key` or `key (read as name)`

    def produces(self) -> set[str]:
        """Every parameter name the groups will make, known before any tensor is read (a converter's
        targets follow its first one, as transformers names them)."""
        names = set()
        for g in self.groups:
            patterns = g.converter.target_patterns if g.converter is not None else [g.target]
            names.update(g.target.replace(patterns[0], p) for p in patterns)
        return names


class CheckpointRules:
    """transformers' checkpoint conversion rules for one config, applied one tensor group at a time."""

    def __init__(self, config: Any):
        from transformers import AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        with torch.device("meta"):  # the config is copied: from_config may set attributes on it
            self.model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        # The state dict of a meta model holds meta tensors: names and shapes only.
        self.meta_state = self.model.state_dict()
        parameters = {n for n, _ in self.model.named_parameters()}
        buffers = {n for n, _ in self.model.named_buffers()}
        # Second names of tied parameters (a tied lm_head): a checkpoint may carry a copy; HF re-ties it.
        self.aliases = set(self.meta_state) - parameters - buffers
        # A checkpoint stored quantized (gpt-oss's MXFP4 experts) is dequantized by transformers' own rules.
        transforms = get_model_conversion_mapping(self.model, hf_quantizer=families.checkpoint_quantizer(config))
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._by_pattern = {p: c for c in self.converters for p in c.source_patterns}

    def _rename(self, key: str) -> tuple[str, str | None]:
        from transformers.core_model_loading import rename_source_key

        prefix = self.model.base_model_prefix
        renamed, pattern = rename_source_key(key, self.renamings, self.converters, prefix, self.meta_state)
        if renamed not in self.meta_state and key in self.meta_state:
            # as from_pretrained: a key that is already a parameter name keeps it (only the prefix may change)
            renamed, pattern = rename_source_key(key, [], [], prefix, self.meta_state)
        return renamed, pattern

    def plan(self, keys: Iterable[str]) -> KeyPlan:
        """Which checkpoint keys make which parameters; reads no tensor. Keys are taken in transformers'
        natural order (layers.2 before layers.10), the order a merge stacks its experts in."""
        from transformers.core_model_loading import dot_natural_key

        groups: dict[str, TensorGroup] = {}
        unexpected: list[str] = []
        for key in sorted(keys, key=dot_natural_key):
            renamed, pattern = self._rename(key)
            if renamed not in self.meta_state:
                if key.endswith("rotary_emb.inv_freq"):
                    continue  # old checkpoints saved this non-persistent buffer; it is recomputed
                unexpected.append(key if renamed == key else f"{key} (read as {renamed})")
                continue
            known = groups.get(renamed)
            if known is not None and (pattern is None or known.converter is None):
                raise ConversionError(f"checkpoint keys {known.sources[0][0]} and {key} both load into {renamed}")
            if pattern is None:
                groups[renamed] = TensorGroup(renamed, [(key, key)])
                continue
            if known is None:  # each target gets its own converter instance, as in from_pretrained
                known = groups[renamed] = TensorGroup(renamed, converter=copy.deepcopy(self._by_pattern[pattern]))
            known.sources.append((key, pattern))
        return KeyPlan(list(groups.values()), unexpected)

    def realize(self, group: TensorGroup, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The group's parameter tensors (name -> tensor, in the checkpoint's dtype). `read(key)` loads one
        checkpoint tensor; a converter's sources are read when it runs and dropped when it returns."""
        if group.converter is None:
            return {group.target: read(group.sources[0][0])}
        conv = group.converter
        for key, pattern in group.sources:
            conv.add_tensor(group.target, key, pattern, lambda key=key: read(key))
        try:
            out = conv.convert(group.target, model=self.model, config=self.model.config)
        except Exception as err:  # noqa: BLE001 - any failure of transformers' operations is reported as one
            ops = ", ".join(type(op).__name__ for op in getattr(conv, "operations", []))
            raise ConversionError(f"transformers' converter {type(conv).__name__}({conv.source_patterns} -> "
                                  f"{conv.target_patterns}; operations {ops}) cannot convert "
                                  f"{group.describe()} one group at a time: {type(err).__name__}: {err}") from err
        return {name: (t[0] if isinstance(t, list) else t) for name, t in out.items()}
