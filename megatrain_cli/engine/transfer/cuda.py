"""The overlapped CUDA path: three streams ordered by events, pinned staging, a packer thread, and
gradient slabs drained by a host thread. Same interface as reference.WeightStreamer / GradSink.

    compute stream   the layers (torch's current stream)
    H2D stream       weights: pinned staging -> device slot; waits on the slot's Buffer-Free event,
                     records Weights-Ready; compute waits on Weights-Ready before binding the slot
    D2H stream       gradients: waits on Backward-Done (recorded by compute), copies into a pinned
                     slab, records Slab-Full; a host thread waits on it and lands the slab in the tile

Costs, per layer: one host cast fp32 -> bf16 into pinned memory (the packer thread, overlapping
compute: torch releases the GIL in copy_; after a clipped step, the tile's weights update in the same
pass instead, when the engine hands it over: optim/worker.py: update on read), one H2D burst, and on the
way back one D2H burst plus one host copy into the tile. The only host-side waits on the hot path are
the packer's, on its own staging buffers, in its own thread; the compute thread waits only when a
transfer is late.

The slots and their residency are slots.SlotPool's (with events); `place` (slots.WholeTiles, or the
sharded path's sharded_cuda.OverlappedShards) says where the H2D lands and what fills the rest.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial

import torch

from megatrain_cli.engine.transfer.reference import GradSink
from megatrain_cli.engine.transfer.slots import Slot, StreamerBase, TransferStats, WholeTiles, transfer_chunk
from megatrain_cli.engine.transfer.updates import HostUpdates
from megatrain_cli.machine import limit_this_thread
from megatrain_cli.store.tiles import HostStore


class CudaStreamer(StreamerBase):
    """acquire(tile) has the packer enqueue the tile's transfer unless it is in flight, makes the compute
    stream wait on Weights-Ready (a host wait only while the packer has not enqueued it yet) and starts
    the next tile in fetch order. `place`: slots.WholeTiles unless given (sharded_cuda.DistCudaStreamer's
    all-gathers on a side stream)."""

    def __init__(self, store: HostStore, device: torch.device, dtype: torch.dtype, *, layer_slots: int,
                 double_buffer: bool, packer_threads: int | None, updates: HostUpdates, on_bind,
                 staging_numel: int | None = None, place=None):
        place = place if place is not None else WholeTiles(store)
        super().__init__(store, device, dtype, place, layer_slots=layer_slots, updates=updates, on_bind=on_bind,
                         events=True)  # the slots get their Weights-Ready / Buffer-Free events
        self.double_buffer = double_buffer
        # Two pinned staging buffers of one chunk each: the packer fills one while the other is in flight.
        self.staging_numel = staging_numel or transfer_chunk(place.largest_layer())
        self.staging = self._pinned_staging(self.staging_numel)
        self.chunk_numel = self.staging_numel  # elements per _copy_chunk
        self.staging_done = [torch.cuda.Event() for _ in range(2)]
        self.h2d = torch.cuda.Stream(device)
        self.compute = torch.cuda.current_stream(device)
        self._packer = ThreadPoolExecutor(1, thread_name_prefix="megatrain-packer",
                                          initializer=limit_this_thread, initargs=(packer_threads,))
        self._order: list[str] = []
        self._cursor = 0
        self._current: Slot | None = None
        self._stalls: list = []
        self.wait_s = 0.0  # host time the compute thread spent waiting for late weights

    def _pinned_staging(self, numel: int) -> list[torch.Tensor]:
        return [torch.empty(numel, dtype=self.dtype, pin_memory=True) for _ in range(2)]

    def pinned_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.staging)

    def begin_step(self, order: list[str]) -> None:
        self.stats.reset()
        self._order, self._cursor = order, 0
        self.wait_s = 0.0
        self._stalls = []

    def stall_seconds(self) -> float:
        """GPU time the compute stream sat idle waiting for weights this step, whether the copy was late
        or the host had not issued it yet (packer behind, optimizer still updating the tile), plus the
        waits wrapped in idle_while. Not counted: short host syncs (the loss value per chunk, the
        gradient norm) and slab back-pressure. Call after a sync."""
        return sum(b.elapsed_time(a) for b, a in self._stalls) / 1e3

    def idle_while(self, wait) -> None:
        """Run a host-side wait (`wait()`), counting the compute stream's idle time it causes as stall."""
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(self.compute)
        wait()
        after.record(self.compute)
        self._stalls.append((before, after))

    # ------------------------------------------------------------ transfers (packer thread)
    def _transfer(self, tile: str, slot: Slot) -> None:
        """Packer thread: this process's part of the tile into the slot, chunk by chunk, after Buffer-Free.
        The placement's hooks end it: `h2d_landed` is the event the H2D records (one GPU: Weights-Ready),
        `assemble` fills the rest of the slot behind it (one GPU: nothing; sharded: the all-gather, which
        records Weights-Ready)."""
        mine = self.place.landing(tile, slot)  # one GPU: the slot's buffer; sharded: this rank's slice
        update = self._claim_or_wait(tile)
        # The claimed update is entered first: whatever fails after the claim closes it with the error
        # (a claim left open would hang every later wait for the tile instead of raising).
        with (update if update is not None else nullcontext()), torch.cuda.stream(self.h2d):
            master = self.store.tiles[tile].master
            n = master.numel()
            self.h2d.wait_event(slot.free)  # GPU-side: compute is done with the slot's old contents
            for k, lo in enumerate(range(0, n, self.chunk_numel)):
                hi = min(n, lo + self.chunk_numel)
                fill = None if update is None else partial(update.apply, lo, hi)
                self._copy_chunk(k, master[lo:hi], mine[lo:hi], fill)
            self.place.h2d_landed(slot).record(self.h2d)
        self.place.assemble(tile, slot, mine)

    def _copy_chunk(self, k: int, src: torch.Tensor, dst: torch.Tensor, fill=None) -> None:
        """Chunk k of a transfer, on the H2D stream: cast on the host into pinned staging, then DMA.
        `fill(out)`, when given, writes the chunk's weights into staging instead (a read-through
        update: the new weights, cast from registers, without re-reading the fp32 masters)."""
        i, n = k % 2, src.numel()
        self.staging_done[i].synchronize()  # host: the last H2D out of this staging buffer is done
        if fill is None:
            self.staging[i][:n].copy_(src)  # cast fp32 -> compute dtype, on the CPU
        else:
            fill(self.staging[i][:n])
        dst.copy_(self.staging[i][:n], non_blocking=True)
        self.staging_done[i].record(self.h2d)

    def _start(self, tile: str, slot: Slot) -> None:
        slot.tile = tile
        self.place.count(self.stats, tile, slot)
        slot.pending = self._packer.submit(self._transfer, tile, slot)

    def _prefetch_next(self, current: str) -> None:
        """Start the next tile in fetch order into the least-recently-used free layer slot."""
        while self._cursor < len(self._order) and self._order[self._cursor] == current:
            self._cursor += 1
        if not self.double_buffer or self._cursor >= len(self._order):
            return
        nxt = self._order[self._cursor]
        slot = self.slots.slot_for(nxt)
        if slot.tile == nxt:
            return  # already resident or in flight
        if self.slots.in_use(slot):
            return  # would evict the tile in use
        self._start(nxt, slot)

    def prefetch_first(self) -> None:
        """The step's first tile in fetch order starts now, behind the inputs' host work (the packer casts
        it while the embedding rows are gathered) instead of at its acquire."""
        self._prefetch_next("")

    # ------------------------------------------------------------ compute side
    def acquire(self, tile: str) -> torch.Tensor:
        try:  # where we are in the step's fetch order (tiles outside it, e.g. a tied embedding, are not)
            self._cursor = self._order.index(tile, self._cursor)
        except ValueError:
            pass
        slot = self.slots.slot_for(tile)
        if self._current is not None and self._current is not slot and self._current.tile is not None:
            self._current.free.record(self.compute)  # Buffer-Free for the slot we are leaving
        self._current = slot
        self.slots.use(slot)
        if slot.tile != tile:
            self._start(tile, slot)
        # `before` goes in ahead of the host-side wait: if the packer is late (e.g. held back by the
        # optimizer), the compute stream runs dry and the gap shows up between the two events.
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(self.compute)
        if slot.pending is not None:
            t0 = time.perf_counter()
            slot.pending.result()  # the packer has enqueued every chunk of this tile
            self.wait_s += time.perf_counter() - t0
            slot.pending = None
        self.compute.wait_event(slot.ready)  # Weights-Ready, GPU-side
        after.record(self.compute)
        self._stalls.append((before, after))
        flat = slot.flat(self.store.layouts[tile].numel)
        self.on_bind(tile, flat)
        self._prefetch_next(tile)
        return flat

    def invalidate(self) -> None:
        """Forget residency (after the optimizer changed the masters); every slot is free from here on
        the compute stream."""
        for s in self.slots.all():
            s.free.record(self.compute)
            s.tile = None
        self._current = None

    def close(self) -> None:
        self._packer.shutdown(wait=True)


