"""GRPO's KL term (grpo.beta > 0): the initial weights' log-probs of every completion token, by a streamed
forward-only pass over a host copy of them.

At the start of the run (before a resume loads a checkpoint) the masters are copied into a second host store
(masters only are written: its optimizer sections are never touched, so their pages are never committed: 4
bytes/param of host memory, 2 with bf16 masters). A second engine over it, with no resident layers, runs each
step's rows through `engine/validate.forward_passes` with the GRPO head's scoring function
(`engine/policy_head.score_tokens`): the same pass and the same definition of a scored token as the training
head, so at the first step the KL term is exactly 0. No second copy of the model is kept on the device: the
pass streams the copy through the second engine's layer slots (on CUDA, `engine.layer_slots` more buffers of
the largest layer), one forward per step over its rows.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from megatrain_cli.recipe import Recipe


class InitialPolicy:
    def __init__(self, r: Recipe, store, device: torch.device, plan):
        from megatrain_cli.store.tiles import HostStore
        from megatrain_cli.train.setup import build_engine

        self.store = HostStore(store.adapter, store.compute_dtype, master_dtype=store.master_dtype)
        for name, tile in store.tiles.items():
            self.store.tiles[name].master.copy_(tile.master)
        frozen = dataclasses.replace(r, engine=dataclasses.replace(r.engine, overlap_optimizer=False))
        self.engine = build_engine(frozen, self.store, dataclasses.replace(plan, resident_layers=0), device)

    def attach(self, mbs: list) -> float:
        """Each micro-batch's `ref_logps` ([B, T] aligned with its labels, on the host); returns the seconds."""
        from megatrain_cli.engine.policy_head import score_tokens
        from megatrain_cli.engine.validate import forward_passes

        t0 = time.perf_counter()
        scores = []
        forward_passes(self.engine, mbs, len(mbs),
                       lambda e, h, x, batch: scores.extend(s.cpu() for s in score_tokens(e, h, x.labels)))
        for mb, logps in zip(mbs, scores):
            mb.ref_logps = logps
        return time.perf_counter() - t0

    def close(self) -> None:
        self.engine.close()
