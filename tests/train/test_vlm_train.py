"""A vision-language model end to end on the CPU: `megatrain train recipes/vlm-tiny.yaml` (vision tower and
projector trained), the export (weights, config, tokenizer and the image processor's preprocessor config),
a reload with transformers' AutoModelForImageTextToText and its generate, and `megatrain eval` on a file of
questions about images scored by exact match."""

from __future__ import annotations

import json

import torch

from megatrain_cli.data.images import IMAGE
from megatrain_cli.models.processor import load_processor
from tests.helpers_bad_inputs import ROOT, megatrain

RECIPE = ROOT / "recipes" / "vlm-tiny.yaml"
SAMPLE = ROOT / "megatrain_cli" / "assets" / "vlm_sample"


def greedy_reply(model, processor, image: str, question: str, max_new_tokens: int) -> str:
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": question.replace(IMAGE, processor.marker)}], tokenize=False,
        add_generation_prompt=True)
    ids, images = processor.encode(prompt, [image])
    ids = torch.tensor([ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         mm_token_type_ids=(ids == processor.image_token_id).int(), do_sample=False,
                         eos_token_id=[processor.tokenizer.convert_tokens_to_ids("<|im_end|>")], **images)
    return processor.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_train_export_reload_generate_and_eval(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "run"
    result = megatrain("train", RECIPE, f"output_dir={out}", "train.steps=3", "checkpoint.every_n_steps=3")
    assert result.exit_code == 0, result.output
    final = out / "final"
    assert (final / "preprocessor_config.json").is_file() and (final / "tokenizer.json").is_file()
    assert "vision_config" in json.loads((final / "config.json").read_text())
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("visual.blocks.") for n in names) and any(n.startswith("visual.merger.") for n in names)

    model = AutoModelForImageTextToText.from_pretrained(str(final), local_files_only=True, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    processor = load_processor(final)
    question = f"{IMAGE}What color is the shape?"
    reply = greedy_reply(model, processor, str(SAMPLE / "red.png"), question, 4)
    assert reply.strip(), "the reloaded model generates"

    # Exact match: one question whose gold is the model's own greedy reply, one whose gold it cannot produce.
    data = tmp_path / "vqa.jsonl"
    rows = [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": gold}],
             "images": [str(SAMPLE / "red.png")]} for gold in (reply.strip(), "purple elephant")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = megatrain("eval", "--model", final, "--split", "all", "--output-dir", tmp_path / "eval",
                       f"data.source={data}", "eval.max_new_tokens=4", "eval.extract=strict")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert (results["correct"], results["total"], results["accuracy"]) == (1, 2, 0.5)
    preds = [json.loads(line) for line in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert [p["correct"] for p in preds] == [True, False] and preds[0]["output"] == reply


def test_packed_image_rows_train_from_the_recipe(tmp_path):
    """data.packing=true on Qwen2-VL: several chats with images per row (each its own multimodal positions and
    attention: tests/engine/test_packed_vision.py), trained end to end; the loss is finite and falls."""
    out = tmp_path / "run"
    result = megatrain("train", RECIPE, f"output_dir={out}", "data.packing=true", "train.steps=4",
                       "checkpoint.every_n_steps=4", "logging.every_n_steps=1")
    assert result.exit_code == 0, result.output
    losses = [float(line.split("|")[1]) for line in result.output.splitlines() if line.strip()[:4] in ("1/4 ", "4/4 ")]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0], result.output
    assert (out / "final" / "model.safetensors").is_file()
