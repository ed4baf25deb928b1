"""The Triton kernels (kernels/) against their PyTorch references, forward and backward.

Run: python -m pytest -q tests/triton/test_kernels.py      (GPU extras: python -m pytest -q -m cuda tests/triton/test_kernels.py)

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors, slow: shapes are
small). The variable must be set before triton is first imported: triton decides at `@triton.jit` time, for
its own helpers as for our kernels, whether a function is interpreted (if something imported triton earlier
in the session, this module skips and says so). It is set only while this module imports and runs, so that
no later test (or subprocess) in the session picks the interpreter up.

Tolerances, relative to the largest magnitude of the expected tensor: fp32 1e-5, bf16 2e-2 (a few bf16 ulps:
the kernels compute in fp32 and round once where eager PyTorch rounds after every op).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
_saved_interpret = os.environ.get("TRITON_INTERPRET")
if not CUDA and "triton" in sys.modules and _saved_interpret != "1":
    # triton.language's own helpers were compiled-mode jitted at its import: the interpreter can't be had now
    pytest.skip("triton was imported before this module could set TRITON_INTERPRET=1: run "
                "`python -m pytest tests/triton/test_kernels.py` alone, or with TRITON_INTERPRET=1", allow_module_level=True)
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    from megatrain_cli import kernels
    from megatrain_cli.kernels import fused_linear_ce, rmsnorm, rope, swiglu
finally:  # the autouse fixture below sets it again around each test of this module only
    if _saved_interpret is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved_interpret

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def triton_path(monkeypatch):
    """Interpreter on (CPU only), and a clean fallback record so one test's failure can't hide another's."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "_fallen_back", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fallback would make every test vacuous
        yield


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape
    tol = TOL[dtype]
    scale = max(expected.abs().max().item(), 1e-6)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def grads_of(fn, inputs, grad_out):
    """fn(*inputs) and the gradients of <fn(*inputs), grad_out> against inputs (fresh leaves)."""
    leaves = [leaf(t) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out, [t.grad for t in leaves]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=generator(seed)) * scale).to(DEVICE, dtype)


# --- RMSNorm ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 48), (37, 33), (2, 130)])
def test_rms_norm_matches_hf_order_reference(shape, dtype):
    x = randn(*shape, dtype=dtype, seed=1)
    w = (1 + randn(shape[-1], seed=2, scale=0.1)).to(dtype)
    grad_y = randn(*shape, dtype=dtype, seed=3)
    y, (gx, gw) = grads_of(lambda a, b: rmsnorm.RMSNormFunction.apply(a, b, 1e-6), (x, w), grad_y)
    y_ref, (gx_ref, gw_ref) = grads_of(lambda a, b: rmsnorm.rms_norm_reference(a, b, 1e-6), (x, w), grad_y)
    assert y.dtype == y_ref.dtype and gx.dtype == dtype and gw.dtype == dtype
    for got, want in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        assert_close(got, want, dtype)


def test_rms_norm_public_function_takes_triton_path(monkeypatch):
    calls = []
    forward = rmsnorm._forward_triton
    monkeypatch.setattr(rmsnorm, "_forward_triton", lambda *a: calls.append(1) or forward(*a))
    x, w = randn(4, 16, seed=4), torch.ones(16, device=DEVICE)
    assert_close(rmsnorm.rms_norm(x, w, 1e-5), rmsnorm.rms_norm_reference(x, w, 1e-5), torch.float32)
    assert calls == [1]


# --- SwiGLU -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 48), (3, 5, 101), (2, 1500)])
def test_swiglu_matches_reference(shape, dtype):
    gate, up, grad = (randn(*shape, dtype=dtype, seed=s) for s in (5, 6, 7))
    y, grads = grads_of(swiglu.swiglu, (gate, up), grad)
    y_ref, grads_ref = grads_of(swiglu.swiglu_reference, (gate, up), grad)
    for got, want in ((y, y_ref), *zip(grads, grads_ref)):
        assert got.dtype == dtype
        assert_close(got, want, dtype)


# --- RoPE -------------------------------------------------------------------------------------------------

