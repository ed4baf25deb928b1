"""`megatrain bench`: full training steps of a random-init preset on synthetic tokens, and the same
model under a baseline in the same run.

Model TFLOPS = (6 x matmul params x tokens + 6 x batch x seq^2 x hidden x layers) / step time: the
causal-attention term is half of full attention's 12bs^2hL; recompute is NOT counted; the embedding
lookup is not a matmul and is not counted (the LM head is). Executed TFLOPS adds the recomputed
forward (2 x params x tokens per recomputed layer).
"""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import time
from pathlib import Path
from dataclasses import asdict, dataclass, field

import torch

from megatrain_cli.bench.loop import BENCH_LR, run_timed_steps
from megatrain_cli.engine.plan.lean import GiB, fmt_bytes, plan_memory_lean, refusal
from megatrain_cli.engine.plan.memory import device_problem, host_problems, kept_block_ids, make_plan, resolve_keep_blocks
from megatrain_cli.engine.schedule import blocks
from megatrain_cli.engine.step import Engine, MicroBatch
from megatrain_cli.machine import host_rss_bytes, peak_rss_bytes
from megatrain_cli.metrics.flops import model_flops
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.models.loader import build_store
from megatrain_cli.presets import PRESETS
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.metrics.flops import streamed_step_flops
from megatrain_cli.metrics.step import step_metrics
from megatrain_cli.store.tiles import HostStore


def parse_tokens(text: str | int) -> int:
    """'512k' -> 524288, '4096' -> 4096."""
    s = str(text).strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def bench_config(preset: str, seq: int, layers: int | None = None):
    """The HF config of `preset` for a bench at `seq` tokens; `layers` overrides num_hidden_layers (the same
    layer shape, fewer or more of them: a truncated model times a long sequence's layers cheaply)."""
    p = PRESETS[preset]
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        p = dataclasses.replace(p, num_hidden_layers=layers)
    return p.hf_config(vocab_size=p.vocab_size or 1024, max_position_embeddings=max(seq, 4096))


def model_label(preset: str, layers: int | None) -> str:
    """'7b', or '7b[2 of 28 layers]' when the bench overrides the preset's layer count."""
    full = PRESETS[preset].num_hidden_layers
    return preset if layers is None or layers == full else f"{preset}[{layers} of {full} layers]"


def causal_lm_flops(matmul_params: int, batch: int, seq: int, hidden: int, layers: int) -> float:
    return model_flops(matmul_params, batch * seq, batch, seq, hidden, layers)


class DoesNotFit(RuntimeError):
    """The memory plan does not fit the machine (raised before anything big is allocated)."""


@dataclass
class BenchResult:
    name: str
    model: str
    batch: int
    seq: int
    steps: int
    step_time_s: float
    tokens_per_s: float
    model_tflops: float
    executed_tflops: float
    peak_device_bytes: int
    host_rss_bytes: int
    host_peak_rss_bytes: int = 0
    bytes_per_param: float = 0.0
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    overlap: float | None = None
    split: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    notes: str = ""
    # A run of fewer layers than the preset's (--layers) on the long-context path: the full model's step,
    # extrapolated from the measured per-layer times, and its planned memory (bench_long.extrapolate).
    extrapolated: dict = field(default_factory=dict)
    # Steady state: the mean of timed steps 2..N, each carrying the previous step's optimizer work
    # (bench_loop.TimedSteps.steady_step_s); 0 when fewer than 2 timed steps.
    steady_step_time_s: float = 0.0


def synthetic_batch(vocab: int, batch: int, seq: int, seed: int) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return MicroBatch(ids, ids.clone())


def choose_bench_plan(plan_args: dict, keep_activations, device_budget: int | None, dev: torch.device, *,
                      reused_store: bool, memory_fallback: bool, log=print):
    """(short-context plan, kept blocks, memory-lean plan or None), from the shape alone: a run that cannot
    fit is refused (DoesNotFit) before the host store (up to 14 bytes per parameter) is allocated."""
    keep = resolve_keep_blocks(keep_activations, device_budget, **plan_args)
    plan = make_plan(**plan_args, keep_blocks=keep)
    log(plan.render())
    # The host check only before the store exists (after, MemAvailable no longer has its bytes).
    problems = [] if reused_store else host_problems(plan)
    too_big = device_problem(plan, device=dev, device_budget=device_budget)
    if too_big and not problems and memory_fallback:
        adapter, dtype = plan_args["adapter"], plan_args["compute_dtype"]
        lean = plan_memory_lean(adapter, seq_len=plan_args["seq_len"], micro_batch_size=plan_args["micro_batch_size"],
                                grad_accum=plan_args["grad_accum"], dtype=dtype, device_type=dev.type,
                                device_budget=device_budget, grad_slabs=plan_args["grad_slabs"],
                                layer_slots=plan_args["layer_slots"], loss_chunk_tokens=plan_args["loss_chunk_tokens"],
                                store_bytes_to_come=0 if reused_store else
                                HostStore(adapter, dtype, allocate=False).host_bytes())
        log(lean.render())
        if not lean.fits:
            raise DoesNotFit(f"the bench would not fit:\n  {too_big}\n  memory-lean path: {refusal(lean)}")
        log(f"[bench] the plan above needs about {fmt_bytes(plan.device_total)} of the {fmt_bytes(device_budget)} "
            f"device budget: memory-lean path ({lean.summary()})")
        return plan, keep, lean
    if too_big:
        problems.append(too_big)
    if problems:
        raise DoesNotFit("the bench would not fit:\n  " + "\n  ".join(problems))
    return plan, keep, None


