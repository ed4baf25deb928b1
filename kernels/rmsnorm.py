"""RMSNorm, forward and backward, in the op order of HF's Qwen2RMSNorm / LlamaRMSNorm.

Test: python -m pytest -q tests/triton/test_kernels.py -k rms_norm     (CPU: runs under TRITON_INTERPRET=1)
Bench: python scripts/bench_kernels.py --only rms_norm           (GPU)

HF computes `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`: the normalised value is
rounded to the input dtype BEFORE the weight multiplies it. The kernel keeps that rounding (so bf16 output
matches HF bit for bit up to rsqrt's last ulp) and does the rest in fp32. One row per program, the whole
row in registers: hidden sizes up to ~16k fit. Eager PyTorch spends ~6 kernels and an fp32 copy of x on
this; the kernel reads x once and writes y once, and saves only one fp32 rstd per row for backward.

Backward: each program walks a stripe of rows, writes dx and keeps a private fp32 partial sum of dweight;
torch sums the [programs, H] partials (a few hundred rows) at the end, so no atomics and a deterministic
result.
"""

from __future__ import annotations

import functools

import torch

from . import reference_vjp, run_with_fallback, wants_triton
from ._triton import cdiv, next_power_of_2, tl, triton

KIND = "rms_norm"


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF's RMSNorm forward, op for op."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


@triton.jit
def _rms_norm_forward_kernel(x_ptr, weight_ptr, y_ptr, rstd_ptr, x_row_stride, y_row_stride, H, eps,
                             BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF's cast back to the input dtype
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(grad_y_ptr, x_ptr, weight_ptr, rstd_ptr, grad_x_ptr, grad_w_partial_ptr,
                              grad_y_row_stride, x_row_stride, grad_x_row_stride, n_rows, H,
                              ROWS_PER_PROGRAM: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    grad_w_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i in range(0, ROWS_PER_PROGRAM):
        row = pid.to(tl.int64) * ROWS_PER_PROGRAM + i
        in_row = mask & (row < n_rows)  # the last stripe may be short: masked rows add zero
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
        dy = tl.load(grad_y_ptr + row * grad_y_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < n_rows, other=0.0)
        x_hat = x * rstd
        # dweight sees the normalised value as HF rounded it; dx treats that rounding as identity (as autograd)
        grad_w_acc += dy * x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
        g = dy * w
        # d/dx of x*rstd(x): rstd * (g - x_hat * mean(g * x_hat))
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / H))
        tl.store(grad_x_ptr + row * grad_x_row_stride + cols, dx.to(grad_x_ptr.dtype.element_ty), mask=in_row)
    tl.store(grad_w_partial_ptr + pid.to(tl.int64) * H + cols, grad_w_acc, mask=mask)


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    t = t.reshape(-1, H)
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@functools.lru_cache(maxsize=None)
def _backward_programs(device: torch.device) -> int:
    """Enough programs to fill the GPU a few times over; few under the interpreter (each is Python)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _forward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    x2, weight = _rows(x, H), weight.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    block = next_power_of_2(H)
    _rms_norm_forward_kernel[(x2.shape[0],)](x2, weight, y, rstd, x2.stride(0), y.stride(0), H, eps,
                                             BLOCK_H=block, num_warps=_num_warps(block))
    return y.view(x.shape), rstd


def _backward_triton(grad_y, x, weight, rstd) -> tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    x2, dy2, weight = _rows(x, H), _rows(grad_y, H), weight.contiguous()
    n_rows = x2.shape[0]
    grad_x = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    # A power of two, so the compiled variants stay few (it is a compile-time constant, one variant per value).
    rows_per_program = next_power_of_2(cdiv(n_rows, _backward_programs(x.device)))
    programs = cdiv(n_rows, rows_per_program)
    partial = torch.empty(programs, H, dtype=torch.float32, device=x.device)
    block = next_power_of_2(H)
    _rms_norm_backward_kernel[(programs,)](dy2, x2, weight, rstd, grad_x, partial, dy2.stride(0), x2.stride(0),
                                           grad_x.stride(0), n_rows, H,
                                           ROWS_PER_PROGRAM=rows_per_program, BLOCK_H=block,
                                           num_warps=_num_warps(block))
    return grad_x.view(x.shape), partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """rms_norm with the Triton forward/backward; falls back to the reference (one warning) on failure."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = run_with_fallback(KIND, lambda: _forward_triton(x, weight, eps),
                                    lambda: (rms_norm_reference(x, weight, eps), None))
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        reference = lambda: reference_vjp(rms_norm_reference, (x, weight), grad_y, ctx.eps)  # noqa: E731
        if rstd is None:  # the forward already fell back
            grad_x, grad_w = reference()
        else:
            grad_x, grad_w = run_with_fallback(KIND, lambda: _backward_triton(grad_y, x, weight, rstd), reference)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF RMSNorm over the last dim of x [..., H] with weight [H]: Triton where it applies (see kernels/)."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if wants_triton(KIND, x, weight):
        return RMSNormFunction.apply(x, weight, float(eps))
    return rms_norm_reference(x, weight, eps)
