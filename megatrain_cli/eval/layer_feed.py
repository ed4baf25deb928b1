"""Decoder-layer weights for the streamed generator, brought to the device one layer ahead of use.

The caller's protocol, per layer i: `get(i)` (named weight views, usable on the compute stream),
`prefetch(next)`, enqueue layer i's compute, `release()`.

CPU (`HostLayerFeed`): views of the layer's fp32 master, cast when the compute dtype is not fp32.
Nothing moves.

CUDA (`CudaLayerFeed`): two device buffers sized to the largest layer. A layer is copied into the
buffer that is not in use, on a copy stream, so layer i+1 arrives while layer i computes; events
order it (the copy waits for compute to free the buffer, compute waits for the copy). The copy reads
pinned host memory in the compute dtype, which is one of:
  - every layer cast once, up front (`pin_all`): each step then costs only the DMA, at link speed,
    for 2 more bytes per parameter of host memory (bf16; the fp32 master stays);
  - two pinned staging buffers each layer is cast into on its way out, when that would not fit in
    available host memory: a host cast (read 4 + write 2 bytes/param) per layer per step, which is
    slower than the link.
"""

from __future__ import annotations

import torch

from megatrain_cli.machine import available_host_bytes
from megatrain_cli.store.tiles import HostStore


class HostLayerFeed:
    """The CPU path: the layers are already where the compute is."""

    def __init__(self, store: HostStore, dtype: torch.dtype):
        self.layouts = [store.layouts[n] for n in store.layer_names]
        self.masters = [store.tiles[n].master for n in store.layer_names]
        self.dtype = dtype
        self.bytes_sent = 0  # nothing crosses a link here

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        flat = self.masters[layer]
        return self.layouts[layer].views(flat if flat.dtype == self.dtype else flat.to(self.dtype))

    def prefetch(self, layer: int) -> None:
        pass

    def release(self) -> None:
        pass


class _DeviceBuffer:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.flat = torch.empty(numel, dtype=dtype, device=device)
        self.layer: int | None = None  # which layer it holds (or is receiving)
        self.ready = torch.cuda.Event()  # on the copy stream, after the copy into it
        self.free = torch.cuda.Event()  # on the compute stream, after the last kernel that reads it
        self.free.record()
        self.staging: torch.Tensor | None = None  # pinned, when layers are not pinned up front


class CudaLayerFeed:
    def __init__(self, store: HostStore, device: torch.device, dtype: torch.dtype, pin_all: bool | None = None):
        self.layouts = [store.layouts[n] for n in store.layer_names]
        self.masters = [store.tiles[n].master for n in store.layer_names]
        self.element_size = torch.empty((), dtype=dtype).element_size()
        largest = max(m.numel() for m in self.masters)
        self.compute = torch.cuda.current_stream(device)
        self.copy_stream = torch.cuda.Stream(device)
        self.buffers = [_DeviceBuffer(largest, dtype, device) for _ in range(2)]
        self._in_use: _DeviceBuffer | None = None
        self.bytes_sent = 0
        if pin_all is None:
            pin_all = self.layer_bytes() < available_host_bytes() // 2
        self.pinned: list[torch.Tensor] | None = None
        if pin_all:
            # One pinned tensor per layer (torch's pinned allocator rounds each up to a power of two,
            # so one allocation for all layers could waste up to half of it).
            self.pinned = [torch.empty(m.numel(), dtype=dtype, pin_memory=True).copy_(m) for m in self.masters]
        else:
            for buf in self.buffers:
                buf.staging = torch.empty(largest, dtype=dtype, pin_memory=True)

    def layer_bytes(self) -> int:
        """Bytes of all decoder layers in the compute dtype: what one forward step streams."""
        return sum(m.numel() for m in self.masters) * self.element_size

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        buf = self._holding(layer) or self._load(layer)
        self.compute.wait_event(buf.ready)  # GPU-side: the copy has landed
        self._in_use = buf
        return self.layouts[layer].views(buf.flat[:self.masters[layer].numel()])

    def prefetch(self, layer: int) -> None:
        if self._holding(layer) is None:
            self._load(layer)

    def release(self) -> None:
        """The kernels reading the current layer are enqueued: its buffer may be refilled after them."""
        self._in_use.free.record(self.compute)

    def _holding(self, layer: int) -> _DeviceBuffer | None:
        return next((b for b in self.buffers if b.layer == layer), None)

    def _load(self, layer: int) -> _DeviceBuffer:
        buf = next(b for b in self.buffers if b is not self._in_use)
        master = self.masters[layer]
        n = master.numel()
        if self.pinned is not None:
            src = self.pinned[layer]
        else:
            buf.ready.synchronize()  # host: the last copy out of this staging buffer has finished
            src = buf.staging[:n].copy_(master)  # cast fp32 -> compute dtype on the host
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(buf.free)
            buf.flat[:n].copy_(src, non_blocking=True)
            buf.ready.record(self.copy_stream)
        buf.layer = layer
        self.bytes_sent += n * self.element_size
        return buf


def layer_feed(store: HostStore, device: torch.device, dtype: torch.dtype, pin_all: bool | None = None):
    if device.type == "cuda":
        return CudaLayerFeed(store, device, dtype, pin_all)
    return HostLayerFeed(store, dtype)
