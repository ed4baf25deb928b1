"""`megatrain bench --gpus N`: the data-parallel engine's throughput on N ranks of one host (issue #11).

    megatrain bench --gpus 2 --model 7b --seq 4096 --batch 8       spawns 2 ranks, one GPU each (NCCL)
    torchrun --nproc-per-node 2 -m megatrain_cli bench --gpus 2 ...  the same ranks under torchrun
    megatrain bench --gpus 1 --model 7b --seq 4096 --batch 8       the single-GPU engine, same loop and batches
    megatrain bench --gpus 2 --model tiny --device cpu ...          2 CPU processes on gloo (the tests)

`--batch` is PER GPU: a step is N x grad_accum micro-batches of batch x seq tokens, and rank r takes
micro-batches r, r + N, ... (split_micro_batches); at N = 1 they are exactly `megatrain bench`'s. Every rank
builds the random-init preset sharded (build_sharded_store: the weights one process would draw), runs the
warm-up and timed steps with the optimizer (bench_loop.run_timed_steps; clipping at 1.0 by default) and
measures itself; rank 0 gathers the figures (gloo) and reports: tokens/s of all ranks (global tokens per
step / the slowest rank's step time), each rank's step time, host RSS per process and their sum per
parameter, peak device memory per GPU. Host memory is checked once, by rank 0, before any rank allocates.
Multicast / NVLS stays off in every launcher (distributed.MULTICAST_OFF).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatrain_cli.bench.short import (BenchResult, DoesNotFit, bench_config, choose_bench_plan, model_label, synthetic_batch)
from megatrain_cli.bench.loop import BENCH_LR, run_timed_steps
from megatrain_cli.train.rank import RankSpec, under_torchrun
from megatrain_cli.engine.dist import (init_distributed, leave_process_group, multicast_off,
                                              split_micro_batches)
from megatrain_cli.engine.plan.memory import host_problems, kept_block_ids, make_plan
from megatrain_cli.engine.schedule import blocks
from megatrain_cli.engine.step import Engine
from megatrain_cli.machine import host_rss_bytes, peak_rss_bytes
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.models.loader import build_store
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.metrics.flops import streamed_step_flops
from megatrain_cli.models.loader import build_sharded_store

GiB = 2**30
# Device memory each rank keeps out of the plan's budget for the two NCCL communicators' buffers.
NCCL_DEVICE_RESERVE = 2 * GiB


@dataclass(frozen=True)
class DistBench:
    model: str = "7b"
    batch: int = 8  # sequences per micro-batch, per GPU
    seq: int = 4096
    steps: int = 3
    warmup: int = 1
    grad_accum: int = 1  # micro-batches per rank per step
    layers: int | None = None  # bench_config: fewer (or more) layers of the preset's shape
    checkpoint_interval: int = 4
    layer_slots: int = 2
    grad_slabs: int = 12
    keep_activations: int | str = "auto"
    max_grad_norm: float | None = 1.0
    loss_chunk_tokens: int = 8192
    device: str = "cuda"
    kernels: str = "auto"
    overlap: bool = True  # False: the synchronous reference path on CUDA (distributed.py), an ablation


def bench_dist(args: DistBench, gpus: int | None = None, log=print) -> dict | None:
    """The launcher. Under torchrun this process is one rank; otherwise gpus = 1 runs the single-GPU engine
    here and gpus > 1 spawns that many ranks. Returns the report where rank 0's lands (this process when it
    is rank 0 or the launcher), None on the other ranks."""
    multicast_off()
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if gpus is not None and gpus != world:
            raise ValueError(f"--gpus {gpus} under torchrun with WORLD_SIZE={world}")
        return run_rank(args, RankSpec(), log) if world > 1 else run_rank(args, None, log)
    world = gpus or 1
    if world == 1:
        return run_rank(args, None, log)
    if args.device == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"--gpus {world}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="megatrain-bench-dist-") as tmp:
        mp.spawn(_spawned, args=(world, args, f"file://{Path(tmp) / 'rendezvous'}", str(Path(tmp) / "report.json")),
                 nprocs=world, join=True)
        return json.loads((Path(tmp) / "report.json").read_text())


def _spawned(rank: int, world: int, args: DistBench, init_method: str, report_path: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    report = run_rank(args, RankSpec(rank, world, init_method), _log_stderr)
    if report is not None:
        Path(report_path).write_text(json.dumps(report))


def _log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_rank(args: DistBench, spec: RankSpec | None, log=print) -> dict | None:
    """One rank's bench (spec None: one process, the ordinary engine); the process group is torn down after."""
    if spec is None:
        return _measure(args, None, log)
    import torch.distributed as dist

    world = spec.world if spec.world is not None else int(os.environ["WORLD_SIZE"])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cpus // world))  # the ranks share the host (torchrun would give each 1)
    ctx = init_distributed(args.device, init_method=spec.init_method, rank=spec.rank, world_size=spec.world)
    ctx.overlap = args.overlap
    try:
        report = _measure(args, ctx, log)
        dist.barrier(group=ctx.cpu_group)  # no rank tears the groups down while another still reads from them
        return report
    finally:
        leave_process_group()


