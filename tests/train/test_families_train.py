"""Every verified family through `megatrain train` end to end on the CPU: a model directory saved by
transformers (tiny config of the family, the bundled tokenizer), trained a few steps on the bundled data
(packed rows), checkpointed and exported; the loss falls and the export reloads with the logits of the
last checkpoint's masters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatrain_cli.models.families import VERIFIED
from megatrain_cli.recipe import load_recipe
from megatrain_cli.train.loop import run_training
from tests.reference import reference_model, tiny_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def model_dir(family: str, root: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.recipe.schema import ModelConfig

    tok = load_tokenizer(ModelConfig(preset="tiny"))
    config = tiny_config(family, layers=2, vocab=len(tok), hidden=64, heads=4, kv_heads=2, inter=96,
                         tied=family.startswith("gemma"))
    config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else config.pad_token_id
    torch.manual_seed(0)
    path = root / family
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", sorted(VERIFIED))
def test_family_trains_end_to_end_and_exports(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatrain_cli.checkpoint import load_checkpoint
    from megatrain_cli.models.loader import build_store, load_hf_config

    src = model_dir(family, tmp_path)
    out = tmp_path / "run"
    r = load_recipe(ROOT / "recipes" / "tiny.yaml", [
        "~model.preset", f"model.path={src}", f"train.steps={STEPS}", "train.seq_len=128", "train.micro_batch_size=4",
        "train.lr=3e-3", "train.warmup_steps=0", "train.schedule=constant", "logging.every_n_steps=1",
        "logging.dashboard=off", f"checkpoint.every_n_steps={STEPS}", "eval.enabled=false", f"output_dir={out}"])
    assert run_training(r) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == STEPS
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.2, losses  # falls

    store = build_store(load_hf_config(src), torch.float32, seed=1)
    load_checkpoint(store, out / f"step_{STEPS}")
    expected = reference_model(store, store.adapter.config).eval()
    final = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    ids = torch.randint(0, store.adapter.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(final(ids).logits, expected(ids).logits, rtol=0, atol=0)
