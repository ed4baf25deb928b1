"""AdamW on the host, against the fp32 master store; the learning-rate schedule.

The update runs where the state lives: torch's fused CPU AdamW kernel over each tile's flat
sections (one call for the weight-decayed leading range, one for the rest). Gradient clipping
costs no extra pass: the clip coefficient goes in as the kernel's `grad_scale` (it divides the
gradient). A bf16 gradient section is widened to fp32 in chunks through a small scratch buffer.

bf16 master weights (train.master_weights: bf16) take the same fp32 math: each chunk of weights is
widened into a second fp32 scratch buffer, updated there with the fp32 moments, and copied back rounded
to nearest even, or stochastically (train.master_rounding: state_adamw.store_master, random bits keyed by
seed, tile, step and element). The C++ kernel does it in registers, bit-identical. `correct` and `rollback` refuse
them: both recover the weight before the update from the weight after it, which rounding destroyed
(worker.py does not speculate with bf16 masters, so they are never needed).

`correct` turns an update done with clip coefficient 1 (a speculative update, see worker.py) into
the update with the true coefficient, and `rollback` undoes it, both by AdamW's algebra from the
new state and the gradient still in the tile. They are exact up to fp32 rounding (about one ulp
of each weight and moment), not bit-exact; they run only on steps where speculation turned out
wrong (the gradient was clipped, or not finite).

`kernel` picks the code for update and correct: 'torch' (the torch path above), 'cpp' (the C++
kernel of adamw_cpp.py, one pass that reads bf16 gradients directly; its update is bit-identical
to the torch path's; required: an error if it does not compile) or 'auto', the default (the C++
kernel if it compiles, else the torch path, with one warning): the C++ update moves fewer bytes per
parameter (no fp32 scratch for a bf16 gradient) and host AdamW is memory-bound. rollback always runs
the torch ops.

bf16 or int8 moments (train.optimizer_state; the tile's `moments`): `update` runs one pass over the whole tile
(adamw_cpp.update_state, or optim/state_adamw.py on the torch path: the same bits), weight decay on its
leading range; `correct` and `rollback` refuse them (a coded moment cannot be taken back exactly) and
`defer_moments` is off (the moments pass would code them again from a recomputation: not worth a pass).

`defer_moments` (the C++ kernel only; on by default, ignored with the torch path): `update_weights`
stores an update's weights and leaves its moments to `update_moments`, which must run before anything
else reads the tile's moments or replaces its gradient. Bit-identical to `update`; what it buys is a
smaller pass where the next forward waits (worker.py), at the cost of one more pass over m, v and the
gradient, later.
"""

from __future__ import annotations

import math
import warnings

import torch

from megatrain_cli.optim.state_adamw import StepConsts, master_key, store_master, update_state
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.store.moments import sr_key
from megatrain_cli.store.tiles import Tile

CAST_CHUNK = 1 << 24  # elements widened per fused call when grads are bf16 (64 MiB of fp32 scratch)
ROLLBACK_CHUNK = 1 << 20  # small enough that the rollback's ~8 elementwise ops stay in cache


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


KERNELS = ("torch", "cpp", "auto")
_warned_fallback = False


