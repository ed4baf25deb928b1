"""Packed rows through the packed-attention entry (models/attention.py, issue #31).

The reference is the plain HF model given the same position ids: HF builds its dense block-causal [B, 1, T, T]
mask from them (with the family's window on sliding layers). The engine's packed rows build no mask: the
documents' boundaries go to the entry as HF's padding-free arguments, and on the CPU the entry runs HF's own
attention once per document. CPU, fp32, a plain family (Qwen2), a sliding-window one (Mistral, window 6 inside
documents of up to 21 tokens) and a softcapped one (Gemma 2: attention and final-logit softcaps, window 6);
rows that hold several documents, one that ends in a padding tail (positions continuing its last document),
and a row of one document. The CUDA tests (skipped here) compare the varlen flash kernel with the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX, MicroBatch
from megatrain_cli.engine.step import Engine
from megatrain_cli.metrics.flops import attention_pairs
from megatrain_cli.models import attention
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.models.loader import build_store
from megatrain_cli.recipe import TrainConfig
from tests import engines
from tests.reference import reference_model, tiny_config

SEQ = 24
# Per micro-batch, per row: the documents' lengths; a (length, 'pad') tail is padding after the last document.
LAYOUTS = [[[9, 11, 4], [3, 14, (7, "pad")]], [[24], [5, 5, 14]]]
FAMILIES = ["qwen2", "mistral", "gemma2"]  # plain, sliding window, softcaps


def make_engine(store, cfg: TrainConfig | None = None, device: str = "cpu", **kwargs) -> Engine:
    """The engine as the other parity tests build it (tests/engine/test_families.py): interval 2, a small loss
    chunk, PyTorch kernels, no optimizer thread, through the tests' one construction (tests/engines.py)."""
    for key, value in (("checkpoint_interval", 2), ("loss_chunk_tokens", 7), ("kernels", "torch"),
                       ("overlap_optimizer", False), ("resident_layers", 0)):
        kwargs.setdefault(key, value)
    return engines.make_engine(store, cfg or TrainConfig(steps=1, max_grad_norm=None), device=device, **kwargs)


def packed_row(docs, vocab: int, g: torch.Generator):
    ids, labels, pos = [], [], []
    for doc in docs:
        n, pad = (doc[0], True) if isinstance(doc, tuple) else (doc, False)
        tokens = torch.randint(0, vocab, (n,), generator=g)
        ids.append(torch.zeros(n, dtype=torch.int64) if pad else tokens)
        lab = torch.full((n,), IGNORE_INDEX) if pad else tokens.clone()
        lab[:2] = IGNORE_INDEX  # a prompt: no loss
        labels.append(lab)
        start = int(pos[-1][-1]) + 1 if pad else 0  # padding continues the last document's positions
        pos.append(torch.arange(start, start + n))
    return torch.cat(ids), torch.cat(labels), torch.cat(pos)


def packed_batches(vocab: int, seed: int = 0) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for layout in LAYOUTS:
        ids, labels, pos = zip(*(packed_row(row, vocab, g) for row in layout))
        out.append(MicroBatch(torch.stack(ids), torch.stack(labels), torch.stack(pos)))
    return out


def grads_by_name(store) -> dict[str, torch.Tensor]:
    return {hf: store.tiles[t].grad[p.offset:p.offset + p.numel].view(p.shape) for hf, t, p in store.hf_items()}


def dense_reference(model, mbs: list[MicroBatch]):
    """The plain model on the same rows (HF's dense block-causal masks): per-micro-batch mean losses, the
    gradient of the step's token-mean loss, and each micro-batch's logits."""
    n_tok = sum(int((mb.labels[:, 1:] != IGNORE_INDEX).sum()) for mb in mbs)
    losses, logits = [], []
    for mb in mbs:
        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
        lab = mb.labels[:, 1:]
        loss_sum = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                                                     lab.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        (loss_sum / n_tok).backward()
        losses.append(float(loss_sum.detach()) / int((lab != IGNORE_INDEX).sum()))
        logits.append(out.logits.detach())
    return losses, {n: p.grad for n, p in model.named_parameters()}, logits


