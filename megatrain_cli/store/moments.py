"""The formats Adam's moments are held in (train.optimizer_state): what a tile's exp_avg / exp_avg_sq
sections mean, and the torch codec between them and fp32 (docs/precision.md, "Optimizer state").

  fp32  the moments as they are (4 + 4 bytes/param): torch's AdamW, bit for bit.
  bf16  m and v rounded to bf16 (2 + 2 bytes). Written back by the update with STOCHASTIC rounding: round
        to nearest would lose every change below half a bf16 step (~0.4%), and v moves by (1 - beta2) =
        0.1% a step, so v would freeze. The random bits are a hash of (train.seed, tile, step, moment,
        element index), not a generator's state: reproducible whatever the threads, chunks or ranks, and
        the same on the host and the device. Chosen over an error-compensated update, which needs a
        second buffer of the bytes this setting saves.
  int8  8-bit codes (1 + 1 bytes) in blocks of BLOCK elements, each block scaled by a power of two (one
        int8 exponent per block and moment: 1/64 byte/param). The code is an fp8 e4m3 number (torch's
        float8_e4m3fn): a dynamic, exponent-and-mantissa map as bitsandbytes' 8-bit Adam uses, here
        computed rather than looked up, and written back by the update with stochastic rounding as bf16 is
        (3 mantissa bits: v's 0.1% a step would otherwise never move a code; measured, a noisy quadratic's
        sqrt(v) froze at half its value). m is coded as it is; the second moment as sqrt(v), which halves
        the dynamic range a block must span (2^17 in sqrt(v) = 2^35 in v, from the block's largest down),
        and sqrt(v) is what the update divides by. A linear int8 code of sqrt(v) would round small entries
        of a block to 0, and a step of m / (0 + eps) with them; e4m3 keeps 3 mantissa bits at every scale.
        Power-of-two scales make scaling exact: a block's codes, decoded to fp32 and coded again, give
        the same fp32 values (v = t * t with t of 4 significant bits, exact in fp32), so a checkpoint
        holds the moments as fp32 and a resume continues bit for bit (checkpoint/layout.py).

BLOCK is SHARD_ALIGN (store/sharded.py): a rank's shard starts on a block boundary of the whole tile, so
N ranks quantise in the blocks one process does. Blocks count from the tile's (or shard's) first element.
"""

from __future__ import annotations

import zlib

import torch

BLOCK = 64  # elements per int8 block: one exponent per block and moment
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float8_e4m3fn}
CODE_MAX = 448.0  # the largest e4m3 value: a block's largest magnitude codes into (224, 448]
_M32 = 0xFFFFFFFF


