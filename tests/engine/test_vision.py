"""Vision-language models (models/vision.py, engine/vision_phase.py) against plain HF + torch AdamW.

CPU, fp32, tiny random configs built with AutoConfig.for_model; real image tensors: the bundled PNGs of
tests/data/images through the family's own image processor (two resolutions: Qwen2-VL's dynamic patches).
Three optimizer steps, gradient accumulation 2, clipping active, checkpoint interval 1. Every weight after
the steps (vision tower and projector included) within 1e-5; the frozen parts bit-unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX, MicroBatch
from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.reference import reference_train

IMAGES = Path(__file__).resolve().parents[1] / "data" / "images"
STEPS, ACCUM, SEQ = 3, 2, 20
IMAGE, START, END = 100, 102, 103  # image / vision start / vision end token ids of the tiny configs


def tiny_vlm_config(family: str = "qwen2_vl", layers: int = 2, depth: int = 2):
    from transformers import AutoConfig

    if family == "qwen3_vl":  # learned position grid (4 x 4), deepstack features after decoder layers 0 and 1
        pytest.importorskip("transformers.models.qwen3_vl", reason="this transformers has no Qwen3-VL")
        # one decoder layer more than deepstack features: a feature added after the last layer reaches only
        # the image tokens' logits, which carry no loss (no gradient, in HF too)
        text = dict(hidden_size=32, head_dim=8, num_hidden_layers=layers + 1, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=48, vocab_size=120, max_position_embeddings=256, pad_token_id=0,
                    rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True,
                                     "rope_theta": 10000.0})
        vision = dict(depth=depth, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16,
                      deepstack_visual_indexes=list(range(depth)))
        return AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=IMAGE,
                                    video_token_id=101, vision_start_token_id=START, vision_end_token_id=END)
    if family == "gemma3":  # SigLIP tower (28 px: 4 patches), pooled to 4 tokens, Gemma 3 text decoder
        from tests.reference import FAMILY_EXTRAS

        text = dict(FAMILY_EXTRAS["gemma3_text"], model_type="gemma3_text", hidden_size=32,
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                    vocab_size=120, max_position_embeddings=256, pad_token_id=0, bos_token_id=2, eos_token_id=1)
        text["layer_types"] = (text["layer_types"] * layers)[:layers]
        vision = dict(model_type="siglip_vision_model", hidden_size=32, num_hidden_layers=depth,
                      num_attention_heads=4, intermediate_size=48, image_size=28, patch_size=14, vision_use_head=False)
        return AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, image_token_id=IMAGE,
                                    boi_token_id=START, eoi_token_id=END, mm_tokens_per_image=4)
    if family == "llava":  # CLIP tower (28 px: 4 patches + CLS), features from hidden state -2, Llama decoder
        text = dict(model_type="llama", hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=48, vocab_size=120, max_position_embeddings=256,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
        vision = dict(model_type="clip_vision_model", hidden_size=32, num_hidden_layers=depth + 1,
                      num_attention_heads=4, intermediate_size=48, image_size=28, patch_size=14)
        return AutoConfig.for_model("llava", text_config=text, vision_config=vision, image_token_id=IMAGE,
                                    projector_hidden_act="gelu", vision_feature_layer=-2,
                                    vision_feature_select_strategy="default")

    text = dict(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, vocab_size=120, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                pad_token_id=0, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                 "rope_theta": 10000.0})
    vision = dict(depth=depth, hidden_size=32, num_heads=4, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    if family == "qwen2_vl":
        vision.update(embed_dim=32, mlp_ratio=2)
    else:  # Qwen2.5-VL: windowed attention in every layer but the last, RMSNorm layers, gated MLP
        vision.update(intermediate_size=40, out_hidden_size=32, window_size=56, fullatt_block_indexes=[depth - 1])
    return AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=IMAGE,
                                video_token_id=101, vision_start_token_id=START, vision_end_token_id=END)


def _pil_processor(patch: int = 14):
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    return pil.Qwen2VLImageProcessorPil(patch_size=patch, temporal_patch_size=2, merge_size=2,
                                        min_pixels=(2 * patch) ** 2, max_pixels=(6 * patch) ** 2)


def _clip_processor():
    from transformers.models.clip import image_processing_pil_clip as pil

    return pil.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})


def image_rows(names: list[str], seed: int, family: str = "qwen2_vl") -> MicroBatch:
    """One row per image: a few text tokens, <vision_start>, the image's placeholders, <vision_end>, text.
    Loss on the last tokens only, never on an image token."""
    from PIL import Image

    processor = _clip_processor() if family in ("llava", "gemma3") else _pil_processor(16 if family == "qwen3_vl" else 14)
    out = processor(images=[Image.open(IMAGES / n).convert("RGB") for n in names], return_tensors="pt")
    g = torch.Generator().manual_seed(seed)
    rows = []
    sizes = [4] * len(names) if family in ("llava", "gemma3") else [int(thw.prod()) // 4 for thw in out["image_grid_thw"]]
    for n in sizes:
        text = torch.randint(3, 99, (SEQ - n - 5,), generator=g)
        rows.append(torch.cat([text[:3], torch.tensor([START] + [IMAGE] * n + [END]), text[3:]]))
    ids = torch.stack(rows)
    labels = ids.clone()
    labels[:, :SEQ - 8] = IGNORE_INDEX
    return MicroBatch(ids, labels, images={k: v for k, v in out.items() if k in ("pixel_values", "image_grid_thw")})


def vlm_batches(family: str = "qwen2_vl"):
    pairs = [["red_square.png", "wide_stripes.png"], ["tall_gradient.png", "red_square.png"]]
    return [[image_rows(pairs[(s + m) % 2], seed=10 * s + m, family=family) for m in range(ACCUM)]
            for s in range(STEPS)]


def reference_vlm(store, config, frozen_prefixes=()):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(store.hf_state_dict(), strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if store.adapter.tied else []), (missing, unexpected)
    if store.adapter.tied:  # Gemma 3: the head is the embedding's tensor
        model.tie_weights()
    for name, p in model.named_parameters():
        if name.startswith(frozen_prefixes):
            p.requires_grad_(False)
    return model


def run_both(family, *, freeze_vision=False, freeze_projector=False, **settings):
    config = tiny_vlm_config(family)
    store = build_store(config, torch.float32, seed=3)
    vision = store.adapter.vision
    frozen = vision.frozen_tiles(freeze_vision, freeze_projector)
    before = {k: v.clone() for k, v in store.hf_state_dict().items()}
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, grad_accum=ACCUM,
                      eps=1e-5)
    prefixes = tuple(store.adapter.hf_name(t, p.name) for t in frozen for p in store.layouts[t].places)
    ref = reference_vlm(store, config, prefixes)
    batches = vlm_batches(family)
    ref_losses = reference_train(ref, batches, cfg, STEPS)
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=1, loss_chunk_tokens=7,
                         **{"overlap_optimizer": False, **settings}, frozen=frozen)
    results = [engine.step(mbs, lr_at(s, cfg, STEPS)) for s, mbs in enumerate(batches)]
    engine.close()  # the optimizer thread's last updates land before the store is read (a race under load)
    return store, ref, ref_losses, results, before, prefixes


def assert_parity(store, ref, ref_losses, results):
    for step, (res, expected) in enumerate(zip(results, ref_losses)):
        assert res.losses == pytest.approx(expected, rel=1e-5), f"step {step} losses"
        assert res.grad_norm > 0.5, "clipping must be active in this test"
    ours = store.hf_state_dict()
    for name, expected in ref.state_dict().items():
        if store.adapter.tied and name == "lm_head.weight":
            continue  # the embedding's tensor
        torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_every_verified_vlm_family_has_a_case():
    from megatrain_cli.models.vision import VERIFIED_VLM

    assert sorted(VERIFIED_VLM) == sorted(FAMILIES)


FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava", "gemma3", "qwen3_vl"]


@pytest.mark.parametrize("family", FAMILIES)
def test_vlm_parity_three_steps_vision_tower_trained(family):
    store, ref, ref_losses, results, before, unused = run_both(family)
    assert_parity(store, ref, ref_losses, results)
    ours = store.hf_state_dict()
    vision = [n for n in ours if store.adapter.vision.owns(n) and n not in unused and "post_layernorm" not in n]
    assert vision and all(not torch.equal(ours[n], before[n]) for n in vision), "every vision tensor trains"
    # LLaVA reads hidden state -2: its last layer (and CLIP's post-layernorm) get no gradient, in HF and here
    assert all(torch.equal(ours[n], before[n]) for n in unused)
    assert bool(unused) == (family == "llava")


@pytest.mark.parametrize("family,freeze_vision,freeze_projector", [
    ("qwen2_vl", True, False), ("qwen2_vl", True, True), ("qwen2_vl", False, True),
    ("qwen3_vl", True, False), ("qwen3_vl", False, True)])  # Qwen3-VL: the deepstack mergers are the projector's
def test_frozen_parts_stay_bit_unchanged_and_the_rest_matches(family, freeze_vision, freeze_projector):
    store, ref, ref_losses, results, before, frozen = run_both(family, freeze_vision=freeze_vision,
                                                               freeze_projector=freeze_projector)
    assert_parity(store, ref, ref_losses, results)
    ours = store.hf_state_dict()
    assert frozen and all(torch.equal(ours[n], before[n]) for n in frozen)
    trained = [n for n in ours if n not in frozen]
    assert all(not torch.equal(ours[n], before[n]) for n in trained if "embed_tokens" not in n)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "gemma3", "qwen3_vl"])
def test_every_gradient_matches_the_plain_model(family):
    """One step's gradients, as they land in the host tiles (unclipped, summed over the micro-batches), equal
    the plain model's for every tensor: vision tower, projector, decoder, embedding rows. A tensor HF gives
    no (or a zero) gradient (LLaVA's unused last layer, CLIP's post-layernorm) has a zero one here."""
    config = tiny_vlm_config(family)
    store = build_store(config, torch.float32, seed=4)
    ref = reference_vlm(store, config)
    mbs = vlm_batches(family)[0]
    cfg = TrainConfig(steps=1, lr=1e-3, max_grad_norm=None, grad_accum=ACCUM)
    n_tok = sum(int((mb.labels[:, 1:] != IGNORE_INDEX).sum()) for mb in mbs)
    for mb in mbs:
        kw = {k: v for k, v in mb.images.items()}
        if family != "llava":  # Qwen2-VL's multimodal positions, Gemma 3's image masks
            kw["mm_token_type_ids" if family.startswith("qwen") else "token_type_ids"] = (mb.input_ids == IMAGE).long()
        logits = ref(input_ids=mb.input_ids, use_cache=False, **kw).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 mb.labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX,
                                                 reduction="sum") / n_tok
        loss.backward()
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=2, overlap_optimizer=False,
                         frozen=store.adapter.vision.frozen_tiles(False, False))
    engine.forward_backward(mbs)
    expected = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ref.named_parameters()}
    unused = [n for n, p in ref.named_parameters() if not expected[n].any()]
    assert bool(unused) == (family == "llava") and all("layers.2." in n or "post_layernorm" in n for n in unused)
    checked = 0
    for hf, tile, place in store.hf_items():
        got = store.tiles[tile].grad[place.offset:place.offset + place.numel].view(place.shape)
        torch.testing.assert_close(got, expected[hf], rtol=1e-5, atol=1e-7, msg=lambda m: f"{hf}: {m}")
        checked += 1
    assert checked == len(expected)
    assert any(hf.startswith(store.adapter.vision.blocks_path + ".0.") for hf, _, _ in store.hf_items())


def test_the_layer_probe_cuts_a_vlm_to_one_decoder_and_one_tower_layer():
    """The planner's probe times one decoder layer of each structure: a VLM's cut keeps one of each, not the
    whole model (the text config holds the decoder's layer count)."""
    from megatrain_cli.engine.layer_probe import cut_config
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.presets import PRESETS

    cut, counts = cut_config(ModelAdapter(PRESETS["qwen2.5-vl-7b"].hf_config()))
    adapter = ModelAdapter(cut)
    assert (adapter.num_layers, counts, adapter.vision.depth) == (1, [28], 1)


@pytest.mark.parametrize("freeze_vision", [False, True])
def test_the_optimizer_thread_updates_the_image_side_as_the_plain_model(freeze_vision):
    """The host optimizer's thread (CUDA's default: speculated, deferred updates in the next forward's order)
    updates the tower's and the projector's tiles as the plain model does; a frozen tower stays as it was."""
    store, ref, ref_losses, results, before, frozen = run_both("qwen2_vl", freeze_vision=freeze_vision,
                                                               overlap_optimizer=True)
    assert_parity(store, ref, ref_losses, results)
    ours = store.hf_state_dict()
    assert all(torch.equal(ours[n], before[n]) for n in frozen)
