"""Qwen3-VL's deepstack in a step: besides the features that replace the image tokens' embeddings, the tower
hands one more [N, H] feature tensor per deepstack layer k (a tower layer's output through its own merger);
HF's text model adds feature k to the image tokens' hidden states right after decoder layer k
(`Qwen3VLTextModel._deepstack_process`). The decoder here runs layer by layer, so the engine does the same at
its one layer entry (`Engine._layer`): `add(i, m, y)` after layer i on micro-batch m.

The gradient needs no graph: y' = y + scatter(feature) is a sum, so d loss / d feature k is d loss / d y' at
the image tokens, read in layer k's backward (`take_grad`) from the gradient the backward already holds.
The vision phase runs those gradients back through the deepstack mergers and the tower with the main
features' (engine/vision_phase.py). Forward-only passes (a checkpoint's rebuild) add the features too;
nothing is kept past the step (`clear`), so a validation pass on text rows never sees a step's features.
"""

from __future__ import annotations

import torch


class Deepstack:
    """One step's deepstack features per micro-batch, and their gradients as the backward reads them."""

    def __init__(self, image_token_id: int, layers: int):
        self.image_token_id, self.layers = image_token_id, layers
        self.clear()

    def clear(self) -> None:
        self._masks: list[torch.Tensor | None] = []  # per micro-batch: its image tokens [B, T], or None
        self._feats: list[list[torch.Tensor]] = []  # per micro-batch: feature k's rows of its images
        self._grads: dict[tuple[int, int], torch.Tensor] = {}  # (k, micro-batch) -> d loss / d its rows

    def begin(self, mbs, deep: list[torch.Tensor], counts: list[int]) -> None:
        """The step's features (`deep`: one [N, H] per layer k, rows of every micro-batch's images in order)."""
        self.clear()
        if not self.layers or not deep:  # (a tower cut short, as the layer probe's, reaches no deepstack layer)
            return
        start, device = 0, deep[0].device
        for mb, n in zip(mbs, counts):
            self._masks.append((mb.input_ids == self.image_token_id).to(device) if n else None)
            self._feats.append([d[start:start + n].detach() for d in deep] if n else [])
            start += n

    def add(self, layer: int, mb: int, hidden: torch.Tensor) -> torch.Tensor:
        """Decoder layer `layer`'s output on micro-batch `mb`, with feature `layer` added at the image tokens
        (HF's clone + indexed sum, so the same rounding)."""
        if layer >= self.layers or mb >= len(self._masks) or self._masks[mb] is None:
            return hidden
        mask = self._masks[mb]
        out = hidden.clone()
        out[mask] = out[mask] + self._feats[mb][layer].to(out.dtype)
        return out

    def take_grad(self, layer: int, mb: int, grad: torch.Tensor) -> None:
        """d loss / d layer `layer`'s output on micro-batch `mb`: its rows at the image tokens are feature
        `layer`'s gradient."""
        if layer < self.layers and mb < len(self._masks) and self._masks[mb] is not None:
            self._grads[(layer, mb)] = grad[self._masks[mb]]

    def grads(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each feature's gradient over the step's images (zeros where no decoder layer read it: a model with
        fewer decoder layers than deepstack features)."""
        out = []
        for k, feat in enumerate(like):
            parts = [self._grads.get((k, m)) for m, mask in enumerate(self._masks) if mask is not None]
            out.append(torch.cat(parts).to(feat.dtype) if all(p is not None for p in parts)
                       else torch.zeros_like(feat))
        return out
