"""The short-context bench (and its memory-lean fallback), and the native baseline.

`measure` times the engine runner.py built: warm-up + timed full optimizer steps on synthetic tokens, one
host sync per step (no per-layer clock: the short steps keep their overlap), each step's metrics to the
dashboard, and a result row with the phase split, PCIe rates, overlap and the settings that ran.
`bench_native` runs the same model, batch and tokens entirely on the GPU, the way PyTorch runs it natively.
"""

from __future__ import annotations

import gc
import io
import time
from pathlib import Path

import torch

from megatrain_cli.bench.loop import BENCH_LR, BenchRows, run_timed_steps, synthetic_batch
from megatrain_cli.bench.result import BenchResult
from megatrain_cli.bench.vision_rows import VisionRows
from megatrain_cli.engine.plan.lean import GiB, fmt_bytes
from megatrain_cli.machine import host_rss_bytes, peak_rss_bytes
from megatrain_cli.metrics.flops import hf_matmul_params, model_flops, streamed_step_flops
from megatrain_cli.metrics.step import step_metrics


def measure(planned, store, engine, run, *, allocator: str = "", log=print, dashboard: str | None = None,
            batches=None, name: str = "megatrain", close: bool = True) -> BenchResult:
    """Time `engine` (built for planned.plan) over run.warmup_steps + run.steps steps; closes it unless not
    `close`. `dashboard`: a Dashboard mode ('off', 'plain', 'rich', 'auto') that gets every step's metrics.
    `batches`: step -> its micro-batches (None: the recipe's synthetic rows, bench/loop.BenchRows); `name`: the row's."""
    from megatrain_cli.dashboard import Dashboard

    r, plan, dev = planned.r, planned.plan, planned.device
    batch, seq, accum = r.train.micro_batch_size, r.train.seq_len, r.train.grad_accum
    warmup, steps, lean = run.warmup_steps(False), run.steps, plan.lean
    vocab = planned.config.get_text_config().vocab_size
    metrics = None
    try:
        rows = bench_rows(planned, steps=warmup + steps)
        t_pin = time.perf_counter()
        pinned = engine.reserve_checkpoint_buffers([(batch, seq)] * accum)  # 0 without a lean plan, and on CPU
        t_pin = time.perf_counter() - t_pin
        if pinned:
            log(f"[bench] pinned {pinned / GiB:.1f} GiB for the offloaded checkpoints in {t_pin:.1f} s")
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)

        with Dashboard(dashboard or "off", total_steps=warmup + steps, title=f"megatrain bench {planned.label}") as dash:
            def show(s: int, res, took: float) -> None:
                nonlocal metrics
                metrics = step_metrics(res, engine=engine, step=s, total=warmup + steps, lr=BENCH_LR, skipped=0,
                                       step_time=took, seq_len=seq, attended=rows.attended_per_step([s]))
                dash.update(metrics)
                spec = res.speculation
                log(f"[bench] step {s}{' (warm-up)' if s < warmup else ''}: loss {res.loss:.4f} "
                    f"norm {res.grad_norm:.3f} {took:.2f} s "
                    f"{({k: round(v, 2) for k, v in res.times.items()})}"
                    + (f" speculated {spec['speculated']} corrected {spec['corrected']}" if spec else ""))

            # `batches` (a preference bench's pairs) or the recipe's synthetic rows; FLOPs count the rows' documents.
            timed = run_timed_steps(engine, batches if batches is not None else rows, warmup=warmup, steps=steps,
                                    optimizer=run.optimizer, on_step=show)
        results, stall, wall = timed.results, timed.stall_s, timed.wall_s
        step_time = wall / steps
        tokens = batch * seq * accum
        # The chunked MLP's extra gate/up FLOPs are per micro-batch of batch x seq tokens, as it chunks them.
        chunk = lean.mlp_chunk_tokens if lean is not None and batch * seq > (lean.mlp_chunk_tokens or 0) else None
        flops, executed = streamed_step_flops(store, rows=batch * accum, seq=seq,
                                              recomputed_layers=engine.recomputed_layers(), mlp_chunk_tokens=chunk,
                                              attended=rows.attended_per_step(range(warmup, warmup + steps)))
        # On the memory-lean path the checkpoints' trips to host memory and back cross PCIe too.
        ckpt_d2h, ckpt_h2d = timed.offload_d2h_bytes, timed.offload_h2d_bytes
        split = {k: round(sum(x.times.get(k, 0.0) for x in results) / steps, 3)
                 for k in ("forward", "head", "backward", "optimizer", "wait_optimizer")}
        split["gpu_stall_on_weights"] = round(stall / steps, 3)
        e = r.engine
        notes = (("NO OPTIMIZER (forward + backward only) " if not run.optimizer else "") +
                 (f"memory-lean path: {lean.summary()}; {fmt_bytes(pinned)} pinned in {t_pin:.1f} s; checkpoint "
                  f"offload D2H {fmt_bytes(ckpt_d2h // steps)}/step, H2D {fmt_bytes(ckpt_h2d // steps)}/step, late "
                  f"gets {engine.offloader.late_gets}; allocator {allocator or 'n/a'}. " if lean is not None else "") +
                 f"kernels={engine.kernels} host_adamw={engine.optimizer.kernel} "
                 f"defer_moments={engine.optimizer.defer_moments} update_on_read={engine.update_on_read} "
                 f"checkpoint_interval={plan.checkpoint_interval} layer_slots={e.layer_slots} "
                 f"keep_blocks={len(plan.keep_blocks)} resident_layers={plan.resident_layers} "
                 f"double_buffer={e.double_buffer} "
                 f"overlap_optimizer={engine.worker is not None} speculate={e.speculate_optimizer} "
                 f"max_grad_norm={r.train.max_grad_norm} "
                 f"predicted_peak_GiB={plan.device_bytes / 2**30:.1f} "
                 f"speculated={sum(x.speculation.get('speculated', 0) for x in results)} "
                 f"corrected={sum(x.speculation.get('corrected', 0) for x in results)} "
                 f"h2d_layer_transfers={sum(v for k, v in results[-1].h2d_count.items() if k.startswith('layers.'))}")
        result = BenchResult(
            name=name, model=planned.label, batch=batch * accum, seq=seq, steps=steps, step_time_s=step_time,
            tokens_per_s=tokens / step_time, model_tflops=flops / step_time / 1e12,
            executed_tflops=executed / step_time / 1e12,
            peak_device_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0,
            host_rss_bytes=host_rss_bytes(), host_peak_rss_bytes=peak_rss_bytes(),
            bytes_per_param=store.host_bytes() / store.num_params(),
            h2d_gbps=(sum(x.h2d_bytes for x in results) + ckpt_h2d) / wall / 1e9,
            d2h_gbps=(sum(x.d2h_bytes for x in results) + ckpt_d2h) / wall / 1e9,
            overlap=(1.0 - stall / wall) if dev.type == "cuda" else None, split=split, losses=timed.losses,
            notes=notes, grad_norms=[x.grad_norm for x in results], packed=rows.describe(),
            images_per_s=rows.images_in(range(warmup, warmup + steps)) / step_time if isinstance(rows, VisionRows)
            else 0.0)
        steady = timed.steady_step_s() if run.optimizer else None
        if steady:
            result.steady_step_time_s = steady
            result.notes += (f"; steady state (timed steps 2..{steps}, each with the previous step's optimizer): "
                             f"{steady:.3f} s/step, {tokens / steady:,.0f} tokens/s, "
                             f"{flops / steady / 1e12:.1f} model TFLOPS")
    finally:
        if close:
            engine.close()
    if run.frame:
        Path(run.frame).write_text(render_frame(metrics, title=f"megatrain bench {planned.label} {batch}x{seq}",
                                                total_steps=warmup + steps))
    return result


