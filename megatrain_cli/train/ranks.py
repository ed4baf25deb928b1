"""`megatrain train RECIPE --gpus N`: data-parallel training on N ranks (issue #11).

Two ways in, one code path per rank (trainer._loop with a DistContext):

    megatrain train RECIPE --gpus N            this module spawns N processes (torch.multiprocessing,
                                               'spawn'); they meet through a file in a temp directory
    torchrun --nproc-per-node N -m megatrain_cli train RECIPE
                                               torchrun's RANK / WORLD_SIZE / LOCAL_RANK (env://)

On CUDA each rank takes the GPU LOCAL_RANK and NCCL (multicast off); on the CPU gloo. Each rank holds
1/N of every tile (store/sharded.py) and takes micro-batches rank, rank + N, ... of every step: every
rank draws the same global batch from the same data stream, so train.grad_accum must be a multiple of
N (>= N). Rank 0 alone prints the dashboard, writes metrics.jsonl and exports final/ (the masters
gathered tile by tile into a whole host store on rank 0, then export.export_hf). Checkpoints are
written per shard (checkpoint_sharded.save_sharded_checkpoint) and resume on any N, one process
included: each rank gathers its range from the shard files that hold it (checkpoint_sharded.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain_cli.recipe import Recipe


@dataclass(frozen=True)
class RankSpec:
    """How this process joins: rank / world / init_method None = torchrun's environment (env://)."""

    rank: int | None = None
    world: int | None = None
    init_method: str | None = None


def world_problem(r: Recipe, world: int) -> str | None:
    """Why the recipe cannot run on `world` ranks (None: it can)."""
    a = r.train.grad_accum
    if a < world or a % world:
        return (f"--gpus {world}: each rank takes its share of every step's micro-batches, so train.grad_accum "
                f"({a}) must be a multiple of {world}; use train.grad_accum={world * max(1, -(-a // world))} "
                f"(and a micro_batch_size {world}x smaller to keep the batch)")
    return None


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def train(r: Recipe, gpus: int | None = None, *, dry_run: bool = False, force: bool = False) -> int:
    """The CLI's entry: one process, N spawned ranks, or this rank of a torchrun job."""
    from megatrain_cli.train.loop import run_training

    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if gpus is not None and gpus != world:
            print(f"error: --gpus {gpus} under torchrun with WORLD_SIZE={world}", file=sys.stderr)
            return 2
        if world > 1:
            problem = world_problem(r, world)
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                return 2
            if dry_run:
                return run_training(r, dry_run=True, force=force) if int(os.environ["RANK"]) == 0 else 0
            return run_rank(r, RankSpec(), force=force)
    n = 1 if gpus is None else gpus
    if n < 1:
        print(f"error: --gpus must be >= 1, got {n}", file=sys.stderr)
        return 2
    if n == 1:
        return run_training(r, dry_run=dry_run, force=force)
    problem = world_problem(r, n)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if dry_run:
        return run_training(r, dry_run=True, force=force)
    return spawn(r, n, force=force)


def run_rank(r: Recipe, spec: RankSpec, *, force: bool = False) -> int:
    """One rank's whole run; the process group is torn down at the end."""
    import torch.distributed as dist

    from megatrain_cli.engine.dist import leave_process_group
    from megatrain_cli.train.loop import run_training

    try:
        return run_training(r, force=force, dist=spec)
    finally:
        if dist.is_initialized():
            leave_process_group()


def _child(r: Recipe, rank: int, world: int, init_method: str, force: bool) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    sys.exit(run_rank(r, RankSpec(rank, world, init_method), force=force))


def spawn(r: Recipe, world: int, *, force: bool = False) -> int:
    """Run `world` ranks as child processes; the exit code is rank 0's, or the first failing rank's."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megatrain-dist-") as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [ctx.Process(target=_child, args=(r, rank, world, init, force)) for rank in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            while True:
                try:
                    p.join()
                    break
                except KeyboardInterrupt:  # the ranks got it too: they checkpoint and exit; wait for them
                    continue
    codes = [p.exitcode if p.exitcode is not None and p.exitcode >= 0 else 1 for p in procs]
    return codes[0] if all(c == codes[0] for c in codes) else next(c for c in codes if c != 0)


# ---------------------------------------------------------------- used by trainer._loop on each rank
def start_rank(spec: RankSpec, r: Recipe, device: torch.device, long_ctx):
    """Join the process group (the DistContext the engine takes), after the checks every rank makes."""
    from megatrain_cli.engine.dist import init_distributed
    from megatrain_cli.train.loop import TrainingError

    if long_ctx is not None:
        raise TrainingError(f"{long_ctx.label} path: not available with several ranks yet (train.seq_len "
                            f"{r.train.seq_len}); use one process", 2)
    world = spec.world if spec.world is not None else int(os.environ["WORLD_SIZE"])
    problem = world_problem(r, world)
    if problem:
        raise TrainingError(problem, 2)
    return init_distributed(device.type, init_method=spec.init_method, rank=spec.rank, world_size=spec.world)


def agree_on_signal(ctx, signum: int | None) -> int | None:
    """A signal any rank caught, on every rank (one small all-reduce per step), so all stop together."""
    import torch.distributed as dist

    t = torch.tensor([signum or 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    return int(t.item()) or None


def export_sharded(store, out_dir, *, dtype: torch.dtype, tokenizer=None) -> Path | None:
    """export.export_hf of a sharded store (a collective): the masters are gathered tile by tile into a
    whole host store on rank 0 (the model in fp32 on that rank's host, masters only touched), which
    rank 0 exports. Returns the path on rank 0, None elsewhere."""
    import torch.distributed as dist

    from megatrain_cli.checkpoint import export_hf
    from megatrain_cli.store.tiles import HostStore

    whole = HostStore(store.adapter, store.compute_dtype) if store.rank == 0 else None
    for name in store.layouts:
        full = store.gather_tile(name)
        if whole is not None:
            whole.tiles[name].master.copy_(full)
    path = export_hf(whole, out_dir, dtype=dtype, tokenizer=tokenizer) if whole is not None else None
    dist.barrier(group=store.cpu_group)
    return path
