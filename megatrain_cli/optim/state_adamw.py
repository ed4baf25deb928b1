"""AdamW over bf16 or int8 moments (train.optimizer_state, store/moments.py) in torch ops, on any device: the
GPU-resident path (engine/resident.py) and HostAdamW's torch path. The C++ host kernel (adamw_state.cpp)
computes the same fp32 operations in the same order, so the two agree bit for bit (tests/optim/
test_state_precision.py); so does the fused Triton kernel (kernels/adamw_state.py) that update_state hands
CUDA tensors to (optim/state_fused.py: one pass instead of ~100; tests/triton/test_adamw_state.py).

Per element, all in fp32, each operation rounded on its own (no FMA: the C++ build has -ffp-contract=off,
torch's elementwise ops round each op):

    g = grad / fp32(1 / clip)                      (clip 1: g = grad)
    m = m + (1 - b1) * (g - m)
    v = v * b2 + (g * g) * (1 - b2)
    p = p * (1 - lr * wd)                          (the weight-decayed leading range)
    p = p + (-lr / bc1 * m) / (sqrt(v) / sqrt(bc2) + eps)

(sqrt rounded correctly: store.moments.sqrt_rn), with m, v decoded from their format first and coded back
after, rounded stochastically (int8: m and sqrt(v) coded per block), and the scalars formed in double and
rounded to fp32 as make_consts does. The update itself uses the new m and v before they are coded, as 8-bit Adam does. A bf16
master is stored rounded to nearest even, or stochastically (train.master_rounding: `store_master`, the bits
of store/moments.stochastic_bf16 keyed by `master_key`), as the C++ kernels store it. Not torch's fused AdamW
(whose lerp and FMAs are tied to its build): the fp32 setting keeps that one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatrain_cli.optim import state_fused
from megatrain_cli.store.moments import BLOCK, MASTER, decode_int8, encode_int8, sqrt_rn, sr_key, stochastic_bf16

# 8 M elements per pass of torch ops (a multiple of the int8 block): ~100 bytes of temporaries an element are
# alive at the peak (the fp32 p, g, m, v, their results, the int64 hashes of the rounding), 832 MiB a chunk
# (engine/plan/memory.py counts them for resident layers).
CHUNK = BLOCK << 17
LIVE_BYTES = 104  # per element of a chunk, at the peak


@dataclass(frozen=True)
class StepConsts:
    """One update's scalars, as python floats that torch rounds to fp32 where they meet a tensor."""

    w1: float  # 1 - beta1
    beta2: float
    c2: float  # 1 - beta2
    bc2s: float  # sqrt(1 - beta2^step)
    eps: float
    neg_step: float  # -lr / (1 - beta1^step)
    decay: float  # 1 - lr * weight_decay
    inv_clip: float  # 1 / clip, by which the gradient is divided (1.0: not)

    @classmethod
    def make(cls, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             clip: float) -> "StepConsts":
        bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
        return cls(1 - beta1, beta2, 1 - beta2, math.sqrt(bc2), eps, -(lr / bc1), 1 - lr * weight_decay, 1.0 / clip)


def master_key(rounding: str, master: torch.Tensor, seed: int, tile: str, step: int) -> int | None:
    """The key of a tile's step's stochastic rounding of its bf16 masters (train.master_rounding=stochastic),
    None where the new weight is stored as it is or rounded to nearest even (fp32 masters; 'nearest')."""
    if rounding != "stochastic" or master.dtype != torch.bfloat16:
        return None
    return sr_key(seed, tile, step, MASTER)


def store_master(dst: torch.Tensor, p: torch.Tensor, key: int | None, first: int) -> None:
    """fp32 new weights `p` into the master section `dst`: as they are (fp32), rounded to nearest even (a bf16
    master, key None), or stochastically (key: the bits of elements first, first + 1, ... of the tile)."""
    dst.copy_(p if key is None else stochastic_bf16(p, key, first))