def cos_sin(B, T, D, dtype, layout):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    positions = torch.arange(T, dtype=torch.float32)[None, :] + 3 * torch.arange(B, dtype=torch.float32)[:, None]
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D], as HF's rotary embedding
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    if layout == "BTD":
        return cos, sin
    if layout == "1TD":
        return cos[:1], sin[:1]
    if layout == "TD":
        return cos[0], sin[0]
    return cos[:, None], sin[:, None]  # "B1TD"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,q_heads,kv_heads,T,D,layout", [
    (2, 3, 1, 5, 10, "BTD"), (1, 7, 2, 9, 16, "1TD"), (2, 4, 4, 3, 8, "TD"), (2, 2, 1, 4, 6, "B1TD")])
def test_rope_matches_reference(B, q_heads, kv_heads, T, D, layout, dtype):
    # q as HF makes it: a [B, T, heads, D] projection viewed as [B, heads, T, D] (not contiguous)
    q = randn(B, T, q_heads, D, dtype=dtype, seed=8).transpose(1, 2)
    k = randn(B, kv_heads, T, D, dtype=dtype, seed=9)
    cos, sin = cos_sin(B, T, D, dtype, layout)
    if layout in ("1TD", "TD"):  # same positions for every sequence: broadcast the first one's
        cos, sin = cos_sin(1, T, D, dtype, layout)
    grad_q, grad_k = randn(*q.shape, dtype=dtype, seed=10), randn(*k.shape, dtype=dtype, seed=11)

    def run(fn):
        q_leaf, k_leaf = leaf(q), leaf(k)
        q_out, k_out = fn(q_leaf, k_leaf, cos, sin)
        torch.autograd.backward([q_out, k_out], [grad_q, grad_k])
        return q_out, k_out, q_leaf.grad, k_leaf.grad

    for got, want in zip(run(rope.apply_rope), run(rope.apply_rope_reference)):
        assert got.dtype == dtype
        assert_close(got, want, dtype)


def test_rope_rejects_cos_that_does_not_broadcast():
    q, k = randn(1, 2, 4, 8), randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="broadcast"):
        rope.apply_rope(q, k, randn(5, 8), randn(5, 8))


# --- fused linear + cross-entropy -------------------------------------------------------------------------

def ce_inputs(N, H, V, dtype, ignored=(), seed=12):
    hidden = randn(N, H, dtype=dtype, seed=seed)
    weight = randn(V, H, dtype=dtype, seed=seed + 1, scale=0.3)
    labels = torch.randint(0, V, (N,), generator=generator(seed + 2)).to(DEVICE)
    labels[list(ignored)] = -100
    return hidden, weight, labels


def assert_ce_close(got, want, dtype):
    (loss, gh, gw), (loss_ref, gh_ref, gw_ref) = got, want
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert gh.dtype == dtype and gw.dtype == torch.float32
    for a, b in ((loss, loss_ref), (gh, gh_ref), (gw, gw_ref)):
        assert_close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H,V,chunk,ignored,scale", [
    (37, 48, 101, 8, [*range(8, 16), 0, 20, 36], 1.0),  # chunk 1 all ignored, plus scattered ignores
    (16, 32, 64, 16, [3], 0.25),                          # one chunk
    (5, 16, 7, 2, [], 1 / 3),                             # tiny vocab, last chunk of one row
])
def test_fused_linear_cross_entropy_matches_unchunked_reference(N, H, V, chunk, ignored, scale, dtype):
    hidden, weight, labels = ce_inputs(N, H, V, dtype, ignored)
    got = fused_linear_ce.fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk, scale=scale)
    want = fused_linear_ce.fused_linear_cross_entropy_reference(hidden, weight, labels, chunk_tokens=N, scale=scale)
    assert_ce_close(got, want, dtype)
    if N == 37:
        assert not got[1][8:16].any()  # the all-ignored chunk: zero gradient


def test_fused_linear_cross_entropy_online_logsumexp_over_several_vocab_blocks(monkeypatch):
    monkeypatch.setattr(fused_linear_ce, "MAX_BLOCK_V", 32)  # V=101 -> 4 blocks per row, last one partial
    hidden, weight, labels = ce_inputs(9, 16, 101, torch.float32, [4])
    weight[7] += 5.0  # one large logit column: the running max must move between blocks
    got = fused_linear_ce.fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    want = fused_linear_ce.fused_linear_cross_entropy_reference(hidden, weight, labels, chunk_tokens=9)
    assert_ce_close(got, want, torch.float32)


