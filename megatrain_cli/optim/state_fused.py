"""update_state's fused path (optim/state_adamw.py): the Triton kernel of kernels/adamw_state.py, which does a
tile's whole AdamW over bf16 / int8 moments in one pass, to the bit of the torch path (tests/triton/
test_adamw_state.py). Taken for CUDA tensors when triton imports (resident layers on the device); the CPU
keeps the torch path (the host has its C++ kernel; the interpreter is for tests only).

Measured before it (H200, Qwen2.5-VL-7B, 28 resident layers, bf16 masters and moments): the torch path's
~100 passes took 3.04 s of a 6.18 s step. The kernel also needs no scratch: the torch path's 104 bytes an
element over an 8M-element chunk (engine/plan/memory.py still counts them: the fallback may need them).

Triton is imported only here and only on the first CUDA update (a second or so): the package imports without it.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatrain_cli.store.moments import BLOCK

KIND = "adamw_state"  # the kernels package's fallback record: one warning, then the torch path for good


def wanted(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, moments: str) -> bool:
    """Whether these sections take the kernel: on a triton device, triton importable, a kernel that has not
    failed before, and dtypes / layouts it takes."""
    from megatrain_cli import kernels

    if not kernels.wants_triton(KIND, master, grad, exp_avg):
        return False
    from megatrain_cli.kernels import adamw_state

    return adamw_state.supports(master, grad, exp_avg, moments)


def update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           exp_avg_exp: torch.Tensor | None, exp_avg_sq_exp: torch.Tensor | None,
           divisors: tuple[torch.Tensor, torch.Tensor], reference: Callable[[], None], *, moments: str,
           decay_numel: int, k, key_m: int, key_v: int, origin: int, key_p: int | None) -> None:
    """update_state's arguments (k: its StepConsts) through the kernel; `reference()` (the torch path) if the
    kernel fails to compile or launch. Such a failure comes before the kernel writes anything, so the
    reference starts from the untouched state; an error inside a running kernel is a CUDA error, not caught."""
    from megatrain_cli import kernels
    from megatrain_cli.kernels import adamw_state

    if adamw_state.BLOCK != BLOCK:
        raise RuntimeError(f"kernels/adamw_state.py's BLOCK {adamw_state.BLOCK} is not store/moments.py's {BLOCK}")

    def fused() -> None:
        adamw_state.adamw_state_update(
            master, grad, exp_avg, exp_avg_sq, exp_avg_exp, exp_avg_sq_exp, divisors, int8=moments == "int8",
            decay_numel=decay_numel, w1=k.w1, beta2=k.beta2, c2=k.c2, eps=k.eps, neg_step=k.neg_step,
            decay=k.decay, scaled=k.inv_clip != 1.0, key_m=key_m, key_v=key_v, key_p=key_p, origin=origin)

    kernels.run_with_fallback(KIND, fused, reference)
