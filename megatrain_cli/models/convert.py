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

Export goes the other way (`SavedLayout`): the rules a checkpoint's keys went through at load are recorded on
the config (`LAYOUT_KEY`, a few pattern strings: it travels in every checkpoint's config.json), and export
reverts exactly those with transformers' own `revert_weight_conversion`, the function save_pretrained uses,
so the tensors go back under the source's names and shapes (Mixtral's per-expert `block_sparse_moe` tensors).
A model that had no checkpoint gets what save_pretrained writes for a model made from its config.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from megatrain_cli.models import families


class ConversionError(ValueError):
    pass


# The config attribute that records which of transformers' rules the loaded checkpoint's keys went through.
LAYOUT_KEY = "megatrain_checkpoint_layout"


def _rule_id(transform: Any) -> list:
    """A rule as it is written in transformers' mapping (its patterns before compilation, its scope): the
    same for the same config in every transformers 5 version that has the rule; JSON, for config.json."""
    return [type(transform).__name__, list(transform._original_source_patterns),
            list(transform._original_target_patterns), getattr(transform, "scope_prefix", None)]


def _same(a: Any) -> str:
    return json.dumps(a)  # a recorded rule compared as JSON text (config.json turns tuples into lists)


def _meta_model(config: Any):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):  # the config is copied: from_config may set attributes on it
        return auto.from_config(copy.deepcopy(config))


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
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.model = _meta_model(config)
        # The state dict of a meta model holds meta tensors: names and shapes only.
        self.meta_state = self.model.state_dict()
        parameters = {n for n, _ in self.model.named_parameters()}
        buffers = {n for n, _ in self.model.named_buffers()}
        # Second names of tied parameters (a tied lm_head): a checkpoint may carry a copy; HF re-ties it.
        self.aliases = set(self.meta_state) - parameters - buffers
        # A checkpoint stored quantized (gpt-oss's MXFP4 experts) is dequantized by transformers' own rules.
        self.transforms = get_model_conversion_mapping(self.model, hf_quantizer=families.checkpoint_quantizer(config))
        self.renamings = [t for t in self.transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in self.transforms if isinstance(t, WeightConverter)]
        self._by_pattern = {p: c for c in self.converters for p in c.source_patterns}

    def _rename(self, key: str) -> tuple[str, str | None]:
        from transformers.core_model_loading import rename_source_key

        prefix = self.model.base_model_prefix
        used = [t._was_used for t in self.transforms]  # transformers marks a rule used when it renames a key
        renamed, pattern = rename_source_key(key, self.renamings, self.converters, prefix, self.meta_state)
        if renamed not in self.meta_state and key in self.meta_state:
            # as from_pretrained: a key that is already a parameter name keeps it (only the prefix may change),
            # and the rules that would have renamed it were not used
            for t, flag in zip(self.transforms, used):
                t._was_used = flag
            renamed, pattern = rename_source_key(key, [], [], prefix, self.meta_state)
        return renamed, pattern

    def used_layout(self) -> list[list]:
        """The model's own rules the planned keys went through (after `plan`), in transformers' order: what
        from_pretrained keeps as `model._weight_conversions` for save_pretrained to revert. The quantizer's
        dequantisation is not among them (export writes the plain tensors)."""
        from transformers.conversion_mapping import get_model_conversion_mapping

        own = {_same(_rule_id(t)) for t in get_model_conversion_mapping(self.model)}
        return [_rule_id(t) for t in self.transforms if t.was_used() and _same(_rule_id(t)) in own]

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


class SavedLayout:
    """The names and shapes export writes: transformers' own reverse conversion (`revert_weight_conversion`,
    what save_pretrained calls) of the rules recorded at load under LAYOUT_KEY, as from_pretrained keeps
    them on the model; with nothing recorded (a model made from its config), the rules save_pretrained
    reverts for a model that did not come from from_pretrained (its family's mapping, no legacy renames).

    `revert` takes some of the model's tensors at a time (one tile: an MoE layer's fused experts are in
    one tile), which suits every rule that works within one layer, as all the MoE rules do."""

    def __init__(self, config: Any):
        from transformers.conversion_mapping import get_model_conversion_mapping

        self.model = _meta_model(config)
        recorded = getattr(config, LAYOUT_KEY, None)
        self.identity = recorded == []  # the checkpoint had the model's own names: nothing to revert
        if recorded is None or self.identity:
            return  # None: transformers finds the family's rules itself, as in save_pretrained
        rules = {_same(_rule_id(t)): t for t in get_model_conversion_mapping(self.model)}
        lost = [r for r in recorded if _same(r) not in rules]
        if lost:
            raise ConversionError(f"the checkpoint was loaded through transformers rules this transformers does "
                                  f"not have ({lost}); export cannot write its layout back")
        self.model._weight_conversions = [rules[_same(r)] for r in recorded]

    def revert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint tensors (name -> tensor) that `tensors` (parameter name -> tensor) come from. Views
        where transformers' reverse operations allow them (a rename, a split into experts); a reverse op
        that chunks a fused tensor copies it once (Chunk makes its pieces contiguous)."""
        from transformers.core_model_loading import revert_weight_conversion

        if self.identity:
            return dict(tensors)
        try:
            return revert_weight_conversion(self.model, tensors)
        except Exception as err:  # noqa: BLE001 - any failure of transformers' reverse operations
            raise ConversionError(f"transformers cannot revert its conversion of {sorted(tensors)[:3]} ...: "
                                  f"{type(err).__name__}: {err}") from err
