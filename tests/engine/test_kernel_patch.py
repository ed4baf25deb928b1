"""The engine with kernels='triton' (issue #8) trains like kernels='torch': the kernels go into the layer
templates (RMSNorm incl. Qwen3's q/k norms, SwiGLU, RoPE) and the head (fused linear + cross-entropy), a
failing kernel falls back to its PyTorch reference with one warning, and they compose with the
long-context pieces (chunked MLP, lean norms).

Run: python -m pytest -q tests/engine/test_kernel_patch.py     (GPU extras: -m cuda)

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors, slow: one layer
of 32 hidden on 12 tokens is a few seconds). As in tests/triton/test_kernels.py, triton must be imported with the
variable set: its own jitted helpers (tl.sum, tl.sigmoid, ...) are compiled or interpreted once, at import.
This module imports nothing of triton when it is collected (so tests/triton/test_kernels.py, collected after it,
still gets the first import); the module fixture below imports triton interpreted before any test of this
module builds a model (torch._dynamo, which HF model creation imports, imports triton). Where some earlier
test already imported it compiled, the interpreter tests skip and say so; the others run.

Tolerances. CPU fp32, kernels against the PyTorch path after 2 optimizer steps: losses rel 1e-5,
parameters rtol 1e-5 / atol 1e-6 (tests/engine/test_parity.py's; the largest difference seen is 2e-7 absolute:
fp32 summation order in the norms' reductions, the softmax and silu). CUDA bf16: losses rel 2e-2,
parameter updates within 10% of their size (as tests/engine/test_cuda.py against plain fp32 training).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

import pytest
import torch

from megatrain_cli import kernels
from megatrain_cli.engine import kernel_patch, lean_layers
from megatrain_cli.engine.plan.lean import GiB, plan_long_context
from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.reference import random_batches, tiny_config

CUDA = torch.cuda.is_available()
KERNEL_MODULES = ("rmsnorm", "swiglu", "rope", "fused_linear_ce")
STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def _import_triton():
    """Import triton (and the kernels) before anything of this module imports it compiled; None if missing."""
    if importlib.util.find_spec("triton") is None:
        yield None
        return
    if CUDA or "triton" in sys.modules:  # compiled kernels, or too late for the interpreter (see triton_path)
        yield importlib.import_module("triton")
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module("triton")
        for name in KERNEL_MODULES:
            importlib.import_module(f"megatrain_cli.kernels.{name}")
    finally:  # only while importing: no later test or subprocess picks the interpreter up
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    yield module


@pytest.fixture
def triton_path(_import_triton, monkeypatch):
    """The kernels' Triton path is what runs: the interpreter on (CPU), a clean fallback record, and any
    RuntimeWarning an error (a silent fallback would make the comparison vacuous)."""
    if _import_triton is None:
        pytest.skip("triton is not installed")
    if not CUDA:
        if not _kernels_interpretable():
            pytest.skip("triton was imported (compiled) before this module could set TRITON_INTERPRET=1: run "
                        "`python -m pytest tests/engine/test_kernel_patch.py` alone or with tests/triton/test_kernels.py")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "_fallen_back", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def _kernels_interpretable() -> bool:
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    from megatrain_cli.kernels import rmsnorm

    return isinstance(standard.sum, InterpretedFunction) and isinstance(rmsnorm._rms_norm_forward_kernel,
                                                                        InterpretedFunction)


def count_triton_calls(monkeypatch) -> dict[str, int]:
    """Count the launches of each kernel's Triton path (forward and backward)."""
    from megatrain_cli.kernels import fused_linear_ce, rmsnorm, rope, swiglu

    calls: dict[str, int] = {}
    for module, name, kind in ((rmsnorm, "_forward_triton", "rms_norm"), (rmsnorm, "_backward_triton", "rms_norm"),
                               (swiglu, "_forward_triton", "swiglu"), (swiglu, "_backward_triton", "swiglu"),
                               (rope, "_rotate_triton", "rope"),
                               (fused_linear_ce, "_softmax_minus_onehot_", "fused_linear_cross_entropy")):
        plain = getattr(module, name)

        def counted(*args, _plain=plain, _kind=kind, **kw):
            calls[_kind] = calls.get(_kind, 0) + 1
            return _plain(*args, **kw)

        monkeypatch.setattr(module, name, counted)
    return calls


