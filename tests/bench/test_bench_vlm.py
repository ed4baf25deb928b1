"""`megatrain bench` of a vision-language model (bench/vision_rows.py): synthetic chats with images shaped as
the processor makes them, the tower trained in the timed steps, images/s beside tokens/s."""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.bench.result import format_table
from megatrain_cli.bench.runner import run_bench
from megatrain_cli.bench.settings import BenchRun, bench_model_config, bench_recipe
from megatrain_cli.bench.vision_rows import VisionRows


def vlm_recipe(**extra):
    words = ["model.preset=qwen2-vl-tiny", "model.dtype=fp32", "engine.device=cpu", "train.micro_batch_size=2",
             "train.seq_len=96", "train.grad_accum=1", "bench.image_size=112"]
    return bench_recipe(words + [f"{k}={v}" for k, v in extra.items()])


def test_rows_hold_images_of_the_asked_size_and_no_loss_on_them():
    r = vlm_recipe(**{"bench.images_per_row": 2})
    config = bench_model_config(r)
    rows = VisionRows(r, config, micro_batches=2)
    mbs = rows(0)
    assert len(mbs) == 2 and rows.images_per_step == 2 * 2 * 2
    mb = mbs[0]
    assert (mb.input_ids == config.image_token_id).sum(1).tolist() == [2 * 16] * 2  # 112 px: 8x8 patches / 4
    assert mb.images["pixel_values"].shape == (2 * 2 * 64, 3 * 2 * 14 * 14)
    assert mb.images["image_grid_thw"].tolist() == [[1, 8, 8]] * 4
    assert not ((mb.labels != IGNORE_INDEX) & (mb.input_ids == config.image_token_id)).any()
    assert torch.equal(rows(0)[1].input_ids, mbs[1].input_ids), "seeded: the native baseline sees the same rows"
    with pytest.raises(ValueError, match="train.seq_len: 16 tokens cannot hold 1 image"):
        VisionRows(vlm_recipe(**{"train.seq_len": 16}), config, micro_batches=1)


def test_bench_trains_the_tower_and_reports_images_per_second():
    res = run_bench(vlm_recipe(), BenchRun(steps=1, warmup=1), log=lambda line: None)
    assert res.tokens_per_s > 0 and res.images_per_s == pytest.approx(2 / res.step_time_s)
    assert len(res.losses) == 2 and all(l > 0 for l in res.losses)
    assert "images/s" in format_table([res]) and "112x112 px" in res.packed
