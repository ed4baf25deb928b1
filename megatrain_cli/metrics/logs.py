"""The metrics sinks: where each logged step's record goes besides the screen.

One interface (`MetricsSink`: write a StepMetrics, close) and one record: every sink writes the same
`StepMetrics.to_json()` dict the dashboard shows, so metrics.jsonl, TensorBoard, W&B and MLflow never
disagree on a value. metrics.jsonl holds every field (null where not measured); the trackers get the
numeric fields as scalars named by `tracker_scalars` (`train/loss`, `val/loss`, ...). The optional
trackers (W&B, MLflow: metrics/trackers.py; TensorBoard here) are refused up front when their package is
missing (train/preflight.py), so a sink never silently drops what it was asked to log.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TextIO

from megatrain_cli.metrics.record import StepMetrics

# Fields that are not a scalar over steps: the step is the x axis, the total never changes.
NOT_SCALARS = frozenset({"step", "total_steps"})
# Record fields measured on the held-out split: `val_loss` is logged as `val/loss`, the rest as `train/KEY`.
VAL_PREFIX = "val_"


def tracker_scalars(record: dict) -> dict[str, float]:
    """The numeric, measured fields of a record as tracker scalars: `val_X` -> `val/X`, any other `train/X`.
    None (not measured at this step) and booleans are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_SCALARS or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = f"val/{key[len(VAL_PREFIX):]}" if key.startswith(VAL_PREFIX) else f"train/{key}"
        out[name] = float(value)
    return out


class MetricsSink:
    """Receives every logged step's record, in step order; `close` flushes and releases the sink."""

    def write(self, m: StepMetrics) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class JsonlLog(MetricsSink):
    """Appends one JSON object per step to a file, flushed at once so a crash loses nothing.

    Append, not truncate: a resumed run continues the same file, after keep_steps_up_to has dropped the
    records of the steps it redoes, so each step appears once.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")

    def write(self, m: StepMetrics) -> None:
        if self._file is None:
            raise ValueError(f"{self.path}: log already closed")
        self._file.write(json.dumps(m.to_json(), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def keep_steps_up_to(path: str | os.PathLike, step: int) -> int:
    """Drop the records of steps after `step` (the step a run resumes at; 0: a fresh start) and a line torn
    by a kill, so that the steps the run does again are not logged twice. The file is rewritten atomically
    (a temp file, fsync, rename) and only when something is dropped; returns how many lines were."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step and line.endswith("\n"):
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass  # a torn last line, or not a record of ours
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(lines) - len(kept)


def tensorboard_available() -> bool:
    """Whether TensorBoard events can be written here (the tensorboard package imports)."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


class TensorBoardLog(MetricsSink):
    """TensorBoard scalars (tracker_scalars) in event files under `log_dir`, flushed every step.
    Needs the tensorboard package (an optional extra): without it the constructor raises ImportError."""

    def __init__(self, log_dir: str | os.PathLike):
        self.log_dir = Path(log_dir)
        if not tensorboard_available():
            raise ImportError("TensorBoard logging needs the tensorboard package: `pip install tensorboard`")
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, m: StepMetrics) -> None:
        if self._writer is None:
            raise ValueError(f"{self.log_dir}: log already closed")
        for name, value in tracker_scalars(m.to_json()).items():
            self._writer.add_scalar(name, value, m.step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

