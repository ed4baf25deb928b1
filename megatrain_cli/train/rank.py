"""One data-parallel rank inside the training loop: who it is, joining the group, agreeing on when to stop
and on whether a checkpoint could be read.

train/launch.py starts the ranks; train/loop.py runs each of them with what this module gives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
    resident = r.engine.resident_layers
    if world > 1 and isinstance(resident, int) and resident > 0:  # the sharded store keeps no layer on the device
        return (f"--gpus {world}: engine.resident_layers={resident} keeps layers' optimizer state on one process's "
                f"device, which data-parallel ranks (each holding a shard of every layer) do not do; use "
                f"engine.resident_layers=0 (or auto) with --gpus, or train on one GPU")
    a = r.train.grad_accum
    if a < world or a % world:
        return (f"--gpus {world}: each rank takes its share of every step's micro-batches, so train.grad_accum "
                f"({a}) must be a multiple of {world}; use train.grad_accum={world * max(1, -(-a // world))} "
                f"(and a micro_batch_size {world}x smaller to keep the batch)")
    return None


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start_rank(spec: RankSpec, r: Recipe, device: torch.device, long_ctx):
    """Join the process group (the DistContext the engine takes), after the checks every rank makes."""
    from megatrain_cli.engine.dist import init_distributed
    from megatrain_cli.train.errors import TrainingError

    if long_ctx is not None:
        raise TrainingError(f"{long_ctx.label} path: not available with several ranks yet (train.seq_len "
                            f"{r.train.seq_len}); use one process", 2)
    world = spec.world if spec.world is not None else int(os.environ["WORLD_SIZE"])
    problem = world_problem(r, world)
    if problem:
        raise TrainingError(problem, 2)
    return init_distributed(device.type, init_method=spec.init_method, rank=spec.rank, world_size=spec.world)


def agree_on_stop(ctx, reason: int | None) -> int | None:
    """A reason to stop (a signal number or train.stop.WALL_TIME) any rank has, on every rank (one small
    all-reduce per step: the largest wins), so all stop after the same step with the same exit code."""
    import torch.distributed as dist

    t = torch.tensor([reason or 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    return int(t.item()) or None


def gather_problems(ctx, problem: str | None) -> list[str]:
    """Every rank's problem (None: none), on every rank, prefixed with its rank: ranks that read different
    files (their own shards) decide together whether a checkpoint is usable."""
    import torch.distributed as dist

    found: list = [None] * ctx.world
    dist.all_gather_object(found, problem, group=ctx.cpu_group)
    return [f"rank {r}: {p}" if ctx.world > 1 else p for r, p in enumerate(found) if p]
