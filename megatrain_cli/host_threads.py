"""Intra-op thread counts for the engine's host threads (the packer's casts, host AdamW).

torch's CPU ops run on OpenMP, whose team size is a per-thread setting: torch.set_num_threads called in
a thread limits the parallel regions that thread starts and no other. The packer and the optimizer
worker each start their own regions, concurrently; with the defaults both ask for every core, and the
two teams contend (32 threads on 16 cores on the H200 machine) for a resource, host memory bandwidth,
that more threads do not add to. These knobs split the cores instead; measured, not assumed
(docs/perf-notes.md): unset, nothing changes.

    MEGATRAIN_PACKER_THREADS   threads of the packer's fp32 -> bf16 casts (engine/cuda_pipeline.py), and of
                               the clipped-step weights updates it applies on read (optim/worker.py)
    MEGATRAIN_ADAMW_THREADS    threads of host AdamW in the optimizer worker (optim/worker.py)
"""

from __future__ import annotations

import os

import torch

PACKER_THREADS_ENV = "MEGATRAIN_PACKER_THREADS"
ADAMW_THREADS_ENV = "MEGATRAIN_ADAMW_THREADS"


def limit_this_thread(env_name: str) -> int | None:
    """Apply the thread count the environment variable gives to the calling thread's torch ops; returns
    it (None when unset). A value that is not a positive integer is an error, not ignored."""
    value = os.environ.get(env_name, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{env_name} must be a positive integer, got {value!r}")
    torch.set_num_threads(n)
    return n
