"""`megatrain bench` on the long-context path: sequences of train.seq_len >= engine.long_context_min_seq
(the planner's rule, as in `train`), typically one sequence of 32K-512K tokens per step.

The engine runs the planner's LeanPlan: checkpoint interval 1, the MLP chunked over the sequence
where that helps, the loss in chunks, as many layer checkpoints in pinned host memory as the device
budget needs, SDPA restricted to cuDNN / flash / memory-efficient. A plan that does not fit is answered
with a row whose notes start 'does not fit:' and whose tokens_per_s is 0; nothing is allocated.

Reported: step time (wall, from the first timed step to the last step's optimizer updates landed),
model TFLOPS (result.py's formula, recompute not counted), executed TFLOPS (adds every layer's
recomputed forward and the chunked MLP's recomputed gate/up projections), the measured device peak
against the plan's prediction, the phase times of StepResult.times and the per-layer figures in `notes`.

Every layer's forward and recompute + backward wall time is logged as it completes (LayerClock), so a
run killed by a time limit still leaves per-layer figures. With --layers below the model's (a whole
model's step at 512K takes minutes), the result also carries the whole model's step, extrapolated from
those per-layer figures (`extrapolate`), and the whole model's memory plan. The layers that run take the
whole model's plan choices (RMSNorm, MLP chunking, loss chunk), so each runs what it would in the whole model.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from megatrain_cli.bench.loop import BenchRows, run_timed_steps
from megatrain_cli.bench.result import BenchResult
from megatrain_cli.engine.plan.lean import GiB, refusal
from megatrain_cli.engine.plan.step_plan import DTYPES, plan_step
from megatrain_cli.machine import host_rss_bytes, peak_rss_bytes
from megatrain_cli.metrics.flops import streamed_step_flops
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.store.tiles import HostStore

NAME = "long-ctx"


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
    checkpoint offload keep overlapping): the host gives up its run-ahead into the next layer's kernel
    launches, milliseconds per layer pass. Small against a long sequence's layer pass, a visible share of
    a short one's, so only the long-context path installs it; the short path keeps one sync per step."""

    def __init__(self, engine, say, *, prefix: str = "[bench-long]"):
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
            self.steps.append({"forward": {}, "rebuild": {}, "recompute": {}, "backward": {}, "head": None,
                               "start": now})
            self._mark = now
            return
        took, self._mark = now - self._mark, now
        step, n = self.steps[-1], len(self.steps) - 1
        at = f"(step at {now - step['start']:.1f} s)"
        if op.kind == "head":
            step["head"] = took
            self.say(f"{self.prefix} step {n} head (final norm + chunked loss) {_fmt(took)} {at}")
        elif op.kind in ("forward", "rebuild", "recompute", "backward"):
            step[op.kind][op.layer] = step[op.kind].get(op.layer, 0.0) + took
        if op.kind == "forward":
            self.say(f"{self.prefix} step {n} layer {op.layer} forward {_fmt(took)} {at}")
        elif op.kind == "rebuild":  # a dropped checkpoint, from the block before (engine/rebuild.py)
            self.say(f"{self.prefix} step {n} layer {op.layer} rebuild of checkpoint {op.block} {_fmt(took)} {at}")
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
                full_executed_flops: float, measured_rebuilds: int = 0, full_rebuilds: int = 0) -> dict:
    """The full model's step from a run of `measured_layers` layers: the layer passes scale with the layer
    count, and each rebuilt (dropped) checkpoint costs one more layer forward; everything else in the measured
    step (embedding, head, loss, the optimizer's tail) is measured once and kept. `samples`: the layer passes
    behind each per-layer figure. FLOPs: the full model's (streamed_step_flops)."""
    per_layer = forward_per_layer + backward_per_layer
    step = step_time + (full_layers - measured_layers) * per_layer + (full_rebuilds - measured_rebuilds) * \
        forward_per_layer
    return dict(layers=full_layers, measured_layers=measured_layers,
                formula="step(L) = step(N) + (L - N) x (forward + recompute/backward per layer) + (D(L) - D(N)) x "
                        "forward, D = rebuilt checkpoints",
                measured_step_time_s=step_time, per_layer_forward_s=forward_per_layer,
                per_layer_backward_s=backward_per_layer, per_layer_samples=samples,
                measured_rebuilds=measured_rebuilds, full_rebuilds=full_rebuilds,
                once_per_step_s=step_time - measured_layers * per_layer - measured_rebuilds * forward_per_layer,
                step_time_s=step, tokens_per_s=tokens / step, model_tflops=full_flops / step / 1e12,
                executed_tflops=full_executed_flops / step / 1e12)


