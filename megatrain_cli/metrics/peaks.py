"""Per-device dense bf16 peaks (the denominator of MFU), matched by the CUDA device's name."""

from __future__ import annotations

import functools
import re

import torch

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


@functools.lru_cache(maxsize=None)
def measured_h2d_gbps(device_index: int, numel: int = 1 << 27, reps: int = 3) -> float:
    """Host-to-device GB/s of pinned copies on this machine (the ceiling the dashboard compares to)."""
    src = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty(numel, dtype=torch.bfloat16, device=f"cuda:{device_index}")
    dst.copy_(src, non_blocking=True)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return reps * numel * 2 / (start.elapsed_time(end) / 1e3) / 1e9