def bench_engine(preset: str, batch: int, seq: int, steps: int, *, grad_accum: int = 1,
                 checkpoint_interval: int = 4, layer_slots: int = 2, double_buffer: bool = True,
                 overlap_optimizer: bool = True, speculate: bool = True, keep_activations: int | str = "auto",
                 device_budget: int | None = None, grad_slabs: int = 12, loss_chunk_tokens: int = 8192,
                 max_grad_norm: float | None = 1.0, device: str = "cuda", warmup: int = 1, log=print,
                 dashboard=None, frame_path: str | None = None, store=None, optimizer: bool = True,
                 kernels: str = "auto", memory_fallback: bool = True, layers: int | None = None,
                 device_cast: bool = False, update_on_read: bool = True) -> BenchResult:
    """Warm-up + timed steps of the engine. `dashboard` (a Dashboard) gets every step's metrics;
    `frame_path` receives the rendered text of the last step's rich frame; `store` reuses a host
    store built earlier (same preset), so several variants share one initialisation. `optimizer=False`
    times forward + backward alone (the reference for "the optimizer costs < 5% of the step").

    `device_budget`: the device bytes the plan must fit (default: the CUDA device's memory; on CPU none
    unless given, and then it drives the plan as on a GPU). When the plan does not fit it for device
    memory alone and `memory_fallback`, the step takes the memory-lean path (long_context.plan_memory_lean:
    checkpoint interval 1, a smaller loss chunk, the MLP tiled where that helps, checkpoints in pinned host
    memory as needed); DoesNotFit when that plan does not fit either (both plans' numbers), or for host
    memory, or without the fallback. `layers`: run that many layers instead of the preset's (bench_config);
    the result's model says so."""
    config = bench_config(preset, seq, layers)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = TrainConfig(steps=steps + warmup, lr=1e-5, max_grad_norm=max_grad_norm, grad_accum=grad_accum,
                      micro_batch_size=batch, seq_len=seq)
    if device_budget is None and dev.type == "cuda":
        device_budget = torch.cuda.get_device_properties(dev).total_memory
    plan_args = dict(adapter=ModelAdapter(config), compute_dtype=dtype, micro_batch_size=batch, seq_len=seq,
                     grad_accum=grad_accum, checkpoint_interval=checkpoint_interval, grad_slabs=grad_slabs,
                     layer_slots=layer_slots, loss_chunk_tokens=loss_chunk_tokens, device_type=dev.type,
                     device_cast=device_cast)
    plan, keep, lean = choose_bench_plan(plan_args, keep_activations, device_budget, dev, reused_store=store is not None,
                                         memory_fallback=memory_fallback, log=log)
    alloc_conf = ""
    if lean is not None:
        from megatrain_cli.bench.long_context import _expandable_segments

        alloc_conf = _expandable_segments(dev)  # multi-GiB activations of varying size fragment the allocator
        checkpoint_interval, keep, loss_chunk_tokens = lean.checkpoint_interval, 0, lean.loss_chunk_tokens
    t0 = time.perf_counter()
    if store is None:
        store = build_store(config, dtype, seed=0)
    log(f"[bench] host store ready: {store.num_params() / 1e9:.2f} B params, "
        f"{store.host_bytes() / 2**30:.1f} GiB, init {time.perf_counter() - t0:.1f} s")
    n_blocks = len(blocks(config.num_hidden_layers, checkpoint_interval))
    engine = Engine(store, cfg, device=dev, checkpoint_interval=checkpoint_interval,
                    loss_chunk_tokens=loss_chunk_tokens, layer_slots=layer_slots, grad_slabs=grad_slabs,
                    double_buffer=double_buffer, overlap_optimizer=overlap_optimizer and optimizer, speculate=speculate,
                    keep_blocks=kept_block_ids(n_blocks, keep), kernels=kernels, long_context=lean,
                    device_cast=device_cast, update_on_read=update_on_read)
    t_pin = time.perf_counter()
    pinned = engine.reserve_checkpoint_buffers([(batch, seq)] * grad_accum)  # 0 without a plan, and on CPU
    t_pin = time.perf_counter() - t_pin
    if pinned:
        log(f"[bench] pinned {pinned / GiB:.1f} GiB for the offloaded checkpoints in {t_pin:.1f} s")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    metrics = None

    def show(s: int, res, took: float) -> None:
        nonlocal metrics
        metrics = step_metrics(res, engine=engine, step=s, total=warmup + steps, lr=BENCH_LR, skipped=0,
                               step_time=took, seq_len=seq)
        if dashboard is not None:
            dashboard.update(metrics)
        spec = res.speculation
        log(f"[bench] step {s}{' (warm-up)' if s < warmup else ''}: loss {res.loss:.4f} "
            f"norm {res.grad_norm:.3f} {took:.2f} s "
            f"{({k: round(v, 2) for k, v in res.times.items()})}"
            + (f" speculated {spec['speculated']} corrected {spec['corrected']}" if spec else ""))

    timed = run_timed_steps(
        engine, lambda s: [synthetic_batch(config.vocab_size, batch, seq, seed=s * 97 + k) for k in range(grad_accum)],
        warmup=warmup, steps=steps, optimizer=optimizer, on_step=show)
    results, losses, stall, wall = timed.results, timed.losses, timed.stall_s, timed.wall_s
    off = engine.offloader
    step_time = wall / steps
    tokens = batch * seq * grad_accum
    recomputed_layers = engine.recomputed_layers()
    # The tiled MLP's extra gate/up FLOPs are per micro-batch of batch x seq tokens, as it tiles them.
    tile = lean.mlp_tile_tokens if lean is not None and batch * seq > (lean.mlp_tile_tokens or 0) else None
    flops, executed = streamed_step_flops(store, rows=batch * grad_accum, seq=seq, recomputed_layers=recomputed_layers,
                                          mlp_tile_tokens=tile)
    # On the memory-lean path the checkpoints' trips to host memory and back cross PCIe too.
    ckpt_d2h, ckpt_h2d = timed.offload_d2h_bytes, timed.offload_h2d_bytes
    h2d = (sum(r.h2d_bytes for r in results) + ckpt_h2d) / wall / 1e9
    d2h = (sum(r.d2h_bytes for r in results) + ckpt_d2h) / wall / 1e9
    split = {k: round(sum(r.times.get(k, 0.0) for r in results) / steps, 3)
             for k in ("forward", "head", "backward", "optimizer", "wait_optimizer")}
    split["gpu_stall_on_weights"] = round(stall / steps, 3)
    peak_dev = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    result = BenchResult(
        name="megatrain", model=model_label(preset, layers), batch=batch * grad_accum, seq=seq, steps=steps,
        step_time_s=step_time, tokens_per_s=tokens / step_time, model_tflops=flops / step_time / 1e12,
        executed_tflops=executed / step_time / 1e12, peak_device_bytes=peak_dev,
        host_rss_bytes=host_rss_bytes(), host_peak_rss_bytes=peak_rss_bytes(),
        bytes_per_param=store.host_bytes() / store.num_params(), h2d_gbps=h2d, d2h_gbps=d2h,
        overlap=(1.0 - stall / wall) if dev.type == "cuda" else None, split=split, losses=losses,
        notes=("NO OPTIMIZER (forward + backward only) " if not optimizer else "") +
              (f"memory-lean path: {lean.summary()}; the short-context plan needs about "
               f"{fmt_bytes(plan.device_total)}; {fmt_bytes(pinned)} pinned in {t_pin:.1f} s; checkpoint offload "
               f"D2H {fmt_bytes(ckpt_d2h // steps)}/step, H2D {fmt_bytes(ckpt_h2d // steps)}/step, late gets "
               f"{off.late_gets}; allocator {alloc_conf or 'n/a'}. " if lean is not None else "") +
              f"kernels={engine.kernels} host_adamw={engine.optimizer.kernel} "
              f"defer_moments={engine.optimizer.defer_moments} device_cast={device_cast} "
              f"update_on_read={engine.update_on_read} "
              f"checkpoint_interval={checkpoint_interval} layer_slots={layer_slots} keep_blocks={keep} "
              f"double_buffer={double_buffer} overlap_optimizer={overlap_optimizer} speculate={speculate} "
              f"max_grad_norm={max_grad_norm} "
              f"predicted_peak_GiB={(lean.predicted_peak if lean else plan.device_total) / 2**30:.1f} "
              f"speculated={sum(r.speculation.get('speculated', 0) for r in results)} "
              f"corrected={sum(r.speculation.get('corrected', 0) for r in results)} "
              f"h2d_layer_transfers={sum(v for k, v in results[-1].h2d_count.items() if k.startswith('layers.'))}")
    steady = timed.steady_step_s() if optimizer else None
    if steady:
        result.steady_step_time_s = steady
        result.notes += (f"; steady state (timed steps 2..{steps}, each with the previous step's optimizer): "
                         f"{steady:.3f} s/step, {tokens / steady:,.0f} tokens/s, {flops / steady / 1e12:.1f} model TFLOPS")
    if frame_path:
        Path(frame_path).write_text(render_frame(metrics, title=f"megatrain bench {preset} {batch}x{seq}",
                                                 total_steps=warmup + steps))
    engine.close()
    del engine, store
    gc.collect()
    return result


