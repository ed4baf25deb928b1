"""How bytes move between the host store and the device: weights in, gradients out, activations aside.

`make_transfers` picks the (streamer, sink) pair for a run: the synchronous reference (CPU), the CUDA
pipeline, or their data-parallel versions over a sharded store. It is the one place that chooses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatrain_cli.engine.transfer.updates import HostUpdates

if TYPE_CHECKING:
    from megatrain_cli.recipe import EngineConfig


def make_transfers(store, device: torch.device, dtype: torch.dtype, settings: EngineConfig, updates: HostUpdates,
                   on_bind, *, dist=None):
    """(weight streamer, gradient sink) for `store` on `device`, sized by the recipe's engine `settings`
    (layer_slots, double_buffer, grad_slabs, packer_threads, overlap_ranks). `updates`: the host optimizer
    beside the step (transfer/updates.py); `on_bind(tile, flat)`: told of every tile bound to a device
    buffer. `dist` (a DistContext) makes them one rank's."""
    hooks = dict(updates=updates, on_bind=on_bind)
    if dist is not None and device.type == "cuda" and settings.overlap_ranks:
        from megatrain_cli.engine.transfer.sharded_cuda import DistCudaGradSink, DistCudaStreamer

        streamer = DistCudaStreamer(store, device, dtype, dist, layer_slots=settings.layer_slots,
                                    double_buffer=settings.double_buffer, packer_threads=settings.packer_threads,
                                    **hooks)
        return streamer, DistCudaGradSink(store, streamer, dist, updates, slabs=settings.grad_slabs)
    if dist is not None:  # gloo on the CPU, or the synchronous reference path asked for (overlap_ranks false)
        from megatrain_cli.engine.transfer.sharded import DistGradSink, DistStreamer

        streamer = DistStreamer(store, device, dtype, dist, layer_slots=settings.layer_slots, **hooks)
        return streamer, DistGradSink(store, streamer, dist, updates)
    if device.type == "cuda":
        from megatrain_cli.engine.transfer.cuda import CudaGradSink, CudaStreamer

        streamer = CudaStreamer(store, device, dtype, layer_slots=settings.layer_slots,
                                double_buffer=settings.double_buffer, packer_threads=settings.packer_threads, **hooks)
        return streamer, CudaGradSink(store, streamer.stats, device, updates, slabs=settings.grad_slabs)
    from megatrain_cli.engine.transfer.reference import GradSink, WeightStreamer

    streamer = WeightStreamer(store, device, dtype, layer_slots=settings.layer_slots, **hooks)
    return streamer, GradSink(store, streamer.stats, updates)
