"""A VLM's tower in the planner (issue #35): engine/plan/vision_terms.py's arithmetic on fixed figures, its
place in predict.py's step, and the layer probe's timing of one tower layer on a tiny Qwen2-VL (CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatrain_cli.engine.plan import probe as pb
from megatrain_cli.engine.plan.predict import Candidate, predict
from megatrain_cli.engine.plan.vision_terms import PerParam, TowerFigures, tower_phase
from tests.engine.test_plan_predict import FIG, LAYER, MODEL, QUICK, SHAPE, SMALL
from tests.helpers_bad_inputs import megatrain

A = SHAPE.grad_accum
TOWER = TowerFigures(layers=32, layer_params=2e7, trained_layers=32, outer_params=int(5e7), trained_outer=int(5e7))
FROZEN = dataclasses.replace(TOWER, trained_layers=0, trained_outer=int(4e7))  # freeze_vision: the projector trains
VLM = dataclasses.replace(MODEL, tower=TOWER)
TIMED = dataclasses.replace(LAYER, vision_forward_s=0.004, vision_backward_s=0.011)  # one tower layer, one micro-batch
PP = PerParam(h2d=1e-11, duplex=2e-11, master_h2d=3e-11, prep=4e-10, cast=1e-10, back=5e-10, serial=7e-10,
              worker=True)
CAND = Candidate(4, 0, 0)


def test_each_tower_layer_waits_for_its_slowest_resource():
    """Fixed per-parameter figures: the forward and backward are the hand-computed sums of each layer's max."""
    slow_gpu = dataclasses.replace(TIMED, vision_forward_s=0.005, vision_backward_s=0.006)
    t = tower_phase(TOWER, slow_gpu, A, PP, cuda=True)
    # forward: max(2 x 5 ms, 2e7 x 4e-10 = 8 ms, 2e7 x 1e-11) = 10 ms a layer; the outer masters' copy after
    assert t["forward"] == pytest.approx(32 * 0.010 + 5e7 * 3e-11)
    # backward: max(2 x 6 ms, 2e7 x 2e-11, 2e7 x 5e-10 = 10 ms) = 12 ms a layer
    assert t["backward"] == pytest.approx(32 * 0.012)
    assert t["serial"] == pytest.approx(5e7 * 7e-10)  # the embedding's and projector's update
    assert t["gpu"] == pytest.approx(32 * 2 * (0.005 + 0.006))
    assert t["pcie"] == pytest.approx(32 * 2e7 * (1e-11 + 2e-11) + 5e7 * 3e-11)
    assert t["host"] == pytest.approx(32 * 2e7 * (4e-10 + 5e-10) + 5e7 * 7e-10)
    host_bound = tower_phase(TOWER, TIMED, A, dataclasses.replace(PP, prep=1e-9, back=2e-9), cuda=True)
    assert host_bound["forward"] == pytest.approx(32 * 2e7 * 1e-9 + 5e7 * 3e-11)
    assert host_bound["backward"] == pytest.approx(32 * 2e7 * 2e-9)


def test_freeze_vision_leaves_the_forward_only():
    t = tower_phase(FROZEN, TIMED, A, PP, cuda=True)
    assert t["backward"] == 0.0  # no re-stream, no recompute, no gradient
    assert t["forward"] == pytest.approx(32 * max(A * 0.004, 2e7 * 1e-10, 2e7 * 1e-11) + 5e7 * 3e-11)
    assert t["serial"] == pytest.approx(4e7 * 7e-10)  # the projector's update only
    assert t["host"] == pytest.approx(32 * 2e7 * 1e-10 + 4e7 * 7e-10)  # casts, never an update
    assert t["gpu"] == pytest.approx(32 * A * 0.004)
    assert t["pcie"] == pytest.approx(32 * 2e7 * 1e-11 + 5e7 * 3e-11)


def test_without_the_optimizer_thread_every_tower_update_is_serial():
    t = tower_phase(TOWER, TIMED, A, dataclasses.replace(PP, worker=False), cuda=True)
    assert t["serial"] == pytest.approx((32 * 2e7 + 5e7) * 7e-10)


def test_text_rows_and_text_models_add_nothing():
    for tower, layer in ((None, TIMED), (TOWER, LAYER)):  # LAYER: the probe timed no images (vision 0)
        assert set(tower_phase(tower, layer, A, PP, cuda=True).values()) == {0.0}
    text, rows = predict(FIG, LAYER, MODEL, SHAPE, CAND), predict(FIG, LAYER, VLM, SHAPE, CAND)
    assert "vision" not in text.phases and rows.phases["vision"] == 0.0
    assert rows.total == text.total and rows.parts == text.parts


