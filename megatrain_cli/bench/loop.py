"""The timed step loop of `megatrain bench` and its synthetic batches, shared by every path (short.py,
long_context.py, ranks.py): warm-up steps, then timed ones; the wall clock runs from the first timed step
until the last step's host optimizer updates have landed, so a pipelined optimizer's tail is paid for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatrain_cli.engine.step import Engine, MicroBatch, StepResult

BENCH_LR = 1e-5


def synthetic_batch(vocab: int, batch: int, seq: int, seed: int) -> MicroBatch:
    """Uniform random tokens, one document per row (no packing, no mask): step s, micro-batch k takes seed
    s * 97 + k on every path and in the baselines (deepspeed_child.synthetic_ids draws the same ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return MicroBatch(ids, ids.clone())


@dataclass
class TimedSteps:
    results: list[StepResult] = field(default_factory=list)  # the timed steps'
    losses: list[float] = field(default_factory=list)  # every step's, warm-up included
    step_times: list[float] = field(default_factory=list)  # each timed step's engine call, in seconds
    # First timed step to the last step's host updates landed (a pipelined optimizer finishes after the call
    # returns). After a failure: the sum of the timed steps that finished (the failed one is not a step).
    wall_s: float = 0.0
    stall_s: float = 0.0  # CUDA: the compute stream's idle time waiting for weights, over the timed steps
    offload_d2h_bytes: int = 0  # checkpoints sent to / brought back from host memory in the timed steps
    offload_h2d_bytes: int = 0
    failure: str = ""  # 'out of memory: ...' when stop_on_oom caught one; the steps before it are kept

    def steady_step_s(self) -> float | None:
        """Mean engine-call time of timed steps 2..N: each carries the previous step's host optimizer
        work (its deferred updates run into the next forward and backward), as in a long run. The first
        timed step carries none (the warm-up's updates were drained) and the final drain runs the last
        step's updates with no next step to overlap, so `wall_s / steps` is biased; None below 2 steps."""
        return sum(self.step_times[1:]) / (len(self.step_times) - 1) if len(self.step_times) >= 2 else None


def run_timed_steps(engine: Engine, batches: Callable[[int], list[MicroBatch]], *, warmup: int, steps: int,
                    optimizer: bool = True, on_step: Callable[[int, StepResult, float], None] | None = None,
                    stop_on_oom: bool = False) -> TimedSteps:
    """`warmup` + `steps` calls of engine.step (forward_backward alone when not `optimizer`) on
    batches(step index). on_step(index, result, seconds of the call) runs after each, warm-up included.
    `stop_on_oom`: a CUDA out-of-memory error ends the loop and is reported in `failure` instead of raised."""
    dev = engine.device
    cuda = dev.type == "cuda"
    off = engine.offloader
    out = TimedSteps()
    t_timed = None
    offload0 = (0, 0)
    try:
        for s in range(warmup + steps):
            mbs = batches(s)
            if s == warmup:
                engine.synchronize(masters=False)  # the warm-up's host updates are not the timed steps' work
                if cuda:
                    torch.cuda.synchronize(dev)
                t_timed = time.perf_counter()
                if off is not None:
                    offload0 = (off.d2h_bytes, off.h2d_bytes)
            t_s = time.perf_counter()
            res = engine.step(mbs, BENCH_LR) if optimizer else engine.forward_backward(mbs)
            took = time.perf_counter() - t_s
            out.losses.append(res.loss)
            if s >= warmup:
                out.results.append(res)
                out.step_times.append(took)
                if cuda:
                    out.stall_s += engine.streamer.stall_seconds()
            if on_step is not None:
                on_step(s, res, took)
        engine.synchronize(masters=False)  # the last step's updates count too (not a checkpoint's copy home)
        if cuda:
            torch.cuda.synchronize(dev)
    except torch.cuda.OutOfMemoryError as err:
        if not stop_on_oom:
            raise
        out.failure = f"out of memory: {str(err).splitlines()[0]}"
    if out.failure:
        out.wall_s = sum(out.step_times)
    elif t_timed is not None:
        out.wall_s = time.perf_counter() - t_timed
    if off is not None and out.results:
        out.offload_d2h_bytes, out.offload_h2d_bytes = off.d2h_bytes - offload0[0], off.h2d_bytes - offload0[1]
    return out
