"""A vision-language model's image side, found through HF's own API on the meta-device model: the vision
tower, its layers (blocks), the projector, and where image features enter the decoder's input embeddings.

The tiles (store order after the decoder's): `vision.embed` (the tower's parameters outside its layers and
the projector: the patch embedding, position tables, norms), `vision.0` ... `vision.D-1` (one per tower layer,
streamed like decoder layers) and `vision.projector` (Qwen2-VL's merger, LLaVA's multi_modal_projector).
Names in `vision.embed` and `vision.projector` are relative to the base model (`model.`), so the features
shell binds them as they are; a layer's names are relative to its layer.

Image features are HF's: the family's `get_image_features` runs on a SHELL of the base model whose tower
layers are stand-ins (`make_features_shell(layer_fn)`: the engine decides how each layer runs, streamed and
recomputed in the backward); they are placed with HF's `get_placeholder_mask` + `masked_scatter`, and
Qwen2-VL's multimodal rotary positions come from HF's `get_rope_index`. Nothing here holds a weight.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from megatrain_cli.models.attention import document_bounds
from megatrain_cli.models.families import UnsupportedModel
from megatrain_cli.store.tiles import ParamSpec

# model_type -> what its parity test covers (tests/engine/test_vision.py).
VERIFIED_VLM: dict[str, str] = {
    "qwen2_vl": "Qwen2-VL (dynamic resolution, multimodal RoPE, merger as projector)",
    "qwen2_5_vl": "Qwen2.5-VL (windowed vision attention, RMSNorm vision layers)",
    "llava": "LLaVA (CLIP / SigLIP tower, features from a hidden state, MLP projector, Llama / Qwen decoder)",
    "gemma3": "Gemma 3 (SigLIP tower, pooled projector, image tokens attending both ways, scaled embeddings)",
    "qwen3_vl": "Qwen3-VL (learned position grid, deepstack features added after the first decoder layers)",
}
# Children of the tower that project into the decoder's width (the rest of the tower is `vision.embed`):
# Qwen-VL's merger, and Qwen3-VL's deepstack mergers (one per tower layer whose output also feeds the decoder).
_PROJECTOR_IN_TOWER = ("merger", "deepstack_merger_list")
EMBED, PROJECTOR = "vision.embed", "vision.projector"


def is_vision_language(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def vision_tile(index: int) -> str:
    return f"vision.{index}"


class _LayerStandIn(nn.Module):
    """Stands in for tower layer `index` in the features shell: `run(index, hidden, args, kwargs)` decides."""

    def forward(self, hidden_states, *args, **kwargs):
        return self.run(self.index, hidden_states, args, kwargs)


def _stand_in(layer: nn.Module, index: int, run: Callable) -> nn.Module:
    """A stand-in that is also an instance of the layer's class (never initialised as one): HF's output
    recorders find the tower's layers by class (`output_hidden_states`, as LLaVA's features ask), and GPU-less
    __call__ wrappers of that class (gradient checkpointing's) see it switched off."""
    cls = type(f"StandIn{type(layer).__name__}", (_LayerStandIn, type(layer)), {})
    stand = cls.__new__(cls)
    nn.Module.__init__(stand)
    stand.index, stand.run, stand.gradient_checkpointing = index, run, False
    return stand


class _ImageFeatures(nn.Module):
    """The family's own `get_image_features` as a forward (functional_call binds the base's weights)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base

    def forward(self, **images) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(features [N, H], deepstack features: one [N, H] per decoder layer they are added after; Qwen3-VL's
        only, empty for every other family), rows in placeholder order."""
        out = self.base.get_image_features(**images)
        feats = getattr(out, "pooler_output", out)  # a model output (5.x) or the features themselves
        deep = getattr(out, "deepstack_features", None) or []
        return _rows(feats), [_rows(d) for d in deep]


def _rows(feats) -> torch.Tensor:
    if isinstance(feats, (tuple, list)):  # one tensor per image
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    return feats.reshape(-1, feats.shape[-1])


class VisionParts:
    """The image side of one meta-device VLM (`meta`: AutoModelForImageTextToText on the meta device)."""

    def __init__(self, meta: nn.Module, decoder: nn.Module, config: Any):
        self.config = config
        self.model_type = str(getattr(config, "model_type", "?"))
        base = getattr(meta, meta.base_model_prefix, None)
        where = f"{type(meta).__name__} (model type {self.model_type!r})"
        vision_type = type(config.vision_config)
        towers = [(n, m) for n, m in base.named_children() if isinstance(getattr(m, "config", None), vision_type)]
        if base is None or len(towers) != 1:
            raise UnsupportedModel(f"{where}: no single vision tower found beside the decoder")
        self._base, (self._tower_attr, self._tower) = base, towers[0]
        self.base_path = meta.base_model_prefix
        vc = config.vision_config
        depth = int(getattr(vc, "depth", None) or getattr(vc, "num_hidden_layers"))
        lists = [(n, m) for n, m in self._tower.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth
                 and n.partition(".")[0] not in _PROJECTOR_IN_TOWER]  # (Qwen3-VL's deepstack mergers may number depth)
        if len(lists) != 1:
            raise UnsupportedModel(f"{where}: expected one list of {depth} vision layers, found "
                                   f"{[n for n, _ in lists]}")
        self._blocks_rel, self._blocks = lists[0]
        self.depth = depth
        projector = [f"{self._tower_attr}.{n}" for n, _ in self._tower.named_children() if n in _PROJECTOR_IN_TOWER]
        projector += [n for n, m in base.named_children()
                      if m is not self._tower and m is not decoder and any(True for _ in m.parameters())]
        if not projector:
            raise UnsupportedModel(f"{where}: no projector found between the vision tower and the decoder")
        self._projector_prefixes = tuple(p + "." for p in projector)
        blocks_prefix = f"{self._tower_attr}.{self._blocks_rel}."
        self._embed_specs, self._projector_specs = [], []
        for n, p in base.named_parameters():
            if n.startswith(blocks_prefix) or n.startswith(decoder_prefix(base, decoder)):
                continue
            (self._projector_specs if n.startswith(self._projector_prefixes) else self._embed_specs).append(
                ParamSpec(n, tuple(p.shape)))
        self.blocks_path = f"{self.base_path}.{blocks_prefix[:-1]}"
        self.image_token_id = int(config.image_token_id)
        # Qwen3-VL: the outputs of these tower layers, each through its own merger, are added to the image
        # tokens' hidden states after decoder layers 0, 1, ... (HF's `_deepstack_process`; engine/deepstack.py)
        self.deepstack = len(getattr(vc, "deepstack_visual_indexes", None) or ())

    # ------------------------------------------------------------ tiles
    def tiles(self) -> list[tuple[str, list[ParamSpec]]]:
        """(tile, specs) in store order: the embedding part, each layer, the projector."""
        out = [(EMBED, list(self._embed_specs))] if self._embed_specs else []
        out += [(vision_tile(i), [ParamSpec(n, tuple(p.shape)) for n, p in self._blocks[i].named_parameters()])
                for i in range(self.depth)]
        return out + [(PROJECTOR, list(self._projector_specs))]

    def owns(self, hf_name: str) -> bool:
        rel = hf_name[len(self.base_path) + 1:]
        return hf_name.startswith(f"{self.base_path}.") and rel.startswith((f"{self._tower_attr}.",
                                                                             *self._projector_prefixes))

    def hf_name(self, tile: str, name: str) -> str:
        if tile in (EMBED, PROJECTOR):
            return f"{self.base_path}.{name}"
        return f"{self.blocks_path}.{tile[len('vision.'):]}.{name}"

    def frozen_tiles(self, freeze_vision: bool, freeze_projector: bool) -> frozenset[str]:
        """The tiles `model.freeze_vision` (patch embedding and layers) and `model.freeze_projector` keep,
        and the layers whose output never reaches the features (unused_layers)."""
        return self.unused_layers() | frozenset(
            t for t, _ in self.tiles() if (freeze_projector if t == PROJECTOR else freeze_vision))

    def unused_layers(self) -> frozenset[str]:
        """Tower layers past the hidden state the features are read from (LLaVA's config.vision_feature_layer,
        -2 by default: the last layer runs but nothing depends on it, so HF gives it no gradient and AdamW
        leaves it as it is; so does the engine)."""
        picks = getattr(self.config, "vision_feature_layer", None)
        if picks is None:
            return frozenset()
        picks = [picks] if isinstance(picks, int) else list(picks)
        deepest = max(p % (self.depth + 1) for p in picks)  # hidden state k: after layer k - 1 (0: the embeddings)
        return frozenset(vision_tile(i) for i in range(deepest, self.depth))

    # ------------------------------------------------------------ templates and the features shell
    def layer_structure(self, index: int) -> str:
        shapes = ",".join(f"{n}{tuple(p.shape)}" for n, p in self._blocks[index].named_parameters())
        return f"{type(self._blocks[index]).__name__}|{hash(shapes)}"

    def make_layer_template(self, index: int) -> nn.Module:
        return copy.deepcopy(self._blocks[index]).train()

    def make_features_shell(self, run_layer: Callable, device: torch.device) -> nn.Module:
        """The base model with its tower's layers replaced by stand-ins calling `run_layer(index, hidden,
        args, kwargs)`, its decoder left out and its rotary tables (non-trained buffers) real on `device`.
        functional_call binds `vision.embed` / `vision.projector` under `base.<name>`."""
        tower = _shallow(self._tower)
        parent_path, _, attr = self._blocks_rel.rpartition(".")
        parent = _shallow(tower.get_submodule(parent_path)) if parent_path else tower
        parent._modules[attr] = nn.ModuleList(_stand_in(self._blocks[i], i, run_layer) for i in range(self.depth))
        if parent_path:
            _set_child(tower, parent_path, parent)
        for path, module in list(tower.named_modules()):
            if path and any(b is not None and b.is_meta for b in module._buffers.values()):
                _set_child(tower, path, _with_real_buffers(module, tower.config, device))
        base = _shallow(self._base)
        base._modules = {n: m for n, m in base._modules.items() if n in (self._tower_attr,) or
                         f"{n}." in self._projector_prefixes}
        base._modules[self._tower_attr] = tower
        return _ImageFeatures(base).train()

    # ------------------------------------------------------------ where features enter
    def image_tokens(self, input_ids: torch.Tensor) -> int:
        return int((input_ids == self.image_token_id).sum())

    def scatter(self, input_ids: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The embeddings with the image tokens' rows replaced by `features` (HF's placeholder mask)."""
        mask = self._base.get_placeholder_mask(input_ids.to(embeds.device), inputs_embeds=embeds,
                                               image_features=features)
        mask = mask[0] if isinstance(mask, tuple) else mask
        return embeds.masked_scatter(mask, features.to(embeds.dtype))

    def decoder_masks(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> dict | None:
        """The decoder's attention masks when the family's own forward builds them from the image tokens
        (Gemma 3: an image's tokens see each other both ways), by its modeling module's own functions;
        None where the decoder's causal masks are the family's."""
        import sys

        module = sys.modules[type(self._base).__module__]
        make = getattr(module, "create_masks_for_vision_model", None)
        blocks = getattr(module, "get_block_sequence_ids_for_mask", None)
        if make is None or blocks is None:
            return None
        types = (input_ids == self.image_token_id).long().to(embeds.device)  # the processor's token_type_ids
        # (config, inputs_embeds, attention_mask, cache, position_ids): the cache's name differs by version
        return make(self.config.get_text_config(), embeds, None, None, None,
                    block_sequence_ids=blocks(types, device=embeds.device))

    def position_ids(self, input_ids: torch.Tensor, images: dict,
                     text_positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """Multimodal rotary positions from HF's `get_rope_index` (host), or None for a family whose decoder
        takes plain positions. Rows of one example each: [3, B, T], as before. Packed rows (`text_positions`
        [B, T] restarting where each document starts, data/image_rows.py): each document's positions as if
        it were alone (packed_rope_index), as HF's packed layout [4, B, T] with the text positions in front."""
        rope_index = getattr(self._base, "get_rope_index", None)
        if rope_index is None:
            return None
        types = (input_ids == self.image_token_id).int()  # the processor's mm_token_type_ids: 1 = image
        grids = images.get("image_grid_thw")
        if text_positions is not None and document_bounds(text_positions) is not None:
            return packed_rope_index(rope_index, input_ids, types, grids, text_positions)
        pos, _ = rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grids)
        return pos

    def bidirectional_images(self) -> bool:
        """Whether the family's decoder lets an image's tokens see each other both ways (Gemma 3: its own
        masks, decoder_masks): packed rows' per-document causal attention cannot do that."""
        return _builds_image_masks(type(self._base).__module__)


def bidirectional_images(model_type: str) -> bool:
    """VisionParts.bidirectional_images from a config's model_type alone (the preflight: no model built)."""
    return _builds_image_masks(f"transformers.models.{model_type}.modeling_{model_type}")


def _builds_image_masks(module_name: str) -> bool:
    """The family's modeling module builds its own masks from the image tokens (HF's Gemma 3 does)."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    return getattr(module, "create_masks_for_vision_model", None) is not None


# Why Gemma 3's image rows are not packed: the varlen kernel and the reference attend causally within each
# document, while HF lets an image's tokens see the whole image; the packed row would train another model.
PACKING_BIDIRECTIONAL = ("data.packing: this model's image tokens attend to each other both ways within an image "
                         "(Gemma 3), which packed rows' causal per-document attention cannot reproduce; set "
                         "data.packing=false")


def packed_rope_index(rope_index: Callable, input_ids: torch.Tensor, types: torch.Tensor, grids: torch.Tensor | None,
                      text_positions: torch.Tensor) -> torch.Tensor:
    """[4, B, T]: `text_positions` in front of HF's multimodal positions of each document computed alone.

    `get_rope_index` over a whole packed row would continue the positions across documents (its text runs
    count on from the row's start), so it runs once per document, on that document's ids and image grids;
    the grids are taken in order, one per run of image tokens (what get_rope_index itself consumes). A row's
    padding tail continues its last document (document_bounds' rule), as it does in a row of one example.
    Costs a host loop over the step's documents (HF's own per-row loop, run per document)."""
    b, t = input_ids.shape
    out = torch.empty(4, b, t, dtype=input_ids.dtype)
    out[0] = text_positions
    bounds = document_bounds(text_positions)[0].tolist()
    flat_ids, flat_types = input_ids.reshape(-1), types.reshape(-1)
    taken = 0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        image = flat_types[lo:hi] == 1
        n = int(image[0]) + int((image[1:] & ~image[:-1]).sum())  # runs of image tokens: one image each
        doc_grids = grids[taken:taken + n] if grids is not None and n else None
        taken += n
        pos, _ = rope_index(flat_ids[None, lo:hi], mm_token_type_ids=flat_types[None, lo:hi], image_grid_thw=doc_grids)
        row, at = divmod(lo, t)
        out[1:, row, at:at + hi - lo] = pos[:, 0]
    return out


def _with_real_buffers(module: nn.Module, config: Any, device: torch.device) -> nn.Module:
    """`module` built again on the host from the tower's config, then moved: its non-trained buffers (rotary
    tables, CLIP's position ids) as its own __init__ makes them (a meta buffer would be read as garbage).
    Its parameters come along too and are never read: the shell binds the tiles' weights over them."""
    try:
        with torch.device("cpu"):  # inv_freq and the like in fp32 on the host, as HF computes them
            fresh = type(module)(config)
    except TypeError as err:
        raise UnsupportedModel(f"{type(module).__name__} holds buffers and cannot be rebuilt from the vision "
                               f"config ({err})") from None
    return fresh.to(device)


def decoder_prefix(base: nn.Module, decoder: nn.Module) -> str:
    name = next((n for n, m in base.named_children() if m is decoder), None)
    return f"{name}." if name else "\0"


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing everything but its own children table (so replacing a child leaves `module` as it was)."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    return out


def _set_child(root: nn.Module, path: str, child: nn.Module) -> None:
    """Replace the module at `path` under `root`, copying every module on the way (the meta model stays)."""
    head, _, rest = path.partition(".")
    if not rest:
        root._modules[head] = child
        return
    inner = _shallow(root._modules[head])
    root._modules[head] = inner
    _set_child(inner, rest, child)
