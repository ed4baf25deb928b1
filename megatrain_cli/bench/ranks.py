"""`megatrain bench --gpus N`: the data-parallel engine's throughput on N ranks of one host.

    megatrain bench --gpus 2 --model 7b --seq 4096 --batch 8       2 ranks, one GPU each (NCCL), started and
                                                                    watched by train/supervise.py's launcher
    torchrun --nproc-per-node 2 -m megatrain_cli bench --gpus 2 ...  the same ranks under torchrun
    megatrain bench --gpus 1 --model 7b --seq 4096 --batch 8       the single-GPU engine, same loop and batches
    megatrain bench --gpus 2 --model tiny --device cpu ...          2 CPU processes on gloo (the tests)

train.micro_batch_size (--batch) and train.grad_accum are PER RANK here: a step is N x grad_accum
micro-batches of batch x seq tokens, and rank r takes micro-batches r, r + N, ... (split_micro_batches); at
N = 1 they are exactly `megatrain bench`'s. Every rank plans with the planner (runner.plan_bench, its
device budget less NCCL_DEVICE_RESERVE), builds its 1/N shard of the host store and its engine through
train/setup.py, runs the warm-up and timed steps (loop.run_timed_steps) and measures itself; rank 0
gathers the figures (gloo) and reports: tokens/s of all ranks (global tokens per step / the slowest rank's
step time), each rank's step time, host RSS per process and their sum per parameter, peak device memory
per GPU. Host memory is checked once, by rank 0, before any rank allocates. The lean paths (long-context,
memory-lean) run on one rank only, as in `train`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from megatrain_cli.bench.loop import BenchRows, run_timed_steps
from megatrain_cli.bench.result import BenchResult
from megatrain_cli.bench.runner import DoesNotFit, build, plan_bench
from megatrain_cli.bench.settings import BenchRun
from megatrain_cli.engine.dist import init_distributed, leave_process_group, split_micro_batches
from megatrain_cli.engine.plan.step_plan import device_budget
from megatrain_cli.machine import host_rss_bytes, peak_rss_bytes, usable_cpus
from megatrain_cli.metrics.flops import streamed_step_flops
from megatrain_cli.recipe import Recipe
from megatrain_cli.train.rank import RankSpec, under_torchrun
from megatrain_cli.train.setup import resolve_device
from megatrain_cli.train.stop import SIGNALS, unblock
from megatrain_cli.train.supervise import peer_gone, spawn_ranks

GiB = 2**30
# Device memory each rank keeps out of the plan's budget for the two NCCL communicators' buffers.
NCCL_DEVICE_RESERVE = 2 * GiB


class RanksFailed(RuntimeError):
    """A spawned rank failed; the ranks and the launcher have said why. `code`: the launcher's exit code."""

    def __init__(self, code: int):
        super().__init__(f"the ranks ended with exit code {code}")
        self.code = code


