"""The gradient norm (and so the clip coefficient) is exact to fp64 rounding, on tiles of any size.

An fp32 dot over a large tile ran 1e-5..5e-4 low on the CPU (issue #32: a real 135M model's logged norm was
2e-5..3.5e-5 low at every step); engine/grad_norm.py accumulates in fp64, chunk by chunk.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatrain_cli.engine.grad_norm import CHUNK, ROW, squared_norm
from megatrain_cli.models.loader import build_store
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.reference import random_batches, tiny_config


def test_squared_norm_of_a_large_tile_matches_fp64():
    g = torch.Generator().manual_seed(0)
    # 30M elements (larger than the 135M model's tied embedding), not a multiple of CHUNK: the tail counts
    # too. Like a softmax gradient: mostly tiny terms, a few large ones, the case fp32 sums lose most on.
    flat = torch.rand(30_000_000 + 517, generator=g) * 1e-6
    flat[::4099] = 1e-2
    want = flat.double().square().sum().item()
    assert abs(torch.dot(flat, flat).item() / want - 1) > 1e-6, "fp32 accumulation must be visibly off here"
    got = squared_norm(flat)
    assert got.dtype == torch.float64 and got.shape == () and got.device == flat.device
    assert got.item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("n", [0, 1, CHUNK - 1, CHUNK, CHUNK + 5])
def test_squared_norm_at_chunk_edges(n):
    flat = torch.arange(1, n + 1, dtype=torch.float32) / max(n, 1)
    assert squared_norm(flat).item() == pytest.approx(flat.double().square().sum().item(), rel=1e-12)


def test_squared_norm_keeps_a_non_finite_gradient_visible():
    flat = torch.ones(CHUNK + 4096)
    flat[CHUNK + 3000] = math.nan
    assert math.isnan(squared_norm(flat).item())
    flat[CHUNK + 3000] = math.inf
    assert math.isinf(squared_norm(flat).item())


@pytest.mark.parametrize("tied", [False, True])
def test_step_grad_norm_is_the_fp64_norm_of_the_landed_gradients(tied):
    """The step's logged norm against the fp64 norm of the gradients the host store received (the ones
    the optimizer reads), to 1e-12. A 65536-word vocabulary makes the head (or the tied embedding) a 4M
    element tile of softmax gradients, on which the fp32 dot ran 1.2e-5 (1.4e-5 tied) low."""
    config = tiny_config("Qwen2ForCausalLM", tied=tied, layers=2, vocab=65536, hidden=64)
    store = build_store(config, torch.float32, seed=3)
    cfg = TrainConfig(steps=1, lr=1e-3, max_grad_norm=None, warmup_steps=0, grad_accum=2)
    batches = random_batches(config.vocab_size, 1, 2, batch=2, seq=16, seed=5)
    engine = make_engine(store, cfg, device="cpu", overlap_optimizer=False, checkpoint_interval=1)
    res = engine.step(batches[0], 0.0)  # lr 0: the gradients are what matters
    want = math.sqrt(sum(t.grad.double().square().sum().item() for t in store.tiles.values()))
    assert want > 0 and res.grad_norm == pytest.approx(want, rel=1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("n", [1, ROW - 1, 233_000_000 + 517])  # the largest: a 7B layer's elements
def test_squared_norm_on_cuda_beats_the_fp32_dot_in_one_pass(n):
    """The GPU path (fp32 rows, fp64 sum) on the softmax-like tile: on the H200 the fp32 dot of a 7B layer's
    233M elements ran 6.8e-7 low, the rows 4.6e-8 (each row still sums in fp32: small squares beside a large
    one are partly lost). Its temporary is the row norms (n / ROW values), never a copy of the tile."""
    g = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.rand(n, generator=g, device="cuda") * 1e-6
    flat[::4099] = 1e-2
    want = sum(torch.dot(c.double(), c.double()).item() for c in flat.split(CHUNK))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = squared_norm(flat)
    torch.cuda.synchronize()
    assert got.dtype == torch.float64 and got.device == flat.device
    assert torch.cuda.max_memory_allocated() - base <= n // ROW * 12 + (1 << 20)
    assert got.item() == pytest.approx(want, rel=2e-7 if n > ROW else 1e-6)
    if n > ROW:
        dot_error = abs(torch.dot(flat, flat).item() / want - 1)
        assert abs(got.item() / want - 1) * 5 < dot_error