def format_extrapolation(x: dict) -> str:
    """The extrapolation of a truncated run, in words and with its formula (labelled: not measured)."""
    n, L = x["measured_layers"], x["layers"]
    lines = [f"extrapolated to {L} layers (NOT measured: {n} of {L} layers ran): {x['formula']}",
             f"  = {_fmt(x['measured_step_time_s'])} + ({L} - {n}) x ({_fmt(x['per_layer_forward_s'])} + "
             f"{_fmt(x['per_layer_backward_s'])}) + ({x['full_rebuilds']} - {x['measured_rebuilds']}) x "
             f"{_fmt(x['per_layer_forward_s'])} = {_fmt(x['step_time_s'])}/step; {x['tokens_per_s']:.0f} tokens/s, "
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


def take_whole_models_plan(planned, whole_adapter, *, log=print, **plan_options) -> None:
    """--layers on the long-context path: plan the whole model too (computed, not run) and make the run's
    plan take its choices (RMSNorm, MLP chunking, loss chunk), the one planner re-deciding only where the
    checkpoints of the layers that run go. Sets planned.full / full_store; where the choices differ, planned.plan
    is plan_step's with them (`plan_options`: plan_step's, as the run's plan was made)."""
    r, dev = planned.r, planned.device
    full = plan_step(r, whole_adapter, dev).lean
    planned.full = full
    planned.full_store = HostStore(whole_adapter, DTYPES[r.model.dtype], allocate=False)
    log(f"[bench-long] the whole {full.num_checkpoints}-layer model's plan (computed, not run): {full.summary()}; "
        f"{'fits' if full.fits else 'DOES NOT FIT: ' + refusal(full)}")
    own = planned.plan.lean
    if (own.lean_norms, own.mlp_chunk_tokens, own.loss_chunk_tokens) == \
            (full.lean_norms, full.mlp_chunk_tokens, full.loss_chunk_tokens):
        return
    planned.plan = plan_step(r, ModelAdapter(planned.config), dev, like=full, **plan_options)
    planned.problems = list(planned.plan.problems)


def _say(log):
    """log, then flush: a run killed by a time limit leaves every line it printed."""
    def say(message: str) -> None:
        log(message)
        sys.stdout.flush()
        sys.stderr.flush()
    return say


def refused(planned, *, log=print) -> BenchResult:
    """The row of a long-context plan that does not fit: why, and nothing allocated."""
    lean = planned.plan.lean
    reason = refusal(lean) if not lean.fits else "; ".join(planned.problems)
    _say(log)(f"[bench-long] does not fit: {reason}")
    t = planned.r.train
    return BenchResult(name=NAME, model=planned.label, batch=t.micro_batch_size, seq=t.seq_len, steps=0,
                       step_time_s=0.0, tokens_per_s=0.0, model_tflops=0.0, executed_tflops=0.0,
                       peak_device_bytes=0, host_rss_bytes=host_rss_bytes(), host_peak_rss_bytes=peak_rss_bytes(),
                       notes=f"does not fit: {reason}")


def measure(planned, store, engine, run, *, allocator: str = "", log=print) -> BenchResult:
    """Warm-up + timed full optimizer steps of `engine` (built for planned.plan) on synthetic tokens, with
    the per-layer clock; closes the engine. A CUDA out-of-memory error ends the loop and the row reports
    the steps before it."""
    say = _say(log)
    r, plan, dev = planned.r, planned.plan.lean, planned.device
    batch, seq, accum = r.train.micro_batch_size, r.train.seq_len, r.train.grad_accum
    warmup, steps, full = run.warmup_steps(True), run.steps, planned.full
    if plan.host_budget is not None:
        say(f"[bench-long] host budget for offloaded checkpoints {plan.host_budget / GiB:.1f} GiB")
    try:
        clock = LayerClock(engine, say)
        t_pin = time.perf_counter()
        pinned = engine.reserve_checkpoint_buffers([(batch, seq)] * accum)
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

        rows = BenchRows(r, planned.config.vocab_size, steps=warmup + steps, micro_batches=accum)
        timed = run_timed_steps(engine, rows, warmup=warmup, steps=steps, on_step=show, stop_on_oom=True)
        late = engine.offloader.late_gets
    finally:
        engine.close()
    results, losses, stall, wall, failure = timed.results, timed.losses, timed.stall_s, timed.wall_s, timed.failure
    if failure:
        say(f"[bench-long] {failure}")
    peak_dev = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    reserved = torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else 0

    base = dict(name=NAME, model=planned.label, batch=batch * accum, seq=seq, host_rss_bytes=host_rss_bytes(),
                packed=rows.describe())
    plan_line = (f"interval {plan.checkpoint_interval}, MLP chunk {plan.mlp_chunk_tokens or 'none'}, loss chunk "
                 f"{plan.loss_chunk_tokens}, RMSNorm {'lean' if plan.lean_norms else 'HF'}, offloaded "
                 f"{plan.offloaded_checkpoints}/{plan.num_checkpoints} checkpoints "
                 f"({plan.host_pinned_bytes / GiB:.1f} GiB pinned, reserved in {t_pin:.1f} s), sdpa {r.engine.sdpa}, "
                 f"allocator {allocator or 'n/a'}; predicted peak {plan.predicted_peak / GiB:.1f} GiB "
                 f"({plan.peak_phase})")
    if not results:
        return BenchResult(**base, steps=0, step_time_s=0.0, tokens_per_s=0.0, model_tflops=0.0, executed_tflops=0.0,
                           peak_device_bytes=peak_dev, host_peak_rss_bytes=peak_rss_bytes(), losses=losses,
                           notes=f"{failure or 'no step finished'} (in warm-up); measured peak "
                                 f"{peak_dev / GiB:.1f} GiB allocated, {reserved / GiB:.1f} GiB reserved; {plan_line}")

    n = len(results)
    step_time = wall / n
    tokens = batch * seq * accum
    layers_run = planned.config.num_hidden_layers
    # Interval 1: every layer is recomputed once; a rebuilt checkpoint is one more layer forward.
    rebuilds = len(plan.dropped_checkpoints)
    attended = rows.attended_per_step(range(warmup, warmup + n))
    flops, executed = streamed_step_flops(store, rows=batch * accum, seq=seq, recomputed_layers=layers_run + rebuilds,
                                          mlp_chunk_tokens=plan.mlp_chunk_tokens, attended=attended)
    phases = {k: sum(x.times.get(k, 0.0) for x in results) / n for k in ("forward", "head", "backward", "optimizer")}
    split = {k: round(v, 3) for k, v in phases.items()}
    split["gpu_stall_on_weights"] = round(stall / n, 3)
    fwd_layer, bwd_layer, samples = clock.per_layer(warmup, n)
    per_layer = (f"per layer: forward {_fmt(fwd_layer)}, recompute + backward {_fmt(bwd_layer)} (medians of "
                 f"{samples} layer passes, host-synced per layer)")
    measured = (f"measured peak {peak_dev / GiB:.1f} GiB allocated ({peak_dev / max(1, plan.predicted_peak):.0%} of "
                f"predicted), {reserved / GiB:.1f} GiB reserved" if dev.type == "cuda" else "measured peak n/a (cpu)")
    d2h, h2d = timed.offload_d2h_bytes, timed.offload_h2d_bytes
    notes = "; ".join(x for x in [
        failure and f"{failure} after {n} timed step(s)",
        plan_line, measured, per_layer,
        "phases " + ", ".join(f"{k} {_fmt(v)}" for k, v in phases.items()),
        f"step times {', '.join(_fmt(t) for t in timed.step_times)}",
        f"checkpoint offload D2H {d2h / n / GiB:.1f} GiB/step, H2D {h2d / n / GiB:.1f} GiB/step, late gets {late}",
    ] if x)
    extrapolated = {}
    if full is not None and not failure:
        full_rebuilds = len(full.dropped_checkpoints)
        full_flops, full_executed = streamed_step_flops(planned.full_store, rows=batch * accum, seq=seq,
                                                        recomputed_layers=full.num_checkpoints + full_rebuilds,
                                                        mlp_chunk_tokens=plan.mlp_chunk_tokens, attended=attended)
        extrapolated = extrapolate(step_time=step_time, measured_layers=layers_run, full_layers=full.num_checkpoints,
                                   forward_per_layer=fwd_layer, backward_per_layer=bwd_layer, samples=samples,
                                   tokens=tokens, full_flops=full_flops, full_executed_flops=full_executed,
                                   measured_rebuilds=rebuilds, full_rebuilds=full_rebuilds)
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
        h2d_gbps=(sum(x.h2d_bytes for x in results) + h2d) / wall / 1e9 if wall else None,
        d2h_gbps=(sum(x.d2h_bytes for x in results) + d2h) / wall / 1e9 if wall else None,
        overlap=(1.0 - stall / wall) if dev.type == "cuda" and wall else None, split=split, losses=losses,
        notes=notes, extrapolated=extrapolated)
    say(f"[bench-long] {n} step(s): {step_time:.2f} s/step, {result.tokens_per_s:.0f} tokens/s, model "
        f"{result.model_tflops:.1f} TFLOPS, executed {result.executed_tflops:.1f}; {measured}; {per_layer}")
    if extrapolated:
        say(f"[bench-long] {format_extrapolation(extrapolated)}")
    return result
