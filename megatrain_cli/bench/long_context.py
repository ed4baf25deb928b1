"""`megatrain bench` at long context (issue #9): one sequence of 32K-512K tokens per step.

The engine runs with a LongContextPlan (engine/long_context.py): checkpoint interval 1, the MLP tiled
over the sequence, the loss in chunks, as many layer checkpoints in pinned host memory as the device
budget needs, SDPA restricted to cuDNN / flash / memory-efficient. The plan is printed first; a plan
that does not fit is refused with the reason (a BenchResult whose notes start 'does not fit:' and whose
tokens_per_s is 0), nothing is allocated on the device.

Reported: step time (wall, from the first timed step to the last step's optimizer updates landed),
model TFLOPS with bench's formula (6 x matmul params x tokens + 6 x batch x seq^2 x hidden x layers,
recompute not counted), executed TFLOPS (adds every layer's recomputed forward and the tiled MLP's
recomputed gate/up projections), the measured device peak against the plan's prediction, the phase
times of StepResult.times and the per-layer figures in `notes`.

Every layer's forward and recompute + backward wall time is logged as it completes (LayerClock), so a
run killed by a time limit still leaves per-layer figures. With `layers` below the preset's (a 512K step
of all 28 layers of the 7B preset takes ~10 minutes), the result also carries the full model's step,
extrapolated from those per-layer figures (`extrapolate`), and the full model's memory plan.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch

from megatrain_cli.bench.short import BenchResult, bench_config, model_label, synthetic_batch
from megatrain_cli.bench.loop import run_timed_steps
from megatrain_cli.engine.plan.lean import GiB, LongContextPlan, choose_plan, host_budget_bytes, refusal
from megatrain_cli.engine.step import Engine
from megatrain_cli.machine import host_rss_bytes, peak_rss_bytes
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.metrics.flops import streamed_step_flops
from megatrain_cli.models.loader import build_store
from megatrain_cli.presets import PRESETS
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.store.tiles import HostStore

NAME = "long-ctx"


def _expandable_segments(dev: torch.device) -> str:
    """Multi-GiB activations of varying size fragment the caching allocator; expandable segments avoid
    it. Switched on here unless PYTORCH_CUDA_ALLOC_CONF says otherwise (the recommended way is the
    environment variable: it holds from the first allocation)."""
    if dev.type != "cuda":
        return ""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if conf:
        return conf
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        return "expandable_segments:True (set by bench_long)"
    except Exception as err:  # noqa: BLE001 - private API; the run goes on without it
        return f"default (could not set expandable_segments: {err})"


def _fmt(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


class LayerClock:
    """Each layer's forward and recompute + backward wall time, logged (through `say`, which flushes) as
    the layer completes: a run killed by a time limit leaves its per-layer figures in the log.

    Installed as the engine's `on_op` observer (engine/step.py): a step's ops begin (the embedding rows and
    the inputs are ready), then each op of the schedule is done issuing. An op's time runs from the
    previous mark to its end, after a sync, so the weight and checkpoint waits before it count and the
    marks add up to the layer phase of the step.

    Cost: one host sync of the compute stream per op (not the copy streams: weight prefetch and
    checkpoint offload keep overlapping). At 128K+ a layer pass takes 0.3-20 s and the sync only gives
    up the host's run-ahead into the next layer's kernel launches (milliseconds); at 32K (0.05 s per
    forward layer) that is about 1-2%. Only the long-context bench installs it: bench_engine's short
    steps keep their one sync per step."""

    def __init__(self, engine: Engine, say, *, prefix: str = "[bench-long]"):
        self.say, self.prefix = say, prefix
        self.steps: list[dict] = []  # per step begun: forward / recompute / backward {layer: s}, head s
        self._mark = 0.0
        cuda = engine.device.type == "cuda"
        self._sync = torch.cuda.current_stream(engine.device).synchronize if cuda else (lambda: None)
        engine.on_op = self._on_op

    def _on_op(self, op) -> None:
        self._sync()
        now = time.perf_counter()
        if op is None:  # a step's ops begin
            self.steps.append({"forward": {}, "recompute": {}, "backward": {}, "head": None, "start": now})
            self._mark = now
            return
        took, self._mark = now - self._mark, now
        step, n = self.steps[-1], len(self.steps) - 1
        at = f"(step at {now - step['start']:.1f} s)"
        if op.kind == "head":
            step["head"] = took
            self.say(f"{self.prefix} step {n} head (final norm + chunked loss) {_fmt(took)} {at}")
        elif op.kind in ("forward", "recompute", "backward"):
            step[op.kind][op.layer] = step[op.kind].get(op.layer, 0.0) + took
        if op.kind == "forward":
            self.say(f"{self.prefix} step {n} layer {op.layer} forward {_fmt(took)} {at}")
        elif op.kind == "backward":
            rec = step["recompute"].get(op.layer, 0.0)
            self.say(f"{self.prefix} step {n} layer {op.layer} recompute + backward {_fmt(rec + took)} "
                     f"(recompute {_fmt(rec)}, backward {_fmt(took)}) {at}")

    def per_layer(self, first: int, count: int) -> tuple[float, float, int]:
        """(median forward, median recompute + backward, samples of each) over steps first..first+count-1.
        Medians: a one-off first-call cost (cuDNN plan, allocator growth) stays out of the per-layer figure."""
        steps = self.steps[first:first + count]
        fwd = [t for s in steps for t in s["forward"].values()]
        bwd = [s["recompute"].get(i, 0.0) + t for s in steps for i, t in s["backward"].items()]
        if not fwd or not bwd:
            return 0.0, 0.0, 0
        return statistics.median(fwd), statistics.median(bwd), min(len(fwd), len(bwd))


def extrapolate(*, step_time: float, measured_layers: int, full_layers: int, forward_per_layer: float,
                backward_per_layer: float, samples: int, tokens: int, full_flops: float,
                full_executed_flops: float) -> dict:
    """The full model's step from a run of `measured_layers` layers: the layer passes scale with the layer
    count, everything else in the measured step (embedding, head, loss, the optimizer's tail) is measured
    once and kept:  step(L) = step(N) + (L - N) x (forward + recompute/backward per layer). `samples`: the
    layer passes behind each per-layer figure. FLOPs: the full model's (streamed_step_flops)."""
    per_layer = forward_per_layer + backward_per_layer
    step = step_time + (full_layers - measured_layers) * per_layer
    return dict(layers=full_layers, measured_layers=measured_layers,
                formula="step(L) = step(N) + (L - N) x (forward + recompute/backward per layer)",
                measured_step_time_s=step_time, per_layer_forward_s=forward_per_layer,
                per_layer_backward_s=backward_per_layer, per_layer_samples=samples,
                once_per_step_s=step_time - measured_layers * per_layer,
                step_time_s=step, tokens_per_s=tokens / step, model_tflops=full_flops / step / 1e12,
                executed_tflops=full_executed_flops / step / 1e12)


def format_extrapolation(x: dict) -> str:
    """The extrapolation of a truncated run, in words and with its formula (labelled: not measured)."""
    n, L = x["measured_layers"], x["layers"]
    lines = [f"extrapolated to {L} layers (NOT measured: {n} of {L} layers ran): {x['formula']}",
             f"  = {_fmt(x['measured_step_time_s'])} + ({L} - {n}) x ({_fmt(x['per_layer_forward_s'])} + "
             f"{_fmt(x['per_layer_backward_s'])}) = {_fmt(x['step_time_s'])}/step; {x['tokens_per_s']:.0f} tokens/s, "
             f"model {x['model_tflops']:.1f} TFLOPS, executed {x['executed_tflops']:.1f}",
             f"  per-layer figures: medians of {x['per_layer_samples']} layer passes; measured once per step "
             f"(embedding, head, loss, optimizer tail): {_fmt(x['once_per_step_s'])}"]
    if "planned_peak_device_bytes" in x:
        measured = x.get("measured_peak_device_bytes")
        lines.append(
            f"  device memory: planned peak {x['planned_peak_device_bytes'] / GiB:.2f} GiB for {L} layers "
            f"({x['planned_peak_phase']}; {x['planned_offloaded_checkpoints']} of {L} checkpoints in "
            f"{x['planned_host_pinned_bytes'] / GiB:.2f} GiB of pinned host memory; "
            f"{'fits' if x['plan_fits'] else 'DOES NOT FIT'}); "
            + (f"measured {measured / GiB:.2f} GiB with {n} layers (planned "
               f"{x['measured_layers_planned_peak_device_bytes'] / GiB:.2f} GiB); measured + the plans' difference "
               f"{x['peak_device_bytes_from_measured'] / GiB:.2f} GiB" if measured else "measured n/a (cpu)"))
        extra = x["planned_offloaded_checkpoints"] - x["measured_layers_offloaded_checkpoints"]
        if extra > 0:
            lines.append(f"  not in the extrapolation: the whole model sends {extra} more checkpoints to host memory "
                         f"and back (each {x['checkpoint_bytes'] / GiB:.2f} GiB, twice per step over PCIe, planned "
                         "to hide behind a layer's compute)")
    return "\n".join(lines)


def full_model_plan(preset: str, seq: int, store: HostStore, *, host_budget: int, host_budget_measured: bool,
                    **plan_options) -> tuple[LongContextPlan, HostStore]:
    """The plan of the preset's whole layer count (computed, not run) and its unallocated store (for its
    FLOPs). A host budget read from the machine is lowered by the host memory the larger store would take."""
    full = HostStore(ModelAdapter(bench_config(preset, seq)), store.compute_dtype, allocate=False)
    if host_budget_measured:
        host_budget = max(0, host_budget - max(0, full.host_bytes() - store.host_bytes()))
    return choose_plan(full.adapter, seq, host_budget_bytes=host_budget, **plan_options), full


def bench_long_context(preset: str, seq: int, *, steps: int = 1, warmup: int = 0, device_budget: int | None = None,
                       host_budget: int | None = None, log=print, device: str = "cuda", batch: int = 1,
                       lean_norms: bool | None = None, mlp_tile_tokens: int = 8192, tile_mlp: bool | None = None,
                       loss_chunk_tokens: int = 4096, offload: bool | None = None, headroom: float = 0.95,
                       sdpa: str = "auto", max_grad_norm: float | None = 1.0, store=None, layers: int | None = None,
                       **engine_kwargs) -> BenchResult:
    """Warm-up + timed full optimizer steps (engine.step) of `preset` at `batch` x `seq` synthetic tokens
    on the long-context path. `device_budget`: device bytes the plan may use (default: the GPU's total;
    on CPU what the host has free). `host_budget`: host bytes the offloaded checkpoints may take
    (default: MemAvailable after the host store, minus the engine's pinned buffers and 4 GiB).
    lean_norms None: HF RMSNorm when that plan fits, else the lean one. engine_kwargs go to Engine
    (layer_slots, grad_slabs, double_buffer, overlap_optimizer, speculate, update_on_read). `store`: a host store of
    this preset (and `layers`) built earlier (several runs share one initialisation).

    `layers`: run that many layers instead of the preset's (bench.bench_config). The whole model's plan is
    computed too (not run); its RMSNorm, MLP tiling and loss chunk are the run's unless given, so each
    measured layer runs what it would in the whole model. The result then carries `extrapolated`: the
    whole model's step from the measured per-layer times (`extrapolate`) and its planned device peak and
    pinned host bytes next to the measured peak."""

    def say(message: str) -> None:
        log(message)
        sys.stdout.flush()
        sys.stderr.flush()

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    config = bench_config(preset, seq, layers)
    truncated = config.num_hidden_layers != PRESETS[preset].num_hidden_layers
    dev = torch.device(device)
    alloc_conf = _expandable_segments(dev)
    t0 = time.perf_counter()
    if store is None:
        store = build_store(config, torch.bfloat16 if dev.type == "cuda" else torch.float32, seed=0)
    say(f"[bench-long] host store ready: {store.num_params() / 1e9:.2f} B params, "
        f"{store.host_bytes() / GiB:.1f} GiB, init {time.perf_counter() - t0:.1f} s")

    layer_slots = engine_kwargs.get("layer_slots", 2)
    grad_slabs = engine_kwargs.get("grad_slabs", 12)
    width = torch.finfo(store.compute_dtype).bits // 8
    engine_pinned = (2 + grad_slabs) * store.largest_layer_numel() * width if dev.type == "cuda" else 0
    if device_budget is None:
        if dev.type == "cuda":
            device_budget = torch.cuda.get_device_properties(dev).total_memory
        else:  # the CPU "device" is the host: what is free besides the store
            device_budget = host_budget_bytes(0, 0)
    host_budget_measured = host_budget is None
    if host_budget is None:
        host_budget = host_budget_bytes(engine_pinned)
    options = dict(batch=batch, device_budget_bytes=device_budget, dtype=store.compute_dtype, layer_slots=layer_slots,
                   mlp_tile_tokens=mlp_tile_tokens, offload=offload, headroom=headroom)
    full = full_store = None
    if truncated:
        full, full_store = full_model_plan(preset, seq, store, host_budget=host_budget,
                                           host_budget_measured=host_budget_measured, tile_mlp=tile_mlp,
                                           loss_chunk_tokens=loss_chunk_tokens, lean_norms=lean_norms, **options)
        say(f"[bench-long] the whole {PRESETS[preset].num_hidden_layers}-layer model's plan (computed, not run): "
            f"{full.summary()}; {'fits' if full.fits else 'DOES NOT FIT: ' + refusal(full)}")
        # Each measured layer runs what it would in the whole model (its checkpoint offload aside).
        lean_norms = full.lean_norms if lean_norms is None else lean_norms
        tile_mlp = (full.mlp_tile_tokens is not None) if tile_mlp is None else tile_mlp
        loss_chunk_tokens = full.loss_chunk_tokens
    plan = choose_plan(store.adapter, seq, host_budget_bytes=host_budget, tile_mlp=tile_mlp,
                       loss_chunk_tokens=loss_chunk_tokens, lean_norms=lean_norms, **options)
    say(plan.render())
    say(f"[bench-long] host budget for offloaded checkpoints {host_budget / GiB:.1f} GiB "
        f"(engine pinned buffers {engine_pinned / GiB:.1f} GiB)")
    tokens = batch * seq
    base = dict(name=NAME, model=model_label(preset, layers), batch=batch, seq=seq, host_rss_bytes=host_rss_bytes())
    if not plan.fits:
        reason = refusal(plan)
        say(f"[bench-long] does not fit: {reason}")
        return BenchResult(**base, steps=0, step_time_s=0.0, tokens_per_s=0.0, model_tflops=0.0,
                           executed_tflops=0.0, peak_device_bytes=0, host_peak_rss_bytes=peak_rss_bytes(),
                           notes=f"does not fit: {reason}")

    cfg = TrainConfig(steps=steps + warmup, lr=1e-5, max_grad_norm=max_grad_norm, grad_accum=1,
                      micro_batch_size=batch, seq_len=seq)
    # The pipelined host optimizer is the CUDA engine's (the trainer turns it off on CPU too).
    engine_kwargs["overlap_optimizer"] = engine_kwargs.get("overlap_optimizer", True) and dev.type == "cuda"
    engine = Engine(store, cfg, device=dev, checkpoint_interval=plan.checkpoint_interval,
                    loss_chunk_tokens=plan.loss_chunk_tokens, long_context=plan, sdpa=sdpa, **engine_kwargs)
    clock = LayerClock(engine, say)
    t_pin = time.perf_counter()
    pinned = engine.reserve_checkpoint_buffers([(batch, seq)])
    t_pin = time.perf_counter() - t_pin
    if pinned:
        say(f"[bench-long] pinned {pinned / GiB:.1f} GiB for the offloaded checkpoints in {t_pin:.1f} s")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)

    def show(s: int, res, took: float) -> None:
        say(f"[bench-long] step {s}{' (warm-up)' if s < warmup else ''}: {took:.2f} s, loss {res.loss:.4f} "
            f"norm {res.grad_norm:.3f} " + " ".join(f"{k} {v:.2f}" for k, v in res.times.items())
            + (f" peak {torch.cuda.max_memory_allocated(dev) / GiB:.1f} GiB" if dev.type == "cuda" else ""))

    timed = run_timed_steps(engine, lambda s: [synthetic_batch(config.vocab_size, batch, seq, seed=s * 97)],
                            warmup=warmup, steps=steps, on_step=show, stop_on_oom=True)
    results, losses, step_times, stall, wall = (timed.results, timed.losses, timed.step_times, timed.stall_s,
                                                timed.wall_s)
    failure = timed.failure
    if failure:
        say(f"[bench-long] {failure}")
    peak_dev = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    reserved = torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else 0
    stats = dict(d2h=timed.offload_d2h_bytes, h2d=timed.offload_h2d_bytes, late=engine.offloader.late_gets)
    engine.close()
    del engine
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    plan_line = (f"interval {plan.checkpoint_interval}, MLP tile {plan.mlp_tile_tokens or 'none'}, loss chunk "
                 f"{plan.loss_chunk_tokens}, RMSNorm {'lean' if plan.lean_norms else 'HF'}, offloaded "
                 f"{plan.offloaded_checkpoints}/{plan.num_checkpoints} checkpoints "
                 f"({plan.host_pinned_bytes / GiB:.1f} GiB pinned, reserved in {t_pin:.1f} s), sdpa {sdpa}, "
                 f"allocator {alloc_conf or 'n/a'}; predicted peak {plan.predicted_peak / GiB:.1f} GiB "
                 f"({plan.peak_phase})")
    if not results:
        return BenchResult(**base, steps=0, step_time_s=0.0, tokens_per_s=0.0, model_tflops=0.0, executed_tflops=0.0,
                           peak_device_bytes=peak_dev, host_peak_rss_bytes=peak_rss_bytes(), losses=losses,
                           notes=f"{failure or 'no step finished'} (in warm-up); measured peak "
                                 f"{peak_dev / GiB:.1f} GiB allocated, {reserved / GiB:.1f} GiB reserved; {plan_line}")

    n = len(results)
    step_time = wall / n
    base["host_rss_bytes"] = host_rss_bytes()
    layers_run = config.num_hidden_layers
    # Interval 1: every layer is recomputed once.
    flops, executed = streamed_step_flops(store, rows=batch, seq=seq, recomputed_layers=layers_run,
                                          mlp_tile_tokens=plan.mlp_tile_tokens)
    phases = {k: sum(r.times.get(k, 0.0) for r in results) / n for k in ("forward", "head", "backward", "optimizer")}
    split = {k: round(v, 3) for k, v in phases.items()}
    split["gpu_stall_on_weights"] = round(stall / n, 3)
    weights_h2d = sum(r.h2d_bytes for r in results)
    fwd_layer, bwd_layer, samples = clock.per_layer(warmup, n)
    per_layer = (f"per layer: forward {_fmt(fwd_layer)}, recompute + backward {_fmt(bwd_layer)} (medians of "
                 f"{samples} layer passes, host-synced per layer)")
    measured = (f"measured peak {peak_dev / GiB:.1f} GiB allocated ({peak_dev / max(1, plan.predicted_peak):.0%} of "
                f"predicted), {reserved / GiB:.1f} GiB reserved" if dev.type == "cuda" else "measured peak n/a (cpu)")
    notes = "; ".join(x for x in [
        failure and f"{failure} after {n} timed step(s)",
        plan_line, measured, per_layer,
        "phases " + ", ".join(f"{k} {_fmt(v)}" for k, v in phases.items()),
        f"step times {', '.join(_fmt(t) for t in step_times)}",
        f"checkpoint offload D2H {stats['d2h'] / n / GiB:.1f} GiB/step, H2D {stats['h2d'] / n / GiB:.1f} GiB/step, "
        f"late gets {stats['late']}",
    ] if x)
    extrapolated = {}
    if full is not None and not failure:
        full_flops, full_executed = streamed_step_flops(full_store, rows=batch, seq=seq,
                                                        recomputed_layers=full.num_checkpoints,
                                                        mlp_tile_tokens=plan.mlp_tile_tokens)
        extrapolated = extrapolate(step_time=step_time, measured_layers=layers_run, full_layers=full.num_checkpoints,
                                   forward_per_layer=fwd_layer, backward_per_layer=bwd_layer, samples=samples,
                                   tokens=tokens,
                                   full_flops=full_flops, full_executed_flops=full_executed)
        extrapolated.update(
            planned_peak_device_bytes=full.predicted_peak,
            planned_peak_phase=full.peak_phase, planned_host_pinned_bytes=full.host_pinned_bytes,
            planned_offloaded_checkpoints=full.offloaded_checkpoints, plan_fits=full.fits,
            measured_layers_planned_peak_device_bytes=plan.predicted_peak, checkpoint_bytes=plan.checkpoint_bytes,
            measured_layers_offloaded_checkpoints=plan.offloaded_checkpoints,
            measured_peak_device_bytes=peak_dev if dev.type == "cuda" else None,
            # The plans differ by the extra layers' checkpoints (and offload staging): added to what was measured.
            peak_device_bytes_from_measured=(peak_dev + full.predicted_peak - plan.predicted_peak
                                             if dev.type == "cuda" else None))
    result = BenchResult(
        **base, steps=n, step_time_s=step_time, tokens_per_s=0.0 if failure else tokens / step_time,
        model_tflops=flops / step_time / 1e12, executed_tflops=executed / step_time / 1e12,
        peak_device_bytes=peak_dev, host_peak_rss_bytes=peak_rss_bytes(),
        bytes_per_param=store.host_bytes() / store.num_params(),
        h2d_gbps=(weights_h2d + stats["h2d"]) / wall / 1e9 if wall else None,
        d2h_gbps=(sum(r.d2h_bytes for r in results) + stats["d2h"]) / wall / 1e9 if wall else None,
        overlap=(1.0 - stall / wall) if dev.type == "cuda" and wall else None, split=split, losses=losses,
        notes=notes, extrapolated=extrapolated)
    say(f"[bench-long] {n} step(s): {step_time:.2f} s/step, {result.tokens_per_s:.0f} tokens/s, model "
        f"{result.model_tflops:.1f} TFLOPS, executed {result.executed_tflops:.1f}; {measured}; {per_layer}")
    if extrapolated:
        say(f"[bench-long] {format_extrapolation(extrapolated)}")
    return result
