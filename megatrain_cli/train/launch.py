"""`megatrain train RECIPE --gpus N`: data-parallel training on N ranks (issue #11).

Two ways in, one code path per rank (train.loop._loop with a DistContext):

    megatrain train RECIPE --gpus N            this module spawns N processes (torch.multiprocessing,
                                               'spawn'); they meet through a file in a temp directory
    torchrun --nproc-per-node N -m megatrain_cli train RECIPE
                                               torchrun's RANK / WORLD_SIZE / LOCAL_RANK (env://)

On CUDA each rank takes the GPU LOCAL_RANK and NCCL (multicast off); on the CPU gloo. Each rank holds
1/N of every tile (store/sharded.py) and takes micro-batches rank, rank + N, ... of every step: every
rank draws the same global batch from the same data stream, so train.grad_accum must be a multiple of
N (>= N). Rank 0 alone prints the dashboard, writes metrics.jsonl and exports final/ (the masters
gathered tile by tile into a whole host store on rank 0, then checkpoint.export_sharded). Checkpoints are
written per shard (checkpoint.save_sharded_checkpoint) and resume on any N, one process
included: each rank gathers its range from the shard files that hold it (checkpoint/sharded.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from megatrain_cli.recipe import Recipe
from megatrain_cli.train.rank import RankSpec, under_torchrun, world_problem


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
