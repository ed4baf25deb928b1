"""Where step metrics go besides the screen: metrics.jsonl (always the same keys) and TensorBoard."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TextIO

from megatrain_cli.metrics.record import StepMetrics

class JsonlLog:
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

    def __enter__(self) -> "JsonlLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


class TensorBoardLog:
    """TensorBoard scalars for every numeric field, when tensorboard is installed; else a no-op.

    `available` says which. It is optional on purpose: tensorboard is not a dependency.
    """

    def __init__(self, log_dir: str | os.PathLike):
        self.log_dir = Path(log_dir)
        self._writer = None
        try:
            import tensorboard  # noqa: F401  (SummaryWriter imports it lazily; fail here instead)
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # ImportError, or a broken install: either way, no TensorBoard
            self.available = False
            return
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self.available = True

    def write(self, m: StepMetrics) -> None:
        if self._writer is None:
            return
        for key, value in m.to_json().items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"train/{key}", value, m.step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
