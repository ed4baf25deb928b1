"""Stateless layer templates and bind.

A template is an HF module built on the meta device: it holds the computation (its forward) and no
weights. `run` binds views of whatever device buffer currently holds a layer into the template's
parameter slots (torch.func.functional_call: no copy) and runs it. Any layer runs on any template
of the same structure; a small pool of templates per structure alternates (ping-pong binding).

`WeightRedirect` keeps the autograd graph from pinning streamed weights. Without it, a recomputed
layer's graph would hold the device buffer its weights came in, and that buffer could not be reused
for the next layer. Its pack hook replaces every saved tensor that lives in a streamed buffer by a
(tile, offset, size, stride) marker; the unpack hook rebuilds the view over wherever that tile is
resident when backward runs. So backward may stream a layer in again into any buffer.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.func import functional_call

from megatrain_cli.models.adapter import ModelAdapter


class TemplatePool:
    def __init__(self, adapter: ModelAdapter, per_structure: int = 2):
        self._pools: dict[str, list[nn.Module]] = {}
        self._turn: dict[str, int] = {}
        self._structure = [adapter.layer_structure(i) for i in range(adapter.num_layers)]
        for i, key in enumerate(self._structure):
            if key not in self._pools:
                self._pools[key] = [adapter.make_layer_template(i) for _ in range(per_structure)]
                self._turn[key] = 0

    def next_for(self, layer: int) -> nn.Module:
        key = self._structure[layer]
        pool = self._pools[key]
        self._turn[key] = (self._turn[key] + 1) % len(pool)
        return pool[self._turn[key]]

    def size(self) -> int:
        return sum(len(p) for p in self._pools.values())

    def all(self) -> Iterator[nn.Module]:
        """Every template of the pool (to install a change on all of them, e.g. lean_layers.chunk_mlp)."""
        for pool in self._pools.values():
            yield from pool


def run_bound(template: nn.Module, weights: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """Bind `weights` (views of a device buffer) into the template's slots and run it."""
    return functional_call(template, weights, args, kwargs, strict=True, tie_weights=False)


class WeightRedirect:
    """saved_tensors_hooks that store streamed weights by reference to their tile, not by storage."""

    def __init__(self, resident: Callable[[str], torch.Tensor]):
        self._resident = resident  # tile name -> the flat device tensor holding it now
        self._owner: dict[int, tuple[str, int]] = {}  # storage ptr -> (tile, flat's storage offset)

    def bind(self, tile: str, flat: torch.Tensor) -> None:
        self._owner[flat.untyped_storage().data_ptr()] = (tile, flat.storage_offset())

    def _pack(self, t: torch.Tensor) -> Any:
        owner = self._owner.get(t.untyped_storage().data_ptr())
        if owner is None:
            return t
        tile, base = owner
        return ("streamed", tile, t.storage_offset() - base, tuple(t.shape), t.stride())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not (isinstance(packed, tuple) and packed and packed[0] == "streamed"):
            return packed
        _, tile, rel, shape, stride = packed
        flat = self._resident(tile)
        return flat.as_strided(shape, stride, flat.storage_offset() + rel)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