def _measure(args: DistBench, ctx, log) -> dict | None:
    import torch.distributed as dist

    world, rank = (ctx.world, ctx.rank) if ctx is not None else (1, 0)
    say = log if rank == 0 else (lambda _: None)
    config = bench_config(args.model, args.seq, args.layers)
    dev = ctx.device if ctx is not None else torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    budget = None
    if cuda:
        budget = torch.cuda.get_device_properties(dev).total_memory - (NCCL_DEVICE_RESERVE if world > 1 else 0)
    plan_args = dict(adapter=ModelAdapter(config), compute_dtype=dtype, micro_batch_size=args.batch,
                     seq_len=args.seq, grad_accum=args.grad_accum, checkpoint_interval=args.checkpoint_interval,
                     grad_slabs=args.grad_slabs, layer_slots=args.layer_slots,
                     loss_chunk_tokens=args.loss_chunk_tokens, device_type=dev.type)
    # The whole model's host need, checked once before any rank allocates (the ranks' shards add up to it).
    problems = host_problems(make_plan(**plan_args)) if rank == 0 else []
    if ctx is not None:
        box = [problems]
        dist.broadcast_object_list(box, src=0, group=ctx.cpu_group)
        problems = box[0]
    if problems:
        raise DoesNotFit("the bench would not fit:\n  " + "\n  ".join(problems))
    _, keep, _ = choose_bench_plan(plan_args, args.keep_activations, budget, dev, reused_store=True,
                                   memory_fallback=False, log=say)
    t0 = time.perf_counter()
    if ctx is None:
        store = build_store(config, dtype, seed=0)
    else:
        store = build_sharded_store(config, dtype, rank, world, seed=0, cpu_group=ctx.cpu_group)
    say(f"[bench] host store ready: {store.num_params() / 1e9:.2f} B params, {store.host_bytes() / GiB:.1f} GiB "
        f"on rank 0 of {world}, init {time.perf_counter() - t0:.1f} s")
    n_blocks = len(blocks(config.num_hidden_layers, args.checkpoint_interval))
    cfg = TrainConfig(steps=args.steps + args.warmup, lr=BENCH_LR, max_grad_norm=args.max_grad_norm,
                      grad_accum=world * args.grad_accum, micro_batch_size=args.batch, seq_len=args.seq)
    engine = Engine(store, cfg, device=dev, checkpoint_interval=args.checkpoint_interval,
                    loss_chunk_tokens=args.loss_chunk_tokens, layer_slots=args.layer_slots,
                    grad_slabs=args.grad_slabs, overlap_optimizer=True, keep_blocks=kept_block_ids(n_blocks, keep),
                    kernels=args.kernels, **({} if ctx is None else {"dist": ctx}))
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    norms: list[float] = []

    def batches(s: int):
        seeds = split_micro_batches([s * 97 + k for k in range(world * args.grad_accum)], rank, world)
        return [synthetic_batch(config.vocab_size, args.batch, args.seq, seed) for seed in seeds]

    def show(s: int, res, took: float) -> None:
        norms.append(res.grad_norm)
        say(f"[bench] step {s}{' (warm-up)' if s < args.warmup else ''}: loss {res.loss:.4f} norm "
            f"{res.grad_norm:.3f} {took:.2f} s {({k: round(v, 2) for k, v in res.times.items()})}")
        if ctx is not None and s == args.warmup - 1:  # every rank starts the clock at the same moment
            engine.synchronize()
            if cuda:
                torch.cuda.synchronize(dev)
            dist.barrier(group=ctx.cpu_group)

    timed = run_timed_steps(engine, batches, warmup=args.warmup, steps=args.steps, on_step=show)
    wall, results = timed.wall_s, timed.results
    mine = {"rank": rank, "device": str(dev), "step_time_s": wall / args.steps,
            "steady_step_time_s": timed.steady_step_s() or 0.0,
            "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if cuda else 0,
            "host_rss_bytes": host_rss_bytes(), "host_peak_rss_bytes": peak_rss_bytes(),
            "host_tile_bytes": store.host_bytes(),
            "pinned_bytes": engine.streamer.pinned_bytes() + engine.sink.pinned_bytes(),
            "h2d_gbps": sum(r.h2d_bytes for r in results) / wall / 1e9,
            "d2h_gbps": sum(r.d2h_bytes for r in results) / wall / 1e9,
            "gpu_stall_on_weights_s": timed.stall_s / args.steps, "threads": torch.get_num_threads(),
            "split": {k: round(sum(r.times.get(k, 0.0) for r in results) / args.steps, 3)
                      for k in ("forward", "head", "backward", "optimizer", "wait_optimizer")}}
    streamer = type(engine.streamer).__name__
    recomputed = engine.recomputed_layers()
    engine.close()
    per_rank = [mine]
    if ctx is not None:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine, group=ctx.cpu_group)
    if rank != 0:
        return None
    rows = world * args.grad_accum * args.batch
    flops, executed = streamed_step_flops(store, rows=rows, seq=args.seq, recomputed_layers=recomputed)
    return report(args, world, per_rank, flops=flops, executed=executed, params=store.num_params(),
                  losses=timed.losses, norms=norms, streamer=streamer, keep=keep)


