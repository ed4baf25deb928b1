"""The one runner of `megatrain bench`: recipe -> model config -> plan -> host store and engine -> the
path's measurement.

It plans with the planner `train` and `train --dry-run` ask (engine/plan/step_plan.plan_step) and builds
with train's build path (train/setup.py), so a recipe key means the same to all three and the bench
measures the engine a training run of that recipe would get. The planner chooses the path:

    short-context, memory-lean   short.measure: the timed loop, the dashboard, one sync per step;
    long-context                 long_context.measure: a per-layer clock, and with --layers the whole
                                 model's step extrapolated from the layers that ran.

ranks.py runs the data-parallel path through plan_bench and build too. A plan that does not fit is
refused before the host store (up to 14 bytes per parameter) is allocated.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass

import torch

from megatrain_cli.bench import long_context, predicted, short
from megatrain_cli.bench.result import BenchResult, model_label
from megatrain_cli.bench.settings import BenchRun, bench_model_config, model_name
from megatrain_cli.engine.plan.lean import GiB, LeanPlan, refusal
from megatrain_cli.engine.plan.step_plan import StepPlan, plan_step
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.recipe import Recipe, parse_bytes
from megatrain_cli.store.tiles import HostStore
from megatrain_cli.train import host_kernel
from megatrain_cli.train.setup import build_engine, build_store, lean_allocator, resolve_device


class DoesNotFit(RuntimeError):
    """The plan does not fit the machine (raised before anything big is allocated)."""


@dataclass
class Planned:
    """A recipe planned for the bench: the model it runs, the device, the planner's StepPlan and what the
    refusal would say. `full`: with --layers on the long-context path, the whole model's plan (computed,
    not run) and its unallocated store (for its FLOPs)."""

    r: Recipe
    config: object
    device: torch.device
    plan: StepPlan
    label: str
    problems: list
    full: LeanPlan | None = None
    full_store: HostStore | None = None

    @property
    def long_context(self) -> bool:
        return self.plan.lean is not None and self.plan.lean.label == "long-context"


def plan_bench(r: Recipe, layers: int | None = None, *, store_built: bool = False, budget: int | None = None,
               one_process: bool = True, log=print) -> Planned:
    """The planner's plan for `r` (with `layers` decoder layers), printed through `log`. `store_built`,
    `budget`, `one_process`: plan_step's (a store built earlier; device bytes less what NCCL takes; a rank of
    several)."""
    device = resolve_device(r.engine.device)
    whole = bench_model_config(r)
    config = bench_model_config(r, layers)
    options = dict(store_built=store_built, budget=budget, one_process=one_process)
    plan = plan_step(r, ModelAdapter(config), device, **options)
    whole_layers = whole.get_text_config().num_hidden_layers  # a VLM's decoder's
    planned = Planned(r, config, device, plan, model_label(model_name(r), layers, whole_layers),
                      list(plan.problems))
    if planned.long_context and config.get_text_config().num_hidden_layers != whole_layers:
        long_context.take_whole_models_plan(planned, ModelAdapter(whole), log=log, **options)
    log(planned.plan.render())
    lean = planned.plan.lean
    if lean is not None and lean.label == "memory-lean":
        if lean.fits:
            log(f"[bench] memory-lean path ({lean.summary()})")
        else:  # both plans' figures: the short-context one that was too big, the lean one that is too
            strict = dataclasses.replace(r, engine=dataclasses.replace(r.engine, memory_fallback=False))
            short_plan = plan_step(strict, ModelAdapter(config), device, **options)
            planned.problems = [*short_plan.problems, f"memory-lean path: {refusal(lean)}"]
    return planned


@dataclass
class Built:
    store: HostStore
    engine: object
    allocator: str  # what the CUDA allocator runs with on a lean path ('' otherwise)


def cap_allocator(device: torch.device, budget: int) -> float:
    """Cap torch's allocator on `device` at `budget` bytes; returns the fraction set. torch wants the device's
    index, and a plain torch.device("cuda") has none: that is the current device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    fraction = min(1.0, budget / torch.cuda.get_device_properties(index).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def build(planned: Planned, *, store: HostStore | None = None, dist=None, prefix: str = "[bench]",
          log=print, method=None) -> Built:
    """The host store (unless given: several runs may share one initialisation) and the engine, through
    train/setup.py. On one CUDA process engine.max_gpu_mem also caps torch's allocator, so the budget the
    plan was made for is the one the run gets. `method`: a preference method for the engine (None: SFT)."""
    r, device = planned.r, planned.device
    if device.type == "cuda" and r.engine.max_gpu_mem and dist is None:
        cap_allocator(device, parse_bytes(r.engine.max_gpu_mem))
    allocator = lean_allocator(device) if planned.plan.lean is not None else ""
    t0 = time.perf_counter()
    if store is None:
        store = build_store(r, planned.config, dist, planned.plan.disk_state)
    where = f" on rank 0 of {dist.world}" if dist is not None else ""
    log(f"{prefix} host store ready: {store.num_params() / 1e9:.2f} B params, {store.host_bytes() / GiB:.1f} GiB"
        f"{where}, init {time.perf_counter() - t0:.1f} s")
    host_kernel.prepare(r.engine.host_adamw, log=lambda line: log(f"{prefix} {line}"))  # a first compile, said
    return Built(store, build_engine(r, store, planned.plan, device, dist, method=method), allocator)


def run_bench(r: Recipe, run: BenchRun = BenchRun(), *, log=print, dashboard: str | None = None,
              store: HostStore | None = None, planned: Planned | None = None) -> BenchResult:
    """Plan, build and time `r` on one process: warm-up + timed steps on synthetic tokens. `dashboard`: a
    Dashboard mode for the short-context steps (None: none). `store`: a host store of this model built
    earlier. `planned`: plan_bench's answer when the caller asked first.

    Raises DoesNotFit when the plan does not fit (its problems, each with what to change). The
    long-context path answers with a row instead (tokens_per_s 0, notes 'does not fit: ...'), so a sweep
    over lengths keeps a row per length."""
    if run.steps < 1:
        raise ValueError(f"steps must be >= 1, got {run.steps}")
    if planned is None:
        planned = plan_bench(r, run.layers, store_built=store is not None, log=log)
    if not run.optimizer:  # forward + backward alone: nothing for a background optimizer to do
        planned.r = dataclasses.replace(r, engine=dataclasses.replace(r.engine, overlap_optimizer=False))
    if planned.long_context and planned.problems:
        return long_context.refused(planned, log=log)
    if planned.problems:
        raise DoesNotFit("the bench would not fit:\n  " + "\n  ".join(planned.problems))
    prefix = "[bench-long]" if planned.long_context else "[bench]"
    probe = None
    if run.predict and not planned.long_context:  # before the store and engine take the memory it measures in
        probe = predicted.probe_for(planned, cache_dir=run.probe_cache, log=log)
    built = build(planned, store=store, prefix=prefix, log=log)
    try:
        if planned.long_context:
            return long_context.measure(planned, built.store, built.engine, run, allocator=built.allocator, log=log)
        result = short.measure(planned, built.store, built.engine, run, allocator=built.allocator, log=log,
                               dashboard=dashboard)
        if probe is not None:
            norm = planned.r.train.max_grad_norm
            clipped = norm is not None and all(n > norm for n in result.grad_norms)
            result.predicted = predicted.predicted_row(planned, probe, clipped=clipped)
            log(f"[bench] {predicted.summary(result.predicted, result.step_time_s, result.steady_step_time_s)}")
        return result
    finally:  # the engine's device buffers go before a baseline runs in this process
        del built
        gc.collect()
        if planned.device.type == "cuda":
            torch.cuda.empty_cache()
