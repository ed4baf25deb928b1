"""A vision-language model's image side in a step: the tower's layers streamed like decoder layers, the
patch embedding and the projector small enough to stay on the device for the step.

Forward (before the decoder's inputs): one pass over every image of the step (all micro-batches at once, so
each tower layer streams in once per step), HF's own `get_image_features` run on the features shell
(models/vision.py) with `vision.embed` / `vision.projector` bound from a per-step device copy of their
masters. Each tower layer runs as `_StreamedLayer`: its forward keeps only its input (the layer's activation
checkpoint) and runs the layer without autograd; its backward streams the layer in again, recomputes it with
autograd and sends the layer's gradient to the host, like a decoder layer's recompute + backward.

Backward (at the embedding's backward): the decoder hands d loss / d features per micro-batch; one
autograd pass through the shell runs the projector's backward, the layers' backward (last first) and the
patch embedding's. Costs: 2 transfers per tower layer per step, one [patches, width] checkpoint per layer,
the projector's and the patch embedding's activations for the step, and one H2D of their fp32 masters cast.

Qwen3-VL's deepstack features (engine/deepstack.py) come out of the same shell pass; the decoder adds them
after its first layers, and their gradients join the main features' in the one autograd pass back.

Frozen parts (`model.freeze_vision`, `model.freeze_projector`) run without autograd and send no gradient;
the optimizer never touches them (their masters stay bit-unchanged).
"""

from __future__ import annotations

import torch

from megatrain_cli.engine.deepstack import Deepstack
from megatrain_cli.engine.grad_norm import squared_norm
from megatrain_cli.engine.templates import run_bound
from megatrain_cli.models.vision import EMBED, PROJECTOR, vision_tile


