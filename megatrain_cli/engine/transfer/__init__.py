"""How bytes move between the host store and the device: weights in, gradients out, activations aside.

`make_transfers` picks the (streamer, sink) pair for a run: the synchronous reference (CPU), the CUDA
pipeline, or their data-parallel versions over a sharded store. It is the one place that chooses.
"""

from __future__ import annotations

import torch


def make_transfers(store, device: torch.device, dtype: torch.dtype, *, dist=None, layer_slots: int = 2,
                   double_buffer: bool = True, grad_slabs: int = 12, before_read=None,
                   packer_threads: int | None = None):
    """(weight streamer, gradient sink) for `store` on `device`; `dist` (a DistContext) makes them one rank's."""
    if dist is not None and device.type == "cuda" and dist.overlap:
        from megatrain_cli.engine.transfer.sharded_cuda import DistCudaGradSink, DistCudaStreamer

        streamer = DistCudaStreamer(store, device, dtype, dist, layer_slots=layer_slots, double_buffer=double_buffer,
                                    before_read=before_read, packer_threads=packer_threads)
        return streamer, DistCudaGradSink(store, streamer, dist, slabs=grad_slabs)
    if dist is not None:  # gloo on the CPU, or the synchronous reference path asked for (dist.overlap False)
        from megatrain_cli.engine.transfer.sharded import DistGradSink, DistStreamer

        streamer = DistStreamer(store, device, dtype, dist, layer_slots=layer_slots, before_read=before_read)
        return streamer, DistGradSink(store, streamer, dist)
    if device.type == "cuda":
        from megatrain_cli.engine.transfer.cuda import CudaGradSink, CudaStreamer

        streamer = CudaStreamer(store, device, dtype, layer_slots=layer_slots, double_buffer=double_buffer,
                                before_read=before_read, packer_threads=packer_threads)
        return streamer, CudaGradSink(store, streamer.stats, device, slabs=grad_slabs)
    from megatrain_cli.engine.transfer.reference import GradSink, WeightStreamer

    streamer = WeightStreamer(store, device, dtype, layer_slots=layer_slots, before_read=before_read)
    return streamer, GradSink(store, streamer.stats)
