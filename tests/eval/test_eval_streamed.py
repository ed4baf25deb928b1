"""Streamed generation (weights in a HostStore, layers streamed per step) gives the token ids HF
`generate` gives on the same weights; `megatrain eval` runs it, and picks resident or streamed."""

from __future__ import annotations

import json

import pytest
import torch

from megatrain_cli.eval.generate import generate_greedy, hf_greedy_batch, left_pad
from megatrain_cli.eval.source import GIB, choose_mode, num_params, resident_from_store, resolve_model
from megatrain_cli.eval.streamed import StreamedModel
from megatrain_cli.models.loader import build_store
from megatrain_cli.models.tokenizer import load_bundled_tokenizer
from tests.reference import reference_model, tiny_config

PROMPT_LENGTHS = (3, 11, 6, 1, 8)  # one batch, left padded to 11
NEW_TOKENS = 10


def random_prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def tiny_store(arch: str, tied: bool, dtype=torch.float32, vocab: int = 97, **shape):
    config = tiny_config(arch, tied=tied, vocab=vocab, **shape)
    # A large init, so that the greedy tokens depend on the prompt and ties between logits are rare.
    config.initializer_range = 0.3
    return config, build_store(config, dtype, seed=1)


def both_ways(resident, streamed, prompts, eos: int, **kw):
    ids, mask = left_pad(prompts, pad_id=0)
    args = dict(max_new_tokens=NEW_TOKENS, eos_ids=[eos], pad_id=0, stop_criteria=[], **kw)
    with torch.inference_mode():
        return hf_greedy_batch(resident, ids, mask, **args), streamed.greedy_batch(ids, mask, **args)


# ---------------------------------------------------------------- token for token against HF generate
@pytest.mark.parametrize("arch,tied", [("Qwen2ForCausalLM", False), ("Qwen2ForCausalLM", True),
                                       ("LlamaForCausalLM", False), ("LlamaForCausalLM", True),
                                       ("gemma2", True)])  # HF's eager attention: an additive mask
def test_streamed_greedy_equals_hf_generate(arch, tied):
    config, store = tiny_store(arch, tied)
    hf = reference_model(store, config).eval()  # an independent HF model holding the store's weights
    streamed = StreamedModel(store, torch.device("cpu"))
    prompts = random_prompts(config.vocab_size)
    theirs, ours = both_ways(hf, streamed, prompts, eos=config.vocab_size - 1)
    assert ours.shape == (len(prompts), NEW_TOKENS)
    assert torch.equal(ours, theirs)
    assert len({tuple(row) for row in ours.tolist()}) == len(prompts)  # outputs depend on the prompt

    # An eos that one row produces midway: that row is cut and padded, the others go on, as in HF.
    midway = [(r, a) for r in range(len(prompts)) for a in range(1, NEW_TOKENS - 1)
              if int(theirs[r, a]) not in theirs[r, :a].tolist()]  # a token new to its row (tiny Gemma 2 repeats one)
    row, at = midway[0] if midway else (0, 0)
    eos = int(theirs[row, at])
    theirs, ours = both_ways(hf, streamed, prompts, eos=eos)
    assert torch.equal(ours, theirs)
    assert ours[row, at] == eos and (ours[row, at + 1:] == 0).all()


def test_sampled_tokens_are_drawn_from_the_capped_logits_hf_computes():
    """Gemma 2's final logit softcap (cap * tanh(logits / cap)) is in what a sampler sees, as in HF's forward and
    in training's head: greedy picks do not show it (tanh keeps the order), GRPO's sampled rollouts would."""
    config, store = tiny_store("gemma2", True)
    hf = reference_model(store, config).eval()
    ids, mask = left_pad(random_prompts(config.vocab_size, (6, 6, 6)), pad_id=0)
    seen = []
    with torch.inference_mode():
        StreamedModel(store, torch.device("cpu")).decode_batch(
            ids, mask, max_new_tokens=1, eos_ids=[config.vocab_size - 1], pad_id=0, stop_criteria=[],
            pick=lambda logits: seen.append(logits.clone()) or logits.argmax(-1))
        want = hf(input_ids=ids, attention_mask=mask).logits[:, -1].float()
    assert want.abs().max() < config.final_logit_softcapping  # the cap is what bounds them
    torch.testing.assert_close(seen[0], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [PROMPT_LENGTHS, (5, 5, 5)])  # with and without padding
