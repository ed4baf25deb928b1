"""AdamW over bf16 or int8 moments in one pass: megatrain_cli/optim/state_adamw.update_state's per-element
work fused into one Triton kernel, bit for bit (the torch path stays the reference and the CPU's path).

Test: python -m pytest -q tests/triton/test_adamw_state.py      (CPU: runs under TRITON_INTERPRET=1)

Why: the torch path runs ~100 elementwise passes per 8M-element chunk (decode, the AdamW ops, three int64
hashes of stochastic rounding, encode), each a kernel reading and writing fp32 / int64 temporaries. Measured
on the H200 (Qwen2.5-VL-7B, 28 resident decoder layers, bf16 masters and moments): 3.04 s of a 6.18 s step,
~2 G params/s. This kernel reads each element's master, gradient and moments once and writes master and
moments once (bf16 everything: 8 bytes in, 6 out), so it should run near HBM bandwidth, tens of ms for
those layers (not measured yet).

Per element, in the order of state_adamw.adam_math, each fp32 op rounded on its own:
    g = grad / inv_clip (SCALED)          m = m + (g - m) * w1          v = v * beta2 + (g * g) * c2
    root = sqrt_rn(v)   denom = root / bc2s + eps   p = p * decay (pos < decay_numel)
    p = p + (m * neg_step) / denom
How the bits are kept equal to torch's (what each choice costs):
  - no FMA: launched with enable_fp_fusion=False (LLVM's contraction and ptxas' --fmad off): a fused
    multiply-add would round once where torch's separate kernels round twice. Costs nothing measurable in a
    memory-bound kernel.
  - division and sqrt correctly rounded (tl.div_rn, tl.sqrt_rn): triton's `/` and tl.sqrt are approximate
    (div.full / sqrt.approx); torch's CUDA division is IEEE and its sqrt_rn is. A few more instructions each.
  - the scalars arrive rounded to fp32 in Python (`f32`), as torch rounds a Python scalar where it meets an
    fp32 tensor; the two divisors (1 / clip, sqrt(bc2)) are read from the same fp32 device tensors the torch
    path divides by (state_adamw._divisors).
  - stochastic rounding's bits are moments.py's hash of the element index origin + position (state_codecs).
  - int8: a program owns BLOCKS whole 64-element blocks (a [BLOCKS, 64] tile), so a block's absmax, hence
    its exponent, is a reduction inside the program; the tile's first block is 64-aligned in the tile, as
    moments.py counts blocks.
Tensors: bf16 ones are passed as int16 views and fp8 codes as uint8 views (bits in, bits out: see
state_codecs.py); fp32 masters and gradients as they are.
"""

from __future__ import annotations

import struct

import torch

from ._triton import cdiv, tl, triton
from .state_codecs import (bf16_load, bf16_nearest, bf16_stochastic, bf16_store, block_exponent, e4m3_decode,
                           e4m3_stochastic, pow2, random_bits)

KIND = "adamw_state"
BLOCK = 64  # store/moments.BLOCK (not imported: kernels know nothing of megatrain_cli; the caller checks it)
BLOCKS = 16  # int8 blocks per program: 1024 elements, 8 per thread at 4 warps (not tuned on the H200 yet)
LAUNCH_OPTIONS = {"enable_fp_fusion": False}  # no FMA: torch rounds every product (module docstring)
KEY_TYPE = 1 << 32  # or-ed into the 32-bit stochastic-rounding keys at launch (the kernel's comment says why)


