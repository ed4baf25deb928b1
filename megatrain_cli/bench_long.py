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
times of StepResult.times and the per-layer figures (phase time / layers) in `notes`.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import torch

from megatrain_cli.bench import BenchResult, peak_rss_bytes, synthetic_batch
from megatrain_cli.engine.long_context import GiB, choose_plan, host_budget_bytes, refusal
from megatrain_cli.engine.step import Engine
from megatrain_cli.metrics import host_rss_bytes
from megatrain_cli.step_metrics import streamed_step_flops
from megatrain_cli.models.loader import build_store
from megatrain_cli.presets import PRESETS
from megatrain_cli.recipe import TrainConfig

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


def bench_long_context(preset: str, seq: int, *, steps: int = 1, warmup: int = 0, device_budget: int | None = None,
                       host_budget: int | None = None, log=print, device: str = "cuda", batch: int = 1,
                       lean_norms: bool | None = None, mlp_tile_tokens: int = 8192, tile_mlp: bool | None = None,
                       loss_chunk_tokens: int = 4096, offload: bool | None = None, headroom: float = 0.95,
                       sdpa: str = "auto", max_grad_norm: float | None = 1.0, store=None,
                       **engine_kwargs) -> BenchResult:
    """Warm-up + timed full optimizer steps (engine.step) of `preset` at `batch` x `seq` synthetic tokens
    on the long-context path. `device_budget`: device bytes the plan may use (default: the GPU's total;
    on CPU what the host has free). `host_budget`: host bytes the offloaded checkpoints may take
    (default: MemAvailable after the host store, minus the engine's pinned buffers and 4 GiB).
    lean_norms None: HF RMSNorm when that plan fits, else the lean one. engine_kwargs go to Engine
    (layer_slots, grad_slabs, double_buffer, overlap_optimizer, speculate). `store`: a host store of
    this preset built earlier (several runs share one initialisation)."""

    def say(message: str) -> None:
        log(message)
        sys.stdout.flush()
        sys.stderr.flush()

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    p = PRESETS[preset]
    config = p.hf_config(vocab_size=p.vocab_size or 1024, max_position_embeddings=max(seq, 4096))
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
    if host_budget is None:
        host_budget = host_budget_bytes(engine_pinned)
    plan = choose_plan(store.adapter, seq, batch=batch, device_budget_bytes=device_budget,
                       host_budget_bytes=host_budget, dtype=store.compute_dtype, layer_slots=layer_slots,
                       mlp_tile_tokens=mlp_tile_tokens, tile_mlp=tile_mlp, loss_chunk_tokens=loss_chunk_tokens,
                       offload=offload, headroom=headroom, lean_norms=lean_norms)
    say(plan.render())
    say(f"[bench-long] host budget for offloaded checkpoints {host_budget / GiB:.1f} GiB "
        f"(engine pinned buffers {engine_pinned / GiB:.1f} GiB)")
    tokens = batch * seq
    base = dict(name=NAME, model=preset, batch=batch, seq=seq, host_rss_bytes=host_rss_bytes())
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
    t_pin = time.perf_counter()
    pinned = engine.reserve_checkpoint_buffers([(batch, seq)])
    t_pin = time.perf_counter() - t_pin
    if pinned:
        say(f"[bench-long] pinned {pinned / GiB:.1f} GiB for the offloaded checkpoints in {t_pin:.1f} s")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)

    results, losses, step_times, stall = [], [], [], 0.0
    t_timed = None
    failure = ""
    off = engine.offloader
    try:
        for s in range(warmup + steps):
            mbs = [synthetic_batch(config.vocab_size, batch, seq, seed=s * 97)]
            if s == warmup:
                engine.synchronize()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t_timed = time.perf_counter()
                d2h0, h2d0 = off.d2h_bytes, off.h2d_bytes
            t_s = time.perf_counter()
            res = engine.step(mbs, 1e-5)
            took = time.perf_counter() - t_s
            losses.append(res.loss)
            if s >= warmup:
                results.append(res)
                step_times.append(took)
                if dev.type == "cuda":
                    stall += engine.streamer.stall_seconds()
            say(f"[bench-long] step {s}{' (warm-up)' if s < warmup else ''}: {took:.2f} s, loss {res.loss:.4f} "
                f"norm {res.grad_norm:.3f} " + " ".join(f"{k} {v:.2f}" for k, v in res.times.items())
                + (f" peak {torch.cuda.max_memory_allocated(dev) / GiB:.1f} GiB" if dev.type == "cuda" else ""))
        engine.synchronize()  # the last step's host updates count too
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except torch.cuda.OutOfMemoryError as err:
        failure = f"out of memory: {str(err).splitlines()[0]}"
        say(f"[bench-long] {failure}")
    wall = time.perf_counter() - t_timed if t_timed is not None else 0.0
    if failure:  # the failed step's partial time is not a step
        wall = sum(step_times)
    peak_dev = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    reserved = torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else 0
    stats = dict(d2h=off.d2h_bytes - d2h0, h2d=off.h2d_bytes - h2d0, late=off.late_gets) if results else {}
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
    layers = config.num_hidden_layers
    # Interval 1: every layer is recomputed once.
    flops, executed = streamed_step_flops(store, rows=batch, seq=seq, recomputed_layers=layers,
                                          mlp_tile_tokens=plan.mlp_tile_tokens)
    phases = {k: sum(r.times.get(k, 0.0) for r in results) / n for k in ("forward", "head", "backward", "optimizer")}
    split = {k: round(v, 3) for k, v in phases.items()}
    split["gpu_stall_on_weights"] = round(stall / n, 3)
    weights_h2d = sum(r.h2d_bytes for r in results)
    per_layer = (f"per layer: forward {_fmt(phases['forward'] / layers)}, recompute + backward "
                 f"{_fmt(phases['backward'] / layers)}")
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
    result = BenchResult(
        **base, steps=n, step_time_s=step_time, tokens_per_s=0.0 if failure else tokens / step_time,
        model_tflops=flops / step_time / 1e12, executed_tflops=executed / step_time / 1e12,
        peak_device_bytes=peak_dev, host_peak_rss_bytes=peak_rss_bytes(),
        bytes_per_param=store.host_bytes() / store.num_params(),
        h2d_gbps=(weights_h2d + stats["h2d"]) / wall / 1e9 if wall else None,
        d2h_gbps=(sum(r.d2h_bytes for r in results) + stats["d2h"]) / wall / 1e9 if wall else None,
        overlap=(1.0 - stall / wall) if dev.type == "cuda" and wall else None, split=split, losses=losses,
        notes=notes)
    say(f"[bench-long] {n} step(s): {step_time:.2f} s/step, {result.tokens_per_s:.0f} tokens/s, model "
        f"{result.model_tflops:.1f} TFLOPS, executed {result.executed_tflops:.1f}; {measured}; {per_layer}")
    return result
