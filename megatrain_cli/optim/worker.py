"""Host AdamW in a background thread, tile by tile, overlapping the GPU: speculate (a tile updated with clip
coefficient 1 as its gradient lands, then corrected or rolled back by the step's verdict), defer (after a
clipped step: updates in the order the next forward reads), deferred moments and updates applied on read.
What each does and costs: docs/architecture.md ("Clipping and the optimizer"). `wait`, `claim`,
`wait_state` and `landed` are the transfer layer's HostUpdates (engine/transfer/updates.py), met by these
methods alone: the optimizer imports nothing of the engine.

With bf16 masters, or bf16 / int8 moments (train.optimizer_state), nothing speculates: a rounded weight or
a coded moment cannot be corrected exactly. Jobs carry their step's
context, so step t's deferred updates can still run while step t+1's forward begins. One worker thread
(AdamW is memory-bound; torch's fused kernel already uses all intra-op threads), so a tile's correction
always follows its speculative update.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import torch

from megatrain_cli.machine import limit_this_thread
from megatrain_cli.optim.host_adamw import HostAdamW
from megatrain_cli.store.tiles import HostStore


@dataclass
class StepContext:
    index: int
    lr: float
    speculating: bool
    partial_sq: float = 0.0  # running sum of the landed tiles' squared gradient norms
    verdict: tuple[float, bool] | None = None  # (clip coefficient, finite), set by resolve()
    speculated: set = field(default_factory=set)  # tiles updated with coefficient 1 before the verdict
    corrected: int = 0


@dataclass
class _Job:
    kind: str  # 'update' | 'fix' (correct a speculative update to the verdict, or roll it back) | 'moments'
    tile: str
    ctx: StepContext
    spec_ok: bool = False  # an 'update' that may run before the verdict
    seq: int = 0  # landing order
    held: bool = False  # a deferred update kept for its reader's claim (update on read); not run here


class UpdateOnRead:
    """A deferred update held for its reader and claimed (update on read): the reader applies it over
    the tile's range in pieces (`apply`), then `close`s it (with the error, if a piece failed: the tile
    is then half-updated, and every later wait raises). Closing queues the update's moments pass, as
    the worker's own weights pass does."""

    def __init__(self, worker: "OptimizerWorker", job: _Job):
        self._worker, self._job = worker, job
        self.tile = job.tile

    def apply(self, lo: int, hi: int, out) -> None:
        """Store the new weights of elements [lo, hi) and their bf16 cast into `out`."""
        ctx = self._job.ctx
        self._worker.optimizer.update_weights_span(self._worker.store.tiles[self.tile], ctx.lr, ctx.verdict[0],
                                                   lo, hi, out)

    def close(self, error: BaseException | None = None) -> None:
        self._worker._finish_claim(self._job, error)

    def __enter__(self) -> "UpdateOnRead":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(exc)
        return False  # an error propagates to the reader too


