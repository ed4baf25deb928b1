"""AdamW on the host, against the fp32 master store; the learning-rate schedule.

The update runs where the state lives: torch's fused CPU AdamW kernel over each tile's flat
sections (one call for the weight-decayed leading range, one for the rest). Gradient clipping
costs no extra pass: the clip coefficient goes in as the kernel's `grad_scale` (it divides the
gradient). A bf16 gradient section is widened to fp32 in chunks through a small scratch buffer.
"""

from __future__ import annotations

import math

import torch

from megatrain_cli.recipe import TrainConfig
from megatrain_cli.store.tiles import Tile

CAST_CHUNK = 1 << 24  # elements widened per fused call when grads are bf16 (64 MiB of fp32 scratch)


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for the optimizer step with 0-based index `step`."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        factor = 1.0 - (1.0 - floor) * progress
    else:
        factor = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * factor


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """As torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


class HostAdamW:
    def __init__(self, cfg: TrainConfig):
        self.beta1, self.beta2 = float(cfg.betas[0]), float(cfg.betas[1])
        self.eps = cfg.eps
        self.weight_decay = cfg.weight_decay
        self._scratch: torch.Tensor | None = None

    def _fused(self, master, grad, m, v, step: float, lr: float, wd: float, clip: float) -> None:
        torch._fused_adamw_(
            [master], [grad], [m], [v], [], [torch.tensor(step)],
            amsgrad=False, lr=lr, beta1=self.beta1, beta2=self.beta2, weight_decay=wd, eps=self.eps,
            maximize=False, grad_scale=None if clip == 1.0 else torch.tensor(1.0 / clip), found_inf=None)

    def update(self, tile: Tile, lr: float, clip: float = 1.0) -> None:
        """One AdamW step for every parameter of the tile (reads tile.grad; leaves it as it is)."""
        step = float(tile.step + 1)
        for start, end, wd in ((0, tile.layout.decay_numel, self.weight_decay),
                               (tile.layout.decay_numel, tile.numel, 0.0)):
            if end <= start:
                continue
            if tile.grad.dtype == torch.float32:
                self._fused(tile.master[start:end], tile.grad[start:end], tile.exp_avg[start:end],
                            tile.exp_avg_sq[start:end], step, lr, wd, clip)
                continue
            for lo in range(start, end, CAST_CHUNK):
                hi = min(end, lo + CAST_CHUNK)
                if self._scratch is None or self._scratch.numel() < hi - lo:
                    self._scratch = torch.empty(min(CAST_CHUNK, tile.numel))
                g = self._scratch[:hi - lo]
                g.copy_(tile.grad[lo:hi])
                self._fused(tile.master[lo:hi], g, tile.exp_avg[lo:hi], tile.exp_avg_sq[lo:hi],
                            step, lr, wd, clip)
        tile.step += 1