class CudaGradSink(GradSink):
    """K pinned slabs between the device and the host tiles; a host thread lands them."""

    def __init__(self, store: HostStore, stats: TransferStats, device: torch.device, updates: HostUpdates, *,
                 slabs: int, slab_numel: int | None = None, lander_sets_device: bool = False):
        super().__init__(store, stats, updates)
        self.device = device
        # A new thread starts on device 0: the lander selects `device` first when asked (one rank per GPU).
        self._lander_sets_device = lander_sets_device
        self.grad_dtype = store.compute_dtype
        self.slab_numel = slab_numel or transfer_chunk(store.largest_layer_numel())
        self.slabs = [torch.empty(self.slab_numel, dtype=self.grad_dtype, pin_memory=True) for _ in range(slabs)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(slabs):
            self._free.put(i)
        self.d2h = torch.cuda.Stream(device)
        self.compute = torch.cuda.current_stream(device)
        self._work: queue.Queue = queue.Queue()
        self._errors: list[BaseException] = []
        self._worker = threading.Thread(target=self._drain, name="megatrain-grad-lander", daemon=True)
        self._worker.start()

    def pinned_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slabs)

    def _drain(self) -> None:
        if self._lander_sets_device:
            torch.cuda.set_device(self.device)  # its event waits on this process's GPU
        while True:
            item = self._work.get()
            if item is None:
                self._work.task_done()
                return
            slab_index, event, tile, dst, n, last = item
            try:
                event.synchronize()  # Slab-Full: this slab's D2H is done
                # The previous step's deferred moments may still read this gradient: a host wait here
                # holds this slab (and, if it lasts, the compute stream once all K are in flight).
                self.updates.wait_state(tile)
                dst.copy_(self.slabs[slab_index][:n])
                if last is not None:  # the tile's final chunk: its gradient is complete on the host
                    tile, sq_host = last
                    self.updates.landed(tile, sq_host)
            except BaseException as err:  # surfaced by finish()
                self._errors.append(err)
            finally:
                self._free.put(slab_index)
                self._work.task_done()

    def _send_flat(self, tile: str, dst: torch.Tensor, grad: torch.Tensor, sq_norm: torch.Tensor | None,
                   made_on: torch.cuda.Stream) -> None:
        """`grad` (and `sq_norm`), made on stream `made_on`, through the slabs into `dst` on the host: a
        device-side cast to the grad dtype, one D2H per slab-sized chunk, the lander's host copy. No host
        wait unless all K slabs are in flight."""
        done = torch.cuda.Event()
        done.record(made_on)  # Backward-Done for this gradient
        # The device gradient is freed by the compute thread once it goes out of scope: tell the
        # caching allocator the D2H stream still reads it.
        grad.record_stream(self.d2h)
        if sq_norm is not None:  # 8 bytes read by the D2H stream below: not to be reused before
            sq_norm.record_stream(self.d2h)
        # The tile's squared norm rides along (8 bytes, same stream), so the host learns it when the
        # gradient lands, without a device sync.
        sq_host = torch.zeros((), dtype=torch.float64, pin_memory=True)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(done)
            if sq_norm is not None:
                sq_host.copy_(sq_norm, non_blocking=True)
            low = grad.to(self.grad_dtype)  # halve the bytes on the wire for bf16 grads (device-side cast)
            for lo in range(0, grad.numel(), self.slab_numel):
                hi = min(grad.numel(), lo + self.slab_numel)
                i = self._free.get()  # blocks only when all K slabs are in flight
                self.slabs[i][:hi - lo].copy_(low[lo:hi], non_blocking=True)
                full = torch.cuda.Event()
                full.record(self.d2h)
                last = (tile, sq_host) if hi == grad.numel() else None
                self._work.put((i, full, tile, dst[lo:hi], hi - lo, last))
            low.record_stream(self.d2h)
        self.stats.d2h_bytes += grad.numel() * self.slabs[0].element_size()

    def send(self, tile: str, grad: torch.Tensor, sq_norm: torch.Tensor | None = None) -> None:
        self._send_flat(tile, self.store.tiles[tile].grad, grad, sq_norm, self.compute)

    def send_rows(self, tile: str, rows: torch.Tensor, index: torch.Tensor,
                  sq_norm: torch.Tensor | None = None) -> None:
        """The embedding's row gradients: cast on the device to the grad dtype (the host cast's rounding),
        one D2H into page-locked memory (a pageable copy runs at a fraction of the link and blocks), and,
        while it flies, the wait for every gradient sent before and the host tile's zeroing; then the rows
        go in by index. Costs |rows| x hidden x width pinned bytes (cached by torch's host allocator)."""
        low = rows.to(self.grad_dtype)
        host = torch.empty(low.shape, dtype=low.dtype, pin_memory=True)
        host.copy_(low, non_blocking=True)  # on the compute stream: the rows are its last work
        copied = torch.cuda.Event()
        copied.record(self.compute)
        self.finish()
        dst = self.store.tiles[tile].grad.view(-1, rows.shape[1])
        self.updates.wait_state(tile)
        dst.zero_()
        copied.synchronize()
        dst.index_copy_(0, index.cpu(), host)
        self.stats.d2h_bytes += low.numel() * low.element_size()
        self.updates.landed(tile, sq_norm if sq_norm is not None else 0.0)

    def finish(self) -> None:
        self._work.join()
        if self._errors:
            raise self._errors.pop()

    def close(self) -> None:
        self._work.put(None)
        self._worker.join()