def test_the_step_adds_the_tower_on_a_gpu_bound_machine():
    """QUICK: link and host far faster than the GPU, so the tower is its GPU time plus tiny copies and updates,
    each at the machine's own figures (the same ones the decoder's layers are priced at)."""
    text, vlm = predict(QUICK, TIMED, MODEL, SHAPE, CAND), predict(QUICK, TIMED, VLM, SHAPE, CAND)
    outer_copy = 5e7 * 4 / (1e4 * 1e9)  # fp32 masters over a 10 TB/s link
    update = 5e7 * 18 / (1e13 * 26)  # the weights pass of a clipped step (18 B/param) at the host's 26e13 B/s
    assert vlm.phases["vision"] == pytest.approx(A * 32 * (0.004 + 0.011) + outer_copy + update)
    assert vlm.total == pytest.approx(text.total + vlm.phases["vision"])
    assert vlm.parts["gpu"] - text.parts["gpu"] == pytest.approx(A * 32 * (0.004 + 0.011))
    for key in ("forward", "head", "backward", "serial"):  # the decoder's phases are its own
        assert vlm.phases[key] == text.phases[key]


def test_the_tower_streams_at_the_links_rate():
    slow_link = dataclasses.replace(QUICK, h2d_gbps=10.0, d2h_gbps=10.0, duplex_gbps=8.0)
    quick_gpu = dataclasses.replace(TIMED, vision_forward_s=1e-6, vision_backward_s=1e-6)
    text, vlm = predict(slow_link, quick_gpu, MODEL, SHAPE, CAND), predict(slow_link, quick_gpu, VLM, SHAPE, CAND)
    streamed = 32 * 2e7 * 2 / 10e9 + 5e7 * 4 / 10e9  # each layer's bf16 weights in, the outer fp32 masters
    back = 32 * 2e7 * 2 / 8e9  # re-stream in and gradient out, each way at the duplex rate
    assert vlm.phases["vision"] == pytest.approx(streamed + back + 5e7 * 18 / (1e13 * 26))
    assert vlm.parts["pcie"] - text.parts["pcie"] == pytest.approx(streamed + back)
    bf16 = dataclasses.replace(SHAPE, masters="bf16-stochastic")  # the outer masters cross at 2 B
    half = predict(slow_link, quick_gpu, VLM, bf16, CAND).parts["pcie"] - \
        predict(slow_link, quick_gpu, MODEL, bf16, CAND).parts["pcie"]
    assert half == pytest.approx(back + streamed - 5e7 * 2 / 10e9)


def test_an_unknown_link_leaves_the_tower_unknown():
    no_link = dataclasses.replace(FIG, h2d_gbps=None, d2h_gbps=None, duplex_gbps=None)
    p = predict(no_link, TIMED, VLM, SHAPE, CAND)
    assert p.phases["vision"] is None and p.total is None and p.parts["pcie"] is None


def test_plan_table_and_lines_show_the_vision_phase():
    from megatrain_cli.plan_cmd import table
    from megatrain_cli.train.predicted import describe

    p = predict(QUICK, TIMED, VLM, SHAPE, CAND)
    assert " vision " in table([p]).splitlines()[0] and f"{p.phases['vision']:.3f}" in table([p]).splitlines()[1]
    assert f"vision {p.phases['vision']:.3f}" in describe(p)
    text_rows = predict(QUICK, LAYER, VLM, SHAPE, CAND)
    assert "vision 0.000 (no images timed" in describe(text_rows)
    assert "vision" not in describe(predict(QUICK, LAYER, MODEL, SHAPE, CAND))


def test_model_figures_count_the_towers_tiles_and_what_freezing_keeps():
    from megatrain_cli.engine.plan.predict import ModelFigures
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.store.tiles import HostStore
    from tests.engine.test_vision import tiny_vlm_config

    adapter = ModelAdapter(tiny_vlm_config("qwen2_vl", depth=2))
    n = {k: v.numel for k, v in HostStore(adapter, torch.bfloat16, allocate=False).layouts.items()}
    whole = ModelFigures.of(adapter, torch.bfloat16).tower
    assert whole == TowerFigures(2, n["vision.0"], 2, n["vision.embed"] + n["vision.projector"],
                                 n["vision.embed"] + n["vision.projector"])
    frozen = ModelFigures.of(adapter, torch.bfloat16, adapter.vision.frozen_tiles(True, False)).tower
    assert (frozen.trained_layers, frozen.trained_outer) == (0, n["vision.projector"])


