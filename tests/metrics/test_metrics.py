"""metrics.py: FLOP formulas against hand arithmetic, peak lookup, /proc readers, the JSONL log."""

import dataclasses
import json
import math

import pytest

from megatrain_cli.machine import host_rss_bytes
from megatrain_cli.metrics.flops import executed_flops, model_flops
from megatrain_cli.metrics.logs import JsonlLog, TensorBoardLog
from megatrain_cli.metrics.peaks import PEAK_BF16_TFLOPS, peak_tflops
from megatrain_cli.metrics.record import StepMetrics


def cpu_metrics(step: int = 3, **overrides) -> StepMetrics:
    values = dict(step=step, total_steps=10, loss=2.5, lr=1e-5, grad_norm=0.75, tokens=4096, loss_tokens=4000,
                  step_time_s=2.0, tokens_per_s=2048.0, model_tflops=0.012, executed_tflops=0.016,
                  host_rss_bytes=3 * 2**30, time_forward_s=0.5, time_backward_s=1.2, time_optimizer_s=0.3,
                  eta_s=14.0)
    values.update(overrides)
    return StepMetrics(**values)


# ---------------------------------------------------------------- FLOPs
def test_model_flops_matches_hand_calculation():
    # 1000 matmul params, batch 2 x seq 16 = 32 tokens, hidden 8, 3 layers:
    # params part 6 * 1000 * 32 = 192,000; causal attention 6 * 2 * 16^2 * 8 * 3 = 73,728.
    assert model_flops(1000, 32, 2, 16, 8, 3) == 192_000 + 73_728


def test_model_flops_attention_is_half_of_full_attention():
    # Only the attention term: no params. Full attention would be 12*b*s^2*h*L.
    b, s, h, layers = 4, 128, 64, 2
    assert model_flops(0, b * s, b, s, h, layers) == 12 * b * s * s * h * layers / 2


def test_executed_flops_adds_one_third_per_recomputed_fraction():
    assert executed_flops(600.0, 0.0) == 600.0
    assert executed_flops(600.0, 1.0) == 800.0  # the forward (2 of 6) runs twice
    assert executed_flops(600.0, 0.5) == 700.0
    # The head is never recomputed: only 600 - 60 = 540 gets the extra third.
    assert executed_flops(600.0, 1.0, head_flops=60.0) == 780.0
    with pytest.raises(ValueError):
        executed_flops(600.0, 1.5)


# ---------------------------------------------------------------- peaks
def test_peak_tflops_by_device_name():
    assert peak_tflops("NVIDIA H200") == PEAK_BF16_TFLOPS["H200"] == 989.0
    assert peak_tflops("NVIDIA H200 NVL") == PEAK_BF16_TFLOPS["H200 NVL"] != PEAK_BF16_TFLOPS["H200"]
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA GeForce RTX 4090") == PEAK_BF16_TFLOPS["RTX 4090"]
    assert peak_tflops("NVIDIA L40S") == PEAK_BF16_TFLOPS["L40S"] != PEAK_BF16_TFLOPS["L40"]


def test_peak_tflops_unknown_or_cpu_is_none():
    assert peak_tflops("cpu") is None
    assert peak_tflops(None) is None
    assert peak_tflops("") is None
    assert peak_tflops("Tesla V100-SXM2-16GB") is None  # no bf16 tensor cores: not in the table
    assert peak_tflops("NVIDIA RTX A1000") is None  # must not match 'A100' or 'A10' inside a word


def test_every_table_key_resolves_to_itself():
    # A shorter key must never shadow a longer one ('H200' inside 'H200 NVL', 'L40' inside 'L40S').
    for key, value in PEAK_BF16_TFLOPS.items():
        assert peak_tflops(f"NVIDIA {key}") == value, key


# ---------------------------------------------------------------- /proc
def test_host_rss_grows_when_memory_is_touched():
    import mmap

    size = 64 * 2**20
    block = mmap.mmap(-1, size)  # fresh anonymous pages, none resident yet
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        # Backed by huge pages the 64 MiB take 32 faults, and Linux folds a thread's RSS count into statm only
        # every 64 faults: the growth may not show yet (seen in CI). 4 KiB pages: 16,384 faults.
        block.madvise(mmap.MADV_NOHUGEPAGE)
    before = host_rss_bytes()
    for offset in range(0, size, 4096):
        block[offset] = 1  # one write per page makes it resident
    after = host_rss_bytes()
    assert after - before >= 48 * 2**20
    block.close()