def bench_rows(planned, *, steps: int):
    """The step's rows: a VLM's synthetic chats with images (vision_rows.py), else BenchRows."""
    r, config = planned.r, planned.config
    if getattr(config, "vision_config", None) is not None:
        return VisionRows(r, config, micro_batches=r.train.grad_accum, steps=steps)
    return BenchRows(r, config.vocab_size, steps=steps, micro_batches=r.train.grad_accum)


def render_frame(metrics, *, title: str, total_steps: int, width: int = 132) -> str:
    """The rich dashboard's frame for these metrics, as plain text (what a terminal would show)."""
    from rich.console import Console

    from megatrain_cli.dashboard import Dashboard

    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=False, color_system=None)
    dash = Dashboard("off", total_steps=total_steps, title=title, console=console)
    console.print(dash.render(metrics))
    return console.export_text()


def bench_native(planned, run, *, log=print) -> BenchResult:
    """The same model, batch and tokens entirely on the GPU: bf16 weights, HF gradient checkpointing, fused
    torch AdamW on the device, clipping at 1.0. (bf16 optimizer state: the fastest and leanest way PyTorch
    runs it natively; it needs the whole model's weights, gradients and moments in device memory.) The
    step's train.grad_accum micro-batches of train.micro_batch_size rows each, accumulated as HF's Trainer
    does (the engine's shape: one [rows x seq x vocab] logits tensor at a time, not the whole step's)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config, t = planned.config, planned.r.train
    batch, seq, warmup, steps = t.micro_batch_size * t.grad_accum, t.seq_len, run.warmup_steps(False), run.steps
    rows, accum = t.micro_batch_size, t.grad_accum
    vision = VisionRows(planned.r, config, micro_batches=accum) if getattr(config, "vision_config", None) else None
    text = config.get_text_config()
    dev = torch.device("cuda")
    with torch.device(dev):
        # HF's own attention choice, as the engine's templates make it (SDPA; eager where a family needs it,
        # e.g. Gemma 2's attention softcap, gpt-oss's sinks): the same model, not a faster relative.
        auto = AutoModelForImageTextToText if vision is not None else AutoModelForCausalLM
        model = auto.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    if getattr(config, "router_aux_loss_coef", 0):  # MoE: HF adds coef * router aux loss to out.loss, as ours does
        model.config.output_router_logits = True
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=BENCH_LR, fused=True)
    torch.cuda.reset_peak_memory_stats(dev)
    losses, t_timed = [], None
    for s in range(warmup + steps):
        if s == warmup:
            torch.cuda.synchronize(dev)
            t_timed = time.perf_counter()
        mbs = vision(s) if vision is not None else None  # ours' image rows, micro-batch by micro-batch
        mb = synthetic_batch(text.vocab_size, batch, seq, seed=s * 97) if vision is None else None
        loss = 0.0
        for a in range(accum):  # every row of a synthetic batch carries the same number of loss tokens
            part = slice(a * rows, (a + 1) * rows)
            if vision is None:
                out = model(input_ids=mb.input_ids[part].to(dev), labels=mb.labels[part].to(dev))
            else:
                ids, images = mbs[a].input_ids.to(dev), mbs[a].images
                out = model(input_ids=ids, labels=mbs[a].labels.to(dev),
                            pixel_values=images["pixel_values"].to(dev, torch.bfloat16),
                            image_grid_thw=images["image_grid_thw"].to(dev),
                            mm_token_type_ids=(ids == config.image_token_id).int())
            (out.loss / accum).backward()
            loss += float(out.loss.detach()) / accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
        log(f"[native] step {s}: loss {losses[-1]:.4f}")
    torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t_timed
    matmul = hf_matmul_params(model)  # ACTIVE parameters for an MoE model, as the engine's row counts
    flops = model_flops(matmul, batch * seq, batch, seq, text.hidden_size, text.num_hidden_layers)
    step_time = wall / steps
    res = BenchResult(
        name="native", model=planned.label, batch=batch, seq=seq, steps=steps, step_time_s=step_time,
        tokens_per_s=batch * seq / step_time, model_tflops=flops / step_time / 1e12,
        executed_tflops=flops * 4 / 3 / step_time / 1e12, peak_device_bytes=torch.cuda.max_memory_allocated(dev),
        host_rss_bytes=host_rss_bytes(), host_peak_rss_bytes=peak_rss_bytes(), losses=losses,
        notes=f"bf16 params+grads+AdamW state on the GPU, HF gradient checkpointing, fused AdamW, "
              f"{accum} micro-batch(es) of {rows} rows" + (f"; {vision.describe()}" if vision is not None else ""),
        images_per_s=vision.images_in(range(warmup, warmup + steps)) / step_time if vision is not None else 0.0)
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return res
