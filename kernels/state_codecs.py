"""The element-wise codecs of the fused AdamW-over-quantised-state kernel (kernels/adamw_state.py), as
@triton.jit helpers: stochastic rounding's counter hash, bf16 by its bits, fp8 e4m3 codes and the int8
block's power-of-two exponent. Each is megatrain_cli/store/moments.py's torch codec written for one
element, to the bit; the kernels import nothing of megatrain_cli, so the references are named, not imported.

Integers are uint32 where moments.py emulates uint32 with int64 and masks: a uint32 multiply wraps mod 2^32
as its `_mul32` does, and `>>` on uint32 is the logical shift its masked int64 shift is. bf16 travels as its
16 bits (int16 views, widened by a shift): exact, and the same on every device and in the interpreter, where
a dtype conversion need not round as torch's does.
"""

from __future__ import annotations

from ._triton import tl, triton

# A NaN's bf16 is written 0x7FFF (a literal below: a jit function may read only constexpr globals, which the
# stand-in of _triton.py cannot build): CUDA's cvt.rn.bf16.f32, what torch's cast runs on sm_80+ (the GPUs
# this kernel is for); torch's CPU cast gives 0x7FC0. A NaN reaches the optimizer only on a step the skip
# check did not catch, and is garbage either way.


@triton.jit
def mix32(x):
    """store/moments.mix32 of uint32 `x` (a bijection on 32 bits)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B  # a literal in [2^31, 2^32) is uint32 in triton: the product stays uint32
    return x ^ (x >> 16)


@triton.jit
def random_bits(idx, key):
    """Element `idx`'s (int64) 32 random bits under `key`: mix32((idx ^ key) mod 2^32), as moments.py's
    mix32_tensor(idx ^ key), whose first step masks to 32 bits (a key's bits above 32, adamw_state's KEY_TYPE,
    drop out)."""
    return mix32((idx ^ key).to(tl.uint32))


@triton.jit
def bf16_load(ptr, offs, mask):
    """fp32 values of bf16 elements stored as int16 bits: exact (a bf16 is an fp32's top half)."""
    bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def bf16_store(ptr, offs, bits, mask):
    """bf16 bits (uint32, in the low 16) into an int16 view."""
    tl.store(ptr + offs, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def bf16_stochastic(x, idx, key):
    """moments.stochastic_bf16 of fp32 `x`: the low 16 random bits added to the magnitude's bits (the sign
    bit sits above any carry), the low half dropped. Returns the bf16 bits."""
    s = (x.to(tl.uint32, bitcast=True) + (random_bits(idx, key) & 0xFFFF)) & 0xFFFF0000
    return tl.where((s & 0x7FFFFFFF) > 0x7F800000, 0x7FFF, s >> 16)  # NaN: 0x7FFF (above)


@triton.jit
def bf16_nearest(x):
    """fp32 -> bf16 bits rounded to nearest even, as torch's cast (and adamw_state.cpp's bf16_rne)."""
    u = x.to(tl.uint32, bitcast=True)
    return tl.where(x != x, 0x7FFF, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)  # NaN: 0x7FFF (above)


@triton.jit
def pow2(e):
    """2^e for int32 e in [-126, 126], from its bits (moments._pow2): exact."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_decode(c):
    """fp32 value of e4m3fn codes `c` (int32, 0..255), as torch's float8_e4m3fn -> float32 (and adamw_state.cpp's
    decode_e4m3x8): exponent field 0 is m * 2^-9, otherwise the fields moved into an fp32's; 0x7F is NaN."""
    mag = c & 0x7F
    norm = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    f = tl.where(mag >= 8, norm, (c & 7).to(tl.float32) * 0.001953125)  # 2^-9: exact
    f = tl.where(mag == 0x7F, float("nan"), f)
    # the sign as a bit: triton's -f is 0 - f, which makes code 0x80 +0.0 where torch decodes -0.0
    return (f.to(tl.uint32, bitcast=True) | ((c & 0x80).to(tl.uint32) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_stochastic(y, r):
    """moments.stochastic_e4m3 of fp32 `y` (|y| <= 448) with random bits `r` (uint32): the code (int32, 0..255).
    Above e4m3's subnormals the 20 dropped mantissa bits plus r's low 20 carry into the kept 3; below, the
    fp32 floor(|y| * 2^9 + r * 2^-20) (two products and a sum, each rounded, as the torch path rounds them)."""
    bits = y.to(tl.uint32, bitcast=True)
    u = bits & 0x7FFFFFFF
    r = r & 0xFFFFF
    sub = (u.to(tl.float32, bitcast=True) * 512.0 + r.to(tl.float32) * 9.5367431640625e-07).to(tl.int32)  # 2^-20
    norm = ((u + r) >> 20).to(tl.int32) - (120 << 3)
    code = tl.where(u < (121 << 23), sub, norm) | ((bits >> 31) << 7).to(tl.int32)
    return code & 0xFF


@triton.jit
def block_exponent(absmax):
    """moments.block_exponents of fp32 `absmax` >= 0 from its bits: frexp's exponent ex (a normal number's
    biased exponent - 126) - 9, plus 1 where frexp's mantissa > 0.875 (fraction bits > 0x600000), clamped to
    [-126, 126]; a subnormal's is below -126 (clamped); zero's frexp is (0, 0): -9."""
    u = absmax.to(tl.int32, bitcast=True)
    biased = u >> 23
    e = biased - 135 + ((u & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    e = tl.where(biased == 0, -126, e)
    return tl.where(u == 0, -9, e)
