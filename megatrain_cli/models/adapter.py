"""What is model-specific, and only that: how an HF causal LM splits into embedding, decoder layers, final
norm and LM head, found through HF's own API on a meta-device model, and weightless templates of each.

The engine never owns a model: it asks this adapter for meta-device modules (the computation, no
weights) and drives them with `torch.func.functional_call`, binding views of the streamed device buffer
into their parameter slots. Parameter lists and checkpoint names come from the meta modules themselves
(biases, fused projections and extra norms come for free); the parts are found with
`get_input_embeddings`, `get_output_embeddings` and `get_decoder`, and the decoder's one ModuleList of
`num_hidden_layers` layers. Which families are verified is models/families.py's business.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from megatrain_cli.models import families
from megatrain_cli.models.attention import use_entry
from megatrain_cli.models.families import UnsupportedModel
from megatrain_cli.models.vision import VERIFIED_VLM, VisionParts, is_vision_language
from megatrain_cli.store.tiles import ParamSpec

UnsupportedArchitecture = UnsupportedModel  # the name older callers catch


def _child_name(parent: nn.Module, child: nn.Module) -> str | None:
    return next((n for n, m in parent.named_children() if m is child), None)


def _path_of(root: nn.Module, target: nn.Module) -> str | None:
    return next((n for n, m in root.named_modules() if m is target), None)


class ModelAdapter:
    """Splits one HF decoder-only causal-LM config into pieces the engine can stream."""

    def __init__(self, config: Any):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        self.config = config
        # A vision-language model's decoder numbers are its text config's (the model's own config otherwise).
        self.text_config = config.get_text_config() if is_vision_language(config) else config
        text = self.text_config
        self.model_type = families.model_type(config)
        self.num_layers = int(text.num_hidden_layers)
        self.hidden_size = int(text.hidden_size)
        self.vocab_size = int(text.vocab_size)
        auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        try:
            with torch.device("meta"):
                # Meta tensors: this costs no memory, even for a 72B config. HF picks the attention code
                # (SDPA where the family supports it; eager for Gemma 2's attention softcap).
                self._meta = auto.from_config(config)
        except ValueError as err:  # transformers: "Unrecognized configuration class ... for AutoModelForCausalLM"
            kind = "vision-language" if auto is AutoModelForImageTextToText else "causal language"
            raise UnsupportedModel(f"model type {self.model_type!r} is not a {kind} model transformers "
                                   f"knows ({str(err).splitlines()[0]})") from None
        self.architecture = type(self._meta).__name__
        self.vision: VisionParts | None = None
        self._find_parts()
        self.tied = self._head is not None and self._head.weight is self._embed.weight
        self.layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * self.num_layers)
        self.input_scale = self._embedding_scale()
        # The model class's own config: Gemma 3's vision-language class applies no final softcap (its text config
        # has one; only the text-only class reads it)
        self.logit_softcap = families.logit_softcap(config)
        self.padding_idx = getattr(self._embed, "padding_idx", None)
        # A window shorter than the sequence needs a dense mask: Mistral's config applies it to every layer,
        # layer_types-style configs to their sliding layers only.
        window = getattr(text, "sliding_window", None)
        typed = getattr(text, "layer_types", None)
        has_sliding = any("sliding" in t for t in typed) if typed else window is not None
        self.sliding_window = int(window) if window and has_sliding else None

    def _find_parts(self) -> None:
        meta = self._meta
        self._embed = meta.get_input_embeddings()
        self._head = meta.get_output_embeddings()
        decoder = meta.get_decoder() if hasattr(meta, "get_decoder") else None
        where = f"{self.architecture} (model type {self.model_type!r})"
        if not isinstance(self._embed, nn.Embedding) or decoder is None:
            raise UnsupportedModel(f"{where}: no token embedding / decoder found: not a decoder-only LM")
        if not isinstance(self._head, nn.Linear) or self._head.bias is not None:
            raise UnsupportedModel(f"{where}: the LM head is not a bias-free linear layer")
        lists = [(n, m) for n, m in decoder.named_children()
                 if isinstance(m, nn.ModuleList) and len(m) == self.num_layers]
        if len(lists) != 1:
            raise UnsupportedModel(f"{where}: expected one list of {self.num_layers} decoder layers in "
                                   f"{type(decoder).__name__}, found {[n for n, _ in lists]}")
        self._layers_attr, self._layers = lists[0]
        embed_attr = _child_name(decoder, self._embed)
        rotary = [(n, m) for n, m in decoder.named_children() if "rotary" in type(m).__name__.lower()]
        self._rotary_attr = rotary[0][0] if rotary else None
        rest = [(n, m) for n, m in decoder.named_children()
                if n not in (self._layers_attr, embed_attr, self._rotary_attr) and any(True for _ in m.parameters())]
        if embed_attr is None or len(rest) != 1:
            raise UnsupportedModel(f"{where}: expected the decoder to hold an embedding, its layers and one final "
                                   f"norm; besides them it holds {[n for n, _ in rest]}")
        self._norm_attr, self._norm = rest[0]
        if any(True for _ in self._norm.parameters()) and any(p.dim() != 1 for p in self._norm.parameters()):
            raise UnsupportedModel(f"{where}: the decoder's {self._norm_attr!r} is not a norm")
        self._decoder = decoder
        self._embed_path = _path_of(meta, self._embed)
        self._norm_path = _path_of(meta, self._norm)
        self._head_path = _path_of(meta, self._head) if not self._head.weight is self._embed.weight else None
        self._layers_path = _path_of(meta, self._layers)
        if is_vision_language(self.config):
            self.vision = VisionParts(meta, decoder, self.config)
        extra = {n for n, _ in meta.named_parameters()} - {
            n for n, _ in meta.named_parameters()
            if n.startswith((self._embed_path + ".", self._layers_path + ".", self._norm_path + "."))
            or (self._head_path is not None and n.startswith(self._head_path + "."))
            or (self.vision is not None and self.vision.owns(n))}
        if extra:
            raise UnsupportedModel(f"{where}: parameters outside embedding, layers, final norm and head: "
                                   f"{sorted(extra)[:4]}")

    def _embedding_scale(self) -> float | None:
        """The engine gathers embedding rows itself, so the embedding module's forward must be a plain lookup,
        or HF's scaled embedding (Gemma's: rows * scalar_embed_scale in the weights' dtype), whose scale it
        applies. Anything else is refused rather than silently skipped."""
        scale = getattr(self._embed, "scalar_embed_scale", None)
        if scale is not None:
            return float(scale) if float(scale) != 1.0 else None
        if type(self._embed).forward is not nn.Embedding.forward:
            raise UnsupportedModel(f"{self.architecture}: its embedding ({type(self._embed).__name__}) computes "
                                   f"more than a row lookup")
        return None

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

    def extra_tiles(self) -> list[tuple[str, list[ParamSpec]]]:
        """Tiles beyond embedding, layers and head: a vision-language model's image side (models/vision.py)."""
        return self.vision.tiles() if self.vision is not None else []

    def hf_name(self, tile: str, name: str) -> str:
        """Map (tile, name inside the tile) to the HF state-dict key (the meta model's module paths)."""
        if tile.startswith("vision."):
            return self.vision.hf_name(tile, name)
        if tile == "embed":
            return f"{self._embed_path}.{name}"
        if tile == "head":
            if name.startswith("lm_head."):
                return f"{self._head_path}.{name[len('lm_head.'):]}"
            return f"{self._norm_path}.{name[len('norm.'):]}"
        return f"{self._layers_path}.{tile[len('layers.'):]}.{name}"  # tile = 'layers.N'

    # ------------------------------------------------------------ templates (weightless modules)
    def layer_structure(self, index: int) -> str:
        """Layers with the same structure share templates: class, attention type and parameter shapes."""
        shapes = ",".join(f"{s.name}{s.shape}" for s in self.layer_specs(index))
        return f"{type(self._layers[index]).__name__}|{self.layer_types[index]}|{hash(shapes)}"

    def make_layer_template(self, index: int) -> nn.Module:
        """A meta-device decoder layer: the computation, no weights (a copy of the meta model's layer, with
        its own copy of the config). Its attention goes through the packed-attention entry
        (models/attention.py): rows of one document run HF's own implementation as before, packed rows
        the varlen kernel or the per-document reference, chosen per call from this layer's window,
        softcap and sinks."""
        template = copy.deepcopy(self._layers[index])
        use_entry(template)
        template.train()
        return template

    def make_norm_template(self) -> nn.Module:
        return copy.deepcopy(self._norm)

    def make_rotary(self, device: torch.device) -> nn.Module | None:
        """The rotary embedding (non-trained buffers): real, on the compute device; None without one."""
        if self._rotary_attr is None:
            return None
        meta_rotary = getattr(self._decoder, self._rotary_attr)
        with torch.device("cpu"):  # inv_freq is computed in fp32 on the host, then moved
            rotary = type(meta_rotary)(config=self.text_config)
        return rotary.to(device)

    def make_layer_inputs(self, device: torch.device):
        """The shell that builds every layer's call arguments as HF's decoder does (models/layer_inputs.py)."""
        from megatrain_cli.models.layer_inputs import LayerInputs

        return LayerInputs(self._decoder, self._layers_attr, self._norm_attr, self.num_layers, self._rotary_attr,
                           self.make_rotary(device))

    def norm_init_value(self) -> float:
        """What HF initialises the final norm's weight to (1, or 0 for Gemma's 1 + weight norms)."""
        norm = copy.deepcopy(self._norm).to_empty(device="cpu")
        self._meta._init_weights(norm)
        w = next(norm.parameters(), None)
        return float(w.detach().flatten()[0]) if w is not None else 1.0

    def init_std(self) -> float:
        return float(getattr(self.text_config, "initializer_range", 0.02))


def check_architecture(config: Any, allow_unverified: bool = False) -> str | None:
    """The recipe-level policy (families.py): refuse an unverified family unless allowed; returns the
    warning to print for an allowed one. Whether the model splits into streamable parts at all is
    ModelAdapter's check, asked first for an unverified family: model.allow_unverified is suggested only
    where it would work (GPT-2's learned positions or BERT's head would be refused right after)."""
    verified = [*families.VERIFIED, *families.VERIFIED_MOE, *VERIFIED_VLM]
    if families.model_type(config) in VERIFIED_VLM:
        ModelAdapter(config)  # its parts are found, or it says which it could not find
        return None
    if families.model_type(config) not in verified:
        try:
            ModelAdapter(config)
        except UnsupportedModel as err:  # the engine cannot stream it: no setting changes that
            raise UnsupportedModel(f"{err}; the engine streams decoder-only models built of an embedding, "
                                   f"decoder layers, a final norm and a linear LM head, which this one is not, "
                                   f"with or without model.allow_unverified (verified families: "
                                   f"{', '.join(verified)})") from None
    return families.check_verified(config, allow_unverified)
