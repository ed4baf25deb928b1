"""Weights cast on the device: the fp32 masters go over PCIe as they are, from page-locked host memory.

CudaStreamer's packer casts each tile fp32 -> bf16 on the host into pinned staging, then DMAs the bf16
copy: per parameter and transfer, 8 bytes of host memory traffic (read 4, write 2, the DMA reads 2) and
a host thread busy casting. Here the masters themselves are registered as page-locked memory once
(cudaHostRegister over each streamed tile's master section: no second copy, no power-of-two rounding
as torch's pinned allocator does), the DMA reads them directly into a small fp32 buffer on the device
and a cast kernel writes the bf16 slot:

    host memory traffic   4 bytes/param per transfer (the DMA's read), instead of 8, and no host cast:
                          what the clipped regime's forward is short of (docs/perf-notes.md, session 3)
    PCIe                  4 bytes/param instead of 2: a 7B layer is 932 MB, ~17 ms at 55 GB/s, against
                          ~27 ms of forward compute at 8 x 4096 (hidden); at 1 x 4096 it would not be
    device                2 fp32 chunk buffers (CHUNK elements, 128 MiB each) and one cast per chunk
    host                  the registered masters stay locked for the engine's life (4 bytes/param:
                          locked, not extra); registering takes ~1 s per 10 GB at start
    syncs                 none: copy and cast are ordered on the H2D stream, so a chunk buffer is reused
                          only after the cast that read it; the packer thread only waits for host AdamW

Same bits as the host path: fp32 -> bf16 rounds to nearest even on both (tests/test_cuda.py).
The masters change only in host AdamW, after the tile's last transfer of the step has landed (its
gradient exists only once the backward consumed the weights), so the DMA never reads a half-updated
master. Opt-in (engine.device_cast / bench --device-cast): measured slower on the H200 (7B 8x4096,
clipped: 6.65 s/step against 5.14 s for host casts, docs/benchmarks.md session 4), because host AdamW
still needs the host's bandwidth and the forward waited longer for it.
"""

from __future__ import annotations

import torch

from megatrain_cli.engine.cuda_pipeline import CudaStreamer
from megatrain_cli.store.tiles import ALIGN, HostStore

CHUNK = 1 << 25  # fp32 elements per device chunk buffer (128 MiB)


def _register(t: torch.Tensor) -> int:
    """Page-lock the (page-aligned) memory of `t`, rounded up to whole pages; returns the bytes locked."""
    nbytes = -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed with CUDA error {err} (too "
                           "much locked memory for this host or container? engine.device_cast: false avoids it)")
    return nbytes


class DeviceCastStreamer(CudaStreamer):
    """CudaStreamer whose transfers DMA the registered fp32 masters and cast on the device (module docstring)."""

    def __init__(self, store: HostStore, device: torch.device, dtype: torch.dtype, *, layer_slots: int = 2,
                 double_buffer: bool = True, before_read=None):
        super().__init__(store, device, dtype, layer_slots=layer_slots, double_buffer=double_buffer,
                         before_read=before_read)
        streamed = [*store.layer_names, "head"] + (["embed"] if store.adapter.tied else [])
        self._registered: list[int] = []
        self.registered_bytes = 0
        try:
            for name in streamed:
                master = store.tiles[name].master
                self.registered_bytes += _register(master)
                self._registered.append(master.data_ptr())
        except RuntimeError:
            self._unregister()
            self._packer.shutdown(wait=False)  # the parent's packer thread, idle: nothing was queued
            raise
        self.chunk_numel = min(CHUNK, store.largest_layer_numel())
        self.device_staging = [torch.empty(self.chunk_numel, dtype=torch.float32, device=device) for _ in range(2)]

    def _pinned_staging(self, numel: int) -> list[torch.Tensor]:
        return []  # no host staging: the DMA reads the masters

    def pinned_bytes(self) -> int:
        return self.registered_bytes  # the page-locked masters (locked, not allocated twice)

    def device_bytes(self) -> int:
        return super().device_bytes() + sum(b.numel() * b.element_size() for b in self.device_staging)

    def _copy_chunk(self, k: int, src: torch.Tensor, dst: torch.Tensor, fill=None) -> None:
        if fill is not None:
            raise RuntimeError("device_cast streams the fp32 masters: it cannot take a read-through update")
        stage = self.device_staging[k % 2][:src.numel()]
        stage.copy_(src, non_blocking=True)  # DMA from the page-locked master
        dst.copy_(stage)  # the cast, on the device, same stream: a buffer is reused after the cast that read it

    def _unregister(self) -> None:
        cudart = torch.cuda.cudart()
        for ptr in self._registered:
            cudart.cudaHostUnregister(ptr)
        self._registered = []

    def close(self) -> None:
        super().close()
        torch.cuda.synchronize(self.device)  # no DMA may still read a master being unlocked
        self._unregister()