def report(args: DistBench, world: int, per_rank: list[dict], *, flops: float, executed: float, params: int,
           losses: list[float], norms: list[float], streamer: str, keep: int) -> dict:
    """Rank 0's figures for the whole run: BenchResult's fields (summed or worst over the ranks, as each
    says) plus the per-rank ones."""
    step_time = max(r["step_time_s"] for r in per_rank)  # the ranks wait for each other every step
    steady = max(r["steady_step_time_s"] for r in per_rank)  # bench_loop.TimedSteps.steady_step_s; 0: < 2 steps
    tokens = world * args.grad_accum * args.batch * args.seq
    rss = sum(r["host_rss_bytes"] for r in per_rank)
    stall = max(r["gpu_stall_on_weights_s"] for r in per_rank)
    split = {**per_rank[0]["split"], "gpu_stall_on_weights": round(stall, 3)}
    result = BenchResult(
        name=f"dp x{world}", model=model_label(args.model, args.layers), batch=world * args.grad_accum * args.batch,
        seq=args.seq, steps=args.steps, step_time_s=step_time, tokens_per_s=tokens / step_time,
        model_tflops=flops / step_time / 1e12, executed_tflops=executed / step_time / 1e12,
        peak_device_bytes=max(r["peak_device_bytes"] for r in per_rank),  # per GPU, the largest
        host_rss_bytes=rss, host_peak_rss_bytes=sum(r["host_peak_rss_bytes"] for r in per_rank),  # all ranks
        bytes_per_param=sum(r["host_tile_bytes"] for r in per_rank) / params,
        h2d_gbps=sum(r["h2d_gbps"] for r in per_rank) / world, d2h_gbps=sum(r["d2h_gbps"] for r in per_rank) / world,
        overlap=(1.0 - stall / step_time) if per_rank[0]["device"].startswith("cuda") else None,
        split=split, losses=losses,
        notes=f"{world} rank(s), {streamer}, batch {args.batch}x{args.seq} x grad_accum {args.grad_accum} per rank; "
              f"keep_blocks={keep} checkpoint_interval={args.checkpoint_interval} max_grad_norm={args.max_grad_norm}; "
              f"tokens/s over all ranks, GB/s per GPU, peak device memory of the fullest GPU, RSS summed" +
              (f"; steady state (timed steps 2..{args.steps}): {steady:.3f} s/step, {tokens / steady:,.0f} tokens/s, "
               f"{flops / steady / 1e12:.1f} model TFLOPS" if steady else ""),
        steady_step_time_s=steady)
    return {**asdict(result), "world": world, "streamer": streamer, "tokens_per_s_per_gpu": tokens / step_time / world,
            "host_rss_bytes_per_param": rss / params, "params": params, "grad_norms": norms, "per_rank": per_rank}