def train(config, kernels_choice, *, accum=1, seq=12, batch=1, device="cpu", dtype=torch.float32, **engine_kwargs):
    store = build_store(config, dtype, seed=3)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1,
                      grad_accum=accum, eps=1e-6)
    engine_kwargs.setdefault("loss_chunk_tokens", 5)  # a chunk that does not divide the tokens
    engine = make_engine(store, cfg, device=device, checkpoint_interval=1, kernels=kernels_choice,
                         overlap_optimizer=False, **engine_kwargs)
    batches = random_batches(config.vocab_size, STEPS, accum, batch=batch, seq=seq, seed=5, prompt_len=3)
    results = [engine.step(mbs, lr_at(s, cfg, STEPS)) for s, mbs in enumerate(batches)]
    engine.close()
    return store, engine, results


def assert_same_training(store, results, ref_store, ref_results):
    for res, ref in zip(results, ref_results):
        assert not res.skipped
        assert res.losses == pytest.approx(ref.losses, rel=1e-5)
        assert res.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
    ours, theirs = store.hf_state_dict(), ref_store.hf_state_dict()
    for name, expected in theirs.items():
        torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# --- CPU, Triton interpreter: kernels='triton' == kernels='torch' -------------------------------------------

@pytest.mark.parametrize("arch,tied,layers,accum", [
    ("Qwen2ForCausalLM", False, 2, 1),
    ("Qwen3ForCausalLM", False, 1, 1),  # q_norm / k_norm on head_dim go through the kernel too
    ("LlamaForCausalLM", True, 1, 2),  # tied head: the fused loss accumulates into the embedding's gradient
])
def test_triton_kernels_train_like_the_torch_path(triton_path, monkeypatch, arch, tied, layers, accum):
    config = tiny_config(arch, tied=tied, layers=layers)
    ref_store, ref_engine, ref_results = train(config, "torch", accum=accum)
    assert all(kernel_patch.installed_kernels(t) == {"rms_norm": 0, "swiglu": 0, "rope": 0}
               for t in (*ref_engine.templates.all(), ref_engine.norm_template))

    calls = count_triton_calls(monkeypatch)
    store, engine, results = train(config, "triton", accum=accum)
    norms_per_layer = 4 if arch == "Qwen3ForCausalLM" else 2
    for template in engine.templates.all():
        assert kernel_patch.installed_kernels(template) == {"rms_norm": norms_per_layer, "swiglu": 1, "rope": 1}
    assert kernel_patch.installed_kernels(engine.norm_template)["rms_norm"] == 1
    assert set(calls) == {"rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"}, calls
    assert not kernels._fallen_back
    assert_same_training(store, results, ref_store, ref_results)


