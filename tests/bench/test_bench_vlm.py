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
    assert len(mbs) == 2 and rows.images_in([0]) == 2 * 2 * 2 and mbs[0].position_ids is None
    mb = mbs[0]
    assert (mb.input_ids == config.image_token_id).sum(1).tolist() == [2 * 16] * 2  # 112 px: 8x8 patches / 4
    assert mb.images["pixel_values"].shape == (2 * 2 * 64, 3 * 2 * 14 * 14)
    assert mb.images["image_grid_thw"].tolist() == [[1, 8, 8]] * 4
    assert not ((mb.labels != IGNORE_INDEX) & (mb.input_ids == config.image_token_id)).any()
    assert torch.equal(rows(0)[1].input_ids, mbs[1].input_ids), "seeded: the native baseline sees the same rows"
    # the planner's probe times the tower on pixel rows of these rows' shape (engine/vision_probe.py)
    from megatrain_cli.engine.vision_probe import image_inputs

    assert rows.probe_images == (2 * 2, 8)
    probed = image_inputs(config.vision_config, *rows.probe_images)
    assert {k: v.shape for k, v in probed.items()} == {k: v.shape for k, v in mb.images.items()}
    assert torch.equal(probed["image_grid_thw"], mb.images["image_grid_thw"])
    with pytest.raises(ValueError, match="train.seq_len: 16 tokens cannot hold 1 image"):
        VisionRows(vlm_recipe(**{"train.seq_len": 16}), config, micro_batches=1)


def test_bench_trains_the_tower_and_reports_images_per_second(tmp_path):
    lines = []
    res = run_bench(vlm_recipe(), BenchRun(steps=1, warmup=1, predict=True, probe_cache=str(tmp_path)),
                    log=lines.append)
    assert res.tokens_per_s > 0 and res.images_per_s == pytest.approx(2 / res.step_time_s)
    assert len(res.losses) == 2 and all(l > 0 for l in res.losses)
    assert "images/s" in format_table([res]) and "112x112 px" in res.packed
    # the prediction prices the tower at the rows' images (timed by the probe on this CPU)
    assert res.predicted["phases"]["vision"] > 0 and res.predicted["layer"]["vision_backward_s"] > 0
    assert any("of it) for a" in line and "the vision tower" in line for line in lines)


def test_packed_rows_hold_whole_image_chats_back_to_back():
    """data.packing: documents (one text token, the images, text) packed into rows as `train` packs them,
    positions restarting at each document, the padding tail continuing the last; images in document order."""
    r = vlm_recipe(**{"data.packing": "true", "bench.doc_len_mean": 30, "bench.doc_len_spread": 0.5})
    config = bench_model_config(r)
    rows = VisionRows(r, config, micro_batches=2, steps=3)
    image, start = config.image_token_id, config.vision_start_token_id
    docs = 0
    for s in range(3):
        mbs = rows(s)
        assert rows.images_in([s]) == sum(mb.images["image_grid_thw"].shape[0] for mb in mbs)
        for mb in mbs:
            pos = mb.position_ids
            assert torch.equal(pos[:, 1:] == 0, pos[:, 1:] != pos[:, :-1] + 1)  # a restart is a 0, nothing else
            for row in range(2):
                firsts = (pos[row] == 0).nonzero().flatten().tolist()
                assert all(mb.input_ids[row, f + 1] == start for f in firsts)  # each chat: a token, then its image
                assert int((mb.input_ids[row] == image).sum()) == 16 * len(firsts)
                docs += len(firsts)
            assert mb.images["image_grid_thw"].shape[0] == int((mb.position_ids == 0).sum())
            assert mb.images["pixel_values"].shape[0] == 64 * mb.images["image_grid_thw"].shape[0]
            assert not ((mb.labels != IGNORE_INDEX) & (mb.input_ids == image)).any()
    assert docs > 3 * 2 * 2 * 2, "several documents a row"
    # the planner's probe times the tower at the packed rows' images a micro-batch (their mean), not one a row
    images, grid = rows.probe_images
    assert grid == 8 and images > 2 and abs(images - rows.images_in([0, 1, 2]) / 2) <= 1.5
    assert rows.attended_per_step([0]) < 2 * 2 * 96 ** 2  # attention within documents only
    assert "documents/row" in rows.describe() and "per document" in rows.describe()
    with pytest.raises(ValueError, match="bench.doc_lengths=data: a vision-language model's bench builds synthetic"):
        VisionRows(vlm_recipe(**{"data.packing": "true", "bench.doc_lengths": "data"}), config, micro_batches=1)


def test_a_packed_bench_counts_the_images_its_rows_hold():
    lines = []
    res = run_bench(vlm_recipe(**{"data.packing": "true", "bench.doc_len_mean": 30}), BenchRun(steps=1, warmup=1),
                    log=lines.append)
    assert res.tokens_per_s > 0 and res.images_per_s * res.step_time_s > 2  # more than one image a row
    assert "documents/row" in res.packed and "1 packed documents a row" not in "\n".join(lines)
