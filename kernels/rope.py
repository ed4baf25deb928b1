"""Rotary position embedding applied to q and k, forward and backward, HF convention.

Test: python -m pytest -q tests/triton/test_kernels.py -k rope     (CPU: runs under TRITON_INTERPRET=1)
Bench: python scripts/bench_kernels.py --only rope           (GPU)

HF: `q * cos + rotate_half(q) * sin` with rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]) and cos/sin
[B, T, D] unsqueezed on the heads dim. Eager PyTorch materialises rotate_half (a slice, a negation, a cat)
and three more [B, heads, T, D] temporaries per tensor; the kernel reads q once and writes it once. One
program per (batch, position): cos/sin for that position are loaded once and reused by every head. q may
be the strided [B, heads, T, D] view HF makes with `.view(...).transpose(1, 2)`: no copy is made.

The backward is the transpose of the rotation, the same kernel with the sines' roles swapped:
    forward   out1 = x1*cos1 - x2*sin1     out2 = x2*cos2 + x1*sin2
    backward  gx1  = g1*cos1 + g2*sin2     gx2  = g2*cos2 - g1*sin1
(x1/x2 the two halves of the head dim). cos and sin are constants (HF computes them from positions
without grad): no gradient flows to them.
"""

from __future__ import annotations

import torch

from . import reference_vjp, run_with_fallback, wants_triton
from ._triton import next_power_of_2, tl, triton

KIND = "rope"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _for_heads(cos: torch.Tensor) -> torch.Tensor:
    """[B, T, D] -> [B, 1, T, D] as HF's unsqueeze_dim=1; [T, D] and 4-D already broadcast."""
    return cos.unsqueeze(1) if cos.dim() == 3 else cos


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One tensor [B, heads, T, D] rotated, op for op as HF's apply_rotary_pos_emb."""
    cos, sin = _for_heads(cos), _for_heads(sin)
    return x * cos + rotate_half(x) * sin


def apply_rope_reference(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, T, n_heads, half,
                 x_stride_b, x_stride_h, x_stride_t, x_stride_d,
                 out_stride_b, out_stride_h, out_stride_t, out_stride_d,
                 cos_stride_b, cos_stride_t, cos_stride_d,
                 BACKWARD: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    in_half = dims < half
    mask = (heads < n_heads) & in_half

    cs = b * cos_stride_b + t * cos_stride_t
    cos1 = tl.load(cos_ptr + cs + dims * cos_stride_d, mask=in_half, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + (dims + half) * cos_stride_d, mask=in_half, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs + dims * cos_stride_d, mask=in_half, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + (dims + half) * cos_stride_d, mask=in_half, other=0.0).to(tl.float32)

    xs = x_ptr + b * x_stride_b + t * x_stride_t + heads * x_stride_h
    x1 = tl.load(xs + dims * x_stride_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xs + (dims + half) * x_stride_d, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        out1 = x1 * cos1 + x2 * sin2
        out2 = x2 * cos2 - x1 * sin1
    else:
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    os_ = out_ptr + b * out_stride_b + t * out_stride_t + heads * out_stride_h
    tl.store(os_ + dims * out_stride_d, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(os_ + (dims + half) * out_stride_d, out2.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [B, heads, T, D] (any strides), cos/sin [B, T, D] (expanded views fine) -> rotated x."""
    B, n_heads, T, D = x.shape
    out = torch.empty_like(x)  # keeps x's layout when it is a dense view (the transposed projection)
    block_heads = next_power_of_2(n_heads)
    block_half = next_power_of_2(D // 2)
    num_warps = 4 if block_heads * block_half <= 2048 else 8
    _rope_kernel[(B * T,)](x, cos, sin, out, T, n_heads, D // 2, *x.stride(), *out.stride(), *cos.stride(),
                           BACKWARD=backward, BLOCK_HEADS=block_heads, BLOCK_HALF=block_half,
                           num_warps=num_warps)
    return out


class RotaryEmbeddingFunction(torch.autograd.Function):
    """rope on one tensor with the Triton forward/backward; the reference (one warning) on failure.
    cos/sin are [B, T, D] (see `_cos_sin_per_position`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)  # not x: the rotation is linear, its backward needs only cos/sin
        return run_with_fallback(KIND, lambda: _rotate_triton(x, cos, sin, backward=False),
                                 lambda: rope_reference(x, cos, sin))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        cos, sin = ctx.saved_tensors
        # Linear in x, so the reference's vjp at any point is the right one: grad_out stands in for x.
        grad_x = run_with_fallback(KIND, lambda: _rotate_triton(grad_out, cos, sin, backward=True),
                                   lambda: reference_vjp(rope_reference, (grad_out,), grad_out, cos, sin)[0])
        return grad_x, None, None


def _cos_sin_per_position(cos: torch.Tensor, B: int, T: int, D: int) -> torch.Tensor:
    """cos as [B, T, D] (an expanded view: no copy) from [B|1, T, D], [T, D] or [B|1, 1, T, D]."""
    if cos.dim() == 4:
        if cos.shape[1] != 1:
            raise ValueError(f"apply_rope: 4-D cos/sin must be [B, 1, T, D], got {tuple(cos.shape)}")
        cos = cos[:, 0]
    if cos.dim() == 2:
        cos = cos.unsqueeze(0)
    if cos.dim() != 3 or cos.shape[-2:] != (T, D) or cos.shape[0] not in (1, B):
        raise ValueError(f"apply_rope: cos/sin {tuple(cos.shape)} do not broadcast to [B={B}, T={T}, D={D}]")
    return cos.expand(B, T, D)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed) for q [B, q_heads, T, D], k [B, kv_heads, T, D], cos/sin [B, T, D] or broadcastable:
    Triton where it applies (see kernels/)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, heads, T, D] alike")
    B, _, T, D = q.shape
    if D % 2 or cos.shape != sin.shape:
        raise ValueError(f"apply_rope: head dim {D} must be even and cos {tuple(cos.shape)} shaped as sin "
                         f"{tuple(sin.shape)}")
    cos3, sin3 = _cos_sin_per_position(cos, B, T, D), _cos_sin_per_position(sin, B, T, D)
    if wants_triton(KIND, q, k, cos, sin):
        return RotaryEmbeddingFunction.apply(q, cos3, sin3), RotaryEmbeddingFunction.apply(k, cos3, sin3)
    return apply_rope_reference(q, k, cos, sin)