def test_fused_linear_cross_entropy_reference_matches_plain_autograd():
    hidden, weight, labels = ce_inputs(11, 8, 13, torch.float32, [2, 3])
    h, w = leaf(hidden), leaf(weight)
    loss = 0.5 * torch.nn.functional.cross_entropy(h @ w.t(), labels, reduction="sum")
    loss.backward()
    got = fused_linear_ce.fused_linear_cross_entropy_reference(hidden, weight, labels, chunk_tokens=4, scale=0.5)
    assert_ce_close(got, (loss.detach(), h.grad, w.grad), torch.float32)


def test_fused_linear_cross_entropy_never_holds_more_than_a_chunk_of_logits(monkeypatch):
    N, V, chunk = 37, 101, 8
    hidden, weight, labels = ce_inputs(N, 48, V, torch.float32, [1])
    seen = []
    cross_entropy, softmax_grad = torch.nn.functional.cross_entropy, fused_linear_ce._softmax_minus_onehot_
    monkeypatch.setattr(torch.nn.functional, "cross_entropy",
                        lambda logits, *a, **k: seen.append(tuple(logits.shape)) or cross_entropy(logits, *a, **k))
    monkeypatch.setattr(fused_linear_ce, "_softmax_minus_onehot_",
                        lambda logits, *a: seen.append(tuple(logits.shape)) or softmax_grad(logits, *a))
    chunked = fused_linear_ce.fused_linear_cross_entropy_reference(hidden, weight, labels, chunk_tokens=chunk)
    assert seen and max(rows for rows, _ in seen) == chunk and len(seen) == 5
    seen.clear()
    fused = fused_linear_ce.fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    assert seen and max(rows for rows, _ in seen) == chunk and len(seen) == 5
    whole = fused_linear_ce.fused_linear_cross_entropy_reference(hidden, weight, labels, chunk_tokens=N)
    assert_ce_close(chunked, whole, torch.float32)
    assert_ce_close(fused, whole, torch.float32)


def test_fused_linear_cross_entropy_all_ignored_is_zero_without_work(monkeypatch):
    hidden, weight, labels = ce_inputs(10, 8, 13, torch.bfloat16, range(10))
    monkeypatch.setattr(torch, "mm", None)  # no chunk may run a matmul
    loss, gh, gw = fused_linear_ce.fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    assert loss.item() == 0.0 and not gh.any() and not gw.any()


def test_fused_linear_cross_entropy_rejects_out_of_range_labels():
    hidden, weight, labels = ce_inputs(6, 8, 13, torch.float32)
    labels[2] = 13
    with pytest.raises(ValueError, match="outside"):
        fused_linear_ce.fused_linear_cross_entropy(hidden, weight, labels)


# --- registry and fallback --------------------------------------------------------------------------------

def test_load_returns_the_public_functions():
    assert kernels.available()
    assert kernels.load("rms_norm") is rmsnorm.rms_norm
    assert kernels.load("rope") is rope.apply_rope
    assert kernels.load_reference("swiglu") is swiglu.swiglu_reference
    assert kernels.load("fused_linear_cross_entropy") is fused_linear_ce.fused_linear_cross_entropy
    with pytest.raises(KeyError):
        kernels.load("flash_attention")