@pytest.mark.parametrize("group", [attention.GROUP_TOKENS, 10], ids=["rows", "groups"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_the_dense_mask_reference(monkeypatch, family, group):
    """Loss and every gradient through the engine, and the logits through HF's own model with the entry set
    and the padding-free arguments given: within 1e-5 of the dense-mask reference. `group`: the reference's
    documents grouped up to a whole row, or up to 10 tokens (longer documents alone)."""
    monkeypatch.setattr(attention, "GROUP_TOKENS", group)
    config = tiny_config(family, layers=3, tied=family == "gemma2")
    store = build_store(config, torch.float32, seed=3)
    mbs = packed_batches(config.vocab_size)
    ref_losses, ref_grads, ref_logits = dense_reference(reference_model(store, copy.deepcopy(config)), mbs)

    documents = []
    reference = attention._reference
    monkeypatch.setattr(attention, "_reference", lambda *a: documents.append(a[5].numel() - 1) or reference(*a))
    engine = make_engine(store)
    res = engine.forward_backward(mbs)
    engine.close()
    assert documents and set(documents) == {5, 4}  # the entry ran every layer on both micro-batches' documents
    assert res.losses == pytest.approx(ref_losses, rel=1e-5)
    ours = grads_by_name(store)
    for name, expected in ref_grads.items():
        if store.adapter.tied and name == "lm_head.weight":
            continue  # the embedding's gradient
        torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")

    model = reference_model(store, copy.deepcopy(config))
    attention.use_entry(model)  # HF's model, its attention through the entry; no mask is built
    for mb, expected in zip(mbs, ref_logits):
        docs = attention.document_bounds(mb.position_ids)
        with torch.no_grad():
            logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False,
                           **attention.document_kwargs(*docs)).logits
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_of_one_document_run_hfs_own_attention_bit_for_bit(family):
    """Unpacked rows: each layer template (its attention through the entry) computes exactly what the HF
    layer with HF's own implementation computes, outputs and gradients, with the mask HF built (Mistral's and
    Gemma 2's window masks included)."""
    config = tiny_config(family, layers=2)
    adapter = ModelAdapter(config)
    call = adapter.make_layer_inputs(torch.device("cpu"))(torch.randn(2, SEQ, config.hidden_size),
                                                          torch.arange(SEQ).expand(2, SEQ))
    assert "cu_seq_lens_q" not in call.kwargs[0]
    if family != "qwen2":
        assert call.masks(), "the window is shorter than the rows: HF builds its mask"
    for i in range(2):
        ours = adapter.make_layer_template(i).to_empty(device="cpu")
        hf = copy.deepcopy(adapter._layers[i]).to_empty(device="cpu").train()
        assert ours.self_attn.config._attn_implementation.startswith(attention.PREFIX)
        assert not hf.self_attn.config._attn_implementation.startswith(attention.PREFIX)
        torch.manual_seed(i)
        for p in ours.parameters():
            p.data.normal_(0, 0.3)
        hf.load_state_dict(ours.state_dict())
        outs = []
        for layer in (ours, hf):
            x = call.hidden.detach().clone().requires_grad_()
            y = layer(x, **call.kwargs[i])
            y = y[0] if isinstance(y, tuple) else y
            y.square().sum().backward()
            outs.append((y.detach(), x.grad, [p.grad for p in layer.parameters()]))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert all(torch.equal(a, b) for a, b in zip(outs[0][2], outs[1][2]))


def test_document_bounds_from_position_ids():
    """Documents start at each row's first token and where a position is not the one before plus 1 (HF's
    rule); a padding tail whose positions continue belongs to the last document; rows of one document each
    give None (the unpacked path)."""
    pos = torch.stack([torch.cat([torch.arange(9), torch.arange(7)]),
                       torch.cat([torch.arange(3), torch.arange(13)])])  # row 1: 3, then 10 + a 3-token tail
    cu, longest = attention.document_bounds(pos)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 9, 16, 19, 32] and longest == 13
    assert attention.document_bounds(torch.arange(16).expand(3, 16)) is None
    assert attention.document_bounds(torch.arange(5, 21)[None]) is None  # not from 0, still one document
    cu, longest = attention.document_bounds(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]]))
    assert cu.tolist() == [0, 3, 5, 6, 8] and longest == 3  # one-token documents
    kwargs = attention.document_kwargs(cu, longest)
    assert kwargs["cu_seq_lens_q"] is kwargs["cu_seq_lens_k"] and kwargs["max_length_q"] == kwargs["max_length_k"] == 3
    mbs = packed_batches(97)
    assert attention_pairs(mbs) == sum(n * n for n in [9, 11, 4, 3, 21, 24, 5, 5, 14])
    assert attention_pairs([MicroBatch(torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8))]) == 2 * 64


def test_the_fast_kernel_is_named_and_its_blockers_listed():
    """This torch's varlen_attn takes scale, window_size and enable_gqa; what sends a call to the reference."""
    varlen_attn, gqa = attention._varlen_api()
    assert varlen_attn is not None and gqa
    q = torch.zeros(1, 2, 4, 8)
    assert attention.fast_kernel_blocker(q, {}) == "not on CUDA"


