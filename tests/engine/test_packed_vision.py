"""Packed rows of image+text examples (issue #35): each document's own multimodal positions (models/vision.py),
attention within each document (models/attention.py), the row's images in document order.

CPU, fp32, the tiny configs of tests/engine/test_vision.py, real images from tests/data/images through the
family's image processor (Qwen's dynamic resolution: each image its own grid). Three examples (one, two and one
images; texts of different lengths; labels on each reply, never on an image token) trained as one packed row
with a padding tail, and as three rows of one example each (padded, position_ids None: the path image rows took
before packing). The plain reference is HF's model on each example alone (batch 1, no padding, no packing).
Per-token losses (one micro-batch per label token: StepResult.losses is then each token's loss) and every
gradient (vision tower, projector, decoder, embedding rows), the step's loss summed over its tokens, equal
within 1e-5. Gemma 3 is refused: HF lets an image's tokens see each other both ways.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX, MicroBatch
from megatrain_cli.models import attention
from megatrain_cli.models.loader import build_store
from megatrain_cli.models.vision import PACKING_BIDIRECTIONAL
from megatrain_cli.recipe import TrainConfig
from tests.engine.test_vision import END, IMAGE, IMAGES, START, _clip_processor, _pil_processor, reference_vlm, \
    tiny_vlm_config
from tests.engines import make_engine

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava", "qwen3_vl"]
# Per example: its images, the text tokens before them and after them (the last REPLY of which carry loss).
EXAMPLES = [(["red_square.png"], 3, 7), (["wide_stripes.png", "tall_gradient.png"], 2, 9),
            (["tall_gradient.png"], 5, 6)]
REPLY, PAD_TAIL = 4, 5


def _image_tensors(family: str, name: str) -> dict:
    from PIL import Image

    patch = 16 if family == "qwen3_vl" else 14
    processor = _clip_processor() if family in ("llava", "gemma3") else _pil_processor(patch)
    out = processor(images=[Image.open(IMAGES / name).convert("RGB")], return_tensors="pt")
    return {k: v for k, v in out.items() if k in ("pixel_values", "image_grid_thw")}


def examples(family: str, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, list[dict]]]:
    """(ids, labels, per-image tensors) of each example: text, then per image <start> placeholders <end>, text."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for names, before, after in EXAMPLES:
        tensors = [_image_tensors(family, n) for n in names]
        pieces = [torch.randint(3, 99, (before,), generator=g)]
        for t in tensors:
            n = int(t["image_grid_thw"].prod()) // 4 if "image_grid_thw" in t else 4
            pieces.append(torch.tensor([START] + [IMAGE] * n + [END]))
        pieces.append(torch.randint(3, 99, (after,), generator=g))
        ids = torch.cat(pieces)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[-REPLY:] = ids[-REPLY:]  # the reply: text only, never an image token
        out.append((ids, labels, tensors))
    return out


def _images(tensors: list[dict]) -> dict:
    return {k: torch.cat([t[k] for t in tensors]) for k in tensors[0]}


def packed_batch(exs) -> MicroBatch:
    """One row: the examples back to back, positions restarting at each, a padding tail continuing the last."""
    ids = torch.cat([e[0] for e in exs] + [torch.zeros(PAD_TAIL, dtype=torch.int64)])
    labels = torch.cat([e[1] for e in exs] + [torch.full((PAD_TAIL,), IGNORE_INDEX)])
    last = len(exs[-1][0])
    pos = torch.cat([torch.arange(len(e[0])) for e in exs[:-1]] + [torch.arange(last + PAD_TAIL)])
    return MicroBatch(ids[None], labels[None], pos[None], images=_images([t for e in exs for t in e[2]]))


def unpacked_batch(exs) -> MicroBatch:
    """One example per row, padded to the longest: position_ids None, as data/image_rows.py makes such rows."""
    t = max(len(e[0]) for e in exs) + 2
    ids = torch.zeros(len(exs), t, dtype=torch.int64)
    labels = torch.full((len(exs), t), IGNORE_INDEX)
    for r, (i, lab, _) in enumerate(exs):
        ids[r, :len(i)], labels[r, :len(lab)] = i, lab
    return MicroBatch(ids, labels, images=_images([t for e in exs for t in e[2]]))


def one_label_each(mb: MicroBatch) -> list[MicroBatch]:
    """A micro-batch per label token, that token's label alone: each one's loss is that token's."""
    out = []
    for flat in (mb.labels.reshape(-1) != IGNORE_INDEX).nonzero().reshape(-1).tolist():
        labels = torch.full_like(mb.labels, IGNORE_INDEX)
        labels.view(-1)[flat] = mb.labels.view(-1)[flat]
        out.append(MicroBatch(mb.input_ids, labels, mb.position_ids, images=mb.images))
    return out


def reference(family: str, store, config, exs):
    """Plain HF on each example alone: its reply tokens' losses in order, and the gradients of their sum / N."""
    ref = reference_vlm(store, config)
    n_tok = sum(int((lab[1:] != IGNORE_INDEX).sum()) for _, lab, _ in exs)
    per_token = []
    for ids, lab, tensors in exs:
        kw = _images(tensors)
        if family != "llava":
            kw["mm_token_type_ids"] = (ids == IMAGE).long()[None]
        logits = ref(input_ids=ids[None], use_cache=False, **kw).logits[0]
        losses = torch.nn.functional.cross_entropy(logits[:-1], lab[1:], ignore_index=IGNORE_INDEX, reduction="none")
        per_token += losses[lab[1:] != IGNORE_INDEX].tolist()
        (losses.sum() / n_tok).backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ref.named_parameters()}
    return per_token, grads, n_tok