def block_count(numel: int) -> int:
    return -(-numel // BLOCK)


def moment_bytes_per_param(moments: str) -> float:
    """Host bytes of both moments per parameter (int8: codes and block exponents)."""
    width = torch.finfo(MOMENT_DTYPES[moments]).bits // 8
    return 2 * width + (2 / BLOCK if moments == "int8" else 0)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 sqrt rounded correctly (as C++'s std::sqrt and CUDA's): torch's vectorised CPU fp32 sqrt is off
    by an ulp for ~1 value in 6; the double sqrt rounded to fp32 is exact (53 >= 2 * 24 + 2 bits)."""
    return x.double().sqrt().to(torch.float32)


# ---------------------------------------------------------------- the random bits of stochastic rounding
def mix32(x: int) -> int:
    """A 32-bit integer hash (a bijection: distinct inputs give distinct outputs); the C++ kernel's mix32."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


MASTER = 2  # sr_key's `moment` for a bf16 master's stochastic rounding (train.master_rounding)


def sr_key(seed: int, tile: str, step: int, moment: int) -> int:
    """The key of one tile's step's moment (0: m, 1: v; MASTER: the bf16 master weights); an element's bits
    are mix32(key ^ index)."""
    h = mix32((seed & _M32) ^ zlib.crc32(tile.encode()))
    return mix32(mix32(h ^ (step & _M32)) ^ moment)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x < 2^32, in two halves so no product leaves int64."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stochastic_bf16(x: torch.Tensor, key: int, first: int) -> torch.Tensor:
    """fp32 -> bf16 rounded stochastically: the magnitude's low 16 bits plus 16 random bits carry into the
    kept ones with probability (dropped part) / (one bf16 step). Element i's bits: mix32(key ^ (first + i))."""
    idx = torch.arange(first, first + x.numel(), dtype=torch.int64, device=x.device)
    noise = (mix32_tensor(idx ^ key) & 0xFFFF).to(torch.int32)
    bits = (x.contiguous().view(torch.int32) + noise) & -65536  # int32: a negative x's sign bit stays
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


# ---------------------------------------------------------------- int8: e4m3 codes in power-of-two blocks
def block_exponents(absmax: torch.Tensor) -> torch.Tensor:
    """Per block, the least e with absmax <= 448 * 2^e (448 = 0.875 * 2^9), clamped to [-126, 126]
    so 2^e and 2^-e are normal fp32 numbers (an all-zero block: any e; -9)."""
    mant, ex = torch.frexp(absmax)
    return (ex - 9 + (mant > 0.875).to(ex.dtype)).clamp_(-126, 126).to(torch.int8)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e (e in [-126, 126]) built from its bits: exact on every device (a pow need not be)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def stochastic_e4m3(y: torch.Tensor, key: int, first: int) -> torch.Tensor:
    """fp32 `y` (|y| <= 448) -> e4m3 codes rounded stochastically with 20 random bits, mix32(key ^ (first + i)):
    above e4m3's subnormals the 20 dropped mantissa bits plus the random ones carry into the kept 3; below,
    floor(y * 2^9 + r / 2^20), in units of the subnormal step 2^-9."""
    idx = torch.arange(first, first + y.numel(), dtype=torch.int64, device=y.device)
    r = mix32_tensor(idx ^ key) & 0xFFFFF
    bits = y.contiguous().view(torch.int32)
    u = bits.to(torch.int64) & 0x7FFFFFFF
    sub = (u.to(torch.int32).view(torch.float32) * 512.0 + r.to(torch.float32) * 2.0 ** -20).to(torch.int64)
    norm = ((u + r) >> 20) - (120 << 3)
    code = torch.where(u < (121 << 23), sub, norm) | ((bits < 0).to(torch.int64) << 7)
    return code.to(torch.uint8).view(torch.float8_e4m3fn)


def encode_int8(x: torch.Tensor, codes: torch.Tensor, exps: torch.Tensor, key: int | None = None,
                first: int = 0) -> None:
    """Code fp32 `x` (a whole number of blocks, the last one possibly short) into `codes` and `exps`: rounded
    to nearest (key None: loading, converting), or stochastically (an update: stochastic_e4m3)."""
    n = x.numel()
    pad = block_count(n) * BLOCK - n
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)
    e = block_exponents(blocks.abs().amax(dim=1))
    exps.copy_(e)
    y = (blocks * _pow2(-e.to(torch.int32))[:, None]).reshape(-1)[:n]
    codes.copy_(y.to(torch.float8_e4m3fn) if key is None else stochastic_e4m3(y, key, first))


def decode_int8(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    n = codes.numel()
    pad = block_count(n) * BLOCK - n
    f = torch.nn.functional.pad(codes.to(torch.float32), (0, pad)).view(-1, BLOCK)
    return (f * _pow2(exps)[:, None]).reshape(-1)[:n]


# ---------------------------------------------------------------- a tile's moments as fp32
def _block_range(lo: int, hi: int) -> slice:
    if lo % BLOCK:
        raise ValueError(f"int8 moments are read and written in whole {BLOCK}-element blocks: {lo} is not on one")
    return slice(lo // BLOCK, block_count(hi))


def read_moment(tile, section: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Elements [lo, hi) of the tile's `section` ('exp_avg' or 'exp_avg_sq') as a new fp32 tensor (lo on a
    block boundary for int8)."""
    hi = tile.exp_avg.numel() if hi is None else hi
    codes = getattr(tile, section)[lo:hi]
    if tile.moments != "int8":
        return codes.to(torch.float32, copy=True)
    t = decode_int8(codes, getattr(tile, section + "_exp")[_block_range(lo, hi)])
    return t * t if section == "exp_avg_sq" else t


def write_moment(tile, section: str, x: torch.Tensor, lo: int = 0) -> None:
    """Store fp32 `x` as elements [lo, lo + numel) of the tile's `section`, rounded to nearest (bf16) or coded
    (int8; lo on a block boundary, the range ends on one or at the tile's end): loading a checkpoint, or
    converting one written with another optimizer_state."""
    hi = lo + x.numel()
    dst = getattr(tile, section)[lo:hi]
    if tile.moments != "int8":
        dst.copy_(x)
        return
    encode_int8(sqrt_rn(x) if section == "exp_avg_sq" else x, dst, getattr(tile, section + "_exp")[_block_range(lo, hi)])


def read_moments(tile, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Elements [lo, hi) of the tile's m and v as new fp32 tensors."""
    return read_moment(tile, "exp_avg", lo, hi), read_moment(tile, "exp_avg_sq", lo, hi)


def write_moments(tile, m: torch.Tensor, v: torch.Tensor, lo: int = 0) -> None:
    write_moment(tile, "exp_avg", m, lo)
    write_moment(tile, "exp_avg_sq", v, lo)
