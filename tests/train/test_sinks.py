"""The metrics sinks (metrics/logs.py, metrics/trackers.py, train/sinks.py), each written and read back:
TensorBoard event files, W&B offline run files, an MLflow folder store; and a training run whose every
sink holds the same values as its metrics.jsonl, validation loss included. A tracker whose package is not
installed here is skipped with the reason (they are optional extras: `pip install -e '.[test]'` has them).
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest

from megatrain_cli.metrics import logs, trackers
from megatrain_cli.metrics.logs import tracker_scalars
from megatrain_cli.metrics.record import StepMetrics
from megatrain_cli.recipe import LoggingConfig, load_recipe
from megatrain_cli.train.loop import run_training

ROOT = Path(__file__).resolve().parents[2]
needs_tensorboard = pytest.mark.skipif(not logs.tensorboard_available(), reason="tensorboard is not installed")
needs_wandb = pytest.mark.skipif(not trackers.wandb_available(), reason="wandb is not installed")
needs_mlflow = pytest.mark.skipif(not trackers.mlflow_available(), reason="mlflow is not installed")


def record(step: int, val_loss: float | None = None) -> StepMetrics:
    return StepMetrics(step=step, total_steps=3, loss=3.0 - step / 4, lr=1e-3 * step, grad_norm=0.5, tokens=128,
                       loss_tokens=100, step_time_s=0.25, tokens_per_s=512.0, model_tflops=0.002, val_loss=val_loss)


STEPS = [record(1), record(2), record(3, val_loss=2.125)]


# ---------------------------------------------------------------- readers
def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(run_dir: Path, timeout_s: float = 30.0) -> list:
    """The protobuf records of a W&B offline run file (`run-ID.wandb`), once W&B's service process has
    written the run's exit record (it writes asynchronously; on a loaded machine that lands after finish()
    returned: seen once in a full CI run)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_file_records(run_dir)
        if any(rec.WhichOneof("record_type") == "exit" for rec in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _wandb_file_records(run_dir: Path) -> list:
    """W&B's LevelDB-style log: a 7-byte header then 32 KiB blocks of chunks (crc32, length, type: full /
    first / middle / last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def wandb_history(run_dir: Path) -> list[dict]:
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            for rec in wandb_records(run_dir) if rec.WhichOneof("record_type") == "history"]
    return [{k: v for k, v in row.items() if not k.startswith("_") or k == "_step"} for row in rows]


def mlflow_client(uri: str, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own opt-in, for this reader only
    return MlflowClient(tracking_uri=uri)


# ---------------------------------------------------------------- the record's scalars
def test_tracker_scalars_are_the_measured_numbers_of_the_record():
    scalars = tracker_scalars(record(3, val_loss=2.125).to_json())
    assert scalars["train/loss"] == 2.25 and scalars["val/loss"] == 2.125 and scalars["train/lr"] == 0.003
    assert scalars["train/skipped_steps"] == 0.0  # an int field is a scalar too
    assert "train/step" not in scalars and "train/total_steps" not in scalars  # the x axis, a constant
    assert "train/mfu" not in scalars and "train/h2d_gbps" not in scalars  # None: not measured, not logged
    assert "val/loss" not in tracker_scalars(record(1).to_json())


# ---------------------------------------------------------------- each sink, written and read back
@needs_tensorboard
def test_tensorboard_event_files_read_back(tmp_path):
    with logs.TensorBoardLog(tmp_path / "tb") as sink:
        for m in STEPS:
            sink.write(m)
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["train/loss"] == [(1, 2.75), (2, 2.5), (3, 2.25)]
    assert scalars["val/loss"] == [(3, 2.125)]
    assert [s for s, _ in scalars["train/lr"]] == [1, 2, 3]
    assert scalars["train/lr"][2][1] == pytest.approx(0.003)  # events hold float32


def test_tensorboard_log_without_its_package_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "tensorboard_available", lambda: False)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        logs.TensorBoardLog(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


@needs_wandb
def test_wandb_offline_run_files_read_back(tmp_path):
    config = {"train": {"lr": 0.001, "steps": 3}, "output_dir": str(tmp_path)}
    sink = trackers.WandbLog(tmp_path, mode="offline", project="proj", name="run-a", config=config)
    for m in STEPS:
        sink.write(m)
    sink.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert sink.dir == run_dir
    (run,) = [rec.run for rec in wandb_records(run_dir) if rec.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("proj", "run-a")
    run_config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert run_config["train"] == {"lr": 0.001, "steps": 3}
    history = wandb_history(run_dir)
    assert [row["_step"] for row in history] == [1, 2, 3]
    assert [row["train/loss"] for row in history] == [2.75, 2.5, 2.25]
    assert [row.get("val/loss") for row in history] == [None, None, 2.125]
    assert history[2] == {"_step": 3, **tracker_scalars(STEPS[2].to_json())}  # every scalar, nothing else


@needs_mlflow
def test_mlflow_folder_store_read_back(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = str(tmp_path / "mlruns")
    sink = trackers.MlflowLog(uri, experiment="exp", name="run-a", config={"train": {"lr": 0.001}, "seed": 7})
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # MLflow's opt-in was set only while the store was built
    for m in STEPS:
        sink.write(m)
    run_id = sink.run_id
    sink.close()
    client = mlflow_client(uri, monkeypatch)
    run = client.get_run(run_id)
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    assert run.data.params == {"train.lr": "0.001", "seed": "7"}
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted((h.step, h.value) for h in history) == [(1, 2.75), (2, 2.5), (3, 2.25)]
    assert [(h.step, h.value) for h in client.get_metric_history(run_id, "val/loss")] == [(3, 2.125)]
    assert set(run.data.metrics) == set(tracker_scalars(STEPS[2].to_json()))


# ---------------------------------------------------------------- a training run, every sink on
def tiny(out: Path, *extra: str):
    return load_recipe(ROOT / "recipes" / "tiny.yaml", [
        "train.steps=4", "train.seq_len=64", "train.micro_batch_size=2", "logging.dashboard=off",
        "logging.every_n_steps=3", "checkpoint.export_final=false", "eval.enabled=false", "eval.every_n_steps=2",
        f"output_dir={out}", *extra])


def test_a_run_gives_every_sink_the_same_records_validation_loss_included(tmp_path, monkeypatch):
    """Logged steps: every 3rd, each validation step (every 2nd) and the last. metrics.jsonl has them all,
    null val_loss where no pass ran; each installed tracker has the same numbers at the same steps."""
    on = [f"logging.tensorboard={logs.tensorboard_available()}",
          f"logging.wandb={'offline' if trackers.wandb_available() else 'off'}",
          f"logging.mlflow={trackers.mlflow_available()}", "logging.run_name=tiny-run"]
    out = tmp_path / "run"
    assert run_training(tiny(out, *on)) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4]
    assert [r["val_loss"] is not None for r in records] == [True, False, True]
    val = [(r["step"], r["val_loss"]) for r in records if r["val_loss"] is not None]
    loss = [(r["step"], r["loss"]) for r in records]
    if logs.tensorboard_available():
        scalars = tensorboard_scalars(out / "tensorboard")
        assert scalars["val/loss"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in val]
        assert scalars["train/loss"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in loss]
    if trackers.wandb_available():
        (run_dir,) = (out / "wandb").glob("offline-run-*")
        history = wandb_history(run_dir)
        assert [(h["_step"], h["val/loss"]) for h in history if "val/loss" in h] == val
        assert [(h["_step"], h["train/loss"]) for h in history] == loss
    if trackers.mlflow_available():
        client = mlflow_client(str(out / "mlruns"), monkeypatch)  # the default: output_dir/mlruns
        (run,) = client.search_runs([client.get_experiment_by_name("megatrain").experiment_id])
        assert run.info.run_name == "tiny-run" and run.data.params["eval.every_n_steps"] == "2"
        assert [(h.step, h.value) for h in client.get_metric_history(run.info.run_id, "val/loss")] == val


def test_a_tracker_without_its_package_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trackers, "wandb_available", lambda: False)
    monkeypatch.setattr(trackers, "mlflow_available", lambda: False)
    out = tmp_path / "run"
    assert run_training(tiny(out, "logging.wandb=online", "logging.mlflow=true")) == 2
    err = capsys.readouterr().err
    assert "logging.wandb is online but the wandb package is not installed: `pip install wandb`" in err
    assert "logging.mlflow is on but the mlflow package is not installed: `pip install mlflow`" in err
    assert "'megatrain[wandb]'" in err and "logging.wandb=off" in err and "logging.mlflow=false" in err
    assert "Traceback" not in err and not out.exists()


def test_logging_keys_have_their_defaults():
    cfg = LoggingConfig()
    assert (cfg.wandb, cfg.mlflow, cfg.mlflow_tracking_uri, cfg.project, cfg.run_name) == \
        ("off", False, None, "megatrain", None)