def _divisors(k: StepConsts, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two scalar divisors as fp32 tensors on the device: CUDA divides by a host scalar as a multiply by
    its reciprocal (another rounding), by a device tensor truly. Filled on the device (a fill kernel takes the
    value as its argument): torch.tensor would copy from pageable memory, a host wait per tile."""
    return (torch.full((), k.inv_clip, dtype=torch.float32, device=device),
            torch.full((), k.bc2s, dtype=torch.float32, device=device))


def adam_math(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, k: StepConsts,
              decays: bool, div: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """New (p, m, v, sqrt(v)) from fp32 p, g, m, v: the formula of the module docstring, one rounding per op
    (a python float scalar is rounded to fp32 where it meets an fp32 tensor)."""
    if k.inv_clip != 1.0:
        g = g / div[0]
    m = m + (g - m) * k.w1
    v = v * k.beta2 + (g * g) * k.c2
    root = sqrt_rn(v)
    denom = root / div[1] + k.eps
    if decays:
        p = p * k.decay
    p = p + (m * k.neg_step) / denom
    return p, m, v, root


def update_state(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 exp_avg_exp: torch.Tensor, exp_avg_sq_exp: torch.Tensor, *, moments: str, decay_numel: int,
                 k: StepConsts, key_m: int, key_v: int, origin: int, key_p: int | None = None) -> None:
    """One AdamW step over a tile's flat sections, in place (module docstring). `decay_numel`: the leading
    range that takes weight decay; `origin`: the tile's first element in the whole tile (stochastic
    rounding's element index); key_m, key_v: store.moments.sr_key of this tile, step and moment; key_p:
    master_key (None: the new weight stored as it is, or rounded to nearest even).
    On CUDA with triton: the fused kernel (optim/state_fused.py), the same bits in one pass; elsewhere, or
    if the kernel fails (one warning, then always), update_state_torch."""
    if moments not in ("bf16", "int8"):
        raise ValueError(f"update_state takes bf16 or int8 moments, got {moments!r}")
    args = (master, grad, exp_avg, exp_avg_sq, exp_avg_exp, exp_avg_sq_exp)
    kw = dict(moments=moments, decay_numel=decay_numel, k=k, key_m=key_m, key_v=key_v, origin=origin, key_p=key_p)
    if master.is_cuda and state_fused.wanted(master, grad, exp_avg, moments):
        state_fused.update(*args, _divisors(k, master.device), lambda: update_state_torch(*args, **kw), **kw)
        return
    update_state_torch(*args, **kw)


def update_state_torch(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       exp_avg_exp: torch.Tensor, exp_avg_sq_exp: torch.Tensor, *, moments: str, decay_numel: int,
                       k: StepConsts, key_m: int, key_v: int, origin: int, key_p: int | None = None) -> None:
    """update_state in chunks of torch ops, on any device: the CPU's path and the fused kernel's reference."""
    n = master.numel()
    div = _divisors(k, master.device)
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        g = grad[lo:hi].float()
        if moments == "bf16":
            m, v = exp_avg[lo:hi].float(), exp_avg_sq[lo:hi].float()
        else:
            b = slice(lo // BLOCK, -(-hi // BLOCK))
            m = decode_int8(exp_avg[lo:hi], exp_avg_exp[b])
            t = decode_int8(exp_avg_sq[lo:hi], exp_avg_sq_exp[b])
            v = t * t
        p = master[lo:hi].float()
        cut = min(max(decay_numel - lo, 0), hi - lo)  # the decayed part of this chunk
        outs = [adam_math(p[a:z], g[a:z], m[a:z], v[a:z], k, decays, div)
                for a, z, decays in ((0, cut, True), (cut, hi - lo, False)) if z > a]
        p, m, v, root = (torch.cat([o[j] for o in outs]) for j in range(4))
        del outs  # their halves, before the rounding's temporaries
        store_master(master[lo:hi], p, key_p, origin + lo)
        if moments == "bf16":
            exp_avg[lo:hi].copy_(stochastic_bf16(m, key_m, origin + lo))
            exp_avg_sq[lo:hi].copy_(stochastic_bf16(v, key_v, origin + lo))
        else:
            encode_int8(m, exp_avg[lo:hi], exp_avg_exp[b], key_m, origin + lo)
            encode_int8(root, exp_avg_sq[lo:hi], exp_avg_sq_exp[b], key_v, origin + lo)