def tower_forward(template, weights: dict, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """One tower layer's forward without a graph (the step's forward; the planner's probe times this)."""
    with torch.no_grad():
        return run_bound(template, weights, hidden, *args, **kwargs)


def tower_backward(template, weights: dict, hidden: torch.Tensor, args: tuple, kwargs: dict,
                   grad: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One tower layer's backward as the step runs it: recompute with autograd from its kept input, then the
    backward; (d hidden, each weight's gradient). The planner's probe times this same code."""
    x = hidden.detach().requires_grad_()
    with torch.enable_grad():
        y = run_bound(template, weights, x, *args, **kwargs)
        out = torch.autograd.grad(y, [x, *weights.values()], grad)
    return out[0], dict(zip(weights, out[1:]))


class _StreamedLayer(torch.autograd.Function):
    """One tower layer: forward without a graph (input kept), backward = stream in, recompute, backward."""

    @staticmethod
    def forward(ctx, phase, index, args, kwargs, hidden):
        ctx.phase, ctx.index, ctx.args, ctx.kwargs = phase, index, args, kwargs
        ctx.save_for_backward(hidden)
        return phase.layer_forward(index, hidden, args, kwargs)

    @staticmethod
    def backward(ctx, grad):
        (hidden,) = ctx.saved_tensors
        return None, None, None, None, ctx.phase.layer_backward(ctx.index, hidden, ctx.args, ctx.kwargs, grad)


class VisionPhase:
    """The image side of one engine. `frozen`: tiles that do not train (and get no gradient)."""

    def __init__(self, engine, frozen: frozenset[str]):
        self.engine = engine
        self.parts = engine.adapter.vision
        self.frozen = frozen
        self.layer_tiles = [vision_tile(i) for i in range(self.parts.depth)]
        self.outer_tiles = [t for t in (EMBED, PROJECTOR) if t in engine.store.layouts]
        self.trainable = [t for t in (*self.outer_tiles, *self.layer_tiles) if t not in frozen]
        if EMBED in frozen and any(t not in frozen for t in self.layer_tiles):  # no gradient would reach them
            raise ValueError("the vision tower's patch embedding and layers are frozen together (model.freeze_vision)")
        self._templates: dict[str, torch.nn.Module] = {}
        self._structure = [self.parts.layer_structure(i) for i in range(self.parts.depth)]
        for i, key in enumerate(self._structure):
            if key not in self._templates:
                self._templates[key] = self.parts.make_layer_template(i)
        self.shell = self.parts.make_features_shell(self._run_layer, engine.device)
        self.deepstack = Deepstack(self.parts.image_token_id, self.parts.deepstack)  # Qwen3-VL's; else none
        self._graph = None  # (features, deepstack features, the trainable outer tiles' leaves) forward -> backward
        self._outer_views: dict[str, dict[str, torch.Tensor]] = {}  # this step's embed / projector weights
        self._sq_norm = None

    def fetch_order(self) -> tuple[list[str], list[str]]:
        """The streamed tiles in the order the forward and the backward read them."""
        back = [t for t in reversed(self.layer_tiles) if t not in self.frozen]
        return list(self.layer_tiles), back

    # ------------------------------------------------------------ one tower layer
    def _run_layer(self, index: int, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        if vision_tile(index) in self.frozen or not torch.is_grad_enabled():
            return self.layer_forward(index, hidden, args, kwargs)
        return _StreamedLayer.apply(self, index, args, kwargs, hidden)

    def _bound(self, index: int, grad: bool):
        tile = vision_tile(index)
        return self.engine.weight_views(tile, self.engine.acquire(tile), grad=grad)

    def layer_forward(self, index: int, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        return tower_forward(self._templates[self._structure[index]], self._bound(index, False), hidden, args, kwargs)

    def layer_backward(self, index: int, hidden: torch.Tensor, args: tuple, kwargs: dict,
                       grad: torch.Tensor) -> torch.Tensor:
        w = self._bound(index, True)
        dx, grads = tower_backward(self._templates[self._structure[index]], w, hidden, args, kwargs, grad)
        self._send(vision_tile(index), grads)
        return dx

    def _send(self, tile: str, grads: dict[str, torch.Tensor]) -> None:
        acc = self.engine.grad_zeros(tile)
        views = self.engine.store.layouts[tile].views(acc)
        for name, g in grads.items():
            if g is not None:
                views[name].add_(g)
        sq = squared_norm(acc)
        self._sq_norm.add_(sq)
        self.engine.send_grad(tile, acc, sq)

    # ------------------------------------------------------------ the step
    def _outer_weights(self) -> dict[str, torch.Tensor]:
        """`vision.embed` and `vision.projector` on the device for this step (a cast copy of the masters,
        after the host optimizer has updated them), as the shell's `base.<name>` weights."""
        engine, out = self.engine, {}
        for tile in self.outer_tiles:
            if engine.worker is not None:
                engine.streamer.idle_while(lambda t=tile: engine.worker.wait(t))
            flat = engine.store.tiles[tile].master.to(engine.device, engine.dtype)
            self._outer_views[tile] = engine.weight_views(tile, flat, grad=tile not in self.frozen)
            out.update({f"base.{name}": v for name, v in self._outer_views[tile].items()})
        return out

    def forward(self, mbs, sq_norm: torch.Tensor) -> list[torch.Tensor | None]:
        """Every micro-batch's image features (rows in placeholder order), None for a text-only one. They
        are leaves of the decoder's graph: their gradients come back through `backward`."""
        self._graph, self._sq_norm = None, sq_norm
        self.deepstack.clear()
        with_images = [mb for mb in mbs if mb.images is not None]
        if not with_images:
            return [None] * len(mbs)
        dev = self.engine.device
        images = {k: torch.cat([mb.images[k] for mb in with_images]).to(dev) for k in with_images[0].images}
        if "pixel_values" in images:
            images["pixel_values"] = images["pixel_values"].to(self.engine.dtype)
        weights = self._outer_weights()
        grad = bool(self.trainable)
        with torch.set_grad_enabled(grad):
            feats, deep = torch.func.functional_call(self.shell, weights, (), images, strict=False, tie_weights=False)
        if grad:
            self._graph = (feats, deep, [w for w in weights.values() if w.requires_grad])
        counts = [self.parts.image_tokens(mb.input_ids) if mb.images is not None else 0 for mb in mbs]
        if sum(counts) != feats.shape[0]:
            raise ValueError(f"the step's rows hold {sum(counts)} image tokens, its images give {feats.shape[0]} "
                             f"features: the rows were not made by this model's processor")
        self.deepstack.begin(mbs, deep, counts)
        out, start = [], 0
        for n in counts:
            out.append(feats[start:start + n].detach().requires_grad_(grad) if n else None)
            start += n
        return out

    def backward(self, feature_grads: list[torch.Tensor | None]) -> None:
        """d loss / d features per micro-batch (None where it had none) through projector, layers, patch
        embedding; every trainable tile's gradient is sent."""
        graph, self._graph = self._graph, None
        deep_grads = self.deepstack.grads(graph[1]) if graph is not None else []
        self.deepstack.clear()  # nothing of the step's features outlives it (a validation pass on text rows)
        if graph is None:
            return
        feats, deep, leaves = graph
        grad = torch.cat([g for g in feature_grads if g is not None]).to(feats.dtype)
        # The tower layers' backward runs inside this pass (_StreamedLayer.backward), last layer first.
        grads = torch.autograd.grad([feats, *deep], leaves, [grad, *deep_grads], allow_unused=True)
        by_leaf = {id(leaf): g for leaf, g in zip(leaves, grads)}
        for tile in self.outer_tiles:
            if tile not in self.frozen:
                self._send(tile, {name: by_leaf.get(id(w)) for name, w in self._outer_views[tile].items()})
        self._outer_views = {}
