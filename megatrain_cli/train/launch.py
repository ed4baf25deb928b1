"""`megatrain train RECIPE --gpus N`: data-parallel training on N ranks (issue #11).

Two ways in, one code path per rank (train.loop._loop with a DistContext):

    megatrain train RECIPE --gpus N            this module spawns N processes (torch.multiprocessing,
                                               'spawn'); they meet through a file in a temp directory
    torchrun --nproc-per-node N -m megatrain_cli train RECIPE
                                               torchrun's RANK / WORLD_SIZE / LOCAL_RANK (env://)

On CUDA each rank takes the GPU LOCAL_RANK and NCCL (with NCCL's own settings: the user's environment); on the CPU gloo. Each rank holds
1/N of every tile (store/sharded.py) and takes micro-batches rank, rank + N, ... of every step: every
rank draws the same global batch from the same data stream, so train.grad_accum must be a multiple of
N (>= N). Rank 0 alone prints the dashboard, writes metrics.jsonl and exports final/ (the masters
gathered tile by tile into a whole host store on rank 0, then checkpoint.export_sharded). Checkpoints are
written per shard (checkpoint.save_sharded_checkpoint) and resume on any N, one process
included: each rank gathers its range from the shard files that hold it (checkpoint/sharded.py).

The launcher and its ranks are one unit (train/supervise.py): signals to the launcher reach every rank,
no rank outlives the launcher, a rank that dies takes the others down. Rank 0 holds output_dir's lock
(train/lock.py); the launcher refuses a held output_dir before starting any rank.
"""

from __future__ import annotations

import os
import sys

import torch

from megatrain_cli.recipe import Recipe
from megatrain_cli.train.errors import TrainingError
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
    """One rank's whole run; the process group is torn down at the end. SIGINT, SIGTERM and SIGUSR1 are
    recorded from here on (train/stop.py), so one that comes before the loop still stops it cleanly."""
    import torch.distributed as dist

    from megatrain_cli.engine.dist import leave_process_group
    from megatrain_cli.train import stop
    from megatrain_cli.train.loop import run_training

    stop.install()
    try:
        return run_training(r, force=force, dist=spec)
    finally:
        if dist.is_initialized():
            leave_process_group()


def _child(rank: int, world: int, init_method: str, r: Recipe, force: bool) -> None:
    """One spawned rank (train/supervise.spawn_ranks has made it watch the launcher and set LOCAL_RANK)."""
    from megatrain_cli.machine import usable_cpus
    from megatrain_cli.train import stop
    from megatrain_cli.train.supervise import peer_gone

    stop.install()
    stop.unblock()  # blocked by the launcher until now: a signal that came meanwhile is recorded here
    torch.set_num_threads(max(1, usable_cpus() // world))  # the ranks share the host's CPUs
    try:
        code = run_rank(r, RankSpec(rank, world, init_method), force=force)
    except Exception as err:
        if not peer_gone(err):
            raise
        # Another rank ended mid-collective: the launcher names it; one line here, not a gloo traceback.
        print(f"rank {rank}: stopped, a collective failed ({str(err).splitlines()[0][:200]})", file=sys.stderr)
        code = 1
    sys.exit(code)


def spawn(r: Recipe, world: int, *, force: bool = False) -> int:
    """Run `world` ranks as child processes under one Supervisor (train/supervise.py): signals reach every
    rank, a failed rank takes the rest down, none outlives the launcher. The exit code is the ranks'
    common one, or the first failing rank's (128 + N when it was killed by signal N)."""
    from megatrain_cli.train.lock import check_free
    from megatrain_cli.train.supervise import spawn_ranks

    try:
        check_free(r.output_dir)  # rank 0 takes the lock; refuse a held output_dir before starting any rank
    except TrainingError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    return spawn_ranks(_child, (r, force), world, output_dir=r.output_dir)