# ---------------------------------------------------------------- StepMetrics and logs
def test_to_json_has_every_field_and_none_for_unmeasured():
    from megatrain_cli.metrics.record import FLATTENED

    record = cpu_metrics().to_json()
    # every field; a preference method's metrics (dicts) under their own names, absent for SFT
    assert list(record) == [f.name for f in dataclasses.fields(StepMetrics) if f.name not in FLATTENED]
    for gpu_only in ("h2d_gbps", "d2h_gbps", "overlap", "gpu_mem_bytes", "mfu", "link_peak_gbps"):
        assert record[gpu_only] is None
    assert record["loss"] == 2.5 and record["tokens"] == 4096
    pref = cpu_metrics(preference={"rewards/accuracies": 0.75, "rewards/margins": math.nan},
                       val_preference={"rewards/accuracies": 1.0}).to_json()
    assert list(pref) == list(record) + ["rewards/accuracies", "rewards/margins", "val_rewards/accuracies"]
    assert pref["rewards/accuracies"] == 0.75 and pref["rewards/margins"] is None
    from megatrain_cli.metrics.logs import tracker_scalars

    scalars = tracker_scalars(pref)
    assert scalars["train/rewards/accuracies"] == 0.75 and scalars["val/rewards/accuracies"] == 1.0


def test_to_json_turns_non_finite_into_null():
    record = cpu_metrics(loss=math.nan, grad_norm=math.inf, skipped_steps=1).to_json()
    assert record["loss"] is None and record["grad_norm"] is None and record["skipped_steps"] == 1
    json.dumps(record, allow_nan=False)  # strict JSON


def test_jsonl_log_appends_flushed_lines_with_every_key(tmp_path):
    path = tmp_path / "deep" / "run" / "metrics.jsonl"
    log = JsonlLog(path)
    for step in (1, 2, 3):
        log.write(cpu_metrics(step=step, loss=3.0 - step / 10))
    # Read before close: each line must already be on disk (a crash loses nothing).
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    from megatrain_cli.metrics.record import FLATTENED

    keys = [f.name for f in dataclasses.fields(StepMetrics) if f.name not in FLATTENED]  # SFT: no preference keys
    records = [json.loads(line) for line in lines]
    for step, record in zip((1, 2, 3), records):
        assert sorted(record) == sorted(keys)
        assert record["step"] == step
    assert records[1]["loss"] == pytest.approx(2.8)
    log.close()
    # A second log on the same path appends (a resumed run), never truncates.
    with JsonlLog(path) as again:
        again.write(cpu_metrics(step=4))
    assert len(path.read_text().splitlines()) == 4


def test_jsonl_log_is_a_metrics_sink_and_writes_val_loss_where_measured(tmp_path):
    """One interface for every sink (metrics/logs.py, metrics/trackers.py); the validation loss is a field
    of the same record: null at the steps without a validation pass, the value at those with one."""
    from megatrain_cli.metrics import trackers
    from megatrain_cli.metrics.logs import MetricsSink

    assert all(issubclass(cls, MetricsSink) for cls in (JsonlLog, TensorBoardLog, trackers.WandbLog,
                                                         trackers.MlflowLog))
    path = tmp_path / "metrics.jsonl"
    with JsonlLog(path) as log:
        log.write(cpu_metrics(step=1))
        log.write(cpu_metrics(step=2, val_loss=1.75))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["val_loss"] for r in records] == [None, 1.75]


def test_keep_steps_up_to_drops_the_steps_a_resume_redoes_and_a_torn_line(tmp_path):
    from megatrain_cli.metrics.logs import keep_steps_up_to

    path = tmp_path / "metrics.jsonl"
    with JsonlLog(path) as log:
        for step in (1, 2, 3, 4):
            log.write(cpu_metrics(step=step, val_loss=2.0 if step == 4 else None))
    with open(path, "a") as f:
        f.write('{"step": 5, "lo')  # killed mid-write
    assert keep_steps_up_to(path, 2) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert keep_steps_up_to(path, 2) == 0  # nothing to drop: the file is left as it is


@pytest.mark.parametrize("keep,expect_recomputed", [(frozenset(), 4), (frozenset({1}), 2), (frozenset({0, 1}), 0)])
def test_step_metrics_count_the_recomputed_layers_in_executed_flops(keep, expect_recomputed):
    import torch

    from megatrain_cli.models.loader import build_store
    from megatrain_cli.recipe import TrainConfig
    from megatrain_cli.metrics.flops import streamed_step_flops
    from megatrain_cli.metrics.step import step_metrics
    from tests.engines import make_engine
    from tests.reference import random_batches, tiny_config

    store = build_store(tiny_config("Qwen2ForCausalLM", layers=4), torch.float32, seed=0)
    engine = make_engine(store, TrainConfig(lr=1e-3), device="cpu", checkpoint_interval=2, keep_blocks=keep,
                         overlap_optimizer=False)
    try:
        assert engine.recomputed_layers() == expect_recomputed
        (mbs,) = random_batches(store.adapter.vocab_size, 1, 1, batch=2, seq=16, seed=1)
        res = engine.step(mbs, 1e-3)
        m = step_metrics(res, engine=engine, step=0, total=1, lr=1e-3, skipped=0, step_time=2.0, seq_len=16)
    finally:
        engine.close()
    model, executed = streamed_step_flops(store, rows=2, seq=16, recomputed_layers=expect_recomputed)
    assert m.model_tflops == pytest.approx(model / 2.0 / 1e12)
    assert m.executed_tflops == pytest.approx(executed / 2.0 / 1e12)
    assert (m.executed_tflops > m.model_tflops) == (expect_recomputed > 0)