def render_frame(metrics, *, title: str, total_steps: int, width: int = 132) -> str:
    """The rich dashboard's frame for these metrics, as plain text (what a terminal would show)."""
    from rich.console import Console

    from megatrain_cli.dashboard import Dashboard

    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=False, color_system=None)
    dash = Dashboard("off", total_steps=total_steps, title=title, console=console)
    console.print(dash.render(metrics))
    return console.export_text()


def bench_native(preset: str, batch: int, seq: int, steps: int, *, warmup: int = 1, log=print,
                 layers: int | None = None) -> BenchResult:
    """The same model entirely on the GPU: bf16 weights, HF gradient checkpointing, fused torch AdamW
    on the device. (bf16 optimizer state: the fastest and leanest way PyTorch runs it natively.)"""
    from transformers import AutoModelForCausalLM

    config = bench_config(preset, seq, layers)
    dev = torch.device("cuda")
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    torch.cuda.reset_peak_memory_stats(dev)
    losses, t_timed = [], None
    for s in range(warmup + steps):
        if s == warmup:
            torch.cuda.synchronize(dev)
            t_timed = time.perf_counter()
        mb = synthetic_batch(config.vocab_size, batch, seq, seed=s * 97)
        out = model(input_ids=mb.input_ids.to(dev), labels=mb.labels.to(dev))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        log(f"[native] step {s}: loss {losses[-1]:.4f}")
    torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t_timed
    n_params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    matmul = n_params - emb + (emb if config.tie_word_embeddings else 0)
    flops = causal_lm_flops(matmul, batch, seq, config.hidden_size, config.num_hidden_layers)
    step_time = wall / steps
    res = BenchResult(
        name="native", model=model_label(preset, layers), batch=batch, seq=seq, steps=steps, step_time_s=step_time,
        tokens_per_s=batch * seq / step_time, model_tflops=flops / step_time / 1e12,
        executed_tflops=flops * 4 / 3 / step_time / 1e12, peak_device_bytes=torch.cuda.max_memory_allocated(dev),
        host_rss_bytes=host_rss_bytes(), host_peak_rss_bytes=peak_rss_bytes(), losses=losses,
        notes="bf16 params+grads+AdamW state on the GPU, HF gradient checkpointing, fused AdamW")
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return res


