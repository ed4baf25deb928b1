"""The fixed-buffer decoder (eval/static_decode.py: a fixed-capacity KV cache written at a device-held column,
masks and inputs copied into fixed buffers, a step replayed as a CUDA graph on the GPU) decodes token for token
what the eager streamed decoder decodes: greedy and sampled, left padding, sliding windows, additive masks, stop
strings and eos midway. On the CPU the same loop runs without the graph."""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.eval.generate import Sampler, StopOnStrings, greedy, left_pad
from megatrain_cli.eval.static_decode import StaticDecoder, why_not_graph
from megatrain_cli.eval.streamed import StreamedModel
from megatrain_cli.models.loader import build_store
from tests.eval.test_eval_streamed import random_prompts
from tests.reference import tiny_config

NEW = 9


def store_of(arch: str, **shape):
    config = tiny_config(arch, vocab=97, **shape)
    config.initializer_range = 0.3  # greedy tokens that depend on the prompt; ties rare
    if arch == "MistralForCausalLM":
        config.sliding_window = 4  # shorter than prompt + new tokens: the window moves during decoding
    return build_store(config, torch.float32, seed=1)


def decode(model, prompts, pick, eos: int, static: bool, stop=None, tok=None):
    ids, mask = left_pad(prompts, pad_id=0)
    crit = [StopOnStrings(tok, stop, ids.shape[1])] if stop else []
    args = dict(max_new_tokens=NEW, eos_ids=[eos], pad_id=0, stop_criteria=crit, pick=pick)
    with torch.inference_mode():
        if static:
            return StaticDecoder(model, graph=False).decode_batch(ids, mask, **args)
        return model.decode_batch(ids, mask, **args)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "gemma2"])
@pytest.mark.parametrize("prompt_lengths", [(3, 11, 6, 1, 8), (5, 5), (1, 1, 1)])  # left padded / none / one token
def test_static_loop_decodes_what_the_eager_loop_decodes(arch, prompt_lengths):
    store = store_of(arch)
    model = StreamedModel(store, torch.device("cpu"))
    prompts = random_prompts(97, prompt_lengths)
    eager_ids, eager_len = decode(model, prompts, greedy, eos=96, static=False)
    assert model.decode_path == "eager (not on CUDA)"
    static_ids, static_len = decode(model, prompts, greedy, eos=96, static=True)
    assert torch.equal(static_ids, eager_ids) and torch.equal(static_len, eager_len)
    assert len({tuple(r) for r in static_ids.tolist()}) == len(set(map(tuple, prompts)))  # depends on the prompt

    # Sampled, from one seed each: the sampler stays outside the graph and sees the same logits.
    draws = [decode(model, prompts, Sampler(1.0, 0.9, torch.Generator().manual_seed(4)), eos=96, static=s)
             for s in (False, True)]
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])

    # An eos one row produces midway: that row is cut (its count stops), the others go on.
    row = eager_ids[0].tolist()
    at = next(j for j in range(1, NEW - 1) if row[j] not in row[:j])
    cut = [decode(model, prompts, greedy, eos=row[at], static=s) for s in (False, True)]
    assert torch.equal(cut[0][0], cut[1][0]) and torch.equal(cut[0][1], cut[1][1])
    assert cut[1][1][0].item() == at + 1 < NEW