def test_failing_kernel_falls_back_once_and_trains_correctly(triton_path, monkeypatch):
    """rms_norm's Triton forward raises (as a compile error would): one warning for the whole run, the
    reference from then on, the same parameters; the other kernels keep running on Triton."""
    from megatrain_cli.kernels import rmsnorm

    config = tiny_config("Qwen2ForCausalLM", layers=1)
    ref_store, _, ref_results = train(config, "torch")
    calls = count_triton_calls(monkeypatch)

    def broken(*args):
        raise RuntimeError("simulated Triton compile failure")

    monkeypatch.setattr(rmsnorm, "_forward_triton", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store, _, results = train(config, "triton")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "simulated Triton compile failure" in messages[0] and "rms_norm" in messages[0]
    assert set(kernels._fallen_back) == {"rms_norm"}
    assert {"swiglu", "rope", "fused_linear_cross_entropy"} <= set(calls)
    assert_same_training(store, results, ref_store, ref_results)


def test_kernels_compose_with_the_long_context_path(triton_path, monkeypatch):
    """Chunked MLP + lean norms + kernels: the MLP stays chunked (no swiglu), the lean norms become the kernel's
    rms_norm, RoPE and the fused head run; same training as the plain torch engine."""
    config = tiny_config("Qwen3ForCausalLM", layers=1)
    ref_store, _, ref_results = train(config, "torch")
    plan = plan_long_context(config, 12, batch=1, device_budget_bytes=GiB, mlp_chunk_tokens=5, chunk_mlp=True,
                             loss_chunk_tokens=5, offload=False, lean_norms=True)
    chunked = []
    plain_chunked_mlp = lean_layers.chunked_mlp
    monkeypatch.setattr(lean_layers, "chunked_mlp", lambda *a, **k: chunked.append(1) or plain_chunked_mlp(*a, **k))
    calls = count_triton_calls(monkeypatch)
    store, engine, results = train(config, "triton", lean=plan)
    for template in engine.templates.all():
        assert kernel_patch.installed_kernels(template) == {"rms_norm": 4, "swiglu": 0, "rope": 1}
        assert lean_layers.mlp_chunk_tokens(template) == 5
    assert chunked and "swiglu" not in calls and {"rms_norm", "rope", "fused_linear_cross_entropy"} <= set(calls)
    assert_same_training(store, results, ref_store, ref_results)


def test_fused_loss_accumulates_into_grad_weight_and_resumes_after_a_mid_loop_failure(triton_path, monkeypatch):
    """The engine passes its [V, H] fp32 LM-head gradient as the accumulator. If the Triton path fails after
    some chunks were added, the reference finishes only the rest: nothing is counted twice."""
    from megatrain_cli.kernels import fused_linear_ce

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(11, 8, generator=g), torch.randn(13, 8, generator=g) * 0.3
    labels = torch.randint(0, 13, (11,), generator=g)
    labels[4:6] = -100
    start = torch.randn(13, 8, generator=g)
    want_loss, want_gh, want_gw = fused_linear_ce.fused_linear_cross_entropy_reference(
        hidden, weight, labels, chunk_tokens=11, scale=0.5)
    plain, launches = fused_linear_ce._softmax_minus_onehot_, []

    def fails_on_third(*args):
        launches.append(1)
        if len(launches) == 3:
            raise RuntimeError("simulated launch failure")
        return plain(*args)

    monkeypatch.setattr(fused_linear_ce, "_softmax_minus_onehot_", fails_on_third)
    acc = start.clone()
    with pytest.warns(RuntimeWarning, match="simulated launch failure"):
        loss, gh, gw = fused_linear_ce.fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=3,
                                                                  scale=0.5, grad_weight=acc)
    assert gw is acc and len(launches) == 3  # chunks 0 and 1 on Triton, 2 and 3 by the reference
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(gh, want_gh)
    torch.testing.assert_close(acc, start + want_gw)


# --- no interpreter needed ------------------------------------------------------------------------------------