def format_table(results: list[BenchResult]) -> str:
    mw = max([6, *(len(r.model) for r in results)])  # '7b[2 of 28 layers]' widens the column
    head = (f"{'run':<10} {'model':<{mw}} {'tokens':>9} {'step s':>7} {'tok/s':>8} {'model TF':>9} {'exec TF':>8} "
            f"{'H2D GB/s':>9} {'D2H GB/s':>9} {'overlap':>8} {'dev GiB':>8} {'RSS GiB':>8} {'B/param':>8}")
    lines = [head]
    for r in results:
        f = lambda v, fmt: "n/a" if v is None else format(v, fmt)  # noqa: E731
        lines.append(f"{r.name:<10} {r.model:<{mw}} {r.batch}x{r.seq:<6} {r.step_time_s:7.2f} {r.tokens_per_s:8.0f} "
                     f"{r.model_tflops:9.1f} {r.executed_tflops:8.1f} {f(r.h2d_gbps, '9.1f'):>9} "
                     f"{f(r.d2h_gbps, '9.1f'):>9} {f(r.overlap, '8.1%'):>8} {r.peak_device_bytes / 2**30:8.1f} "
                     f"{r.host_rss_bytes / 2**30:8.1f} {r.bytes_per_param:8.1f}")
    if len(results) > 1:  # ours against each baseline
        ours = results[0]
        for base in results[1:]:
            r = ours
            if base.tokens_per_s > 0:
                lines.append(f"{r.name} / {base.name}: {r.tokens_per_s / base.tokens_per_s:.2f}x tokens/s")
            else:
                lines.append(f"{r.name} / {base.name}: {base.name} produced no result ({base.notes})")
    return "\n".join(lines)


def to_json(results: list[BenchResult]) -> str:
    return json.dumps([asdict(r) for r in results], indent=2)
