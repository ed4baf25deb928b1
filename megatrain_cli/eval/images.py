"""Exact-match eval of a vision-language model on questions about images: the model's own HF class
(AutoModelForImageTextToText) resident on the device, greedy `generate`, one example at a time.

Prompts are the training prompts (the chat template with the generation prompt, each IMAGE placeholder as
the processor's image marker, expanded for its image: models/processor.py). The gold is the record's
answer field (data.fields.gold) or its reply; a reply matches when it equals the gold, stripped ('strict'),
or also case and trailing punctuation aside ('flexible'). Costs: the whole model on the device (no
streamed mode for VLMs yet) and one generate call per example.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from megatrain_cli.data.images import IMAGE
from megatrain_cli.data.prompts import render_prompt
from megatrain_cli.models.processor import load_processor

RESULTS_FILE, PREDICTIONS_FILE = "results.json", "predictions.jsonl"


def matches(reply: str, gold: str) -> dict[str, bool]:
    loose = lambda s: s.strip().rstrip(".!").strip().lower()  # noqa: E731
    return {"strict": reply.strip() == gold.strip(), "flexible": loose(reply) == loose(gold)}


def generate_inputs(model, ids: torch.Tensor, image_token_id: int, images: dict | None, dtype: torch.dtype) -> dict:
    """What the family's own HF processor hands `generate` beside input_ids, under the names its forward takes:
    the attention mask, the image tensors (pixel_values in the model's dtype, Qwen2-VL's image_grid_thw), and
    the image tokens' types where the family reads them: Qwen2-VL / 2.5-VL `mm_token_type_ids` (its M-RoPE
    positions; without them the images' tokens get plain positions), Gemma 3 `token_type_ids` (its processor's
    name: an image's tokens attend to each other both ways), LLaVA neither. One name for every family was wrong:
    generate refuses an argument the forward does not take (ValueError before the first token). Costs: one
    signature lookup per example."""
    import inspect

    takes = inspect.signature(model.forward).parameters
    out = {"attention_mask": torch.ones_like(ids)}
    is_image = ids == image_token_id  # 1 = image token, as the processors mark them (no videos here)
    if "mm_token_type_ids" in takes:
        out["mm_token_type_ids"] = is_image.int()
    elif "token_type_ids" in takes:
        out["token_type_ids"] = is_image.long()
    for key, value in (images or {}).items():
        out[key] = value.to(ids.device, dtype) if key == "pixel_values" else value.to(ids.device)
    return out


def run_image_eval(examples, model_path: str, *, template: str, extract: str, max_new_tokens: int,
                   device: torch.device, output_dir: str | Path, label: str, split: str,
                   log: Callable[[str], None]) -> dict:
    from transformers import AutoModelForImageTextToText

    started = time.perf_counter()
    if not Path(model_path).is_dir():
        raise ValueError(f"--model {model_path}: questions about images need a vision-language model folder "
                         f"(a run's final/), not a preset")
    processor = load_processor(model_path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForImageTextToText.from_pretrained(model_path, local_files_only=True, dtype=dtype)
    model = model.to(device).eval()
    tok = processor.tokenizer
    stop = sorted({i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)})
    log(f"eval: {len(examples)} {split} examples of {label} with images on {device.type}, resident, greedy")
    out, rows, generated, t0 = Path(output_dir), [], 0, time.perf_counter()
    for ex in examples:
        swap = lambda text: text.replace(IMAGE, processor.marker)  # noqa: E731
        prompt = render_prompt(tok, swap(ex.prompt), template, [{**t, "content": swap(t["content"])}
                                                                 for t in ex.history], ex.chat)
        ids, images = processor.encode(prompt, ex.images)
        ids_t = torch.tensor([ids], device=device)
        with torch.no_grad():
            seq = model.generate(input_ids=ids_t, **generate_inputs(model, ids_t, processor.image_token_id, images,
                                                                    dtype),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                                 pad_token_id=tok.pad_token_id)
        new = seq[0, len(ids):]
        generated += int(new.numel())
        reply = tok.decode(new, skip_special_tokens=True)
        gold = ex.answer if ex.answer is not None else ex.response
        rows.append({"prompt": prompt, "images": ex.images, "output": reply, "gold": gold, **matches(reply, gold)})
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    with open(out / PREDICTIONS_FILE, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({**row, "correct": row[extract]}, ensure_ascii=False) + "\n")
    correct = sum(row[extract] for row in rows)
    results = {"accuracy": correct / len(rows), "correct": correct, "total": len(rows),
               "scores": {m: sum(row[m] for row in rows) / len(rows) for m in ("strict", "flexible")},
               "generated_tokens": generated, "tokens_per_s": generated / seconds if seconds > 0 else 0.0,
               "generation_s": seconds, "model_path": str(model_path), "data_source": label, "split": split,
               "device": device.type, "dtype": str(dtype).removeprefix("torch."), "mode": "resident",
               "protocol": {"task": "exact match of the reply to a question about images", "extract": extract,
                            "decoding": "greedy", "max_new_tokens": max_new_tokens, "stop_token_ids": stop},
               "predictions": str(out / PREDICTIONS_FILE), "wall_s": time.perf_counter() - started}
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
    log(f"eval: accuracy {results['accuracy']:.4f} ({correct}/{len(rows)}, {extract}), "
        f"wrote {out / RESULTS_FILE} and {out / PREDICTIONS_FILE}")
    return results
