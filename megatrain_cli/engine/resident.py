"""Tiles whose optimizer state lives on the device (engine.resident_layers).

For the first N decoder layers, and with them the head (final norm + LM head), the engine keeps, on the
device, the master weights, both Adam moments,
the compute-dtype weights the layers run with and the gradient, and runs AdamW there once the step's
clip coefficient is known. What it saves per step and layer: every transfer (H2D in the forward and
again in the backward, the gradient's D2H), the packer's host casts and the host AdamW pass over the
layer's parameters, which is what a host-bound step (a clipped step, or an MoE layer with ten times the
parameters of a dense one for the same compute) waits for. What it costs: device memory, per parameter
the master and moments (12 bytes with fp32 masters), the weights and the gradient (2 + 2 in bf16), which
the planner takes from the budget that kept activations would otherwise use.

The first layers are the ones kept: the next forward reads them first, so the host has their compute
time to finish the streamed layers' updates; in the backward they come last, after every streamed
gradient has left. The head comes with them: the next forward reads it last, so after a clipped step its
host update would queue behind every streamed layer's while the GPU waits at the head. The update is the host kernel's arithmetic (torch's fused AdamW, the gradient rounded
to the compute dtype as the streamed path's D2H rounds it, the same decay ranges and clip), so a run's
result does not depend on which layers are resident beyond the device's own fp32 rounding.

bf16 or int8 moments (train.optimizer_state) stay in their format on the device too (2 + 2 or ~1 + 1 bytes
instead of 4 + 4) and take optim/state_adamw.py's update, which is the C++ host kernel's to the bit (one
pass per tile, weight decay on its leading range, stochastic rounding keyed by tile, step and element). bf16
masters are stored as the host kernel stores them too: to nearest even, or stochastically with the same
bits (train.master_rounding; state_adamw.store_master).

The host tiles stay the state's home between runs: `load` copies them in before the first step (after
any resume), `store_home` copies the device state back where the engine promises current host masters
(Engine.synchronize: checkpoints, export, the final eval; a validation pass reads them in place): master
and moments cross into pageable memory, seconds for tens of GB, so only there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain_cli.optim.state_adamw import StepConsts, master_key, store_master, update_state
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.store.moments import moment_bytes_per_param, sr_key
from megatrain_cli.store.tiles import HostStore

CAST_CHUNK = 1 << 24  # elements widened to fp32 per fused call (64 MiB of device scratch)


@dataclass
class _State:
    master: torch.Tensor | None  # None (with the moments and gradient): loaded weights_only
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    weights: torch.Tensor  # compute dtype: what the layer runs with
    grad: torch.Tensor | None  # the host tile's gradient dtype
    step: int
    exp_avg_exp: torch.Tensor  # int8 moments' block exponents (empty otherwise)
    exp_avg_sq_exp: torch.Tensor


def resident_bytes_per_param(master_width: int, compute_width: int, grad_width: int, moments: str = "fp32") -> float:
    """Device bytes one resident parameter holds: master, two moments (train.optimizer_state), weights, gradient."""
    return master_width + moment_bytes_per_param(moments) + compute_width + grad_width


class ResidentLayers:
    def __init__(self, store: HostStore, names: list[str], device: torch.device, dtype: torch.dtype,
                 train: TrainConfig):
        self.store, self.device, self.dtype = store, device, dtype
        self.names = tuple(names)
        self._names = frozenset(names)
        self.beta1, self.beta2 = float(train.betas[0]), float(train.betas[1])
        self.eps, self.weight_decay = train.eps, train.weight_decay
        self.seed = train.seed  # bf16 moments' and bf16 masters' stochastic rounding, as HostAdamW's
        self.master_rounding = train.master_rounding
        self._state: dict[str, _State] = {}
        self._scratch: torch.Tensor | None = None

    def __contains__(self, tile: str) -> bool:
        return tile in self._names

    @property
    def loaded(self) -> bool:
        """True once `load` ran (always for an empty set: nothing is resident)."""
        return bool(self._state) or not self.names

    def load(self, weights_only: bool = False) -> None:
        """Host tiles -> device (every resident tile's master, moments and step; its weights cast).
        `weights_only`: the cast weights alone, for a forward-only pass before the first step (the reference
        pass; `release` drops them): the master's bytes cross PCIe, not the moments' too (7B, 28 layers
        resident on the H200: the first reference pass 14.9 s -> 10.6 s, the later ones 0.9 s)."""
        for name in self.names:
            t = self.store.tiles[name]
            master = t.master.to(self.device, copy=True)
            weights = torch.empty(master.numel(), dtype=self.dtype, device=self.device)
            weights.copy_(master)
            empty = torch.empty(0, device=self.device)
            if weights_only:
                self._state[name] = _State(None, None, None, weights, None, t.step, empty, empty)
                continue
            dev = lambda x: x.to(self.device, copy=True)  # noqa: E731
            self._state[name] = _State(master, dev(t.exp_avg), dev(t.exp_avg_sq), weights,
                                       torch.zeros(master.numel(), dtype=t.grad.dtype, device=self.device), t.step,
                                       dev(t.exp_avg_exp), dev(t.exp_avg_sq_exp))
            self.store.settle(name)  # a disk tier's pages read for the copy leave host memory again

    def release(self) -> None:
        """Drop the device state without bringing it home (nothing updated it since `load`: a forward-only
        pass before the first step); the next step loads the host tiles again, a resume's included."""
        self._state.clear()
        self._scratch = None

    def store_home(self) -> None:
        """Device -> host tiles (master, moments, step): after it the host holds the current state."""
        for name, s in self._state.items():
            t = self.store.tiles[name]
            t.master.copy_(s.master)
            t.exp_avg.copy_(s.exp_avg)
            t.exp_avg_sq.copy_(s.exp_avg_sq)
            t.exp_avg_exp.copy_(s.exp_avg_exp)
            t.exp_avg_sq_exp.copy_(s.exp_avg_sq_exp)
            t.step = s.step
            self.store.settle(name)

    def weights(self, tile: str) -> torch.Tensor:
        return self._state[tile].weights

    def set_grad(self, tile: str, grad: torch.Tensor) -> None:
        """The tile's finished fp32 gradient, rounded to the gradient dtype (as the D2H path rounds it)."""
        self._state[tile].grad.copy_(grad)

    def device_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for s in self._state.values()
                   for x in (s.master, s.exp_avg, s.exp_avg_sq, s.weights, s.grad, s.exp_avg_exp, s.exp_avg_sq_exp)
                   if x is not None)

    def _widened(self, x: torch.Tensor, lo: int, hi: int, which: int) -> torch.Tensor:
        if x.dtype == torch.float32:
            return x[lo:hi]
        if self._scratch is None:
            self._scratch = torch.empty(2, CAST_CHUNK, dtype=torch.float32, device=self.device)
        out = self._scratch[which, :hi - lo]
        out.copy_(x[lo:hi])
        return out

    def update(self, lr: float, clip: float) -> None:
        """One AdamW step of every resident tile with this lr and clip coefficient (queued on the device's
        current stream on CUDA: the next forward's reads follow it there; no host wait)."""
        scale = None if clip == 1.0 else torch.tensor(1.0 / clip, device=self.device)
        for name, s in self._state.items():
            s.step += 1
            decay = self.store.layouts[name].decay_numel
            moments = self.store.tiles[name].moments
            key_p = master_key(self.master_rounding, s.master, self.seed, name, s.step)
            if moments != "fp32":
                k = StepConsts.make(s.step, lr, self.beta1, self.beta2, self.eps, self.weight_decay, clip)
                update_state(s.master, s.grad, s.exp_avg, s.exp_avg_sq, s.exp_avg_exp, s.exp_avg_sq_exp,
                             moments=moments, decay_numel=decay, k=k, key_m=sr_key(self.seed, name, s.step, 0),
                             key_v=sr_key(self.seed, name, s.step, 1), origin=0, key_p=key_p)
                s.weights.copy_(s.master)
                continue
            step = torch.tensor(float(s.step), device=self.device)
            for start, end, wd in ((0, decay, self.weight_decay), (decay, s.master.numel(), 0.0)):
                for lo in range(start, end, CAST_CHUNK):
                    hi = min(end, lo + CAST_CHUNK)
                    p = self._widened(s.master, lo, hi, 0)
                    torch._fused_adamw_(
                        [p], [self._widened(s.grad, lo, hi, 1)], [s.exp_avg[lo:hi]], [s.exp_avg_sq[lo:hi]], [],
                        [step], amsgrad=False, lr=lr, beta1=self.beta1, beta2=self.beta2, weight_decay=wd,
                        eps=self.eps, maximize=False, grad_scale=scale, found_inf=None)
                    if s.master.dtype != torch.float32:  # a bf16 master: to nearest even, or stochastically
                        store_master(s.master[lo:hi], p, key_p, lo)
            s.weights.copy_(s.master)