def test_streamed_bf16_equals_resident_bf16(lengths):
    """In bf16 rounding shows: equal ids mean the same computation, the same masks (none where HF passes
    none) and a rotary table computed the same way."""
    config, store = tiny_store("Qwen2ForCausalLM", False, dtype=torch.bfloat16)
    resident = resident_from_store(store, torch.device("cpu"), torch.bfloat16)
    theirs, ours = both_ways(resident, StreamedModel(store, torch.device("cpu")),
                             random_prompts(config.vocab_size, lengths), eos=config.vocab_size - 1)
    assert torch.equal(ours, theirs)


def test_sliding_window_layers_are_masked_as_hf_masks_them():
    config = tiny_config("MistralForCausalLM", vocab=97)
    config.sliding_window, config.initializer_range = 4, 0.3  # shorter than prompt + new tokens
    store = build_store(config, torch.float32, seed=1)
    theirs, ours = both_ways(reference_model(store, config).eval(), StreamedModel(store, torch.device("cpu")),
                             random_prompts(config.vocab_size), eos=config.vocab_size - 1)
    assert torch.equal(ours, theirs)


def test_generate_greedy_stops_streamed_rows_where_resident_rows_stop():
    """The whole eval path, stop strings included: same texts and token counts in both modes."""
    tok = load_bundled_tokenizer()
    config, store = tiny_store("Qwen2ForCausalLM", True, vocab=len(tok))
    hf = reference_model(store, config).eval()
    streamed = StreamedModel(store, torch.device("cpu"))
    texts = ["Question: What is 2 + 2?\nAnswer: ", "Question: Lucy has 13 coins. How many?\nAnswer: ",
             "Question: 7\nAnswer: "]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    kw = dict(eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, max_new_tokens=NEW_TOKENS, batch_size=2)
    free_run, _ = generate_greedy(hf, tok, prompts, stop=[], **kw)
    # A stop string the model really produces: a piece of the middle of the first answer.
    stop = free_run[0].text[len(free_run[0].text) // 2:][:3]
    assert stop.strip()
    resident, _ = generate_greedy(hf, tok, prompts, stop=[stop], **kw)
    ours, _ = generate_greedy(streamed, tok, prompts, stop=[stop], **kw)
    assert ours == resident
    assert resident[0].new_tokens < free_run[0].new_tokens


# ---------------------------------------------------------------- choosing the mode
def test_auto_mode_streams_only_what_does_not_fit(monkeypatch):
    source = resolve_model("preset:7b", tokenizer_size=502, max_positions=128)
    assert source.config.vocab_size == 152064  # the preset keeps its own vocabulary
    params = num_params(source.config)
    assert params == 7_615_616_512  # Qwen2.5-7B
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_mode("auto", source, params, cpu, torch.float32, 32, 128)[0] == "resident"
    assert choose_mode("streamed", source, params, cpu, torch.float32, 32, 128)[0] == "streamed"
    # ~14 GiB of bf16 weights: resident with 40 GiB free, streamed with 12.
    for free_gib, expected in ((40, "resident"), (12, "streamed")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_a, f=free_gib: (f * GIB, 141 * GIB))
        assert choose_mode("auto", source, params, cuda, torch.bfloat16, 32, 128)[0] == expected
    with pytest.raises(ValueError, match="mode"):
        choose_mode("fast", source, params, cpu, torch.float32, 32, 128)
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_model("preset:9b", tokenizer_size=502, max_positions=128)


# ---------------------------------------------------------------- the command
def run_cli(*args: str):
    from typer.testing import CliRunner

    from megatrain_cli.cli import app

    return CliRunner().invoke(app, ["eval", *args])


def test_cli_eval_preset_streamed_writes_speed_and_matches_resident(tmp_path):
    common = ["--model", "preset:tiny", "eval.limit=4", "eval.max_new_tokens=8", "engine.device=cpu"]
    streamed = run_cli(*common, "--mode", "streamed", "--output-dir", str(tmp_path / "streamed"))
    assert streamed.exit_code == 0, streamed.output
    results = json.loads((tmp_path / "streamed" / "results.json").read_text())
    assert results["mode"] == "streamed" and results["total"] == 4 and results["model_path"] == "preset:tiny"
    assert 0 < results["generated_tokens"] <= 4 * 8 and results["tokens_per_s"] > 0
    assert results["wall_s"] >= results["generation_s"] > 0
    assert results["forward_steps"] >= 1 and results["streamed_gb"] == 0.0  # CPU: layers are used in place

    resident = run_cli(*common, "--mode", "resident", "--output-dir", str(tmp_path / "resident"))
    assert resident.exit_code == 0, resident.output
    assert json.loads((tmp_path / "resident" / "results.json").read_text())["mode"] == "resident"
    assert (tmp_path / "resident" / "predictions.jsonl").read_text() == \
        (tmp_path / "streamed" / "predictions.jsonl").read_text()


def test_run_eval_streams_an_hf_directory_as_it_runs_it_resident(tmp_path):
    """Weights read from safetensors into the host store, the directory's tokenizer and generation config."""
    from megatrain_cli.eval.run import run_eval
    from tests.eval.test_eval import settings

    tok = load_bundled_tokenizer()
    config, store = tiny_store("LlamaForCausalLM", False, vocab=len(tok))
    reference_model(store, config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    r = settings("eval.limit=6", "eval.batch_size=4", "eval.max_new_tokens=6", "engine.device=cpu")
    resident = run_eval(r, str(tmp_path / "model"), mode="resident", output_dir=str(tmp_path / "resident"), log=None)
    streamed = run_eval(r, str(tmp_path / "model"), mode="streamed", output_dir=str(tmp_path / "streamed"), log=None)
    assert (resident["mode"], streamed["mode"]) == ("resident", "streamed")
    assert streamed["generated_tokens"] == resident["generated_tokens"] > 0
    assert (tmp_path / "resident" / "predictions.jsonl").read_text() == \
        (tmp_path / "streamed" / "predictions.jsonl").read_text()


def test_cli_eval_rejects_bad_mode_and_preset(tmp_path):
    bad_mode = run_cli("--model", "preset:tiny", "--mode", "fast", "--output-dir", str(tmp_path))
    assert bad_mode.exit_code == 2 and "--mode" in bad_mode.output
    bad_preset = run_cli("--model", "preset:nope", "eval.limit=1", "engine.device=cpu", "--output-dir", str(tmp_path))
    assert bad_preset.exit_code == 2 and "unknown preset" in bad_preset.output
    assert not (tmp_path / "results.json").exists()


# ---------------------------------------------------------------- on the GPU (run with `pytest -m cuda`)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("pin_all", [True, False])  # layers pinned up front / cast into staging per step
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_streamed_equals_resident(pin_all, dtype):
    cuda = torch.device("cuda")
    # Five layers: an odd count, so the next step's first layer goes into either buffer in turn.
    config, store = tiny_store("Qwen2ForCausalLM", False, dtype=dtype, layers=5, hidden=64, inter=192)
    resident = resident_from_store(store, cuda, dtype)
    streamed = StreamedModel(store, cuda, pin_all=pin_all)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # one attention kernel for both
        theirs, ours = both_ways(resident, streamed, random_prompts(config.vocab_size), eos=config.vocab_size - 1)
    assert torch.equal(ours, theirs)
    # Every step streamed every layer (five layers never fit in two buffers), plus at most one prefetch
    # of a next step's first layer when the batch ended early.
    element = torch.empty((), dtype=dtype).element_size()
    layer_bytes = sum(store.tiles[n].master.numel() for n in store.layer_names) * element
    assert streamed.steps == ours.shape[1]
    assert 0 <= streamed.bytes_sent - streamed.steps * layer_bytes <= layer_bytes // 5 + 1