def test_failing_triton_kernel_falls_back_with_exactly_one_warning(monkeypatch):
    def broken(*args):
        raise RuntimeError("simulated compile failure")

    monkeypatch.setattr(swiglu, "_forward_triton", broken)
    gate, up, grad = (randn(4, 9, seed=s) for s in (13, 14, 15))
    want, want_grads = grads_of(swiglu.swiglu_reference, (gate, up), grad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            got, got_grads = grads_of(swiglu.swiglu, (gate, up), grad)
            torch.testing.assert_close(got, want)
            for a, b in zip(got_grads, want_grads):
                torch.testing.assert_close(a, b)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "simulated compile failure" in messages[0] and "swiglu" in messages[0]
    assert "swiglu" in kernels._fallen_back and "rms_norm" not in kernels._fallen_back


def test_failing_backward_kernel_falls_back_to_reference_gradients(monkeypatch):
    monkeypatch.setattr(rmsnorm, "_backward_triton", lambda *a: 1 / 0)
    x, w, grad = randn(5, 12, seed=16), 1 + randn(12, seed=17, scale=0.1), randn(5, 12, seed=18)
    with pytest.warns(RuntimeWarning, match="ZeroDivisionError"):
        _, got = grads_of(lambda a, b: rmsnorm.rms_norm(a, b, 1e-6), (x, w), grad)
    _, want = grads_of(lambda a, b: rmsnorm.rms_norm_reference(a, b, 1e-6), (x, w), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_missing_triton_warns_once_for_all_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "triton_import_error", lambda: ImportError("no module named triton"))
    x, w = randn(3, 8, seed=19), torch.ones(8, device=DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rmsnorm.rms_norm(x, w)
        swiglu.swiglu(x, x)
        swiglu.swiglu(x, x)
    assert [str(w.message).count("every kernel") for w in caught] == [1]


def test_package_imports_and_falls_back_without_triton():
    """What CI without triton sees: the package and the references work; `available()` says no."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, warnings\n"
            "from megatrain_cli import kernels\n"
            "assert not kernels.available()\n"
            "x = torch.randn(3, 8)\n"
            "y = kernels.load('rms_norm')(x, torch.ones(8))\n"
            "torch.testing.assert_close(y, kernels.load_reference('rms_norm')(x, torch.ones(8)))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --- GPU only: memory and speed at realistic sizes --------------------------------------------------------

def peak_and_time(fn):
    torch.cuda.synchronize()
    fn()  # compile / warm up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, time.perf_counter() - start


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_cuda_fused_cross_entropy_at_qwen_vocab_beats_reference_memory(dtype):
    N, H, V, chunk = 4096, 1024, 152064, 1024
    hidden, weight, labels = ce_inputs(N, H, V, dtype, range(0, N, 7))
    got = fused_linear_ce.fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    want = fused_linear_ce.fused_linear_cross_entropy_reference(hidden, weight, labels, chunk_tokens=chunk)
    assert_ce_close(got, want, dtype)
    del got, want
    fused_peak, _ = peak_and_time(
        lambda: fused_linear_ce.fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk))
    ref_peak, _ = peak_and_time(
        lambda: fused_linear_ce.fused_linear_cross_entropy_reference(hidden, weight, labels, chunk_tokens=chunk))
    outputs = N * H * hidden.element_size() + V * H * 4
    one_chunk = chunk * V * hidden.element_size()
    # without cuBLAS's bf16 -> fp32 addmm (older torch) each chunk's [V, H] weight gradient is a temporary
    rounded_partial = 0 if fused_linear_ce._addmm_out_dtype_works is not False else V * H * hidden.element_size()
    assert fused_peak <= outputs + one_chunk + rounded_partial + 2**26, (fused_peak, outputs, one_chunk)
    assert fused_peak < ref_peak


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_cuda_elementwise_kernels_are_not_slower_than_eager():
    """Loose (1.5x) on purpose: a guard against a badly configured kernel, not a benchmark (see scripts/)."""
    dtype = torch.bfloat16
    x, w = randn(8192, 3584, dtype=dtype), torch.ones(3584, device=DEVICE, dtype=dtype)
    gate, up = randn(8192, 18944, dtype=dtype, seed=1), randn(8192, 18944, dtype=dtype, seed=2)
    q, k = randn(2, 28, 4096, 128, dtype=dtype), randn(2, 4, 4096, 128, dtype=dtype)
    cos, sin = cos_sin(2, 4096, 128, dtype, "BTD")
    cases = {
        "rms_norm": (lambda: rmsnorm.rms_norm(x, w), lambda: rmsnorm.rms_norm_reference(x, w)),
        "swiglu": (lambda: swiglu.swiglu(gate, up), lambda: swiglu.swiglu_reference(gate, up)),
        "rope": (lambda: rope.apply_rope(q, k, cos, sin), lambda: rope.apply_rope_reference(q, k, cos, sin)),
    }
    for name, (fast, eager) in cases.items():
        fast_time = min(peak_and_time(fast)[1] for _ in range(3))
        eager_time = min(peak_and_time(eager)[1] for _ in range(3))
        assert fast_time <= 1.5 * eager_time, (name, fast_time, eager_time)