def bench_ranks(r: Recipe, run: BenchRun = BenchRun(), gpus: int | None = None, log=print) -> dict | None:
    """The launcher. Under torchrun this process is one rank; otherwise gpus = 1 runs the single-GPU engine
    here and gpus > 1 starts that many ranks under train/supervise.py's launcher (signals forwarded, no rank
    outlives it, a failed rank takes the others down: RanksFailed). Returns the report where rank 0's lands
    (this process when it is rank 0 or the launcher), None on the other ranks."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if gpus is not None and gpus != world:
            raise ValueError(f"--gpus {gpus} under torchrun with WORLD_SIZE={world}")
        return run_rank(r, run, RankSpec(), log) if world > 1 else run_rank(r, run, None, log)
    world = gpus or 1
    if world == 1:
        return run_rank(r, run, None, log)
    if resolve_device(r.engine.device).type == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"--gpus {world}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    with tempfile.TemporaryDirectory(prefix="megatrain-bench-dist-") as tmp:
        report_path = Path(tmp) / "report.json"
        code = spawn_ranks(_spawned, (r, run, str(report_path)), world)
        if code != 0:
            raise RanksFailed(code)
        return json.loads(report_path.read_text())


def _spawned(rank: int, world: int, init_method: str, r: Recipe, run: BenchRun, report_path: str) -> None:
    """One spawned rank. A stop signal (forwarded by the launcher) ends it at once: a bench has nothing to
    save. A refusal is said once (every rank has rank 0's verdict), exit 3 as in one process."""
    for s in SIGNALS:  # the default actions (set: a launcher started with SIGINT ignored passes that on)
        signal.signal(s, signal.SIG_DFL)
    unblock()  # blocked by the launcher while the ranks started
    try:
        report = run_rank(r, run, RankSpec(rank, world, init_method), _log_stderr)
    except DoesNotFit as err:
        if rank == 0:
            _log_stderr(f"error: {err}")
        sys.exit(3)
    except ValueError as err:
        _log_stderr(f"error: rank {rank}: {err}")
        sys.exit(3)
    except Exception as err:
        if not peer_gone(err):
            raise
        _log_stderr(f"rank {rank}: stopped, a collective failed ({str(err).splitlines()[0][:200]})")
        sys.exit(1)
    if report is not None:
        Path(report_path).write_text(json.dumps(report))


def _log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_rank(r: Recipe, run: BenchRun, spec: RankSpec | None, log=print) -> dict | None:
    """One rank's bench (spec None: one process, the ordinary engine); the process group is torn down after."""
    if spec is None:
        return _measure(r, run, None, log)
    import torch.distributed as dist

    world = spec.world if spec.world is not None else int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, usable_cpus() // world))  # the ranks share the host (torchrun would give each 1)
    ctx = init_distributed(resolve_device(r.engine.device).type, init_method=spec.init_method, rank=spec.rank,
                           world_size=spec.world)
    try:
        report = _measure(r, run, ctx, log)
        dist.barrier(group=ctx.cpu_group)  # no rank tears the groups down while another still reads from them
        return report
    finally:
        leave_process_group()


def _measure(r: Recipe, run: BenchRun, ctx, log) -> dict | None:
    import torch.distributed as dist

    world, rank = (ctx.world, ctx.rank) if ctx is not None else (1, 0)
    say = log if rank == 0 else (lambda _: None)
    dev = ctx.device if ctx is not None else resolve_device(r.engine.device)
    cuda = dev.type == "cuda"
    budget = device_budget(r, dev)
    if budget is not None and world > 1:
        budget -= NCCL_DEVICE_RESERVE
    # Every rank plans as one process would (the whole model's host need: the ranks' shards add up to it);
    # rank 0's verdict counts, taken before any rank allocates.
    planned = plan_bench(r, run.layers, budget=budget, one_process=world == 1, log=say)
    problems = planned.problems
    if planned.plan.lean is not None and world > 1:
        problems = [*problems, f"{planned.plan.lean.label} path: not available with several ranks yet "
                               f"({planned.plan.path.removeprefix('path: ')}); use one process"]
    if ctx is not None:
        box = [problems]
        dist.broadcast_object_list(box, src=0, group=ctx.cpu_group)
        problems = box[0]
    if problems:
        raise DoesNotFit("the bench would not fit:\n  " + "\n  ".join(problems))
    warmup, steps, batch, seq, accum = (run.warmup_steps(planned.long_context), run.steps, r.train.micro_batch_size,
                                        r.train.seq_len, r.train.grad_accum)
    rows = BenchRows(r, planned.config.vocab_size, steps=warmup + steps, micro_batches=world * accum)
    built = build(planned, dist=ctx, log=say)
    store, engine = built.store, built.engine
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    norms: list[float] = []

    def batches(s: int):  # every rank draws the global batch and keeps its share, as `train` does
        return split_micro_batches(rows(s), rank, world)

    def show(s: int, res, took: float) -> None:
        norms.append(res.grad_norm)
        say(f"[bench] step {s}{' (warm-up)' if s < warmup else ''}: loss {res.loss:.4f} norm "
            f"{res.grad_norm:.3f} {took:.2f} s {({k: round(v, 2) for k, v in res.times.items()})}")
        if ctx is not None and s == warmup - 1:  # every rank starts the clock at the same moment
            engine.synchronize()
            if cuda:
                torch.cuda.synchronize(dev)
            dist.barrier(group=ctx.cpu_group)

    try:
        timed = run_timed_steps(engine, batches, warmup=warmup, steps=steps, on_step=show)
        wall, results = timed.wall_s, timed.results
        mine = {"rank": rank, "device": str(dev), "step_time_s": wall / steps,
                "steady_step_time_s": timed.steady_step_s() or 0.0,
                "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if cuda else 0,
                "host_rss_bytes": host_rss_bytes(), "host_peak_rss_bytes": peak_rss_bytes(),
                "host_tile_bytes": store.host_bytes(),
                "pinned_bytes": engine.streamer.pinned_bytes() + engine.sink.pinned_bytes(),
                "h2d_gbps": sum(x.h2d_bytes for x in results) / wall / 1e9,
                "d2h_gbps": sum(x.d2h_bytes for x in results) / wall / 1e9,
                "gpu_stall_on_weights_s": timed.stall_s / steps, "threads": torch.get_num_threads(),
                "split": {k: round(sum(x.times.get(k, 0.0) for x in results) / steps, 3)
                          for k in ("forward", "head", "backward", "optimizer", "wait_optimizer")}}
        streamer = type(engine.streamer).__name__
        recomputed = engine.recomputed_layers()
    finally:
        engine.close()
    per_rank = [mine]
    if ctx is not None:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine, group=ctx.cpu_group)
    if rank != 0:
        return None
    flops, executed = streamed_step_flops(store, rows=world * accum * batch, seq=seq, recomputed_layers=recomputed,
                                          attended=rows.attended_per_step(range(warmup, warmup + steps)))
    return report(planned, run, world, per_rank, flops=flops, executed=executed, params=store.num_params(),
                  losses=timed.losses, norms=norms, streamer=streamer, packed=rows.describe())