class OptimizerWorker:
    def __init__(self, optimizer: HostAdamW, store: HostStore, *, forward_order: list[str],
                 max_grad_norm: float | None, speculate: bool = True, assume_clipped: bool = True,
                 threads: int | None = None, update_on_read: frozenset[str] = frozenset()):
        if threads is not None and threads < 1:  # raised here, not in the worker thread's first job
            raise ValueError(f"OptimizerWorker threads must be >= 1 (None: torch's default), got {threads}")
        self.optimizer, self.store = optimizer, store
        # bf16 masters, bf16 / int8 moments: a speculative update cannot be corrected or rolled back exactly
        exact = all(t.master.dtype == torch.float32 and t.moments == "fp32" for t in store.tiles.values())
        self.max_grad_norm, self.speculate = max_grad_norm, speculate and exact
        self.threads = threads  # intra-op threads of host AdamW in this worker's thread (None: torch's default)
        self._rank = {name: i for i, name in enumerate(forward_order)}
        # _done: no job pending for the tile; _weights_done: none that changes its weights ('moments' jobs
        # do not), which is all the next forward needs.
        self._done = {name: threading.Event() for name in store.tiles}
        self._weights_done = {name: threading.Event() for name in store.tiles}
        for ev in (*self._done.values(), *self._weights_done.values()):
            ev.set()
        self._pending = {name: 0 for name in store.tiles}
        self._pending_weights = {name: 0 for name in store.tiles}
        self._jobs: list[_Job] = []
        self._cv = threading.Condition()
        self._ctx: StepContext | None = None
        self._steps = 0
        self._moments_through = 0  # deferred moments of steps <= this index may run
        self._seq = 0
        self._closed = False
        # The tiles whose deferred updates are held for the streamer's claim (update on read: the ones it
        # streams in the next forward; not the embedding, whose rows are read on the host).
        self.update_on_read = update_on_read
        self.waited_s = 0.0  # host seconds any thread spent blocked in wait(): the optimizer behind the GPU
        # The previous verdict: clipped or skipped. Before any verdict, assume clipped: the first steps
        # of a run are the likeliest to clip, and a one-step bench would otherwise time a correction.
        self.last_clipped = assume_clipped
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="megatrain-adamw", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training thread
    def begin_step(self, lr: float) -> None:
        """A new step's gradients are about to land; they will be updated with this lr."""
        with self._cv:
            self._steps += 1
            self._ctx = StepContext(self._steps, lr, speculating=self.speculate and not self.last_clipped)

    def resolve(self, clip: float, finite: bool) -> dict:
        """The step's verdict: deferred tiles may run; wrong speculations are corrected or undone."""
        with self._cv:
            ctx = self._ctx
            ctx.verdict = (clip, finite)
            self.last_clipped = not (finite and clip == 1.0)
            if not (finite and clip == 1.0):
                for tile in ctx.speculated:
                    self._enqueue(_Job("fix", tile, ctx))
                ctx.corrected = len(ctx.speculated)
            self._cv.notify_all()
            return {"speculated": len(ctx.speculated), "corrected": ctx.corrected}

    def release_moments(self, through: int | None = None) -> None:
        """Deferred moments of steps before the current one (or <= `through`) may run from now on."""
        with self._cv:
            target = self._steps - 1 if through is None else through
            if target > self._moments_through:
                self._moments_through = target
                self._cv.notify_all()

    def wait(self, tile: str) -> None:
        """Block until `tile` holds its updated weights (a host-side wait, only when AdamW is behind).
        An update held for its reader (update on read) runs here instead."""
        self._release_held(tile)
        self._wait_event(self._weights_done[tile])

    def claim(self, tile: str) -> UpdateOnRead | None:
        """The tile's held deferred update, for the caller to apply as it reads the tile; None when there
        is none (then `wait` as usual). Blocks for the step's verdict if it is not in yet."""
        with self._cv:
            while True:  # looked up again after every wait: a wait() or drain() may have released it
                job = next((j for j in self._jobs if j.held and j.tile == tile), None)
                if job is None:
                    return None
                if job.ctx.verdict is not None or self._error is not None:
                    break
                self._cv.wait()
            if self._error is not None or not job.ctx.verdict[1]:  # a skipped step: nothing to apply
                job.held = False
                self._cv.notify_all()
                return None
            self._jobs.remove(job)
            return UpdateOnRead(self, job)

    def _finish_claim(self, job: _Job, error: BaseException | None) -> None:
        if error is None:
            self.optimizer.count_step(self.store.tiles[job.tile])
        with self._cv:
            if error is not None and self._error is None:
                self._error = error
            follow = None if error is not None else _Job("moments", job.tile, job.ctx)
            self._job_done(job, follow)
            self._cv.notify_all()

    def _release_held(self, tile: str | None = None) -> None:
        """Held updates (of `tile`, or all) go back to the worker thread."""
        with self._cv:
            released = False
            for j in self._jobs:
                if j.held and (tile is None or j.tile == tile):
                    j.held, released = False, True
            if released:
                self._cv.notify_all()

    def wait_state(self, tile: str) -> None:
        """Block until every job on `tile` is done, deferred moments included (its gradient is free);
        releases every held moments pass (and an update held for its reader) first, so the wait cannot
        depend on a release or a claim to come."""
        if not self._done[tile].is_set():
            self._release_held(tile)
            self.release_moments(self._steps)
        self._wait_event(self._done[tile])

    def _wait_event(self, event: threading.Event) -> None:
        if not event.is_set():
            t0 = time.perf_counter()
            event.wait()
            with self._cv:
                self.waited_s += time.perf_counter() - t0
        if self._error is not None:
            raise RuntimeError("host AdamW failed") from self._error

    def drain(self) -> None:
        self._release_held()
        self.release_moments(self._steps)
        for name in self._done:
            self.wait_state(name)

    def close(self) -> None:
        self.drain()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    # ------------------------------------------------------------ gradient-lander thread
    def landed(self, tile: str, sq_norm: float) -> None:
        """`tile`'s gradient for the current step is complete in the host store; `sq_norm` its squared norm
        (a float or a one-element tensor)."""
        sq_norm = float(sq_norm)
        with self._cv:
            ctx = self._ctx
            ctx.partial_sq += sq_norm
            ok = ctx.speculating and math.isfinite(sq_norm) and (
                self.max_grad_norm is None or math.sqrt(ctx.partial_sq) + 1e-6 <= self.max_grad_norm)
            ctx.speculating = ok  # the running sum only grows: once over the threshold, stop
            if ok:
                # Decided here, in landing order, not by whether the worker gets to it before the
                # verdict: which tiles are speculated (and later corrected) must not depend on thread
                # timing, or clipped steps would differ run to run in the last bits.
                ctx.speculated.add(tile)
            self._seq += 1
            held = tile in self.update_on_read and not ok and self.optimizer.defer_moments
            self._enqueue(_Job("update", tile, ctx, spec_ok=ok, seq=self._seq, held=held))
            self._cv.notify_all()

    # ------------------------------------------------------------ worker thread
    def _enqueue(self, job: _Job) -> None:  # holds self._cv
        self._pending[job.tile] += 1
        self._done[job.tile].clear()
        if job.kind != "moments":
            self._pending_weights[job.tile] += 1
            self._weights_done[job.tile].clear()
        self._jobs.append(job)

    def _key(self, job: _Job):
        if job.ctx.verdict is None:
            return (job.ctx.index, job.seq, 0)  # speculative: as gradients land
        if job.kind == "moments":  # after every weight of the step, in the next backward's landing order
            return (job.ctx.index, 2 * len(self._rank) - self._rank.get(job.tile, 0), 0)
        # Decided: in the order the next forward reads; a tile's update before its fix.
        return (job.ctx.index, self._rank.get(job.tile, 0), job.kind == "fix")

    def _next_job(self) -> _Job | None:
        with self._cv:
            while True:
                runnable = [j for j in self._jobs if (j.ctx.verdict is not None or j.spec_ok) and not j.held and
                            (j.kind != "moments" or j.ctx.index <= self._moments_through)]
                if runnable:
                    job = min(runnable, key=self._key)
                    self._jobs.remove(job)
                    return job
                if self._closed:
                    return None
                self._cv.wait()

    def _execute(self, job: _Job) -> _Job | None:
        """Run one job; returns the job it leaves behind (a deferred update's moments), if any."""
        tile, ctx = self.store.tiles[job.tile], job.ctx
        if job.kind == "update" and job.tile in ctx.speculated:
            self.optimizer.update(tile, ctx.lr, 1.0)
            return None
        clip, finite = ctx.verdict
        if job.kind == "moments":
            self.optimizer.update_moments(tile, clip)
        elif job.kind == "fix":
            if finite:
                self.optimizer.correct(tile, ctx.lr, clip)
            else:
                self.optimizer.rollback(tile, ctx.lr)
        elif finite and self.optimizer.defer_moments:
            self.optimizer.update_weights(tile, ctx.lr, clip)
            return _Job("moments", job.tile, ctx)
        elif finite:
            self.optimizer.update(tile, ctx.lr, clip)
        return None

    def _run(self) -> None:
        try:
            limit_this_thread(self.threads)
        except ValueError as err:  # surfaced by the first wait()
            self._error = err
        while True:
            job = self._next_job()
            if job is None:
                return
            follow = None
            try:
                if self._error is None:
                    follow = self._execute(job)
            except BaseException as err:  # re-raised in the training thread by wait()
                self._error = err
            finally:
                with self._cv:
                    self._job_done(job, follow)

    def _job_done(self, job: _Job, follow: _Job | None) -> None:  # holds self._cv
        if follow is not None:  # queued before the update counts as done: _done never flickers
            self._enqueue(follow)
        self._pending[job.tile] -= 1
        if self._pending[job.tile] == 0:
            self._done[job.tile].set()
        if job.kind != "moments":
            self._pending_weights[job.tile] -= 1
            if self._pending_weights[job.tile] == 0:
                self._weights_done[job.tile].set()
