"""SwiGLU, `silu(gate) * up`, forward and backward (the MLP activation of Qwen2 / Llama).

Test: python -m pytest -q tests/triton/test_kernels.py -k swiglu     (CPU: runs under TRITON_INTERPRET=1)
Bench: python scripts/bench_kernels.py --only swiglu           (GPU)

Elementwise and memory-bound: eager PyTorch runs silu and the product as two kernels with a rounded
[tokens, intermediate] temporary between them, and its backward several more. The kernel reads gate and up
once, computes in fp32 and rounds once; the backward produces both gradients in one pass. At 7B shapes
(32k tokens x 18944) each of those tensors is 1.2 GB in bf16: every read or write saved is ~0.25 ms on an H200.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference_vjp, run_with_fallback, wants_triton
from ._triton import cdiv, tl, triton

KIND = "swiglu"
BLOCK = 1024  # elements per program: 8 bytes/thread/tensor at 4 warps, enough to saturate HBM


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's `act_fn(gate_proj(x)) * up_proj(x)` with act_fn = SiLU."""
    return F.silu(gate) * up


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(grad_out_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(grad_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    d_silu = s * (1.0 + g * (1.0 - s))  # d silu(g)/dg = s + g*s*(1-s)
    tl.store(grad_gate_ptr + offs, (dy * u * d_silu).to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + offs, (dy * silu).to(grad_up_ptr.dtype.element_ty), mask=mask)


def _forward_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    _swiglu_forward_kernel[(cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK)
    return out


def _backward_triton(grad_out, gate, up) -> tuple[torch.Tensor, torch.Tensor]:
    grad_out, gate, up = grad_out.contiguous(), gate.contiguous(), up.contiguous()
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    _swiglu_backward_kernel[(cdiv(n, BLOCK),)](grad_out, gate, up, grad_gate, grad_up, n, BLOCK=BLOCK)
    return grad_gate, grad_up


class SwiGLUFunction(torch.autograd.Function):
    """swiglu with the Triton forward/backward; falls back to the reference (one warning) on failure."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return run_with_fallback(KIND, lambda: _forward_triton(gate, up), lambda: swiglu_reference(gate, up))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        return run_with_fallback(KIND, lambda: _backward_triton(grad_out, gate, up),
                                 lambda: reference_vjp(swiglu_reference, (gate, up), grad_out))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for same-shape, same-dtype tensors: Triton where it applies (see kernels/)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         f"must match")
    if wants_triton(KIND, gate, up):
        return SwiGLUFunction.apply(gate, up)
    return swiglu_reference(gate, up)
