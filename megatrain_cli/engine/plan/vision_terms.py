"""A vision-language model's tower in the predicted step (issue #35): the 'vision' phase of predict.py.

The step runs the tower once over every image (engine/vision_phase.py): before the decoder, each tower layer
streams in and runs its forward (A micro-batches' images at once, priced as A times the probe's micro-batch);
after the decoder's backward, each trained layer streams in again, recomputes with autograd, runs its backward
and sends its gradient. Each tower layer is priced as a streamed decoder layer is, with predict.py's own
per-parameter figures (`PerParam`: the link at the compute width, the packer's work before a read, the host
work as a gradient lands), so the two models cannot drift apart:

    forward   sum over the D layers of max(A fv, Pv prep, Pv w / H2D)        (a frozen layer: prep = a cast)
              + the patch embedding's and projector's fp32 masters copied in (vision.embed, vision.projector)
    backward  sum over the trained layers of max(A bv, Pv w / duplex, Pv back)   (bv: recompute + backward)
    serial    the embedding's and projector's updates (the next forward waits for them first, as for the
              decoder's embedding), and without the optimizer thread every trained tower layer's too

`model.freeze_vision`: forward only, no re-stream, no gradient, no update. Text rows (no images a step: both
probed times 0) run no tower at all. Left out: the projector's and patch embedding's GPU work and gradient
(small beside 32 layers), windowed against full attention layers (the probe times layer 0's), and, with fp32
moments, the worker's weights pass + cast on a tower tile after a clipped step (24 B/param where the decoder's
update on read, the price used, is 20).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain_cli.models.vision import EMBED, PROJECTOR, vision_tile


@dataclass(frozen=True)
class TowerFigures:
    layers: int  # D: every tower layer runs forward
    layer_params: float  # Pv, the mean over them
    trained_layers: int  # those with a gradient (0 under model.freeze_vision; LLaVA's unused layers never)
    outer_params: int  # vision.embed + vision.projector: cast-copied to the device once a step
    trained_outer: int  # their params that train

    @classmethod
    def of(cls, adapter, layouts: dict, frozen: frozenset = frozenset()) -> "TowerFigures | None":
        """The tower of `adapter` from a store's tile layouts (None: a text model); `frozen`: the tiles
        VisionParts.frozen_tiles gives for the recipe's model.freeze_vision / freeze_projector."""
        if adapter.vision is None:
            return None
        tiles = [vision_tile(i) for i in range(adapter.vision.depth)]
        outer = [t for t in (EMBED, PROJECTOR) if t in layouts]
        return cls(len(tiles), sum(layouts[t].numel for t in tiles) / max(1, len(tiles)),
                   sum(t not in frozen for t in tiles), sum(layouts[t].numel for t in outer),
                   sum(layouts[t].numel for t in outer if t not in frozen))


@dataclass(frozen=True)
class PerParam:
    """Seconds per parameter, as predict.py prices a streamed decoder layer (None: the link is unknown)."""

    h2d: float | None  # the weights in, at the compute dtype's width
    duplex: float | None  # one way while both directions run (the backward's re-stream and gradient)
    master_h2d: float | None  # an fp32 master copied in (the embedding's and projector's copy once a step)
    prep: float  # the host's work before the forward reads a trained tile (cast, or update + cast)
    cast: float  # a cast alone (a frozen tile: never updated)
    back: float  # host work as a trained tile's gradient lands: re-stream cast, landing, this phase's AdamW
    serial: float  # an update nothing overlaps (the embedding's)
    worker: bool  # the optimizer thread runs (else every update is serial)


def tower_phase(tower: TowerFigures | None, layer, micro_batches: int, pp: PerParam, *, cuda: bool) -> dict:
    """{'forward', 'backward', 'serial', 'gpu', 'pcie', 'host'} seconds of the tower in one step (None where the
    probe left something unknown); all 0 for a text model or text rows."""
    if tower is None or (layer is not None and not layer.vision_forward_s and not layer.vision_backward_s):
        return dict.fromkeys(("forward", "backward", "serial", "gpu", "pcie", "host"), 0.0)
    D, T, Pv = tower.layers, tower.trained_layers, tower.layer_params
    serial = ((T * Pv if not pp.worker else 0) + tower.trained_outer) * pp.serial
    host = (T * pp.prep + (D - T) * pp.cast + T * pp.back) * Pv + serial
    linked = not cuda or None not in (pp.h2d, pp.duplex, pp.master_h2d)
    h2d, duplex, master = (pp.h2d, pp.duplex, pp.master_h2d) if cuda and linked else (0.0, 0.0, 0.0)
    outer = tower.outer_params * master
    pcie = D * Pv * h2d + outer + T * Pv * duplex if linked else None
    if layer is None or not linked:  # a layer timing without a link, or none: the GPU or link unknown
        gpu = None if layer is None else micro_batches * (D * layer.vision_forward_s + T * layer.vision_backward_s)
        return {"forward": None, "backward": None, "serial": serial, "gpu": gpu, "pcie": pcie, "host": host}
    f, b = micro_batches * layer.vision_forward_s, micro_batches * layer.vision_backward_s
    if cuda:  # each layer waits for its slowest resource (predict.py's streamed layer)
        forward = T * max(f, Pv * pp.prep, Pv * h2d) + (D - T) * max(f, Pv * pp.cast, Pv * h2d) + outer
        backward = T * max(b, Pv * duplex, Pv * pp.back)
    else:  # the reference streamer: the host's work, then the layer's
        forward = D * f + (T * pp.prep + (D - T) * pp.cast) * Pv
        backward = T * (b + Pv * pp.back)
    return {"forward": forward, "backward": backward, "serial": serial, "gpu": D * f + T * b, "pcie": pcie,
            "host": host}


def frozen_of(r, adapter) -> frozenset:
    """The tiles the recipe keeps as they are (model.freeze_vision / freeze_projector), as train/setup.py has them."""
    vision = adapter.vision
    return vision.frozen_tiles(r.model.freeze_vision, r.model.freeze_projector) if vision is not None else frozenset()