def resolve_kernel(kernel: str = "auto") -> str:
    """'torch' or 'cpp': the code HostAdamW's update and correct will run."""
    global _warned_fallback
    if kernel not in KERNELS:
        raise ValueError(f"host AdamW kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "torch":
        return "torch"
    from megatrain_cli.optim import adamw_cpp

    try:
        adamw_cpp.load()
    except RuntimeError as e:
        if kernel == "cpp":
            raise
        if not _warned_fallback:
            _warned_fallback = True
            reason = str(e).splitlines()[0][:300]
            warnings.warn(f"{reason}; host AdamW runs the torch path instead", RuntimeWarning, stacklevel=3)
        return "torch"
    return "cpp"


class HostAdamW:
    def __init__(self, cfg: TrainConfig, kernel: str = "auto", defer_moments: bool = True, tier=None):
        """`tier`: the store's disk tier (store/disk.py), told before and after each tile's update; with one,
        `update` is the only pass over a tile's state (no deferred moments)."""
        self.beta1, self.beta2 = float(cfg.betas[0]), float(cfg.betas[1])
        self.eps = cfg.eps
        self.weight_decay = cfg.weight_decay
        self.seed = cfg.seed  # stochastic rounding of bf16 moments (store/moments.py) and of bf16 masters
        self.master_rounding = cfg.master_rounding
        self._scratch: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None  # fp32 scratch for a chunk of bf16 masters
        self.kernel = resolve_kernel(kernel)
        self._cpp = None
        if self.kernel == "cpp":
            from megatrain_cli.optim import adamw_cpp

            self._cpp = adamw_cpp
        self.tier = tier
        self.defer_moments = (bool(defer_moments) and self._cpp is not None and cfg.optimizer_state == "fp32"
                              and tier is None)

    def _fused(self, master, grad, m, v, step: float, lr: float, wd: float, clip: float) -> None:
        torch._fused_adamw_(
            [master], [grad], [m], [v], [], [torch.tensor(step)],
            amsgrad=False, lr=lr, beta1=self.beta1, beta2=self.beta2, weight_decay=wd, eps=self.eps,
            maximize=False, grad_scale=None if clip == 1.0 else torch.tensor(1.0 / clip), found_inf=None)

    def _sections(self, tile: Tile):
        """(start, end, weight decay) of the decayed leading range and the rest."""
        for start, end, wd in ((0, tile.layout.decay_numel, self.weight_decay),
                               (tile.layout.decay_numel, tile.numel, 0.0)):
            if end > start:
                yield start, end, wd

    def _widened(self, grad: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if grad.dtype == torch.float32:
            return grad[lo:hi]
        if self._scratch is None or self._scratch.numel() < hi - lo:
            self._scratch = torch.empty(max(hi - lo, min(CAST_CHUNK, grad.numel())))
        g = self._scratch[:hi - lo]
        g.copy_(grad[lo:hi])
        return g

    def _widened_weights(self, master: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if self._weights is None or self._weights.numel() < hi - lo:
            self._weights = torch.empty(max(hi - lo, min(CAST_CHUNK, master.numel())))
        return self._weights[:hi - lo].copy_(master[lo:hi])

    @staticmethod
    def _exact_only(tile: Tile, what: str) -> None:
        if tile.master.dtype != torch.float32:
            raise RuntimeError(f"HostAdamW.{what} needs fp32 master weights: a bf16 weight was rounded after the "
                               "update and cannot be taken back exactly (train.master_weights=bf16 does not "
                               "speculate)")
        if tile.moments != "fp32":
            raise RuntimeError(f"HostAdamW.{what} needs fp32 moments: {tile.moments} moments were coded after the "
                               "update and cannot be taken back exactly (train.optimizer_state="
                               f"{tile.moments} does not speculate)")

    def _master_key(self, tile: Tile, step: int) -> int | None:
        """This step's stochastic-rounding key of the tile's bf16 masters; None: stored as they are or rounded
        to nearest even."""
        if self.master_rounding == "nearest" or tile.master.dtype != torch.bfloat16:  # fp32 masters: stored as is
            return None
        return master_key(self.master_rounding, tile.master, self.seed, tile.name, step)

    @staticmethod
    def _cpp_key(key: int | None) -> int:
        return -1 if key is None else key

    def _update_state(self, tile: Tile, lr: float, clip: float) -> None:
        """`update` of a tile with bf16 or int8 moments: one pass over the whole tile."""
        step = tile.step + 1
        keys = dict(key_m=sr_key(self.seed, tile.name, step, 0), key_v=sr_key(self.seed, tile.name, step, 1),
                    origin=tile.origin)
        key_p = self._master_key(tile, step)
        sections = (tile.master, tile.grad, tile.exp_avg, tile.exp_avg_sq, tile.exp_avg_exp, tile.exp_avg_sq_exp)
        if self._cpp is not None:
            self._cpp.update_state(*sections, step=step, lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                                   weight_decay=self.weight_decay, clip=clip, decay_numel=tile.layout.decay_numel,
                                   key_p=self._cpp_key(key_p), **keys)
        else:
            k = StepConsts.make(step, lr, self.beta1, self.beta2, self.eps, self.weight_decay, clip)
            update_state(*sections, moments=tile.moments, decay_numel=tile.layout.decay_numel, k=k, key_p=key_p,
                         **keys)
        tile.step = step

    def _bias_corrections(self, step: int) -> tuple[float, float]:
        return 1.0 - self.beta1 ** step, math.sqrt(1.0 - self.beta2 ** step)

    def rollback(self, tile: Tile, lr: float) -> None:
        """Undo this tile's last update, which must have used clip 1.0 and this lr (a skipped step).

        About eight elementwise passes, over cache-sized chunks: one memory pass of the tile's state.
        """
        self._exact_only(tile, "rollback")
        bc1, bc2_sqrt = self._bias_corrections(tile.step)
        for start, end, wd in self._sections(tile):
            for lo in range(start, end, ROLLBACK_CHUNK):
                hi = min(end, lo + ROLLBACK_CHUNK)
                p, m, v = tile.master[lo:hi], tile.exp_avg[lo:hi], tile.exp_avg_sq[lo:hi]
                denom = v.sqrt().div_(bc2_sqrt).add_(self.eps)
                p.addcdiv_(m, denom, value=lr / bc1)
                if wd:
                    p.div_(1.0 - lr * wd)
                g = self._widened(tile.grad, lo, hi)
                m.sub_(g, alpha=1.0 - self.beta1).div_(self.beta1)
                v.addcmul_(g, g, value=-(1.0 - self.beta2)).div_(self.beta2).clamp_min_(0.0)
        tile.step -= 1

    def correct(self, tile: Tile, lr: float, clip: float) -> None:
        """Turn this tile's last update, done with clip 1.0 and this lr, into the update with `clip`.

        The moments are linear in the clipped gradient c*g, so m and v move by (1-b1)(c-1)g and
        (1-b2)(c^2-1)g^2; the weight swaps its old Adam step for the new one (weight decay is the
        same in both, so it cancels). One memory pass, like an update, instead of undo + redo.
        """
        self._exact_only(tile, "correct")
        if self._cpp is not None:
            if clip != 1.0:
                for start, end, _ in self._sections(tile):
                    self._cpp.correct(tile.master[start:end], tile.grad[start:end], tile.exp_avg[start:end],
                                      tile.exp_avg_sq[start:end], step=tile.step, lr=lr, beta1=self.beta1,
                                      beta2=self.beta2, eps=self.eps, clip=clip)
            return
        bc1, bc2_sqrt = self._bias_corrections(tile.step)
        step_size = lr / bc1
        for start, end, _ in self._sections(tile):
            for lo in range(start, end, ROLLBACK_CHUNK):
                hi = min(end, lo + ROLLBACK_CHUNK)
                p, m, v = tile.master[lo:hi], tile.exp_avg[lo:hi], tile.exp_avg_sq[lo:hi]
                g = self._widened(tile.grad, lo, hi)
                p.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(self.eps), value=step_size)
                m.add_(g, alpha=(1.0 - self.beta1) * (clip - 1.0))
                v.addcmul_(g, g, value=(1.0 - self.beta2) * (clip * clip - 1.0)).clamp_min_(0.0)
                p.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(self.eps), value=-step_size)

    def update_weights(self, tile: Tile, lr: float, clip: float = 1.0) -> None:
        """`update`'s new weights (and step count); its moments wait for update_moments (defer_moments)."""
        if not self.defer_moments or tile.moments != "fp32":
            raise RuntimeError("update_weights needs defer_moments (the C++ host kernel) and fp32 moments")
        step = float(tile.step + 1)
        key = self._cpp_key(self._master_key(tile, tile.step + 1))
        for start, end, wd in self._sections(tile):
            self._cpp.update_weights(tile.master[start:end], tile.grad[start:end], tile.exp_avg[start:end],
                                     tile.exp_avg_sq[start:end], step=step, lr=lr, beta1=self.beta1,
                                     beta2=self.beta2, eps=self.eps, weight_decay=wd, clip=clip, key_p=key,
                                     first=tile.origin + start)
        tile.step += 1

    def update_weights_span(self, tile: Tile, lr: float, clip: float, lo: int, hi: int, out: torch.Tensor) -> None:
        """`update_weights` for elements [lo, hi) of the tile, also writing their new bf16 weights into
        `out` (hi - lo elements): the update on read of optim/worker.py, which calls it over a tile's
        whole range in pieces and then `count_step` once. Bit-identical to update_weights + a cast."""
        step = float(tile.step + 1)
        key = self._cpp_key(self._master_key(tile, tile.step + 1))
        for start, end, wd in self._sections(tile):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                self._cpp.update_weights_emit(
                    tile.master[a:b], tile.grad[a:b], tile.exp_avg[a:b], tile.exp_avg_sq[a:b], out[a - lo:b - lo],
                    step=step, lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=wd, clip=clip,
                    section_offset=a - start, section_numel=end - start, key_p=key, first=tile.origin + a)

    @staticmethod
    def count_step(tile: Tile) -> None:
        """The tile's update is complete (after update_weights_span has covered it)."""
        tile.step += 1

    def update_moments(self, tile: Tile, clip: float = 1.0) -> None:
        """The moments of the update_weights just done on this tile, from the same gradient and clip."""
        for start, end, _ in self._sections(tile):
            self._cpp.update_moments(tile.master[start:end], tile.grad[start:end], tile.exp_avg[start:end],
                                     tile.exp_avg_sq[start:end], beta1=self.beta1, beta2=self.beta2, clip=clip)

    def update(self, tile: Tile, lr: float, clip: float = 1.0) -> None:
        """One AdamW step for every parameter of the tile (reads tile.grad; leaves it as it is). With a disk tier
        the tile's state is read ahead before (waited for here) and written behind after."""
        if self.tier is None:
            return self._update(tile, lr, clip)
        self.tier.before(tile.name)
        try:
            self._update(tile, lr, clip)
        finally:
            self.tier.after(tile.name)

    def _update(self, tile: Tile, lr: float, clip: float) -> None:
        if tile.moments != "fp32":
            return self._update_state(tile, lr, clip)
        step = float(tile.step + 1)
        key = self._master_key(tile, tile.step + 1)
        if self._cpp is not None:
            for start, end, wd in self._sections(tile):
                self._cpp.update(tile.master[start:end], tile.grad[start:end], tile.exp_avg[start:end],
                                 tile.exp_avg_sq[start:end], step=step, lr=lr, beta1=self.beta1,
                                 beta2=self.beta2, eps=self.eps, weight_decay=wd, clip=clip,
                                 key_p=self._cpp_key(key), first=tile.origin + start)
            tile.step += 1
            return
        fp32_master = tile.master.dtype == torch.float32
        for start, end, wd in self._sections(tile):
            if tile.grad.dtype == torch.float32 and fp32_master:
                self._fused(tile.master[start:end], tile.grad[start:end], tile.exp_avg[start:end],
                            tile.exp_avg_sq[start:end], step, lr, wd, clip)
                continue
            for lo in range(start, end, CAST_CHUNK):
                hi = min(end, lo + CAST_CHUNK)
                p = tile.master[lo:hi] if fp32_master else self._widened_weights(tile.master, lo, hi)
                self._fused(p, self._widened(tile.grad, lo, hi), tile.exp_avg[lo:hi],
                            tile.exp_avg_sq[lo:hi], step, lr, wd, clip)
                if not fp32_master:
                    store_master(tile.master[lo:hi], p, key, tile.origin + lo)
        tile.step += 1
