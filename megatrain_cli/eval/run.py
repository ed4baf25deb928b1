"""Exact-match eval: greedy answers of a model on held-out problems, scored against gold.

'test' is the held-out side of the very split the trainer makes (same source, seed and fraction
through `split_examples`), and prompts go through the same `render_prompt` / `encode_prompt`, so the
model is asked exactly what it was trained to answer. The model runs resident or streamed from host
memory (`source.choose_mode`); results.json records which, with generated tokens/s and wall time, and
the protocol (protocol.py: prompt, few-shot, answer extraction) that the score depends on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.load import load_examples, source_label, split_examples
from megatrain_cli.data.prompts import default_prefix_ids, encode_prompt, eos_id, pad_id, render_prompt, \
    stop_strings, uses_chat_template
from megatrain_cli.data.turns import end_of_turn_id
from megatrain_cli.eval import protocol
from megatrain_cli.eval.generate import generate_greedy
from megatrain_cli.eval.settings import check_options
from megatrain_cli.eval.source import check_host_memory, choose_mode, host_bytes, load_resident, load_streamed, \
    model_eos_ids, num_params, resolve_model
from megatrain_cli.models.tokenizer import has_tokenizer_files, load_bundled_tokenizer, load_tokenizer_dir
from megatrain_cli.recipe import DataConfig, Recipe

RESULTS_FILE = "results.json"
PREDICTIONS_FILE = "predictions.jsonl"


def run_eval(r: Recipe, model_path: str, *, split: str = "test", mode: str = "auto", output_dir: str | Path = ".",
             log: Callable[[str], None] | None = print) -> dict:
    """Evaluate `model_path` on r.data's `split` under r.eval's protocol, on r.engine.device; write
    results.json and predictions.jsonl into `output_dir`; return the results.

    `r`: a recipe as load_recipe returns it (its values checked; model and train keys unread): `megatrain
    eval`'s, or the trainer's own. `model_path` is an HF model directory or `preset:NAME` (random weights,
    for speed: see `source`); `mode` is resident, streamed or auto (see `source.choose_mode`).
    """
    started = time.perf_counter()
    log = log or (lambda _msg: None)
    # The options first, then the data, then the memory check: all before the model is loaded.
    cfg, ecfg = r.data, r.eval
    check_options(ecfg, split=split, mode=mode)
    dev = resolve_device(r.engine.device)
    limit, batch_size, max_new_tokens = ecfg.limit, ecfg.batch_size, ecfg.max_new_tokens
    everything = load_examples(cfg)
    examples = select_examples(cfg, split, limit, everything)
    if ecfg.num_fewshot:
        examples = protocol.with_fewshot(examples, split_examples(everything, cfg)[0], ecfg.num_fewshot,
                                         ecfg.fewshot_seed)
    prompt_template = protocol.template(ecfg, cfg)
    if any(ex.images for ex in examples):  # questions about images: the VLM's own class (eval/images.py)
        from megatrain_cli.eval.images import run_image_eval

        return run_image_eval(examples, model_path, template=prompt_template, extract=ecfg.extract,
                              max_new_tokens=max_new_tokens, device=dev, output_dir=output_dir,
                              label=source_label(cfg), split=split, log=log)

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokenizer = load_eval_tokenizer(model_path)
    chat = uses_chat_template(tokenizer, prompt_template, examples[0].chat, evaluating=True,
                              key="data.template" if ecfg.prompt == "auto" else "eval.prompt")
    prefix = default_prefix_ids(tokenizer)
    prompts = [render_prompt(tokenizer, ex.prompt, prompt_template, ex.history, ex.chat) for ex in examples]
    prompt_ids = [encode_prompt(tokenizer, p, prefix) for p in prompts]
    max_positions = max(len(p) for p in prompt_ids) + max_new_tokens

    source = resolve_model(model_path, len(tokenizer), max_positions)
    params = num_params(source.config)
    chosen, why = choose_mode(mode, source, params, dev, dtype, batch_size, max_positions)
    check_host_memory(chosen, host_bytes(chosen, source, params, dev, dtype, batch_size, max_positions))
    log(f"eval: {chosen} ({why})")
    t0 = time.perf_counter()
    model = (load_resident if chosen == "resident" else load_streamed)(source, dev, dtype)
    load_s = time.perf_counter() - t0

    # A chat model stops at its template's end of turn, as training taught it, even where eos is another token.
    eos_ids = sorted({eos_id(tokenizer), *model_eos_ids(source), *([end_of_turn_id(tokenizer)] if chat else [])}
                     - {None})
    stop = stop_strings(tokenizer, prompt_template, examples[0].chat)
    label = source_label(cfg)
    log(f"eval: {len(examples)} {split} examples of {label} on {dev.type} ({dtype}), batch {batch_size}, "
        f"{ecfg.num_fewshot}-shot {'chat' if chat else 'plain'}, {ecfg.extract} extraction")
    generations, seconds = generate_greedy(
        model, tokenizer, prompt_ids, eos_ids=eos_ids, pad_id=pad_id(tokenizer), stop=stop,
        max_new_tokens=max_new_tokens, batch_size=batch_size,
        progress=lambda done, total: log(f"eval: {done}/{total}") if done % (batch_size * 10) == 0 else None)

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    scored = protocol.score([g.text for g in generations], [ex.answer for ex in examples])
    chosen_scores = scored[ecfg.extract]
    correct = sum(ok for _, ok in chosen_scores)
    unparseable = sum(got is None for got, _ in chosen_scores)
    with open(out / PREDICTIONS_FILE, "w", encoding="utf-8") as f:
        for ex, prompt, gen, (extracted, ok) in zip(examples, prompts, generations, chosen_scores):
            f.write(json.dumps({"prompt": prompt, "output": gen.text, "extracted": extracted, "gold": ex.answer,
                                "correct": ok}, ensure_ascii=False) + "\n")
    generated = sum(g.new_tokens for g in generations)
    results = {
        "accuracy": correct / len(examples), "correct": correct, "total": len(examples),
        "scores": {mode: sum(ok for _, ok in pairs) / len(examples) for mode, pairs in scored.items()},
        "unparseable": unparseable, "generated_tokens": generated,
        "tokens_per_s": generated / seconds if seconds > 0 else 0.0, "generation_s": seconds,
        "model_path": str(model_path), "data_source": label, "split": split, "limit": limit,
        "template": "chat" if chat else "plain",
        "test_fraction": cfg.test_fraction, "split_seed": cfg.split_seed, "device": dev.type,
        "dtype": str(dtype).removeprefix("torch."), "batch_size": batch_size, "max_new_tokens": max_new_tokens,
        "mode": chosen, "params": params, "load_s": load_s,
        "predictions": str(out / PREDICTIONS_FILE),
        "protocol": protocol.describe(ecfg, cfg, chat=chat, tokenizer=tokenizer, split=split, total=len(examples),
                                      source=label, stop=stop, stop_ids=eos_ids,
                                      dtype=str(dtype).removeprefix("torch.")),
    }
    if chosen == "streamed":
        # Weights copied to the device (0 on CPU, where nothing moves) over the generation time: the
        # host link's rate is the ceiling of this, and streamed decoding sits near it.
        results.update(forward_steps=model.steps, streamed_gb=model.bytes_sent / 1e9,
                       streamed_gb_per_s=model.bytes_sent / 1e9 / seconds if seconds > 0 else 0.0)
    results["wall_s"] = time.perf_counter() - started  # everything: data, load, generation, scoring
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
    log(f"eval: accuracy {results['accuracy']:.4f} ({correct}/{len(examples)}, {ecfg.extract}; strict "
        f"{results['scores']['strict']:.4f}, flexible {results['scores']['flexible']:.4f}), {unparseable} unparseable, "
        f"{results['tokens_per_s']:.1f} generated tokens/s {chosen}, {results['wall_s']:.1f} s in all; "
        f"wrote {out / RESULTS_FILE} and {out / PREDICTIONS_FILE}")
    return results


def select_examples(cfg: DataConfig, split: str, limit: int | None, examples=None):
    """The examples of `split` (the trainer's seeded split), at most `limit`, each with a gold answer.
    `examples`: cfg's examples when the caller has read them already."""
    examples = load_examples(cfg) if examples is None else examples
    if split != "all":
        train, test = split_examples(examples, cfg)
        examples = test if split == "test" else train
    examples = [ex for ex in examples if not ex.unusable]  # a NaN where text belongs, every reply empty
    if limit is not None:
        examples = examples[:limit]
    if not examples:
        raise DataError(f"{source_label(cfg)}: the {split} split is empty (test_fraction={cfg.test_fraction})")
    missing = [ex for ex in examples if ex.answer is None]
    if missing:
        gold = cfg.fields.get("gold") if cfg.fields else None
        where = f"field {gold!r} (data.fields.gold)" if gold else \
            "response ('The answer is: X', '#### X' or a number; or name an answer field with data.fields.gold)"
        raise DataError(f"{source_label(cfg)}: {len(missing)} of {len(examples)} {split} examples have no gold answer "
                        f"in their {where}; first: {missing[0].prompt[:80]!r}")
    return examples


def resolve_device(device: str) -> torch.device:
    """engine.device (auto, cpu or cuda: the recipe's type says so) as a torch device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine.device is 'cuda' but no CUDA device is available (use 'auto' or 'cpu')")
    return torch.device(device)


def load_eval_tokenizer(model_path: str):
    """The model directory's tokenizer; the bundled one when the directory has none (a preset run)."""
    if has_tokenizer_files(model_path):
        return load_tokenizer_dir(model_path)
    return load_bundled_tokenizer()
