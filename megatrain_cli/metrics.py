"""Honest per-step metrics: FLOP counts, device peaks, host memory, and the logs they go to.

"Honest" means two things here. A throughput figure says which FLOPs it counts (model FLOPs leave
recompute out, executed FLOPs put it in), and a field that was not measured is None -- shown as
'n/a' and written as null -- never a plausible-looking invented number. On a CPU run every GPU-only
field (transfer rates, overlap, device memory, MFU) is None.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO


# ---------------------------------------------------------------- FLOPs
def model_flops(num_matmul_params: int, tokens: int, batch: int, seq_len: int, hidden: int,
                num_layers: int) -> float:
    """Model FLOPs of one training step (forward + backward), the numerator of MFU.

        6 * num_matmul_params * tokens  +  6 * batch * seq_len**2 * hidden * num_layers

    - 6 = 2 (multiply-add) for the forward matmul + 4 for the backward (gradient of the input and
      of the weight), per parameter per token.
    - num_matmul_params: parameters that take part in a matmul -- every decoder-layer weight plus
      the LM head. The input embedding is a row lookup, not a matmul, so it is excluded (when the
      head is tied to the embedding, the shared matrix is counted once, as the head).
    - The attention term: QK^T and attention-times-V cost 2 * 2 * s^2 * h forward per sequence
      per layer, so 12 * b * s^2 * h * L forward+backward for full attention; causal attention
      needs only half of it: 6 * b * s^2 * h * L. Packed rows are counted as one causal sequence of
      seq_len (the kernel computes the whole causal triangle; the block mask only hides entries).
    - Recompute is NOT counted (see executed_flops): a smarter schedule must not look faster by
      doing more work. Norms, activations, softmax and the loss are left out (lower order).
    """
    return 6.0 * num_matmul_params * tokens + 6.0 * batch * seq_len ** 2 * hidden * num_layers


def executed_flops(model_flops_value: float, recompute_fraction: float, *, head_flops: float = 0.0) -> float:
    """FLOPs the device actually executed: model FLOPs plus the recomputed forward passes.

    A forward pass is 2 of the 6 FLOPs per parameter per token (and the same third of the
    attention term), so recomputing a layer adds 2/6 = 1/3 of that layer's model FLOPs:

        executed = model + (model - head_flops) * recompute_fraction / 3

    recompute_fraction: the fraction of decoder layers whose forward runs twice (1.0 for block
    recompute of every block; less when some blocks keep their activations; 0 without recompute).
    head_flops: the LM head's share of model_flops_value, which is never recomputed; the default 0
    treats the whole value as layer FLOPs, overstating executed FLOPs by head_share / 3 at most.
    """
    if not 0.0 <= recompute_fraction <= 1.0:
        raise ValueError(f"recompute_fraction must be in [0, 1], got {recompute_fraction}")
    return model_flops_value + (model_flops_value - head_flops) * recompute_fraction / 3.0


# ---------------------------------------------------------------- device peaks
# Dense (no 2:4 sparsity) bf16 tensor-core peaks, TFLOP/s, from the vendors' datasheets, with fp32
# accumulation where the datasheet separates it (that is what torch's bf16 matmuls use).
# Keys are matched inside torch.cuda.get_device_name() as whole words (case-insensitive), and the
# longest matching key wins: 'NVIDIA GH200 480GB' is a GH200, not an H200; 'NVIDIA H200 NVL' is
# an H200 NVL; 'NVIDIA RTX A1000' is none of A10 / A100; 'NVIDIA A10G' is not an A10 (unknown).
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200 NVL": 835.0,
    "H200": 989.0,  # H200 SXM ('NVIDIA H200')
    "GH200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,  # how the SXM part names itself
    "H100": 989.0,  # other H100 names: the SXM figure
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "RTX 6000 Ada": 364.0,
    "A6000": 154.8,
    "RTX 4090": 165.2,
    "RTX 3090": 71.0,
}


def _whole_word(key: str) -> re.Pattern:
    # Not preceded or followed by a letter or digit: '-', ' ' and the string's ends all delimit.
    return re.compile(r"(?<![A-Za-z0-9])" + re.escape(key) + r"(?![A-Za-z0-9])", re.IGNORECASE)


def peak_tflops(device_name: str | None) -> float | None:
    """Dense bf16 peak of a device, by name; None for a CPU or an unknown device (MFU is then n/a)."""
    if not device_name:
        return None
    matches = [key for key in PEAK_BF16_TFLOPS if _whole_word(key).search(device_name)]
    if not matches:
        return None
    return PEAK_BF16_TFLOPS[max(matches, key=len)]


# ---------------------------------------------------------------- host memory (read from /proc)
def host_rss_bytes() -> int:
    """Resident set size of this process: the second field of /proc/self/statm, in pages."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def meminfo_bytes(key: str) -> int:
    """One field of /proc/meminfo (given there in kB), in bytes; 0 when the field is missing."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def host_memory_bytes() -> int:
    """Physical memory of the machine (MemTotal)."""
    return meminfo_bytes("MemTotal")


def available_host_bytes() -> int:
    """What can be allocated without swapping (MemAvailable)."""
    return meminfo_bytes("MemAvailable")


# ---------------------------------------------------------------- one step's metrics
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

    def to_json(self) -> dict[str, Any]:
        """Every field, always the same keys. A non-finite float (the NaN loss of a skipped step)
        becomes None, so each line is strict JSON that any reader parses; skipped_steps says why."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            out[f.name] = value
        return out


# ---------------------------------------------------------------- logs
class JsonlLog:
    """Appends one JSON object per step to a file, flushed at once so a crash loses nothing.

    Append, not truncate: a resumed run continues the same file (plot.py keeps the last record of
    a step that appears twice).
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
