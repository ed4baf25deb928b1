"""Chats with images (data/images.py, data/image_rows.py): both layouts read, images checked, the processor's
ids (dynamic resolution: each image's own feature count), loss on assistant tokens only, one example per
row, micro-batches carrying their rows' image tensors. And every bad input refused by `megatrain train`:
the exact one-line message naming the record's line and the path, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.data.errors import DataError
from megatrain_cli.data.formats import records_to_examples
from megatrain_cli.data.image_rows import build_image_data
from megatrain_cli.data.images import IMAGE
from megatrain_cli.models.processor import load_processor
from megatrain_cli.recipe import DataConfig
from tests.helpers_bad_inputs import ROOT, megatrain, refused

SAMPLE = ROOT / "megatrain_cli" / "assets" / "vlm_sample"
RECIPE = ROOT / "recipes" / "vlm-tiny.yaml"


def write_data(folder: Path, records: list[dict], images=("red.png", "blue.png")) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in images:
        shutil.copyfile(SAMPLE / name, folder / name)
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(prompt, reply="blue", **extra):
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}], **extra}


def test_both_layouts_read_into_placeholders_and_resolved_paths(tmp_path):
    path = write_data(tmp_path / "d", [
        chat("<image>What color?", images=["red.png"]),
        chat([{"type": "text", "text": "Compare "}, {"type": "image", "image": "red.png"},
              {"type": "text", "text": " and "}, {"type": "image", "image": "blue.png"}])])
    from megatrain_cli.data.sources import read_records

    records, label = read_records(str(path))
    a, b = records_to_examples(records, "auto", {}, label)
    assert a.prompt == f"{IMAGE}What color?" and a.images == [str(tmp_path / "d" / "red.png")]
    assert b.prompt == f"Compare {IMAGE} and {IMAGE}"
    assert b.images == [str(tmp_path / "d" / n) for n in ("red.png", "blue.png")]


def test_rows_hold_each_images_own_tokens_and_loss_only_on_the_reply():
    processor = load_processor(None)
    from megatrain_cli.data import load_examples

    examples = [ex for ex in load_examples(DataConfig(source="builtin:sample_vlm")) if ex.images][:6]
    data = build_image_data(examples, processor, DataConfig(source="builtin:sample_vlm", packing=False), 96, 0)
    assert data.num_rows == len(examples) and not data.packing
    mb = data.micro_batch(list(range(data.num_rows)))
    grids = mb.images["image_grid_thw"]
    assert len({tuple(g.tolist()) for g in grids}) > 1, "dynamic resolution: images of several sizes"
    counts = (mb.input_ids == processor.image_token_id).sum(1)
    assert counts.tolist() == (grids.prod(-1) // 4).tolist()  # one row, one image: its own feature count
    assert mb.images["pixel_values"].shape[0] == int(grids.prod(-1).sum())
    assert mb.position_ids is None
    assert not ((mb.labels != IGNORE_INDEX) & (mb.input_ids == processor.image_token_id)).any()
    for row, ex in zip(range(data.num_rows), examples):
        labelled = mb.input_ids[row][mb.labels[row] != IGNORE_INDEX]
        reply = processor.tokenizer(ex.response + "<|im_end|>", add_special_tokens=False)["input_ids"]
        assert labelled.tolist() == reply  # the reply and its end of turn, nothing else


def test_packed_image_rows_hold_each_example_as_alone_and_its_images_in_document_order():
    """data.packing=true: several examples per row, each with the ids and labels it has alone, positions
    restarting at each (the engine's documents), the row's images those of its documents in order."""
    processor = load_processor(None)
    from megatrain_cli.data import load_examples

    examples = [ex for ex in load_examples(DataConfig(source="builtin:sample_vlm")) if ex.images]
    alone = build_image_data(examples, processor, DataConfig(source="builtin:sample_vlm", packing=False), 96, 0)
    packed = build_image_data(examples, processor, DataConfig(source="builtin:sample_vlm"), 96, 0)
    assert packed.packing and packed.num_rows < alone.num_rows == len(examples)
    assert max(map(len, packed.rows)) > 1 and sorted(e for r in packed.rows for e in r) == list(range(len(examples)))
    for row in range(packed.num_rows):
        mb = packed.micro_batch([row])
        assert not ((mb.labels != IGNORE_INDEX) & (mb.input_ids == processor.image_token_id)).any()
        at = 0
        for ex in packed.rows[row]:
            one = alone.micro_batch([ex])
            n = int(alone.offsets[ex + 1] - alone.offsets[ex])
            assert torch.equal(mb.input_ids[0, at:at + n], one.input_ids[0, :n])
            assert torch.equal(mb.labels[0, at:at + n], one.labels[0, :n])
            assert mb.position_ids[0, at:at + n].tolist() == list(range(n))  # restarts: a document each
            at += n
        grids = torch.cat([alone.micro_batch([ex]).images["image_grid_thw"] for ex in packed.rows[row]])
        assert torch.equal(mb.images["image_grid_thw"], grids)  # the documents' images, in order
    assert packed.stats()["fill"] > alone.stats()["fill"]


def test_packing_raises_the_fill_on_a_realistic_mix(tmp_path):
    """Chats of one or two images of 112..448 px (16..256 image tokens each: the bundled processor's dynamic
    resolution) and some text-only ones, replies of a word to a few sentences, at train.seq_len=1024: one example
    per row fills well under half of each row; packed, most of it."""
    from PIL import Image

    from megatrain_cli.data import load_examples

    rng = torch.Generator().manual_seed(0)
    sizes = [(112, 112), (224, 168), (336, 336), (448, 336), (448, 448)]
    folder = tmp_path / "d"
    folder.mkdir()
    for w, h in sizes:
        Image.open(SAMPLE / "red.png").convert("RGB").resize((w, h)).save(folder / f"{w}x{h}.png")
    words = "the shape on the left is red and the stripes run across the whole picture".split()
    records = []
    for i in range(60):
        k = int(torch.randint(0, 3, (1,), generator=rng))  # 0, 1 or 2 images
        names = [f"{w}x{h}.png" for w, h in (sizes[int(j)] for j in torch.randint(0, len(sizes), (k,), generator=rng))]
        reply = " ".join(words[int(j)] for j in torch.randint(0, len(words), (int(torch.randint(1, 120, (1,),
                                                                                                 generator=rng)),),
                                                                           generator=rng))
        records.append(chat("<image>" * k + f"Describe picture {i}.", reply=reply, images=names) if k else
                       chat(f"Say something about shapes, take {i}.", reply=reply))
    path = write_data(folder, records, images=())
    processor = load_processor(None)
    fills = {}
    for packing in (False, True):
        cfg = DataConfig(source=str(path), packing=packing, test_fraction=0.0)
        data = build_image_data(load_examples(cfg), processor, cfg, 1024, 0)
        assert data.num_examples == len(records) and not data.truncated
        fills[packing] = data.stats()["fill"]
    print(f"fill: one example per row {fills[False]:.3f}, packed {fills[True]:.3f}")
    assert fills[False] < 0.4 and fills[True] > 0.85, fills


def run_refused(tmp_path, records, expected, **files) -> None:
    data = write_data(tmp_path / "data", records)
    for name, content in files.items():
        (tmp_path / "data" / name).write_bytes(content)
    out = tmp_path / "run"
    result = megatrain("train", RECIPE, f"data.source={data}", f"output_dir={out}", "train.steps=1")
    text = refused(result, 2)
    assert text.strip().splitlines()[-1] == f"error: {expected.format(data=data)}"
    assert not out.exists(), "nothing written"


def test_missing_image_is_named_with_its_line_and_where_it_was_looked_for(tmp_path):
    look = tmp_path / "data" / "cat.png"
    run_refused(tmp_path, [chat("<image>a", images=["red.png"]), chat("<image>b", images=["cat.png"])],
                "data.source: {data} line 2: image 'cat.png' not found (looked for " + str(look) + "); image "
                "paths are relative to the data file: fix the path or remove the record")


def test_placeholder_count_must_match_the_images(tmp_path):
    run_refused(tmp_path, [chat("<image><image>two?", images=["red.png"])],
                "data.source: {data} line 1: 2 <image> placeholder(s) in 'messages' but 1 image(s) in 'images': "
                "write one <image> where each image goes, in order")


def test_a_file_that_is_not_an_image_is_refused(tmp_path):
    run_refused(tmp_path, [chat("<image>what?", images=["notes.png"])],
                "data.source: {data} line 1: 'notes.png' is not an image PIL can read (UnidentifiedImageError); "
                "give a PNG, JPEG or WebP file or remove the record", **{"notes.png": b"just some text\n"})


@pytest.mark.parametrize("before", [0, 65])  # 65: past the preflight's 64-record sample (eval off)
def test_a_text_only_model_given_images_is_refused(tmp_path, before):
    """Refused before anything is written, with the image's line, also where the preflight's sample does not
    reach it (the run used to read the bundled VLM processor's rows and train)."""
    records = [chat(f"question {i}?") for i in range(before)] + [chat("<image>what?", images=["red.png"])]
    data = write_data(tmp_path / "data", records)
    out = tmp_path / "run"
    result = megatrain("train", RECIPE, "model.preset=tiny", "~model.freeze_vision", "~model.freeze_projector",
                       f"data.source={data}", f"output_dir={out}", "train.steps=1")
    text = refused(result, 2)
    assert text.strip().splitlines()[-1] == (
        f"error: data.source: {data} line {before + 1} has images but the model ('tiny') has no vision tower; "
        f"train a vision-language model (e.g. model.preset=qwen2-vl-tiny) or remove the images from the data")
    assert not out.exists()


def test_a_validation_loss_on_images_is_refused_with_the_fix(tmp_path):
    data = write_data(tmp_path / "data", [chat("<image>what?", images=["red.png"])])
    out = tmp_path / "run"
    result = megatrain("train", RECIPE, f"data.source={data}", f"output_dir={out}", "train.steps=1",
                       "eval.every_n_steps=2")
    text = refused(result, 2)
    assert text.strip().splitlines()[-1] == (
        f"error: eval.every_n_steps: data with images ({data} line 1) has no validation loss yet (docs/vlm.md); "
        f"set eval.every_n_steps=null")
    assert not out.exists()


def test_an_image_processor_without_dynamic_resolution_is_refused_with_the_fix():
    """A fixed-size image processor without its family's processor files (processor_config.json: LLaVA's and
    Gemma 3's, tests/data/test_image_families.py): the refusal says which folders train from image data."""
    from megatrain_cli.models.processor import ImageTextProcessor

    class CLIPImageProcessor:  # what a LLaVA folder's AutoImageProcessor gives: no merge_size
        pass

    with pytest.raises(ValueError) as err:
        ImageTextProcessor(load_processor(None).tokenizer, CLIPImageProcessor())
    assert str(err.value) == (
        "CLIPImageProcessor: no merge_size, and no processor_config.json beside it: image data trains models with "
        "a dynamic-resolution image processor (Qwen2-VL's) or with their own processor's files (LLaVA, Gemma 3; "
        "docs/vlm.md)")


def test_an_image_too_large_to_decode_is_refused(monkeypatch):
    """PIL's decompression-bomb guard (an image of more than twice Image.MAX_IMAGE_PIXELS) is a DataError naming
    the record (exit 2 through train), not a traceback: the limit is lowered so a bundled PNG trips it."""
    from PIL import Image

    from megatrain_cli.data.images import check_image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(DataError, match=r"^line 1: 'red.png' is too large to decode \(Image size \(\d+ pixels\) "
                                        r"exceeds limit of 200 pixels.*\); resize it or remove the record$"):
        check_image("red.png", "line 1", SAMPLE)


def test_a_truncated_image_body_is_named_with_its_path(tmp_path):
    """A JPEG whose header reads but whose body was cut: the processor's decode names the file, as a DataError
    (exit 2 through train), not an OSError traceback."""
    from PIL import Image

    path = tmp_path / "cut.jpg"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(path, quality=90)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(DataError, match=rf"image {path}: .*; replace the file or remove its record"):
        load_processor(None, False).images([str(path)])
