"""CheckpointOffloader: activation checkpoints in pinned host memory between the forward and the
backward, brought back one block ahead (the long-context / memory-lean plans decide which keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Container, Hashable

import torch


@dataclass
class _Offloaded:
    host: list  # pinned (CUDA) or plain (CPU) host copies
    as_list: bool  # put() was given a list/tuple
    saved: Any = None  # CUDA event: the D2H copies are done
    device: list | None = None  # after prefetch: the device copies being filled
    loaded: Any = None  # CUDA event: the H2D copies are done


class CheckpointOffloader:
    """Keeps activation checkpoints in host memory between the forward and the backward.

    put(key, t) copies `t` (a tensor, or a list of tensors: one per micro-batch) to host memory on a
    side stream and returns at once; the device tensor may be dropped right away (record_stream keeps
    its memory from being reused before the copy has read it). prefetch(key) starts the copy back;
    get(key) waits for it on the compute stream (not the host) and returns the tensor(s), then
    forgets the key. Keys not in `offload_keys` (None: every key) stay on the device, so the engine
    can route every checkpoint through here. Pinned buffers are kept per key and reused next step:
    pinning (cudaHostAlloc) is a long host stall that grows with the bytes, a reuse costs nothing. On a
    CPU device the copies are plain.
    """

    def __init__(self, device: torch.device, offload_keys: Container[Hashable] | None = None):
        self.device = torch.device(device)
        self.offload_keys = offload_keys
        self.cuda = self.device.type == "cuda"
        self._kept: dict[Hashable, Any] = {}
        self._entries: dict[Hashable, _Offloaded] = {}
        self._buffers: dict[Hashable, list[torch.Tensor]] = {}  # pinned, reused across steps
        self._buffer_free: dict[Hashable, Any] = {}  # event: the last H2D out of these buffers is done
        self.d2h_bytes = self.h2d_bytes = 0
        self.late_gets = 0  # get() of a key nobody prefetched: the compute stream waits a whole copy
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)

    def offloads(self, key: Hashable) -> bool:
        return self.offload_keys is None or key in self.offload_keys

    def pinned_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for bufs in self._buffers.values() for b in bufs)

    def put(self, key: Hashable, value) -> None:
        if not self.offloads(key):
            self._kept[key] = value
            return
        tensors = list(value) if isinstance(value, (list, tuple)) else [value]
        self._entries.pop(key, None)
        if not self.cuda:
            host = [t.detach().to("cpu", copy=True) for t in tensors]
            self.d2h_bytes += sum(t.numel() * t.element_size() for t in tensors)
            self._entries[key] = _Offloaded(host, isinstance(value, (list, tuple)))
            return
        bufs = self._buffers.get(key)
        if bufs is None or [(b.shape, b.dtype) for b in bufs] != [(t.shape, t.dtype) for t in tensors]:
            bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            self._buffers[key] = bufs
            self._buffer_free.pop(key, None)
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # the tensors are written by then
        if key in self._buffer_free:  # last step's H2D may still be reading these buffers
            self.d2h.wait_event(self._buffer_free[key])
        with torch.cuda.stream(self.d2h):
            for b, t in zip(bufs, tensors):
                b.copy_(t.detach(), non_blocking=True)
                t.record_stream(self.d2h)
                self.d2h_bytes += t.numel() * t.element_size()
            saved = torch.cuda.Event()
            saved.record(self.d2h)
        self._entries[key] = _Offloaded(bufs, isinstance(value, (list, tuple)), saved=saved)

    def prefetch(self, key: Hashable) -> None:
        """Start bringing `key` back; a no-op for kept keys, unknown keys and repeated calls."""
        entry = self._entries.get(key)
        if entry is None or entry.device is not None:
            return
        if not self.cuda:
            entry.device = [h.to(self.device) for h in entry.host]
            self.h2d_bytes += sum(h.numel() * h.element_size() for h in entry.host)
            return
        compute = torch.cuda.current_stream(self.device)
        # Allocated on the compute stream (so it returns to the compute pool when dropped); the copy
        # must wait for compute work already queued, which may still use the memory just handed out.
        dev = [torch.empty_like(h, device=self.device) for h in entry.host]
        self.h2d.wait_stream(compute)
        self.h2d.wait_event(entry.saved)
        with torch.cuda.stream(self.h2d):
            for d, h in zip(dev, entry.host):
                d.copy_(h, non_blocking=True)
                self.h2d_bytes += h.numel() * h.element_size()
            loaded = torch.cuda.Event()
            loaded.record(self.h2d)
        entry.device, entry.loaded = dev, loaded
        self._buffer_free[key] = loaded

    def get(self, key: Hashable):
        """The tensor(s) stored under `key`, on the device, usable on the current stream; forgets `key`."""
        if key in self._kept:
            return self._kept.pop(key)
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"no checkpoint stored under {key!r}")
        if entry.device is None:
            self.late_gets += 1
            self.prefetch(key)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(entry.loaded)
        del self._entries[key]
        return list(entry.device) if entry.as_list else entry.device[0]

    def reserve(self, key: Hashable, like: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        """Pin the host buffers for `key` now (one per (shape, dtype)), so the first put() does not stop
        the forward for cudaHostAlloc. Returns the bytes pinned; 0 for keys that stay on the device, and
        on a CPU device (nothing to pin)."""
        if not self.cuda or not self.offloads(key):
            return 0
        bufs = self._buffers.get(key)
        if bufs is None or [(tuple(b.shape), b.dtype) for b in bufs] != [(tuple(sh), dt) for sh, dt in like]:
            bufs = [torch.empty(sh, dtype=dt, pin_memory=True) for sh, dt in like]
            self._buffers[key] = bufs
            self._buffer_free.pop(key, None)
        return sum(b.numel() * b.element_size() for b in bufs)

    def forget(self) -> None:
        """Drop the checkpoints still stored (a step that failed half-way), keeping the pinned buffers."""
        if self.cuda:
            self.d2h.synchronize()
            self.h2d.synchronize()
        self._kept.clear()
        self._entries.clear()

    def clear(self) -> None:
        """Drop every stored checkpoint and the pinned buffers (e.g. when the sequence length changes)."""
        self.forget()
        self._buffers.clear()
        self._buffer_free.clear()
