"""Long-context pieces on the CPU: the chunked MLP and the lean RMSNorm give the unchunked gradients, also
inside an HF decoder-layer template run through functional_call and the engine's WeightRedirect; the
long-context plan's arithmetic (its per-layer terms against the tensors a real layer saves); the
checkpoint offloader's round trip.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain_cli.engine import lean_layers
from megatrain_cli.engine.plan.lean import plan_long_context
from megatrain_cli.engine.plan.lean_terms import ModelShape, layer_saved_bytes
from megatrain_cli.engine.transfer.offload import CheckpointOffloader
from megatrain_cli.engine.templates import WeightRedirect, run_bound
from megatrain_cli.engine.lean_layers import (best_sdpa_backends, sdpa_backend_context, slim_norms, chunk_mlp,
                                         chunked_mlp)
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.store.tiles import TileLayout
from tests.reference import saved_bytes, tiny_config

GB = 10**9


def assert_close(actual, expected, tol=1e-5):
    """Equal up to summation order: `tol` relative to the tensor's own scale."""
    scale = max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale)


# ---------------------------------------------------------------------------------------------- MLP


def plain_mlp(x, gate_w, up_w, down_w, act, gate_b=None, up_b=None, down_b=None):
    return F.linear(act(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), down_w, down_b)


@pytest.mark.parametrize("tokens,chunk,bias", [(37, 8, False), (32, 8, False), (37, 8, True), (37, 64, False)])
def test_chunked_mlp_matches_unchunked(tokens, chunk, bias):
    g = torch.Generator().manual_seed(0)
    hidden, inter = 12, 20
    x = torch.randn(2, tokens, hidden, generator=g)
    weights = [torch.randn(inter, hidden, generator=g) * 0.3, torch.randn(inter, hidden, generator=g) * 0.3,
               torch.randn(hidden, inter, generator=g) * 0.3]
    biases = [torch.randn(n, generator=g) * 0.1 for n in (inter, inter, hidden)] if bias else [None] * 3
    leaves = [t.requires_grad_() for t in [x, *weights, *biases] if t is not None]
    grad_out = torch.randn(2, tokens, hidden, generator=g)
    act = torch.nn.SiLU()

    expected = plain_mlp(x, *weights, act, *biases)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    actual = chunked_mlp(x, *weights, act, chunk, *biases)
    actual_grads = torch.autograd.grad(actual, leaves, grad_out)

    assert_close(actual, expected)
    for a, e in zip(actual_grads, expected_grads):
        assert_close(a, e)


def test_chunked_mlp_skips_gradients_nobody_asked_for():
    x = torch.randn(19, 6, requires_grad=True)
    frozen = [torch.randn(10, 6), torch.randn(10, 6), torch.randn(6, 10)]
    (dx,) = torch.autograd.grad(chunked_mlp(x, *frozen, torch.nn.SiLU(), 4).sum(), [x])
    expected = torch.autograd.grad(plain_mlp(x, *frozen, torch.nn.SiLU()).sum(), [x])[0]
    assert_close(dx, expected)


# ---------------------------------------------------------------------------------------------- in a layer


def layer_setup(arch, *, tied=False, dtype=torch.float32, seed=0, **config):
    adapter = ModelAdapter(tiny_config(arch, layers=1, tied=tied, **config))
    layout = TileLayout.from_specs(adapter.layer_specs(0))
    flat = (torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed)) * 0.2).to(dtype)
    return adapter, layout, flat


def run_layer(template, weights, x, adapter):
    pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    cos_sin = adapter.make_rotary(torch.device("cpu"))(x, pos)
    return run_bound(template, weights, x, attention_mask=None, position_ids=pos,
                     position_embeddings=tuple(t.to(x.dtype) for t in cos_sin))


def layer_grads(template, adapter, layout, flat, x, grad_out, hooks=None):
    weights = {k: v.detach().requires_grad_() for k, v in layout.views(flat).items()}
    x = x.detach().requires_grad_()
    if hooks is None:
        y = run_layer(template, weights, x, adapter)
    else:
        with hooks():
            y = run_layer(template, weights, x, adapter)
    return y, weights, x


