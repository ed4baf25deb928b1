"""LLaVA's and Gemma 3's image data (models/processor.py's FixedImageProcessor over the family's own HF
processor, data/image_rows.py): each image marker expanded by the processor to the model's image tokens,
loss on the reply only, never on an image token; `megatrain train` from a JSONL with the bundled PNGs on tiny
model folders built here (tests/vlm_folders.py), and the bad inputs refused as for Qwen2-VL (one line, exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.data.image_rows import build_image_data
from megatrain_cli.data.images import IMAGE
from megatrain_cli.models.processor import FixedImageProcessor, load_processor
from megatrain_cli.recipe import DataConfig
from tests.data.test_images import RECIPE, chat, write_data
from tests.helpers_bad_inputs import megatrain, refused
from tests.vlm_folders import FEATURES_PER_IMAGE, build_folder

FAMILIES = ["llava", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory):
    return build_folder(request.param, tmp_path_factory.mktemp(request.param))


def records():
    return [chat("<image>What color?", reply="red", images=["red.png"]),
            chat([{"type": "text", "text": "Compare "}, {"type": "image", "image": "red.png"},
                  {"type": "text", "text": " and "}, {"type": "image", "image": "blue.png"}], reply="red, blue")]


def test_rows_expand_each_image_and_carry_loss_only_on_the_reply(folder, tmp_path):
    from megatrain_cli.data import load_examples

    processor = load_processor(folder)
    assert isinstance(processor, FixedImageProcessor)
    cfg = DataConfig(source=str(write_data(tmp_path / "d", records())), packing=False, test_fraction=0.0)
    examples = load_examples(cfg)
    assert [len(ex.images) for ex in examples] == [1, 2] and examples[0].prompt == f"{IMAGE}What color?"
    data = build_image_data(examples, processor, cfg, 96, 0)
    mb = data.micro_batch([0, 1])
    image = mb.input_ids == processor.image_token_id
    assert image.sum(1).tolist() == [FEATURES_PER_IMAGE, 2 * FEATURES_PER_IMAGE]  # the processor's expansion
    assert mb.images["pixel_values"].shape[0] == 3  # one per image, in placeholder order
    assert not ((mb.labels != IGNORE_INDEX) & image).any()
    end = processor.tokenizer.convert_tokens_to_ids("<|end|>")
    for row, ex in enumerate(examples):
        labelled = mb.input_ids[row][mb.labels[row] != IGNORE_INDEX]
        reply = processor.tokenizer(ex.response, add_special_tokens=False)["input_ids"]
        assert labelled.tolist() == [*reply, end]  # the reply and its end of turn, nothing else


def test_train_from_image_chats_then_export_reloads(folder, tmp_path):
    from transformers import AutoModelForImageTextToText

    data = write_data(tmp_path / "d", records() * 3)
    out = tmp_path / "run"
    result = megatrain("train", RECIPE, "~model.preset", f"model.path={folder}", f"data.source={data}",
                       "data.test_fraction=0", f"output_dir={out}", "train.steps=3", "checkpoint.every_n_steps=3",
                       "logging.every_n_steps=1")
    assert result.exit_code == 0, result.output
    losses = [float(line.split("|")[1]) for line in result.output.splitlines() if line.strip()[:4] in ("1/3 ", "3/3 ")]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]
    final = out / "final"
    assert (final / "processor_config.json").is_file()
    model = AutoModelForImageTextToText.from_pretrained(str(final), local_files_only=True, dtype=torch.float32)
    assert model.config.model_type == json.loads((folder / "config.json").read_text())["model_type"]
    assert isinstance(load_processor(final), FixedImageProcessor)


@pytest.mark.parametrize("bad,expected", [
    ([chat("<image><image>two?", images=["red.png"])],
     "line 1: 2 <image> placeholder(s) in 'messages' but 1 image(s) in 'images': write one <image> where each "
     "image goes, in order"),
    ([chat("<image>a", images=["red.png"]), chat("<image>b", images=["cat.png"])],
     "line 2: image 'cat.png' not found (looked for {look}); image paths are relative to the data file: fix the "
     "path or remove the record")])
def test_bad_inputs_are_refused_as_for_qwen2_vl(folder, tmp_path, bad, expected):
    data = write_data(tmp_path / "data", bad)
    out = tmp_path / "run"
    result = megatrain("train", RECIPE, "~model.preset", f"model.path={folder}", f"data.source={data}",
                       f"output_dir={out}", "train.steps=1")
    text = refused(result, 2)
    line = expected.format(look=tmp_path / "data" / "cat.png")
    assert text.strip().splitlines()[-1] == f"error: data.source: {data} {line}"
    assert not out.exists(), "nothing written"


def test_packed_image_rows_train_on_llava_and_are_refused_on_gemma3(folder, tmp_path):
    """data.packing=true: LLaVA's rows (plain positions, causal decoder) pack and train; Gemma 3's image tokens
    attend both ways within an image in HF, which packed rows cannot reproduce: refused before anything is
    written, naming the setting and the fix (tests/engine/test_packed_vision.py: the parity of packed rows)."""
    from megatrain_cli.models.vision import PACKING_BIDIRECTIONAL

    data = write_data(tmp_path / "d", records() * 3)
    out = tmp_path / "run"
    result = megatrain("train", RECIPE, "~model.preset", f"model.path={folder}", f"data.source={data}",
                       "data.test_fraction=0", "data.packing=true", f"output_dir={out}", "train.steps=2",
                       "checkpoint.every_n_steps=2")
    if json.loads((folder / "config.json").read_text())["model_type"] == "gemma3":
        text = refused(result, 2)
        assert text.strip().splitlines()[-1] == f"error: {PACKING_BIDIRECTIONAL}"
        assert not out.exists(), "nothing written"
    else:
        assert result.exit_code == 0, result.output
        assert (out / "final" / "config.json").is_file()
