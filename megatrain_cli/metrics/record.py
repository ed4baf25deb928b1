"""StepMetrics: everything reported about one optimizer step, None where it was not measured.

"Honest" means a field that was not measured is None -- shown as 'n/a' and written as null -- never a
plausible-looking invented number. On a CPU run every GPU-only field (transfer rates, overlap, device
memory, MFU) is None.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

@dataclass
class StepMetrics:
    """Everything reported about one optimizer step. None = not measured here (e.g. GPU-only on CPU)."""

    step: int  # 1-based optimizer step
    total_steps: int
    loss: float  # token-weighted mean over the step
    lr: float
    grad_norm: float  # before clipping
    tokens: int  # input tokens processed this step
    loss_tokens: int  # tokens that carried loss
    step_time_s: float  # wall time of the whole step
    tokens_per_s: float
    model_tflops: float | None = None  # model_flops / step time (recompute not counted)
    executed_tflops: float | None = None  # executed_flops / step time (recompute counted)
    mfu: float | None = None  # model_tflops / device peak, 0..1; None without a known peak
    h2d_gbps: float | None = None  # host-to-device bytes / step time, GB/s (1e9)
    d2h_gbps: float | None = None
    link_peak_gbps: float | None = None  # measured or nominal one-way link peak; None when unknown
    overlap: float | None = None  # fraction of step wall time the compute stream was busy
    time_forward_s: float | None = None
    time_backward_s: float | None = None  # recompute + backward
    time_optimizer_s: float | None = None  # optimizer time NOT hidden behind the backward
    time_wait_weights_s: float | None = None  # compute stalled waiting for weights to arrive
    time_wait_optimizer_s: float | None = None  # stalled waiting for the host optimizer
    gpu_mem_bytes: int | None = None  # peak device memory allocated this step
    host_rss_bytes: int | None = None
    pinned_bytes: int | None = None  # pinned host memory held (staging buffers, gradient slabs)
    skipped_steps: int = 0  # steps skipped so far for a non-finite loss or gradient
    eta_s: float | None = None
    # Token-mean cross-entropy on the held-out rows, at the steps a validation pass ran (eval.every_n_steps);
    # a preference method: the mean loss of the held-out pairs
    val_loss: float | None = None
    # A preference method's metrics (TRL's names: rewards/chosen, ..., logps/rejected) over the step's pairs,
    # and over the held-out pairs at a validation pass; None: SFT, or no pass. The record holds them flat,
    # under their own names and as val_<name> (`to_json`).
    preference: dict | None = None
    val_preference: dict | None = None

    def to_json(self) -> dict[str, Any]:
        """Every field, always the same keys (a preference method's metrics flat, under their own names). A
        non-finite float (the NaN loss of a skipped step) becomes None, so each line is strict JSON that any
        reader parses; skipped_steps says why."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in FLATTENED:
                prefix = "val_" if f.name.startswith("val_") else ""
                out.update({prefix + k: _finite(v) for k, v in (value or {}).items()})
                continue
            out[f.name] = _finite(value)
        return out


FLATTENED = ("preference", "val_preference")  # dict fields written as their entries (absent when None)


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value