def f32(x: float) -> float:
    """`x` rounded to the nearest fp32 (exact from here on: the launch's fp32 argument is this value)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@triton.jit
def _load_f32(ptr, offs, mask, IS_BF16: tl.constexpr):
    if IS_BF16:
        x = bf16_load(ptr, offs, mask)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x


# Triton compiles a kernel per signature, and types an int argument by its value: i32 below 2^31, i64 above, a
# specialisation when divisible by 16. Per-step keys would give up to 4^3 signatures, a compile (~1 s) at random
# steps; not specialised, and lifted above 2^32 (KEY_TYPE: always i64; the kernel uses their low 32 bits), one.
@triton.jit(do_not_specialize=["key_m", "key_v", "key_p"])
def _adamw_state_kernel(master_ptr, grad_ptr, m_ptr, v_ptr, m_exp_ptr, v_exp_ptr, clip_ptr, bc2s_ptr,
                        n, decay_numel, origin, key_m, key_v, key_p,
                        w1, beta2, c2, eps, neg_step, decay,
                        INT8: tl.constexpr, MASTER_BF16: tl.constexpr, GRAD_BF16: tl.constexpr,
                        SR_MASTER: tl.constexpr, SCALED: tl.constexpr,
                        BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)  # the program's blocks, [BLOCKS]
    pos = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # tile positions, [BLOCKS, BLOCK]
    live = pos < n
    idx = pos + origin  # stochastic rounding's element index

    if INT8:  # e4m3 codes times 2^e per block; the second moment is held as sqrt(v)
        has = blk * BLOCK < n
        m = e4m3_decode(tl.load(m_ptr + pos, mask=live, other=0).to(tl.int32))
        m = m * pow2(tl.load(m_exp_ptr + blk, mask=has, other=0).to(tl.int32))[:, None]
        t = e4m3_decode(tl.load(v_ptr + pos, mask=live, other=0).to(tl.int32))
        t = t * pow2(tl.load(v_exp_ptr + blk, mask=has, other=0).to(tl.int32))[:, None]
        v = t * t
    else:
        m = bf16_load(m_ptr, pos, live)
        v = bf16_load(v_ptr, pos, live)
    g = _load_f32(grad_ptr, pos, live, GRAD_BF16)
    p = _load_f32(master_ptr, pos, live, MASTER_BF16)

    # state_adamw.adam_math, op for op
    if SCALED:
        g = tl.div_rn(g, tl.load(clip_ptr))
    m = m + (g - m) * w1
    v = v * beta2 + (g * g) * c2
    root = tl.sqrt_rn(v)
    denom = tl.div_rn(root, tl.load(bc2s_ptr)) + eps
    p = tl.where(pos < decay_numel, p * decay, p)
    p = p + tl.div_rn(m * neg_step, denom)

    # the new weight: stochastically to bf16 (key_p), to nearest even (a bf16 master), or as it is
    if SR_MASTER:
        bits = bf16_stochastic(p, idx, key_p)
        if MASTER_BF16:
            bf16_store(master_ptr, pos, bits, live)
        else:  # state_adamw.store_master's bf16 copied into an fp32 master: widened exactly
            tl.store(master_ptr + pos, (bits << 16).to(tl.float32, bitcast=True), mask=live)
    elif MASTER_BF16:
        bf16_store(master_ptr, pos, bf16_nearest(p), live)
    else:
        tl.store(master_ptr + pos, p, mask=live)

    if INT8:  # m and sqrt(v) coded per block: exponent from the block's absmax, codes rounded stochastically
        e = block_exponent(tl.max(tl.where(live, tl.abs(m), 0.0), axis=1))
        tl.store(m_exp_ptr + blk, e.to(tl.int8), mask=has)
        code = e4m3_stochastic(m * pow2(-e)[:, None], random_bits(idx, key_m))
        tl.store(m_ptr + pos, code.to(tl.uint8), mask=live)
        e = block_exponent(tl.max(tl.where(live, root, 0.0), axis=1))
        tl.store(v_exp_ptr + blk, e.to(tl.int8), mask=has)
        code = e4m3_stochastic(root * pow2(-e)[:, None], random_bits(idx, key_v))
        tl.store(v_ptr + pos, code.to(tl.uint8), mask=live)
    else:
        bf16_store(m_ptr, pos, bf16_stochastic(m, idx, key_m), live)
        bf16_store(v_ptr, pos, bf16_stochastic(v, idx, key_v), live)


def _bits_view(x: torch.Tensor) -> torch.Tensor:
    """What the kernel reads: bf16 as int16 bits, fp8 as uint8 bits, fp32 / int8 as they are (same storage)."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16)
    if x.dtype == torch.float8_e4m3fn:
        return x.view(torch.uint8)
    return x


def supports(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, moments: str) -> bool:
    """Whether the kernel takes these sections: fp32 / bf16 masters and gradients, contiguous, bf16 or int8
    moments of the master's length (anything else: the caller's torch path)."""
    floats = (torch.float32, torch.bfloat16)
    want = {"bf16": torch.bfloat16, "int8": torch.float8_e4m3fn}.get(moments)
    return (master.dtype in floats and grad.dtype in floats and exp_avg.dtype == want
            and master.numel() == grad.numel() == exp_avg.numel()
            and all(t.is_contiguous() for t in (master, grad, exp_avg)))


def adamw_state_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       exp_avg_exp: torch.Tensor | None, exp_avg_sq_exp: torch.Tensor | None,
                       divisors: tuple[torch.Tensor, torch.Tensor], *, int8: bool, decay_numel: int,
                       w1: float, beta2: float, c2: float, eps: float, neg_step: float, decay: float,
                       scaled: bool, key_m: int, key_v: int, key_p: int | None, origin: int) -> None:
    """One AdamW step over a tile's flat sections, in place, in one launch (module docstring): the arguments
    of state_adamw.update_state with its StepConsts spelled out (`scaled`: inv_clip != 1) and `divisors`
    its _divisors (fp32 device scalars 1 / clip and sqrt(bc2)). key_p None: no stochastic master rounding."""
    n = master.numel()
    if n == 0:
        return
    if int8 and (exp_avg_exp is None or exp_avg_sq_exp is None or exp_avg_exp.numel() < cdiv(n, BLOCK)):
        raise ValueError(f"int8 moments need {cdiv(n, BLOCK)} block exponents per moment")
    exps = (exp_avg_exp, exp_avg_sq_exp) if int8 else (master, master)  # unread unless INT8
    grid = (cdiv(cdiv(n, BLOCK), BLOCKS),)
    _adamw_state_kernel[grid](
        _bits_view(master), _bits_view(grad), _bits_view(exp_avg), _bits_view(exp_avg_sq), *exps, *divisors,
        n, decay_numel, origin, key_m | KEY_TYPE, key_v | KEY_TYPE, (0 if key_p is None else key_p) | KEY_TYPE,
        f32(w1), f32(beta2), f32(c2), f32(eps), f32(neg_step), f32(decay),
        INT8=int8, MASTER_BF16=master.dtype == torch.bfloat16, GRAD_BF16=grad.dtype == torch.bfloat16,
        SR_MASTER=key_p is not None, SCALED=scaled, BLOCKS=BLOCKS, BLOCK=BLOCK,
        **LAUNCH_OPTIONS)
