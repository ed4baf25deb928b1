"""What is model-specific, and only that: how an HF causal LM splits into embedding, decoder layers,
final norm and LM head, and how to build weightless templates of each piece.

The engine never owns a model: it asks this adapter for meta-device modules (the computation, no
weights) and drives them with `torch.func.functional_call`, binding views of the streamed device
buffer into their parameter slots.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatrain_cli.store.tiles import ParamSpec

# Architectures whose decoder layers follow the same contract: layer(hidden, attention_mask=,
# position_ids=, position_embeddings=(cos, sin)) -> hidden; model.model.{embed_tokens, layers, norm,
# rotary_emb}; lm_head.
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")


class UnsupportedArchitecture(ValueError):
    pass


def check_architecture(config: Any) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    arch = archs[0] if archs else f"(model_type={getattr(config, 'model_type', '?')})"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"architecture {arch} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


class ModelAdapter:
    """Splits one HF causal-LM config into pieces the engine can stream."""

    def __init__(self, config: Any):
        self.architecture = check_architecture(config)
        config._attn_implementation = "sdpa"
        self.config = config
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            # Meta tensors: this costs no memory, even for a 72B config.
            self._meta = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        inner = self._meta.model
        self._layers = inner.layers
        self._norm = inner.norm
        self._rotary_cls = type(inner.rotary_emb)
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers)

    # ------------------------------------------------------------ parameter specs (HF names)
    def layer_specs(self, index: int) -> list[ParamSpec]:
        return [ParamSpec(n, tuple(p.shape)) for n, p in self._layers[index].named_parameters()]

    def embed_specs(self) -> list[ParamSpec]:
        return [ParamSpec("weight", (self.vocab_size, self.hidden_size))]

    def head_specs(self) -> list[ParamSpec]:
        """The head tile: the final norm, plus lm_head unless it is tied to the embedding."""
        specs = [ParamSpec("norm." + n, tuple(p.shape)) for n, p in self._norm.named_parameters()]
        if not self.tied:
            specs.append(ParamSpec("lm_head.weight", (self.vocab_size, self.hidden_size)))
        return specs

    @staticmethod
    def hf_name(tile: str, name: str) -> str:
        """Map (tile, name inside the tile) to the HF state-dict key."""
        if tile == "embed":
            return "model.embed_tokens." + name
        if tile == "head":
            return name if name.startswith("lm_head.") else "model." + name
        return f"model.{tile}.{name}"  # tile = 'layers.N'

    # ------------------------------------------------------------ templates (weightless modules)
    def layer_structure(self, index: int) -> str:
        """Layers with the same structure can share templates (e.g. full vs sliding attention)."""
        return self.layer_types[index]

    def make_layer_template(self, index: int) -> nn.Module:
        """A meta-device decoder layer: the computation, no weights. `index` only sets attention type."""
        layer_cls = type(self._layers[index])
        with torch.device("meta"):
            template = layer_cls(self.config, index)
        template.train()
        return template

    def make_norm_template(self) -> nn.Module:
        with torch.device("meta"):
            return type(self._norm)(self.hidden_size, eps=self.config.rms_norm_eps)

    def make_rotary(self, device: torch.device) -> nn.Module:
        """Rotary embedding (a non-trained buffer): real, on the compute device."""
        with torch.device("cpu"):  # inv_freq is computed in fp32 on the host, then moved
            rotary = self._rotary_cls(config=self.config)
        return rotary.to(device)

    def init_std(self) -> float:
        return float(getattr(self.config, "initializer_range", 0.02))
