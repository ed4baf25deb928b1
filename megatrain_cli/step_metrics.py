"""From one engine step (StepResult) to the StepMetrics the dashboard and metrics.jsonl show.

Shared by `train` and `bench`, so both report the same figures the same way. GPU-only fields are
None on the CPU. The link peak is measured once per process (a few pinned 256 MiB copies, ~20 ms).
"""

from __future__ import annotations

import functools

import torch

from megatrain_cli.metrics import StepMetrics, host_rss_bytes, model_flops, peak_tflops


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


def matmul_params(store) -> int:
    """Parameters that take part in matmuls: all but the embedding table, unless it is tied to the LM head."""
    embed = store.layouts["embed"].numel
    return store.num_params() - (0 if store.adapter.tied else embed)


def streamed_step_flops(store, *, rows: int, seq: int, recomputed_layers: int,
                        mlp_tile_tokens: int | None = None) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) of one step over `rows` sequences of `seq` tokens. Model FLOPs: 6 x
    matmul params x tokens + causal attention (metrics.model_flops). Executed adds the forward of every
    recomputed layer (2 x its params x tokens + its attention) and, with a tiled MLP, the gate and up
    projections its backward runs again."""
    a = store.adapter
    cfg = a.config
    tokens = rows * seq
    flops = model_flops(matmul_params(store), tokens, rows, seq, a.hidden_size, a.num_layers)
    layer_params = sum(store.layouts[n].numel for n in store.layer_names) / a.num_layers
    extra = (2.0 * layer_params * tokens + 2.0 * rows * seq * seq * a.hidden_size) * recomputed_layers
    if mlp_tile_tokens and tokens > mlp_tile_tokens:
        extra += 4.0 * a.hidden_size * int(cfg.intermediate_size) * tokens * a.num_layers
    return flops, flops + extra


def step_metrics(res, *, engine, step: int, total: int, lr: float, skipped: int, step_time: float,
                 seq_len: int, eta: float | None = None) -> StepMetrics:
    """`step` is 0-based here; the metrics carry it 1-based."""
    store, device = engine.store, engine.device
    flops, executed = streamed_step_flops(store, rows=res.tokens // seq_len, seq=seq_len,
                                          recomputed_layers=engine.recomputed_layers(),
                                          mlp_tile_tokens=engine.mlp_tile_tokens())
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
        skipped_steps=skipped, eta_s=eta)