def test_stop_strings_end_rows_in_both_loops():
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer

    tok = load_bundled_tokenizer()
    config = tiny_config("Qwen2ForCausalLM", vocab=len(tok))
    config.initializer_range = 0.3
    model = StreamedModel(build_store(config, torch.float32, seed=1), torch.device("cpu"))
    prompts = [tok(t)["input_ids"] for t in ("Question: 2 + 2?\nAnswer: ", "Question: 13 coins?\nAnswer: ")]
    free, _ = decode(model, prompts, greedy, eos=tok.eos_token_id, static=True)
    text = tok.decode(free[0].tolist(), skip_special_tokens=True)
    stop = text[len(text) // 2:][:2]
    assert stop.strip()
    got = [decode(model, prompts, greedy, eos=tok.eos_token_id, static=s, stop=[stop], tok=tok) for s in (False, True)]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert got[1][1][0].item() < NEW


class _ResidentFeed:
    """Every layer on the device, as a trainer holding them all resident (TrainerLayerFeed.all_in_place)."""

    def __init__(self, store, device, dtype):
        self.layers = [store.layouts[n].views(store.tiles[n].master.to(device, dtype)) for n in store.layer_names]
        self.bytes_sent = 0

    def all_in_place(self) -> bool:
        return True

    def get(self, i):
        return self.layers[i]

    def prefetch(self, i):
        pass

    def release(self):
        pass


def test_why_not_a_graph_is_said(monkeypatch):
    store = store_of("Qwen2ForCausalLM")
    assert why_not_graph(StreamedModel(store, torch.device("cpu"))) == "not on CUDA"
    model = StreamedModel(store, torch.device("cpu"), feed=_ResidentFeed(store, "cpu", torch.float32))
    model.device = torch.device("cuda")  # only the reasons are read
    assert why_not_graph(model) is None
    model.feed.all_in_place = lambda: False
    assert why_not_graph(model) == "some layers stream from host memory"
    model.feed.all_in_place = lambda: True
    from megatrain_cli.eval import static_decode

    monkeypatch.setitem(static_decode._CAPTURE_FAILED, id(store), "operation not permitted when stream is capturing")
    assert why_not_graph(model) == ("the CUDA graph capture failed earlier in this run: operation not permitted "
                                    "when stream is capturing")
    long = build_store(tiny_config("Qwen2ForCausalLM", vocab=97, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), torch.float32, seed=1)
    model = StreamedModel(long, torch.device("cpu"), feed=_ResidentFeed(long, "cpu", torch.float32))
    model.device = torch.device("cuda")
    assert why_not_graph(model) == "its dynamic RoPE picks its tables by the largest position, read on the host"
    moe = build_store(tiny_config("qwen3_moe", vocab=97), torch.float32, seed=1)
    model = StreamedModel(moe, torch.device("cpu"), feed=_ResidentFeed(moe, "cpu", torch.float32))
    model.device = torch.device("cuda")
    assert why_not_graph(model) == "mixture-of-experts layers route with data-dependent shapes"


# ---------------------------------------------------------------- on the GPU (run with `pytest -m cuda`)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MistralForCausalLM", "gemma2"])
def test_cuda_graph_replays_decode_what_eager_decodes(arch):
    cuda = torch.device("cuda")
    store = store_of(arch, layers=3)
    prompts = random_prompts(97)
    graphed = StreamedModel(store, cuda, feed=_ResidentFeed(store, cuda, torch.float32))
    eager = StreamedModel(store, cuda, pin_all=True)  # the layer feed: eager steps
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # one attention kernel for both
        for pick in (greedy, "sampled"):
            got = [decode(m, prompts, pick if pick is greedy else Sampler(1.0, 1.0, torch.Generator(cuda).manual_seed(3)),
                          eos=96, static=False) for m in (eager, graphed)]
            assert graphed.decode_path == "graph" and eager.decode_path.startswith("eager (")
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert graphed.steps == eager.steps  # a forward per token, the capture not counted


def test_one_token_attention_reads_grouped_heads_as_sdpa_over_repeated_ones():
    from megatrain_cli.eval.decode_attention import grouped_decode

    g = torch.Generator().manual_seed(0)
    b, h, hkv, t, d = 3, 8, 2, 11, 16
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n, s in ((h, 1), (hkv, t), (hkv, t)))
    mask = torch.rand(b, 1, 1, t, generator=g) < 0.7
    mask[:, :, :, 0] = True  # every row sees a key
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), attn_mask=mask, scale=0.3)
    got = grouped_decode(q, k, v, mask, 0.3)
    assert got.shape == (b, 1, h, d)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)
    hidden = ~mask[:, :, 0, :, None]  # [B, 1, T, 1]: over every head and dim
    noisy = torch.where(hidden, torch.full_like(v, 1e4), v)
    assert torch.equal(grouped_decode(q, k, noisy, mask, 0.3), got)  # a masked column weighs exactly 0


@pytest.mark.parametrize("arch,grouped", [("Qwen2ForCausalLM", True), ("gemma2", False)])
def test_the_static_loop_routes_one_token_attention_to_the_grouped_kernel(arch, grouped, monkeypatch):
    """Families on HF's SDPA take grouped_decode at every token step of every layer (not the prefill); Gemma 2's
    softcapped eager attention keeps HF's own."""
    from megatrain_cli.eval import decode_attention

    calls = []
    real = decode_attention.grouped_decode
    monkeypatch.setattr(decode_attention, "grouped_decode", lambda *a: calls.append(a[0].shape) or real(*a))
    store = store_of(arch)
    model = StreamedModel(store, torch.device("cpu"))
    decode(model, random_prompts(97), greedy, eos=-1, static=True)
    assert len(calls) == (store.adapter.num_layers * (NEW - 1) if grouped else 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_grouped_one_token_attention_matches_sdpa_in_bf16():
    """On the GPU in bf16 at a 7B layer's head layout (28 query heads over 4 key heads, 128 dims): the grouped
    kernel agrees with SDPA over repeated heads to bf16 rounding (its scores are rounded to bf16 as HF's eager
    attention rounds them; SDPA keeps them in fp32)."""
    from megatrain_cli.eval.decode_attention import grouped_decode

    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(8, n, s, 128, generator=g, device="cuda", dtype=torch.bfloat16)
               for n, s in ((28, 1), (4, 300), (4, 300)))
    mask = torch.ones(8, 1, 1, 300, dtype=torch.bool, device="cuda")
    mask[:, :, :, 200:] = False  # columns not written yet
    mask[0, :, :, :30] = False  # a left-padded row
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(7, 1), v.repeat_interleave(7, 1), attn_mask=mask, scale=128 ** -0.5).transpose(1, 2)
    got = grouped_decode(q, k, v, mask, 128 ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.02)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_a_failed_capture_decodes_eagerly_restores_the_stream_and_is_not_retried(monkeypatch):
    from megatrain_cli.eval import static_decode

    monkeypatch.setattr(static_decode, "_CAPTURE_FAILED", {})
    real_step = StaticDecoder._step

    def syncing_step(self, *args):  # a host read inside the step, as a RoPE that sizes itself by data does
        out = real_step(self, *args)
        if torch.cuda.is_current_stream_capturing():
            out.sum().item()
        return out

    monkeypatch.setattr(StaticDecoder, "_step", syncing_step)
    cuda = torch.device("cuda")
    store = store_of("Qwen2ForCausalLM", layers=2)
    prompts = random_prompts(97)
    model = StreamedModel(store, cuda, feed=_ResidentFeed(store, cuda, torch.float32))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = decode(StreamedModel(store, cuda, pin_all=True), prompts, greedy, eos=96, static=False)
        got = decode(model, prompts, greedy, eos=96, static=False)
        assert model.decode_path.startswith("eager (the CUDA graph capture failed: ")
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        again = decode(model, prompts, greedy, eos=96, static=False)
        assert model.decode_path.startswith("eager (the CUDA graph capture failed earlier in this run: ")
        assert torch.equal(again[0], want[0])
