"""From one engine step (StepResult) to the StepMetrics the dashboard and metrics.jsonl show.

Shared by `train` and `bench`, so both report the same figures the same way. GPU-only fields are
None on the CPU. The link peak is measured once per process (a few pinned 256 MiB copies).
"""

from __future__ import annotations

import torch

from megatrain_cli.machine import host_rss_bytes
from megatrain_cli.metrics.flops import streamed_step_flops
from megatrain_cli.metrics.peaks import measured_h2d_gbps, peak_tflops
from megatrain_cli.metrics.record import StepMetrics


def step_metrics(res, *, engine, step: int, total: int, lr: float, skipped: int, step_time: float,
                 seq_len: int, eta: float | None = None, attended: float | None = None) -> StepMetrics:
    """`step` is 0-based here; the metrics carry it 1-based. `attended`: the step's flops.attention_pairs
    (packed rows: model TFLOPS count attention within documents); None: one document per row."""
    store, device = engine.store, engine.device
    flops, executed = streamed_step_flops(store, rows=res.tokens // seq_len, seq=seq_len,
                                          recomputed_layers=engine.recomputed_layers(),
                                          mlp_chunk_tokens=engine.mlp_chunk_tokens(), attended=attended)
    tflops = flops / step_time / 1e12
    cuda = device.type == "cuda"
    peak = peak_tflops(torch.cuda.get_device_name(device)) if cuda else None
    stall = engine.streamer.stall_seconds() if cuda else None
    return StepMetrics(
        step=step + 1, total_steps=total, loss=res.loss, lr=lr, grad_norm=res.grad_norm, tokens=res.tokens,
        loss_tokens=res.loss_tokens, step_time_s=step_time, tokens_per_s=res.tokens / step_time,
        model_tflops=tflops, executed_tflops=executed / step_time / 1e12, mfu=(tflops / peak) if peak else None,
        h2d_gbps=res.h2d_bytes / step_time / 1e9 if cuda else None,
        d2h_gbps=res.d2h_bytes / step_time / 1e9 if cuda else None,
        link_peak_gbps=measured_h2d_gbps(device.index or 0) if cuda else None,
        overlap=(1.0 - stall / step_time) if cuda else None,
        time_forward_s=res.times.get("forward"), time_backward_s=res.times.get("backward"),
        time_optimizer_s=res.times.get("optimizer"), time_wait_weights_s=stall,
        time_wait_optimizer_s=res.times.get("wait_optimizer"),
        gpu_mem_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        host_rss_bytes=host_rss_bytes(), pinned_bytes=engine.streamer.pinned_bytes() + engine.sink.pinned_bytes(),
        skipped_steps=skipped, eta_s=eta, preference=dict(res.metrics) or None)
