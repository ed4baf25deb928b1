"""The fused AdamW-over-quantised-state kernel (kernels/adamw_state.py) against update_state's torch path
(optim/state_adamw.update_state_torch), byte for byte: masters, moment codes and int8 block exponents, for
bf16 / int8 moments x fp32 / bf16 masters x fp32 / bf16 gradients x key_p None / set, over 3 consecutive
steps (the second clipped), with a weight-decay boundary inside a block, a short last block, an origin past
2^31, a zero block (exponent -9) and fp32 subnormals (g * g and v). Then its codecs alone: every e4m3 code,
block maxima around every exponent boundary, bf16 ties, e4m3's subnormal boundary, an index past 2^32.

Run: python -m pytest -q tests/triton/test_adamw_state.py       (CUDA: python -m pytest -q -m cuda ...)
On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before
triton is imported): sizes are ~1300 elements. The CUDA test runs the same cases through update_state's
dispatch on the device, plus one of a million elements (many programs).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernel runs on the CPU only under TRITON_INTERPRET=1 (tests/conftest.py sets it)",
                allow_module_level=True)
pytest.importorskip("triton")

from megatrain_cli import kernels  # noqa: E402
from megatrain_cli.kernels import adamw_state  # noqa: E402
from megatrain_cli.kernels._triton import tl, triton  # noqa: E402
from megatrain_cli.kernels.state_codecs import (  # noqa: E402
    bf16_nearest, bf16_stochastic, block_exponent, e4m3_decode, e4m3_stochastic, random_bits)
from megatrain_cli.optim import state_adamw, state_fused  # noqa: E402
from megatrain_cli.store.moments import (BLOCK, block_exponents, encode_int8, sqrt_rn, stochastic_bf16,  # noqa: E402
                                        stochastic_e4m3)

N, DECAY = 20 * BLOCK + 23, 7 * BLOCK + 19  # a short last block (23); decay ends inside block 7
ORIGIN = 2**31 + 4099
KEYS = dict(key_m=0x9E3779B9, key_v=0x01234567, key_p=0xDEADBEEF)  # one >= 2^31 (an i64 argument), one not
CLIPS = (1.0, 0.37, 1.0)  # step 2 divides the gradient by fp32(1 / 0.37)
ZERO_BLOCK = 3  # moments and gradients all zero there at step 1


@pytest.fixture(autouse=True)
def no_silent_fallback(monkeypatch):
    monkeypatch.setattr(kernels, "_fallen_back", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to the torch path would make the test vacuous
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_state(n: int, moments: str, master: torch.dtype, device: torch.device) -> dict:
    """A tile's sections, moments as a few steps of Adam would leave them (int8: coded to nearest)."""
    p = torch.randn(n, generator=_gen(1)) * 0.02
    m = torch.randn(n, generator=_gen(2)) * 1e-3
    v = (torch.randn(n, generator=_gen(3)) * 1e-3) ** 2
    z = slice(ZERO_BLOCK * BLOCK, (ZERO_BLOCK + 1) * BLOCK)
    m[z], v[z] = 0.0, 0.0
    s = {"master": p.to(master)}
    if moments == "bf16":
        s.update(exp_avg=m.bfloat16(), exp_avg_sq=v.bfloat16(), exp_avg_exp=None, exp_avg_sq_exp=None)
    else:
        def codes():
            return torch.empty(n, dtype=torch.float8_e4m3fn)

        def exps():
            return torch.empty(-(-n // BLOCK), dtype=torch.int8)

        s.update(exp_avg=codes(), exp_avg_sq=codes(), exp_avg_exp=exps(), exp_avg_sq_exp=exps())
        encode_int8(m, s["exp_avg"], s["exp_avg_exp"])
        encode_int8(sqrt_rn(v), s["exp_avg_sq"], s["exp_avg_sq_exp"])
    return {k: None if x is None else x.to(device) for k, x in s.items()}


def make_grad(n: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Mostly N(0, 1e-2); some large (1e2), some tiny (g * g subnormal), some exactly 0."""
    g = torch.randn(n, generator=_gen(10 + step)) * 1e-2
    g[5::97] *= 1e4
    g[11::89] = 3e-21 * (1 + torch.arange(len(g[11::89])))
    g[17::101] = 0.0
    z = g[ZERO_BLOCK * BLOCK:(ZERO_BLOCK + 1) * BLOCK]
    if step == 1:
        z[:] = 0.0
    else:  # v was 0 there: g * g and v are fp32 subnormals, which a device flushing them would zero; v of
        z[::2] = 1e-21  # ~1e-41 is stored as bf16 2^-133 (its least) ~11% of the time, so 32 such are seen
        z[1::2] = 1e-19
    return g.to(device, dtype)


def sections(s: dict) -> tuple:
    return tuple(s[k] for k in ("master", "grad", "exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp"))


def as_bytes(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.contiguous().view(torch.uint8).cpu().clone()  # a copy, not a view


def assert_same_bytes(got: dict, want: dict, step: int) -> None:
    for name in ("master", "exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp"):
        a, b = as_bytes(got[name]), as_bytes(want[name])
        if a is None:
            assert b is None
            continue
        diff = (a != b).nonzero().flatten()
        assert diff.numel() == 0, f"step {step}: {name} differs in {diff.numel()} bytes, first at {diff[:8].tolist()}"


def run_steps(n: int, moments: str, master: torch.dtype, grad: torch.dtype, sr_master: bool, device: torch.device,
              fused) -> tuple[dict, dict]:
    """3 steps of the torch path and of `fused(state, step, k, keys)` from the same state; the bytes compared
    after every step."""
    ref, got = make_state(n, moments, master, device), make_state(n, moments, master, device)
    before = as_bytes(ref["master"])
    for step, clip in enumerate(CLIPS, start=1):
        k = state_adamw.StepConsts.make(step, 1e-3, 0.9, 0.999, 1e-8, 0.1, clip)
        keys = dict(key_m=KEYS["key_m"] ^ step, key_v=KEYS["key_v"] ^ step,
                    key_p=KEYS["key_p"] ^ step if sr_master else None)
        ref["grad"] = got["grad"] = make_grad(n, step, grad, device)
        state_adamw.update_state_torch(*sections(ref), moments=moments, decay_numel=DECAY, k=k, origin=ORIGIN, **keys)
        fused(got, k, keys)
        assert_same_bytes(got, ref, step)
        if step == 1 and moments == "int8":  # the all-zero block took zero's exponent, its neighbour did not
            assert ref["exp_avg_exp"][ZERO_BLOCK] == -9 and ref["exp_avg_exp"][ZERO_BLOCK + 1] != -9
    assert not torch.equal(as_bytes(ref["master"]), before)  # the steps moved the weights
    return got, ref


CASES = [(mo, ma, g, sr) for mo in ("bf16", "int8") for ma in (torch.float32, torch.bfloat16)
         for g in (torch.bfloat16, torch.float32) for sr in (False, True)]


def _id(case) -> str:
    mo, ma, g, sr = case
    return f"{mo}-master_{str(ma)[6:]}-grad_{str(g)[6:]}-{'sr' if sr else 'nearest'}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernel_matches_torch_path_byte_for_byte(case):
    moments, master, grad, sr_master = case

    def fused(s, k, keys):  # through state_fused.update, which update_state calls on CUDA; no torch fallback
        state_fused.update(*sections(s), state_adamw._divisors(k, s["master"].device), _no_reference,
                           moments=moments, decay_numel=DECAY, k=k, origin=ORIGIN, **keys)

    run_steps(N, moments, master, grad, sr_master, torch.device("cuda" if CUDA else "cpu"), fused)


def _no_reference():
    raise AssertionError("the kernel failed and update_state's torch path was asked instead")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("n", [N, 1 << 20 | 37])
def test_update_state_dispatches_to_kernel_on_cuda(case, n, monkeypatch):
    """update_state on CUDA tensors takes the kernel (counted) and matches update_state_torch on the device."""
    moments, master, grad, sr_master = case
    calls = []
    kernel = adamw_state.adamw_state_update
    monkeypatch.setattr(adamw_state, "adamw_state_update", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))

    def dispatched(s, k, keys):
        state_adamw.update_state(*sections(s), moments=moments, decay_numel=DECAY, k=k, origin=ORIGIN, **keys)

    run_steps(n, moments, master, grad, sr_master, torch.device("cuda"), dispatched)
    assert calls == [1, 1, 1]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_keys_of_every_step_share_one_compiled_kernel():
    """Triton types an int argument by its value (i32 / i64) and specialises it (divisible by 16, equal to 1):
    the keys change every step and tile, and must not make new kernels (a compile each, ~1 s at random steps).
    One kernel for keys on both sides of 2^31, multiples of 16 and 1; each launch the torch path's bytes."""
    from triton.runtime import driver

    moments, n = "int8", 4 * BLOCK + 5
    compiled = adamw_state._adamw_state_kernel.device_caches[driver.active.get_current_device()][0]
    seen = []
    for key in (0x9E3779B9, 16, 1, 0x7FFFFFF0, 0x80000000, 5):
        ref, got = (make_state(n, moments, torch.bfloat16, torch.device("cuda")) for _ in range(2))
        k = state_adamw.StepConsts.make(1, 1e-3, 0.9, 0.999, 1e-8, 0.1, 1.0)
        keys = dict(key_m=key, key_v=key ^ 0x10, key_p=key)
        ref["grad"] = got["grad"] = make_grad(n, 2, torch.bfloat16, torch.device("cuda"))
        state_adamw.update_state_torch(*sections(ref), moments=moments, decay_numel=DECAY, k=k, origin=0, **keys)
        state_fused.update(*sections(got), state_adamw._divisors(k, got["master"].device), _no_reference,
                           moments=moments, decay_numel=DECAY, k=k, origin=0, **keys)
        assert_same_bytes(got, ref, 1)
        seen.append(len(compiled))
    assert seen[1:] == seen[:1] * (len(seen) - 1), f"kernels compiled after each launch: {seen}"


# ---------------------------------------------------------------- the codecs alone
@triton.jit
def _codec_kernel(code_ptr, decoded_ptr, absmax_ptr, exp_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    tl.store(decoded_ptr + offs, e4m3_decode(tl.load(code_ptr + offs, mask=live, other=0).to(tl.int32)), mask=live)
    tl.store(exp_ptr + offs, block_exponent(tl.load(absmax_ptr + offs, mask=live, other=0.0)).to(tl.int8), mask=live)


def test_codecs_match_torch():
    """Every e4m3 code decodes as torch's cast; the block exponent of maxima at and around every boundary
    448 * 2^e (and 0, subnormals, the clamp at +-126) is moments.block_exponents'."""
    device = torch.device("cuda" if CUDA else "cpu")
    codes = torch.arange(256, dtype=torch.uint8)
    bounds = torch.tensor([448.0 * 2.0 ** e for e in range(-140, 120, 4)], dtype=torch.float32)
    nudged = torch.cat([bounds, torch.nextafter(bounds, bounds * 2), torch.nextafter(bounds, bounds * 0)])
    absmax = torch.cat([nudged, torch.tensor([0.0, 1e-45, 1e-39, 1.1754942e-38, 1.0, 0.875, 0.8750001, 3e38])])
    absmax = torch.cat([absmax, torch.zeros(256 - absmax.numel())])[:256]
    decoded, exps = torch.empty(256, device=device), torch.empty(256, dtype=torch.int8, device=device)
    _codec_kernel[(1,)](codes.to(device), decoded, absmax.to(device), exps, 256, BLOCK=256)
    want = codes.view(torch.float8_e4m3fn).float()
    nan = want.isnan()
    assert nan.sum() == 2 and decoded.cpu()[nan].isnan().all()
    assert torch.equal(decoded.cpu()[~nan].view(torch.int32), want[~nan].view(torch.int32))  # -0.0 included
    assert torch.equal(exps.cpu(), block_exponents(absmax))
    assert set(exps.tolist()) >= {-126, -9, -8}  # clamped (subnormals), zero, and 1.0's


@triton.jit
def _rounding_kernel(x_ptr, y_ptr, nearest_ptr, sr_ptr, code_ptr, n, first, key, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    x = tl.load(x_ptr + offs, mask=live, other=0.0)
    idx = offs.to(tl.int64) + first
    tl.store(nearest_ptr + offs, bf16_nearest(x).to(tl.int32), mask=live)
    tl.store(sr_ptr + offs, bf16_stochastic(x, idx, key).to(tl.int32), mask=live)
    y = tl.load(y_ptr + offs, mask=live, other=0.0)
    tl.store(code_ptr + offs, e4m3_stochastic(y, random_bits(idx, key)), mask=live)


def test_roundings_match_torch():
    """bf16 to nearest even at ties (kept bit even and odd), max finite, inf, subnormals, -0.0; bf16 and e4m3
    rounded stochastically (moments.py's functions) at e4m3's subnormal boundary 2^-6, its extremes +-448
    and in between, with the index past 2^32 (wrapped) and a key >= 2^31."""
    device = torch.device("cuda" if CUDA else "cpu")
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x00008000,
                         0x00018000, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001], dtype=torch.int64)
    x = torch.cat([ties.to(torch.int32).view(torch.float32), torch.randn(500, generator=_gen(20)) * 3e-3])
    edges = [2.0 ** -6, -(2.0 ** -6), 2.0 ** -6 * 1.0000001, 2.0 ** -6 * 0.9999999, 448.0, -448.0, 2.0 ** -9, 0.0, -0.0]
    y = torch.cat([torch.tensor(edges), torch.randn(x.numel() - len(edges), generator=_gen(21)) * 20]).clamp(-448, 448)
    first, key, n = 2**32 - 100, 0xC0FFEE11, x.numel()
    out = [torch.empty(n, dtype=torch.int32, device=device) for _ in range(3)]
    _rounding_kernel[(1,)](x.to(device), y.to(device), *out, n, first, key, BLOCK=1024)
    nearest, sr, code = (o.cpu() for o in out)
    assert torch.equal(nearest, x.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF)
    assert torch.equal(sr, stochastic_bf16(x, key, first).view(torch.int16).to(torch.int32) & 0xFFFF)
    assert torch.equal(code, stochastic_e4m3(y, key, first).view(torch.uint8).to(torch.int32))