def engine_for(store):
    return make_engine(store, TrainConfig(steps=1, max_grad_norm=None), device="cpu", checkpoint_interval=1,
                       loss_chunk_tokens=7, overlap_optimizer=False,
                       frozen=store.adapter.vision.frozen_tiles(False, False))


def tile_grads(store) -> dict:
    return {hf: store.tiles[tile].grad[p.offset:p.offset + p.numel].view(p.shape).clone()
            for hf, tile, p in store.hf_items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_row_of_image_examples_trains_as_each_example_alone(family):
    config = tiny_vlm_config(family)
    exs = examples(family)
    packed, unpacked = packed_batch(exs), unpacked_batch(exs)
    assert attention.document_bounds(packed.position_ids)[0].tolist() == [0, len(exs[0][0]),
                                                                          len(exs[0][0]) + len(exs[1][0]),
                                                                          packed.input_ids.shape[1]]
    ref_tokens, ref_grads, n_tok = reference(family, build_store(config, torch.float32, seed=5), config, exs)

    grads, sums = {}, {}
    for name, mb in (("packed", packed), ("unpacked", unpacked)):
        engine = engine_for(build_store(config, torch.float32, seed=5))
        per_token = engine.forward_backward(one_label_each(mb)).losses
        engine.close()
        assert per_token == pytest.approx(ref_tokens, rel=1e-5, abs=1e-6), f"{name}: per-token losses"
        store = build_store(config, torch.float32, seed=5)  # fresh gradient tiles
        engine = engine_for(store)
        res = engine.forward_backward([mb])
        engine.close()
        assert res.loss_tokens == n_tok
        sums[name] = res.loss * res.loss_tokens
        grads[name] = tile_grads(store)
    assert sums["packed"] == pytest.approx(sum(ref_tokens), rel=1e-5)
    assert sums["unpacked"] == pytest.approx(sum(ref_tokens), rel=1e-5)
    for name, expected in ref_grads.items():
        for how in ("packed", "unpacked"):
            torch.testing.assert_close(grads[how][name], expected, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{how} {name}: {m}")
    vision = [n for n in ref_grads if store.adapter.vision.owns(n)]
    assert vision and any(grads["packed"][n].any() for n in vision), "the tower's gradients are checked, not zero"


def test_multimodal_positions_restart_per_document_and_the_text_axis_gives_the_documents():
    """Each document's positions are those HF's get_rope_index gives it alone; the rotary axes step back
    inside an image (the old one-axis rule would cut it into 'documents'), so the documents come from the text
    positions in front ([4, B, T], HF's packed layout); [3, B, T] is HF's unpacked layout: no documents."""
    config = tiny_vlm_config("qwen2_vl")
    store = build_store(config, torch.float32, seed=5)
    vision = store.adapter.vision
    exs = examples("qwen2_vl")
    mb = packed_batch(exs)
    pos = vision.position_ids(mb.input_ids, mb.images, mb.position_ids)
    assert pos.shape == (4, 1, mb.input_ids.shape[1]) and torch.equal(pos[0], mb.position_ids)
    at = 0
    for i, (ids, _, tensors) in enumerate(exs):
        alone = vision.position_ids(ids[None], _images(tensors))
        end = at + len(ids) + (PAD_TAIL if i == len(exs) - 1 else 0)
        assert torch.equal(pos[1:, :, at:at + len(ids)], alone), f"document {i}"
        at = end
    assert at == mb.input_ids.shape[1]
    image = (mb.input_ids[0] == IMAGE).nonzero().reshape(-1)
    inside = pos[2, 0, image]
    assert bool((inside[1:] != inside[:-1] + 1).any()), "a rotary axis steps back inside an image"
    assert attention.document_bounds(pos[2:3].squeeze(0)) is not None  # read alone, it would cut the image
    assert torch.equal(attention.document_bounds(pos)[0], attention.document_bounds(mb.position_ids)[0])
    assert attention.document_bounds(pos[1:]) is None  # [3, B, T]: one document per row, as HF reads it
    unpacked = vision.position_ids(mb.input_ids, mb.images)  # no text positions: the whole row, as before
    assert unpacked.shape == (3, 1, mb.input_ids.shape[1])


def test_gemma3_packed_image_rows_are_refused_with_the_fix():
    """HF's Gemma 3 lets an image's tokens see each other both ways; packed rows attend causally within each
    document, so they would train another model: refused, naming the setting and the fix."""
    config = tiny_vlm_config("gemma3")
    store = build_store(config, torch.float32, seed=5)
    engine = engine_for(store)
    with pytest.raises(ValueError, match="set data.packing=false") as err:
        engine.forward_backward([packed_batch(examples("gemma3"))])
    engine.close()
    assert str(err.value) == PACKING_BIDIRECTIONAL and "\n" not in PACKING_BIDIRECTIONAL