def report(planned, run: BenchRun, world: int, per_rank: list[dict], *, flops: float, executed: float, params: int,
           losses: list[float], norms: list[float], streamer: str, packed: str = "") -> dict:
    """Rank 0's figures for the whole run: BenchResult's fields (summed or worst over the ranks, as each
    says) plus the per-rank ones."""
    t, plan = planned.r.train, planned.plan
    step_time = max(x["step_time_s"] for x in per_rank)  # the ranks wait for each other every step
    steady = max(x["steady_step_time_s"] for x in per_rank)  # loop.TimedSteps.steady_step_s; 0: < 2 steps
    tokens = world * t.grad_accum * t.micro_batch_size * t.seq_len
    rss = sum(x["host_rss_bytes"] for x in per_rank)
    stall = max(x["gpu_stall_on_weights_s"] for x in per_rank)
    split = {**per_rank[0]["split"], "gpu_stall_on_weights": round(stall, 3)}
    result = BenchResult(
        name=f"dp x{world}", model=planned.label, batch=world * t.grad_accum * t.micro_batch_size,
        seq=t.seq_len, steps=run.steps, step_time_s=step_time, tokens_per_s=tokens / step_time,
        model_tflops=flops / step_time / 1e12, executed_tflops=executed / step_time / 1e12,
        peak_device_bytes=max(x["peak_device_bytes"] for x in per_rank),  # per GPU, the largest
        host_rss_bytes=rss, host_peak_rss_bytes=sum(x["host_peak_rss_bytes"] for x in per_rank),  # all ranks
        bytes_per_param=sum(x["host_tile_bytes"] for x in per_rank) / params,
        h2d_gbps=sum(x["h2d_gbps"] for x in per_rank) / world, d2h_gbps=sum(x["d2h_gbps"] for x in per_rank) / world,
        overlap=(1.0 - stall / step_time) if per_rank[0]["device"].startswith("cuda") else None,
        split=split, losses=losses,
        notes=f"{world} rank(s), {streamer}, batch {t.micro_batch_size}x{t.seq_len} x grad_accum {t.grad_accum} per "
              f"rank; keep_blocks={len(plan.keep_blocks)} checkpoint_interval={plan.checkpoint_interval} "
              f"max_grad_norm={t.max_grad_norm}; tokens/s over all ranks, GB/s per GPU, peak device memory of the "
              f"fullest GPU, RSS summed" +
              (f"; steady state (timed steps 2..{run.steps}): {steady:.3f} s/step, {tokens / steady:,.0f} tokens/s, "
               f"{flops / steady / 1e12:.1f} model TFLOPS" if steady else ""),
        steady_step_time_s=steady, packed=packed)
    return {**asdict(result), "world": world, "streamer": streamer, "tokens_per_s_per_gpu": tokens / step_time / world,
            "host_rss_bytes_per_param": rss / params, "params": params, "grad_norms": norms, "per_rank": per_rank}