def graph_nodes(y) -> set[str]:
    names, stack, seen = set(), [y.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("lean", [False, True])
def test_chunked_layer_template_matches_plain(arch, lean):
    adapter, layout, flat = layer_setup(arch)
    plain, chunked = adapter.make_layer_template(0), adapter.make_layer_template(0)
    chunk_mlp(chunked, 8)  # 2 x 37 tokens: 10 chunks, the last one short
    if lean:
        assert slim_norms(chunked) == (4 if arch == "Qwen3ForCausalLM" else 2)
    x = torch.randn(2, 37, adapter.hidden_size)
    grad_out = torch.randn(2, 37, adapter.hidden_size)

    results = []
    for template in (plain, chunked):
        y, weights, leaf = layer_grads(template, adapter, layout, flat, x, grad_out)
        grads = torch.autograd.grad(y, [leaf, *weights.values()], grad_out)
        results.append((y, grads))
    (y0, g0), (y1, g1) = results
    assert "ChunkedMLPBackward" in graph_nodes(y1) and "ChunkedMLPBackward" not in graph_nodes(y0)
    assert_close(y1, y0)
    for a, e in zip(g1, g0):
        assert_close(a, e)
    with torch.no_grad():  # the engine's forward pass: no graph, the same chunks
        weights = {k: v for k, v in layout.views(flat).items()}
        assert_close(run_layer(chunked, weights, x, adapter), y0)


def test_chunked_layer_under_weight_redirect_reads_weights_where_they_are_now():
    """The engine's saved-tensor hooks see the chunked MLP's saved weights: after the forward, the tile
    moves to another buffer and the old one is overwritten; backward must read the new one."""
    adapter, layout, flat = layer_setup("Qwen2ForCausalLM", seed=1)
    plain, chunked = adapter.make_layer_template(0), chunk_mlp(adapter.make_layer_template(0), 5)
    x = torch.randn(1, 23, adapter.hidden_size)
    grad_out = torch.randn(1, 23, adapter.hidden_size)
    y0, w0, x0 = layer_grads(plain, adapter, layout, flat.clone(), x, grad_out)
    expected = torch.autograd.grad(y0, [x0, *w0.values()], grad_out)

    resident = {"layers.0": flat}
    redirect = WeightRedirect(lambda tile: resident[tile])
    redirect.bind("layers.0", flat)
    y1, w1, x1 = layer_grads(chunked, adapter, layout, flat, x, grad_out, hooks=redirect.hooks)
    resident["layers.0"] = flat.clone()  # streamed in again, into another slot
    flat.fill_(float("nan"))  # the old slot now holds another layer
    actual = torch.autograd.grad(y1, [x1, *w1.values()], grad_out)
    for a, e in zip(actual, expected):
        assert_close(a, e)


def test_lean_rmsnorm_matches_hf_in_row_chunks(monkeypatch):
    monkeypatch.setattr(lean_layers, "NORM_ROWS_PER_CHUNK", 5)  # 3 x 7 rows: 5 chunks, the last one short
    adapter = ModelAdapter(tiny_config("Qwen2ForCausalLM", layers=1))
    hf, lean = adapter.make_norm_template(), adapter.make_norm_template()
    assert slim_norms(lean) == 1
    weight = {"weight": (torch.rand(adapter.hidden_size) + 0.5).requires_grad_()}
    x = (torch.randn(3, 7, adapter.hidden_size) * 3).requires_grad_()
    grad_out = torch.randn(3, 7, adapter.hidden_size)
    results = []
    for template in (hf, lean):
        y = run_bound(template, weight, x)
        results.append((y, torch.autograd.grad(y, [x, weight["weight"]], grad_out)))
    assert_close(results[1][0], results[0][0])
    for a, e in zip(results[1][1], results[0][1]):
        assert_close(a, e)


# ---------------------------------------------------------------------------------------------- SDPA


def test_sdpa_backend_context_on_cpu():
    assert best_sdpa_backends(torch.device("cpu")) == []
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for kind in ("auto", "math"):
        with sdpa_backend_context(kind, torch.device("cpu")):
            assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), expected)
    with pytest.raises(ValueError):
        sdpa_backend_context("fastest")


# ---------------------------------------------------------------------------------------------- the plan


def qwen25_7b():
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen2", hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                num_key_value_heads=4, num_hidden_layers=28, vocab_size=152064,
                                tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])


@pytest.mark.parametrize("arch,extra", [("Qwen2ForCausalLM", {}), ("LlamaForCausalLM", {}),
                                        ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
                                        ("MistralForCausalLM", {}), ("Qwen3ForCausalLM", {})])
def test_shape_from_config_counts_the_adapters_parameters(arch, extra):
    config = tiny_config(arch, layers=2)
    for k, v in extra.items():
        setattr(config, k, v)
    assert ModelShape.of(config) == ModelShape.of(ModelAdapter(config))