def test_resolve_choices():
    assert kernel_patch.resolve("auto", torch.device("cpu")) == "torch"
    assert kernel_patch.resolve("auto", torch.device("cuda")) == "triton"
    assert kernel_patch.resolve("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="unknown kernels"):
        kernel_patch.resolve("cuda", torch.device("cpu"))


def test_explicit_triton_on_cpu_without_interpreter_warns_and_uses_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.warns(RuntimeWarning, match="needs a CUDA device"):
        assert kernel_patch.resolve("triton", torch.device("cpu")) == "torch"


def test_torch_engine_installs_nothing():
    config = tiny_config("Qwen3ForCausalLM", layers=1)
    store = build_store(config, torch.float32, seed=0)
    engine = make_engine(store, TrainConfig(steps=1), device="cpu", checkpoint_interval=1, kernels="auto",
                         overlap_optimizer=False)
    assert engine.kernels == "torch" and engine.fused_ce is None
    for template in (*engine.templates.all(), engine.norm_template):
        assert not any("forward" in m.__dict__ for m in template.modules())
    engine.close()


def _template(arch="Qwen2ForCausalLM", **config_overrides):
    from megatrain_cli.models.adapter import ModelAdapter

    config = tiny_config(arch, layers=1)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    return ModelAdapter(config).make_layer_template(0)


def test_install_kernels_where_they_apply():
    qwen3 = _template("Qwen3ForCausalLM")
    assert kernel_patch.install_kernels(qwen3) == {"rms_norm": 4, "swiglu": 1, "rope": 1}
    assert kernel_patch.install_kernels(qwen3) == {"rms_norm": 4, "swiglu": 1, "rope": 1}  # idempotent
    kernel_patch.uninstall_kernels(qwen3)
    assert not any("forward" in m.__dict__ for m in qwen3.modules())

    gelu = _template(hidden_act="gelu")  # not SiLU: the MLP keeps HF's activation
    assert kernel_patch.install_kernels(gelu, ["swiglu", "rms_norm"]) == {"rms_norm": 2, "swiglu": 0, "rope": 0}

    chunked = lean_layers.chunk_mlp(_template(), 4)  # long context: the chunked MLP wins
    assert kernel_patch.install_kernels(chunked)["swiglu"] == 0 and lean_layers.mlp_chunk_tokens(chunked) == 4

    with pytest.raises(ValueError, match="unknown layer kernels"):
        kernel_patch.install_kernels(_template(), ["flash_attention"])


def test_lean_norm_stays_lean_where_the_kernel_does_not_run(monkeypatch):
    """slim_norms then install_kernels: the kernel's rms_norm when Triton runs; where it cannot (fallen
    back, or no Triton) the norm goes back to LeanRMSNorm, not HF's fp32-copy graph."""
    template = _template()
    lean_layers.slim_norms(template)
    kernel_patch.install_kernels(template, ["rms_norm"])
    norm = template.input_layernorm
    assert norm.megatrain_lean
    lean_calls = []
    monkeypatch.setattr(lean_layers.LeanRMSNorm, "apply", lambda *a: lean_calls.append(1) or a[0])
    monkeypatch.setattr(kernels, "_fallen_back", {"rms_norm": RuntimeError("earlier failure")})
    x = torch.randn(2, 3, 32)
    norm.weight = torch.nn.Parameter(torch.ones(32))  # a real weight in the meta template's slot
    assert norm(x) is x and lean_calls == [1]
    kernel_patch.uninstall_kernels(template)
    assert getattr(norm.__dict__["forward"], "__func__", None) is lean_layers._lean_norm_forward


def test_rope_dispatcher_leaves_other_models_alone():
    """install_kernels swaps the modeling module's apply_rotary_pos_emb for a dispatcher: a plain HF model
    of the same architecture computes exactly what it computed before."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("Qwen2ForCausalLM", layers=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (1, 9))
    before = model(input_ids=ids).logits
    assert kernel_patch.install_kernels(_template(), ["rope"])["rope"] == 1
    import transformers.models.qwen2.modeling_qwen2 as modeling

    assert hasattr(modeling.apply_rotary_pos_emb, "megatrain_original")
    assert torch.equal(model(input_ids=ids).logits, before)


# --- CUDA: bf16, kernels against the torch path on the GPU ---------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("arch,tied", [("Qwen2ForCausalLM", False), ("Qwen3ForCausalLM", False),
                                       ("LlamaForCausalLM", True)])
def test_cuda_bf16_triton_kernels_match_the_torch_path(triton_path, monkeypatch, arch, tied):
    config = tiny_config(arch, tied=tied, layers=3, hidden=256, heads=4, kv_heads=2, inter=768, vocab=1000)
    kw = dict(accum=2, seq=128, batch=2, device="cuda", dtype=torch.bfloat16, loss_chunk_tokens=96)
    start = build_store(config, torch.bfloat16, seed=3).hf_state_dict()
    ref_store, _, ref_results = train(config, "torch", **kw)
    calls = count_triton_calls(monkeypatch)
    store, engine, results = train(config, "auto", **kw)  # 'auto' on CUDA is the kernels
    assert engine.kernels == "triton"
    assert set(calls) == {"rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"}, calls
    assert not kernels._fallen_back
    for res, ref in zip(results, ref_results):
        assert res.losses == pytest.approx(ref.losses, rel=2e-2)
    ours, theirs = store.hf_state_dict(), ref_store.hf_state_dict()
    for name, after in theirs.items():
        d_ref, d_ours = after - start[name], ours[name] - start[name]
        if d_ref.norm() < 1e-6:
            continue
        rel = float((d_ours - d_ref).norm() / d_ref.norm())
        assert rel < 0.1, f"{name}: update differs by {rel:.3f} of its size"
