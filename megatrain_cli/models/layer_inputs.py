"""What each decoder layer is called with, built by the model's own HF decoder code.

The engine runs decoder layers one at a time, so it must hand each the arguments HF's decoder loop would:
per-layer-type attention masks (full, sliding window, chunked; for packed rows, detected from the position
ids as transformers does, the documents' boundaries instead), per-layer-type rotary tables (Gemma 3 has two RoPE bases),
position ids, and whatever that family's loop adds. Rather than re-implement each family, `LayerInputs`
runs the HF decoder's own forward on a SHELL: the decoder module with its layers replaced by recorders
(they note their arguments and pass the hidden state through) and its final norm by an identity. Its
embedding is never called (the engine gathers the rows itself and passes `inputs_embeds`), so the shell
holds no weights; only the rotary embedding is real, on the compute device.

The first recorder's hidden state is the layer-0 input: whatever a family's decoder forward does to the
embeddings before its layers (older Gemma code scaled them there; Granite-style multipliers) happens
here, differentiably. Costs per micro-batch: one
pass of HF's mask and rotary code (the masks as HF builds them: None when SDPA can run causal, a dense
[B, 1, T, T] mask for a window shorter than the sequence).

Packed rows (positions restart inside a row) run a second shell whose config names the packed-attention
entry (models/attention.py): HF's mask code then builds no mask, and the documents' boundaries go in as
HF's padding-free arguments (cu_seq_lens_q/k, max_length_q/k), which the decoder hands every layer and
each layer's attention hands the entry. Rows with one document each take the first shell, as before.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from megatrain_cli.models.attention import config_with_entry, document_bounds, document_kwargs


class _Recorder(nn.Module):
    """Stands in for decoder layer `index`: keeps its arguments, returns the hidden state unchanged."""

    def __init__(self, index: int, record: dict):
        super().__init__()
        self.index, self.record = index, record

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise TypeError("the decoder passed positional arguments besides the hidden state")
        self.record[self.index] = (hidden_states, kwargs)
        return hidden_states


class LayerCall:
    """One micro-batch's layer inputs: the layer-0 hidden state and each layer's keyword arguments."""

    def __init__(self, hidden: torch.Tensor, kwargs: list[dict[str, Any]]):
        self.hidden = hidden
        self.kwargs = kwargs

    def masks(self) -> list[torch.Tensor]:
        """The distinct dense masks among the layers' arguments (for memory checks and tests)."""
        seen: dict[int, torch.Tensor] = {}
        for kw in self.kwargs:
            m = kw.get("attention_mask")
            if isinstance(m, torch.Tensor):
                seen[id(m)] = m
        return list(seen.values())


class LayerInputs:
    """Builds LayerCalls for one model on one device (the shell: no weights, the rotary tables real)."""

    def __init__(self, decoder: nn.Module, layers_attr: str, norm_attr: str, num_layers: int, rotary_attr: str | None,
                 rotary: nn.Module | None):
        self._record: dict[int, tuple] = {}
        shell = copy.copy(decoder)  # shallow: the meta decoder itself is left as it was
        shell._modules = dict(decoder._modules)
        shell._parameters, shell._buffers = {}, {}
        shell._modules[layers_attr] = nn.ModuleList(_Recorder(i, self._record) for i in range(num_layers))
        shell._modules[norm_attr] = nn.Identity()
        if rotary_attr is not None:
            shell._modules[rotary_attr] = rotary
        self.num_layers = num_layers
        self._shell = shell.train()
        packed = copy.copy(shell)  # the same recorders and rotary; only the config differs
        packed._modules = dict(shell._modules)
        packed.config = config_with_entry(decoder.config)
        self._packed_shell = packed.train()

    def __call__(self, embeds: torch.Tensor, position_ids: torch.Tensor, masks: dict | None = None) -> LayerCall:
        """Run HF's decoder forward on `embeds` [B, T, H] (autograd follows it: see module doc).
        `position_ids` [B, T] (or a VLM's [3 | 4, B, T]: attention.document_bounds): best on the host (the documents are read there; they move to the device
        here). `masks`: per-layer-type masks the decoder takes as they are (a VLM family's own: Gemma 3's)."""
        self._record.clear()
        # A VLM's multimodal positions: [3, B, T] one example per row; [4, B, T] packed rows, whose documents
        # come from the text positions in front (HF's layout: its text model splits them off the same way)
        docs = document_bounds(position_ids)
        pos = position_ids.to(embeds.device)
        if docs is None:
            extra = {"attention_mask": masks} if masks is not None else {}
            out = self._shell(inputs_embeds=embeds, position_ids=pos, use_cache=False, **extra)
        else:
            bounds = document_kwargs(docs[0].to(embeds.device), docs[1])
            out = self._packed_shell(inputs_embeds=embeds, position_ids=pos, use_cache=False, **bounds)
        last = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
        if len(self._record) != self.num_layers or last.shape != embeds.shape:
            raise ValueError(f"{type(self._shell).__name__}'s forward does not run its decoder layers as one "
                             f"hidden state through each in turn: not a supported decoder-only layout")
        hidden = self._record[0][0]
        kwargs = [self._record[i][1] for i in range(self.num_layers)]
        self._record.clear()
        if docs is not None and any(kw.get("cu_seq_lens_q") is not bounds["cu_seq_lens_q"] for kw in kwargs):
            raise ValueError(f"{type(self._shell).__name__}'s forward does not hand its layers HF's padding-free "
                             f"arguments (cu_seq_lens_q, ...): its packed rows cannot be told apart; use "
                             f"data.packing=false")
        return LayerCall(hidden, kwargs)
