"""The planner's timing of one vision-tower layer (issue #35), run by engine/layer_probe.py in the probe's engine.

The step runs a VLM's tower once over every image (engine/vision_phase.py): each layer's forward without a
graph, then in the backward a recompute with autograd and the backward. Those two are timed here through the
same functions the step calls (`tower_forward`, `tower_backward`), the layer's weights already on the device
(what is timed is the GPU's work; the link and the host are the planner's arithmetic, as for decoder layers).
The layer's input and call arguments (cu_seqlens, rotary tables) are the ones HF's `get_image_features` hands
layer 0 on the features shell, over seeded random pixel rows of the processor's shape, so the attention runs
per image as in a real step.

Cost: the cut model's tower (patch embedding, one layer, projector) on the device, one micro-batch's images
(a 7B-class tower at 8 images of 1024 patches: ~21 MB per [patches, width] activation), warm-up + `reps`
passes each way.
"""

from __future__ import annotations


import torch

from megatrain_cli.engine.plan.probe import timed
from megatrain_cli.engine.vision_phase import tower_backward, tower_forward
from megatrain_cli.models.vision import EMBED, PROJECTOR, vision_tile


def image_inputs(vision_config, images: int, grid: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """`images` images of grid x grid patches as a Qwen-VL image processor gives them (bench/vision_rows.py's
    shape): pixel rows [patches, channels x temporal x patch^2] and image_grid_thw."""
    vc = vision_config
    patch = int(vc.patch_size)
    dim = int(getattr(vc, "in_channels", 3)) * int(getattr(vc, "temporal_patch_size", 1)) * patch * patch
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(images * grid * grid, dim, generator=g),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * images)}


def measure_tower(engine, *, images: int, grid: int, reps: int = 3, warmup: int = 1) -> tuple[float, float]:
    """(forward, recompute + backward) seconds of tower layer 0 over one micro-batch of `images` images of
    grid x grid patches, on the engine's device and dtype."""
    parts, store, dev, dtype = engine.adapter.vision, engine.store, engine.device, engine.dtype
    seen: dict[int, tuple] = {}

    def capture(index, hidden, args, kwargs):  # layer 0's call as HF's tower loop makes it; the layer: identity
        seen.setdefault(index, (hidden, args, kwargs))
        return hidden

    shell = parts.make_features_shell(capture, dev)
    weights = {}
    for tile in (EMBED, PROJECTOR):
        if tile in store.layouts:
            flat = store.tiles[tile].master.to(dev, dtype)
            weights.update({f"base.{n}": v for n, v in engine.weight_views(tile, flat, grad=False).items()})
    pixels = image_inputs(parts.config.vision_config, images, grid)
    pixels = {k: v.to(dev) for k, v in pixels.items()}
    pixels["pixel_values"] = pixels["pixel_values"].to(dtype)
    with torch.no_grad():
        torch.func.functional_call(shell, weights, (), pixels, strict=False, tie_weights=False)
    hidden, args, kwargs = seen[0]
    template = parts.make_layer_template(0)
    flat = store.tiles[vision_tile(0)].master.to(dev, dtype)
    frozen_w = engine.weight_views(vision_tile(0), flat, grad=False)
    grad_w = engine.weight_views(vision_tile(0), flat, grad=True)
    out = tower_forward(template, frozen_w, hidden, args, kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dev, out.dtype)
    cuda = dev.type == "cuda"
    fwd = timed(lambda: tower_forward(template, frozen_w, hidden, args, kwargs), cuda=cuda, reps=reps, warmup=warmup)
    bwd = timed(lambda: tower_backward(template, grad_w, hidden, args, kwargs, grad), cuda=cuda, reps=reps,
                warmup=warmup)
    return fwd, bwd