def test_long_context_trains_a_packed_row_of_32k_tokens():
    """Issue #31: a packed row of 32768 tokens trains one step on the long-context path on the CPU, MLP chunked;
    the row is the trainer's (pack_rows) and no layer gets a mask (before, a micro-batch of such rows past
    4 GiB of mask was refused: 8 of them at this length; tests/test_train_long.py plans those)."""
    from megatrain_cli.data.train_data import synthetic_lengths, synthetic_train_data
    from megatrain_cli.engine import lean_layers
    from megatrain_cli.engine.plan.lean import GiB, plan_long_context

    seq, batch = 32768, 1
    config = tiny_config("qwen2", layers=2, hidden=16, heads=2, kv_heads=1, inter=24)
    data = synthetic_train_data(synthetic_lengths(batch * seq, 256, 0.5, 2048, seed=0), config.vocab_size, seq,
                                seed=0)
    (mb,) = data.next_step(batch, 1)
    assert mb.input_ids.shape == (batch, seq)
    assert attention.document_bounds(mb.position_ids) is not None
    plan = plan_long_context(config, seq, batch=batch, device_budget_bytes=GiB, mlp_chunk_tokens=8192,
                             chunk_mlp=True, offload=False, device_type="cpu")
    store = build_store(config, torch.float32, seed=0)
    engine = make_engine(store, TrainConfig(steps=1, lr=1e-3), checkpoint_interval=1, lean=plan)
    masks = engine.layer_inputs(torch.zeros(1, seq, config.hidden_size), mb.position_ids[:1]).masks()
    before = store.hf_state_dict()["model.layers.0.mlp.up_proj.weight"].clone()
    res = engine.step([mb], 1e-3)
    engine.close()
    assert masks == [] and all(lean_layers.mlp_chunk_tokens(t) == 8192 for t in engine.templates.all())
    assert torch.isfinite(torch.tensor(res.loss)) and res.tokens == batch * seq and not res.skipped
    assert not torch.equal(store.hf_state_dict()["model.layers.0.mlp.up_proj.weight"], before)


# ---------------------------------------------------------------------------------------------- CUDA
def cuda(test):
    """A GPU test: marked for `pytest -m cuda` (make test-gpu) and skipped without a device."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason="the varlen flash kernel needs CUDA")(test))


@cuda
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_kernel_equals_the_reference_reference_on_cuda(window, kv_heads):
    """bf16 on the GPU: the varlen flash kernel (grouped keys, a window shorter than the documents) against
    HF's SDPA once per document, outputs and gradients, within bf16's rounding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    dev = torch.device("cuda")
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 4 // kv_heads
    pos = torch.stack([torch.cat([torch.arange(100), torch.arange(156)]),
                       torch.cat([torch.arange(7), torch.arange(200), torch.arange(49)])])
    cu, longest = attention.document_bounds(pos)
    cu = cu.to(dev)
    q = torch.randn(2, 4, 256, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, kv_heads, 256, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, kv_heads, 256, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    kw = dict(scaling=0.125, sliding_window=window, dropout=0.0)
    assert attention.fast_kernel_blocker(q, kw) is None
    fast = attention._varlen(q, k, v, cu, longest, 0.125, window)
    ref = attention._reference(sdpa_attention_forward, module, q, k, v, cu, window, "sdpa", kw)
    grads = [torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in (fast, ref)]
    torch.testing.assert_close(fast.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(*grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


@cuda
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_packed_rows_on_cuda_match_the_dense_reference(family):
    """The engine in bf16 on the GPU (packed rows through the varlen kernel) against the plain HF model with its
    dense mask, in bf16 on the GPU: the same losses within bf16's rounding."""
    config = tiny_config(family, layers=3, hidden=128, heads=4, kv_heads=2, head_dim=32)
    store = build_store(config, torch.float32, seed=3)
    mbs = packed_batches(config.vocab_size)
    model = reference_model(store, copy.deepcopy(config), dtype=torch.bfloat16, device="cuda")
    cuda_mbs = [MicroBatch(mb.input_ids.cuda(), mb.labels.cuda(), mb.position_ids.cuda()) for mb in mbs]
    ref_losses, _, _ = dense_reference(model, cuda_mbs)
    store = build_store(config, torch.bfloat16, seed=3)
    engine = make_engine(store, device="cuda")
    res = engine.forward_backward(mbs)
    engine.close()
    assert res.losses == pytest.approx(ref_losses, rel=2e-2)