def test_plan_7b_offloads_at_512k_not_at_32k():
    config = qwen25_7b()
    shape = ModelShape.of(config)
    assert shape.layer_numel * 2 == pytest.approx(466e6, rel=0.01)  # one bf16 weight slot
    long = plan_long_context(config, 512 * 1024, device_budget_bytes=141 * GB)
    assert long.checkpoint_interval == 1
    assert long.checkpoint_bytes == pytest.approx(3.76e9, rel=0.01)
    assert long.mlp_chunk_tokens is not None
    assert 0 < long.offloaded_checkpoints < long.num_checkpoints
    assert long.fits and long.predicted_peak <= 0.95 * 141 * GB
    assert list(long.offload_keys) == list(range(long.offloaded_checkpoints))
    # one fewer offloaded checkpoint would not fit: the plan offloads as few as it can
    fewer = plan_long_context(config, 512 * 1024, device_budget_bytes=141 * GB, offload=False)
    assert fewer.predicted_peak > long.usable
    text = long.render()
    assert "checkpoints on the device" in text and "SDPA backward" in text and "<- peak" in text

    short = plan_long_context(config, 32 * 1024, device_budget_bytes=141 * GB)
    assert short.offloaded_checkpoints == 0 and short.checkpoint_interval == 1 and short.fits


def test_plan_grows_linearly_with_tokens():
    config = qwen25_7b()
    peak = {n: plan_long_context(config, n * 256 * 1024, device_budget_bytes=141 * GB, offload=False,
                                 chunk_mlp=True).predicted_peak for n in (1, 2, 3, 4)}
    assert peak[2] - peak[1] == pytest.approx(peak[4] - peak[3], rel=0.03)
    assert peak[4] - peak[3] > 0


def test_plan_offload_host_budget_is_checked():
    plan = plan_long_context(qwen25_7b(), 512 * 1024, device_budget_bytes=141 * GB, host_budget_bytes=10 * GB,
                             drop=0)
    assert plan.offloaded_checkpoints > 0 and not plan.fits
    assert any("pinned" in n for n in plan.notes)
    # Left to choose, the plan recomputes checkpoints instead (tests/engine/test_rebuild.py).
    traded = plan_long_context(qwen25_7b(), 512 * 1024, device_budget_bytes=141 * GB, host_budget_bytes=10 * GB)
    assert traded.fits and traded.dropped_checkpoints and traded.host_pinned_bytes <= 10 * GB


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("chunked,lean", [(False, False), (True, False), (True, True)])
def test_plan_counts_what_a_real_layer_saves(arch, chunked, lean):
    """The plan's per-layer terms against the bytes autograd actually keeps for an HF layer in bf16."""
    adapter, layout, flat = layer_setup(arch, dtype=torch.bfloat16, hidden=64, heads=8, kv_heads=2, inter=160)
    template = adapter.make_layer_template(0)
    if chunked:
        chunk_mlp(template, 16)
    if lean:
        slim_norms(template)
    weights = {k: v.detach().requires_grad_() for k, v in layout.views(flat).items()}
    x = torch.randn(1, 96, adapter.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(96)[None]
    cos_sin = tuple(t.to(torch.bfloat16) for t in adapter.make_rotary(torch.device("cpu"))(x, pos))
    kept = saved_bytes(lambda: run_bound(template, weights, x, attention_mask=None, position_ids=pos,
                                         position_embeddings=cos_sin), exclude=[x, flat, *cos_sin])
    planned = layer_saved_bytes(ModelShape.of(adapter), 96, 2, mlp_chunked=chunked, lean_norms=lean)
    # The layer's input and output are the engine's to keep, not autograd's.
    planned = sum(planned.values()) - planned["layer input (the checkpoint, now a leaf)"] - planned["layer output"]
    assert kept == pytest.approx(planned, rel=0.01)


# ---------------------------------------------------------------------------------------------- offloader


def test_offloader_round_trips_on_cpu():
    store = CheckpointOffloader(torch.device("cpu"), offload_keys={0, 1})
    single = torch.randn(2, 5, 8)
    pair = [torch.randn(1, 5, 8), torch.randn(3, 2, 8).to(torch.bfloat16)]
    expected = [single.clone(), [t.clone() for t in pair]]
    store.put(0, single)
    store.put(1, pair)
    store.put(2, single)  # not offloaded: kept as it is
    single.zero_()  # the host copy is independent of the device tensor
    store.prefetch(1)
    store.prefetch(1)  # repeated prefetch is harmless
    assert torch.equal(store.get(0), expected[0])
    back = store.get(1)
    assert isinstance(back, list) and all(torch.equal(a, e) and a.dtype == e.dtype for a, e in zip(back, expected[1]))
    assert store.get(2) is single
    assert store.late_gets == 1  # key 0 was never prefetched
    with pytest.raises(KeyError):
        store.get(0)  # a checkpoint is read once
