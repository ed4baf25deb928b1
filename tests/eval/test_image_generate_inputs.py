"""eval/images.generate_inputs: what `generate` gets beside input_ids for each VLM family the repo builds
(Qwen2-VL, Qwen2.5-VL, LLaVA, Gemma 3), under the names HF's own processor of that family uses; HF's generate
runs with them on a tiny random model of the family. The old single name (mm_token_type_ids for every family)
made LLaVA's and Gemma 3's generate refuse before the first token."""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.eval.images import generate_inputs
from tests.engine.test_vision import END, IMAGE, START, tiny_vlm_config

WANT = {"qwen2_vl": {"attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"},
        "qwen2_5_vl": {"attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"},
        "llava": {"attention_mask", "pixel_values"},
        "gemma3": {"attention_mask", "token_type_ids", "pixel_values"}}


def _model_and_images(family: str):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config(family)).eval()
    if family.startswith("qwen"):  # a 4 x 4 patch grid merged 2 x 2: 4 image tokens
        images = {"pixel_values": torch.randn(16, 3 * 2 * 14 * 14, dtype=torch.float64),
                  "image_grid_thw": torch.tensor([[1, 4, 4]])}
    else:  # a 28 px image: 4 patches (Gemma 3 pools them to its 4 tokens)
        images = {"pixel_values": torch.randn(1, 3, 28, 28, dtype=torch.float64)}
    return model, images


@pytest.mark.parametrize("family", list(WANT))
def test_each_family_gets_its_processors_names_and_generate_runs(family):
    model, images = _model_and_images(family)
    ids = torch.tensor([[5, 6, START, *[IMAGE] * 4, END, 7, 8]])
    kwargs = generate_inputs(model, ids, IMAGE, images, torch.float32)
    assert set(kwargs) == WANT[family]
    assert kwargs["pixel_values"].dtype == torch.float32  # the model's dtype, not the processor's
    types = kwargs.get("mm_token_type_ids", kwargs.get("token_type_ids"))
    if types is not None:
        assert types[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]
    with torch.no_grad():
        seq = model.generate(input_ids=ids, **kwargs, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert seq.shape == (1, ids.shape[1] + 3) and torch.equal(seq[:, :ids.shape[1]], ids)
    if family.startswith("qwen"):  # M-RoPE used: the image's 4 tokens span 2 positions (its merged 2 x 2 grid)
        assert model.model.rope_deltas.flatten().tolist() == [-2]


def test_a_question_without_images_gets_no_image_tensors():
    model, _ = _model_and_images("qwen2_vl")
    ids = torch.tensor([[5, 6, 7]])
    kwargs = generate_inputs(model, ids, IMAGE, None, torch.float32)
    assert set(kwargs) == {"attention_mask", "mm_token_type_ids"} and not kwargs["mm_token_type_ids"].any()