def test_the_layer_probe_times_a_tower_layer_on_the_cpu(tmp_path):
    """A tiny Qwen2-VL: the engine's probe with images times one tower layer (positive), keys it by the images,
    and a text-rows timing (no images) prices no tower."""
    from megatrain_cli.engine.layer_probe import measure_layer
    from megatrain_cli.models.adapter import ModelAdapter
    from tests.engine.test_vision import tiny_vlm_config

    adapter = ModelAdapter(tiny_vlm_config("qwen2_vl"))
    args = dict(micro_batch_size=1, seq_len=16, dtype=torch.float32, device=torch.device("cpu"), kernels="torch",
                cache_dir=tmp_path,
                machine_args=SMALL, measure_layer=measure_layer, vision_images=(2, 8))
    probe = pb.load_or_probe(adapter, **args)
    assert probe.measured == ["machine", "layer"]
    lt = probe.layer
    assert lt.vision_forward_s > 0 and lt.vision_backward_s > 0 and lt.forward_s > 0
    assert pb.load_or_probe(adapter, **args).measured == []  # cached under its images
    key = pb.layer_key(adapter, **{k: v for k, v in args.items() if k not in ("cache_dir", "machine_args",
                                                                           "measure_layer")})
    assert key.endswith("-loss4096") and "-img2x8-" in key
    text = pb.read_cached(adapter, **{**{k: v for k, v in args.items() if k not in ("machine_args", "measure_layer")},
                                      "vision_images": None})
    assert text is not None and text.layer is None  # text rows are another timing, not this one


VLM_TINY = Path(__file__).resolve().parents[2] / "recipes" / "vlm-tiny.yaml"


def test_the_datas_images_as_the_probe_times_them():
    """ImageTrainData.probe_images from the ids' image tokens equals what the processor's own tensors hold:
    images a micro-batch over the rows, the mean patches per image as a square of whole merged patches."""
    from megatrain_cli.data import load_examples, split_examples
    from megatrain_cli.data.image_rows import build_image_data
    from megatrain_cli.models.processor import load_processor
    from megatrain_cli.recipe import load_recipe

    r = load_recipe(VLM_TINY)
    processor = load_processor(r.model.tokenizer or r.model.path)
    data = build_image_data(split_examples(load_examples(r.data), r.data)[0], processor, r.data, r.train.seq_len,
                            r.train.seed)
    grids = torch.cat([data.micro_batch([row]).images["image_grid_thw"] for row in range(data.num_rows)
                       if any(data.images[ex] for ex in data.rows[row])])
    images, patches = grids.shape[0], int(grids.prod(-1).sum())
    side = processor.merge * max(1, round((patches / images) ** 0.5 / processor.merge))
    assert data.probe_images(3) == (round(images / data.num_rows * 3), side)


def test_plan_times_the_towers_layer_at_the_datas_images(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the default cache folder, which `train` reads
    tmp_path = pb.default_cache_dir()
    pb.load_or_probe(cache_dir=tmp_path, machine_args=SMALL)  # the machine figures: cached, small and quick
    result = megatrain("plan", VLM_TINY, "engine.device=cpu")  # the CPU's timing, on a GPU machine too
    out = result.output
    assert result.exit_code == 0, out
    assert "images: " in out and "the vision tower is timed at that" in out
    vision = float(out.split("not overlapped ", 1)[1].split(", vision ", 1)[1].split(";")[0])
    assert vision > 0 and " vision " in out  # the phase, and its column in the table
    # the dry run reads the data's images as `plan` timed them
    dry = megatrain("train", VLM_TINY, "--dry-run", "engine.device=cpu").output
    assert f", vision {vision:.3f}; docs/planner.md)" in dry
    # `train` once its data is read (train/loop.py): the cached timing at those images, else the tower at 0
    from megatrain_cli.data import load_examples, split_examples
    from megatrain_cli.data.image_rows import build_image_data
    from megatrain_cli.engine.plan.step_plan import plan_step
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.models.processor import load_processor
    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.recipe import load_recipe
    from megatrain_cli.train.predicted import prediction
    from megatrain_cli.train.setup import model_config

    r = load_recipe(VLM_TINY, ["engine.device=cpu"])
    adapter = ModelAdapter(model_config(r, load_tokenizer(r.model)))
    data = build_image_data(split_examples(load_examples(r.data), r.data)[0], load_processor(r.model.tokenizer),
                            r.data, r.train.seq_len, r.train.seed)
    images = data.probe_images(r.train.micro_batch_size)
    plan = plan_step(r, adapter, torch.device("cpu"))
    timed = prediction(r, adapter, torch.device("cpu"), plan, cache_dir=tmp_path, images=images)
    assert timed.phases["vision"] == pytest.approx(vision, abs=5e-4)
    other = (images[0] + 1, images[1])  # images never timed: no timing without images cached either here
    untimed = prediction(r, adapter, torch.device("cpu"), plan, cache_dir=tmp_path, images=other)
    assert untimed.total is None and untimed.unknown == ["layer timing"]
