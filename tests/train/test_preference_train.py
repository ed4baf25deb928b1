"""Preference training through the trainer and the CLI (recipes/dpo-tiny.yaml, made small): the reference pass
against plain HF forwards, its cache (reused by a rerun and a resume, redone when the data or the model
changes, the same for any beta), the metrics TRL names in metrics.jsonl, exact resume, the held-out pairs'
eval, and bad preference inputs refused through `megatrain train` with nothing written.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from megatrain_cli.recipe import load_recipe
from megatrain_cli.train.loop import run_training
from tests.helpers_bad_inputs import megatrain, refused

ROOT = Path(__file__).resolve().parents[2]
DPO_TINY = ROOT / "recipes" / "dpo-tiny.yaml"
# 24 records: 22 training pairs in 11 rows of 256 tokens (3 steps an epoch), 2 held out
FAST = ["data.max_samples=24", "train.steps=4", "logging.dashboard=plain", "logging.every_n_steps=1",
        "checkpoint.export_final=false", "checkpoint.every_n_steps=2", "data.cache_dir=off", "train.warmup_steps=1"]
TRL = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")


def recipe(out: Path, cache: Path, *extra: str):
    return load_recipe(DPO_TINY, [*FAST, f"output_dir={out}", f"preference.reference_cache={cache}", *extra])


def run(capsys, out: Path, cache: Path, *extra: str) -> str:
    assert run_training(recipe(out, cache, *extra)) == 0
    captured = capsys.readouterr()
    return captured.out + captured.err


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- the reference pass against HF
@pytest.mark.parametrize("arch,extra", [("Qwen2ForCausalLM", {"tied": True}), ("qwen3_moe", {})],
                         ids=["tied-embeddings", "moe"])
def test_the_reference_pass_equals_plain_hf_forwards(arch, extra):
    from megatrain_cli.data.preference import load_preference_examples
    from megatrain_cli.data.preference_rows import build_preference_data
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer
    from megatrain_cli.recipe import DataConfig, TrainConfig
    from megatrain_cli.train.reference_pass import score_data
    from tests.engines import make_engine
    from tests.preference_reference import sequence_logps, units_of
    from tests.reference import reference_model, tiny_config

    tok = load_bundled_tokenizer()
    data_cfg = DataConfig(source="builtin:sample_math_pref", max_samples=10, cache_dir="off")
    data = build_preference_data(load_preference_examples(data_cfg, "dpo"), tok, data_cfg, 256, seed=0)
    config = tiny_config(arch, vocab=len(tok), layers=2, **extra)
    store = build_store(config, torch.float32, seed=3)
    engine = make_engine(store, TrainConfig(steps=1), device="cpu", checkpoint_interval=1, loss_chunk_tokens=96,
                         overlap_optimizer=False)
    scores = score_data(engine, data, micro_batch_size=3, group=2)
    engine.close()
    model = reference_model(store, config).eval()
    everything = data.micro_batch(list(range(data.num_rows)))
    with torch.no_grad():
        for s, (seq,) in zip(everything.layout.sequences.tolist(), units_of(everything, "kto")):
            want, count = sequence_logps(model, seq)
            assert int(scores.tokens[s]) == count > 0
            assert float(scores.logps[s]) == pytest.approx(float(want), rel=1e-5, abs=1e-5), f"sequence {s}"


# ---------------------------------------------------------------- the cache
def test_the_model_files_are_hashed_by_content(tmp_path):
    from megatrain_cli.checkpoint import export_hf
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer
    from megatrain_cli.train.reference_pass import HASH_MEMO, model_fingerprint
    from megatrain_cli.train.setup import model_config

    tok = load_bundled_tokenizer()
    r = load_recipe(DPO_TINY)
    export_hf(build_store(model_config(r, tok), torch.float32, seed=0), tmp_path / "model", dtype=torch.float32,
              tokenizer=tok)
    r = load_recipe(DPO_TINY, ["~model.preset", f"model.path={tmp_path / 'model'}"])
    config = model_config(r, tok)
    memo = tmp_path / "memo"
    first = model_fingerprint(r, config, memo)
    assert model_fingerprint(r, config, memo) == first
    assert len(json.loads((memo / HASH_MEMO).read_text())) == 2  # config.json and the weights, remembered
    weights = next((tmp_path / "model").glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1  # one bit of one weight: same size, another file
    weights.write_bytes(bytes(raw))
    assert model_fingerprint(r, config, memo) != first
    preset = load_recipe(DPO_TINY)
    seeded = load_recipe(DPO_TINY, ["model.seed=1"])
    assert model_fingerprint(preset, model_config(preset, tok), memo) != \
        model_fingerprint(seeded, model_config(seeded, tok), memo)


def test_the_cached_reference_is_reused_and_redone_when_the_data_or_model_change(tmp_path, capsys):
    cache = tmp_path / "cache"
    first = run(capsys, tmp_path / "a", cache)
    assert "reference pass (training): 44 sequences in 11 rows" in first and "cached at" in first
    records = metrics(tmp_path / "a")
    assert [m["step"] for m in records] == [1, 2, 3, 4]
    one = records[0]  # the policy is the reference: every pair's loss ln 2
    assert abs(one["loss"] - math.log(2)) <= math.ulp(math.log(2))
    assert [one[k] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")] == [0.0] * 4
    assert all(set(TRL) <= set(m) for m in records) and "val_rewards/accuracies" not in one

    # A rerun: the cache, no pass, the same steps. Its resume from step 2: the cache again, the same steps 3 and 4.
    again = run(capsys, tmp_path / "b", cache)
    assert "reused from the cache" in again and "reference pass (training):" not in again
    assert_same_steps(metrics(tmp_path / "b"), records)
    shutil.rmtree(tmp_path / "b" / "step_4")
    resumed = run(capsys, tmp_path / "b", cache, "checkpoint.resume=auto")
    assert "reused from the cache" in resumed and "resumed from" in resumed and "step 2" in resumed
    assert_same_steps(metrics(tmp_path / "b"), records)
    # The method's settings do not change the reference; the data and the model do.
    assert "reused from the cache" in run(capsys, tmp_path / "c", cache, "preference.beta=0.3", "train.steps=1")
    for change in ("data.max_samples=20", "model.seed=1"):
        redone = run(capsys, tmp_path / change, cache, change, "train.steps=1")
        assert "reused from the cache" not in redone and "reference pass (training):" in redone, change


def assert_same_steps(ours: list[dict], straight: list[dict]) -> None:
    """Every step's figures equal, exactly, but the clocks and the host's."""
    assert [m["step"] for m in ours] == [m["step"] for m in straight]
    for a, b in zip(ours, straight):
        assert {k: v for k, v in a.items() if k not in VARYING} == {k: v for k, v in b.items() if k not in VARYING}


# timings and host figures differ between two runs of the same steps
VARYING = ("step_time_s", "tokens_per_s", "model_tflops", "executed_tflops", "host_rss_bytes", "eta_s",
           "time_forward_s", "time_backward_s", "time_optimizer_s", "time_wait_optimizer_s", "pinned_bytes")


def test_dpo_learns_its_pairs_and_scores_the_held_out_ones(tmp_path, capsys):
    out = tmp_path / "run"
    text = run(capsys, out, tmp_path / "cache", "train.steps=12", "eval.enabled=true", "eval.every_n_steps=6",
               "checkpoint.every_n_steps=null")
    records = metrics(out)
    margins = [m["rewards/margins"] for m in records]
    accuracies = [m["rewards/accuracies"] for m in records]
    assert sum(margins[-3:]) > sum(margins[:3]) + 0.1 and sum(accuracies[-3:]) / 3 >= 0.75, (margins, accuracies)
    assert [m["step"] for m in records if "val_rewards/accuracies" in m] == [6, 12]
    result = json.loads((out / "eval" / "results.json").read_text())
    assert result["method"] == "dpo" and result["held_out_units"] == 2 and set(TRL) <= set(result)
    assert result["loss"] == pytest.approx(records[-1]["val_loss"], abs=1e-12)
    assert "reference pass (held-out): 4 sequences" in text and "held-out 2 pairs after step 12" in text


@pytest.mark.parametrize("method,extra,line", [
    ("simpo", [], "simpo is reference-free: no reference pass"),
    ("orpo", [], "orpo is reference-free: no reference pass"),
    ("ipo", [], "reference pass (training)"),
    ("kto", ["data.source=builtin:sample_math_kto"], "reference pass (training): 22 sequences in"),
])
def test_every_method_trains_through_the_cli(tmp_path, capsys, method, extra, line):
    out = tmp_path / "run"
    text = run(capsys, out, tmp_path / "cache", f"train.method={method}", "train.steps=2",
               "checkpoint.every_n_steps=null", *extra)
    assert line in text
    records = metrics(out)
    assert len(records) == 2 and all(math.isfinite(m["loss"]) for m in records)
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins"} <= set(records[-1])
    if method == "kto":
        assert "kl" in records[-1] and "rewards/accuracies" not in records[-1]


# ---------------------------------------------------------------- bad inputs through `megatrain train`
GOOD = {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5. The answer is: 5", "rejected": "2 + 3 = 6. The answer is: 6"}
BAD_RECORDS = [
    ({"prompt": "What is 1 + 1?", "chosen": "1 + 1 = 2"}, ["line 2", "missing field 'rejected'"]),
    ({"prompt": "What is 1 + 1?", "chosen": "  ", "rejected": "3"}, ["line 2", "field 'chosen' is empty"]),
    ({"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "2"},
     ["line 2", "fields 'chosen' and 'rejected' are the same completion"]),
    ({"prompt": "What is 1 + 1?", "chosen": "two " * 300, "rejected": "three"},
     ["line 2", "the pair is", "chosen", "more than train.seq_len=256"]),
]


@pytest.mark.parametrize("record,names", BAD_RECORDS, ids=["missing-rejected", "empty", "same", "too-long"])
def test_a_bad_pair_is_refused_naming_its_line_and_field(tmp_path, record, names):
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (GOOD, record, GOOD, GOOD)) + "\n")
    out = refused(megatrain("train", DPO_TINY, f"data.source={data}", f"output_dir={tmp_path / 'out'}",
                            f"preference.reference_cache={tmp_path / 'cache'}", "data.cache_dir=off",
                            "data.test_fraction=0.0"), 2, str(data), *names)
    assert "Traceback" not in out
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists(), "nothing written"


def test_supervised_data_with_a_preference_method_is_refused(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"query": "What is 1 + 1?", "response": "The answer is: 2"}) + "\n")
    refused(megatrain("train", DPO_TINY, f"data.source={data}", f"output_dir={tmp_path / 'out'}"), 2,
            f"{data} line 1 (fields query, response)", "supervised data (format metamathqa)", "train.method dpo",
            "{prompt, chosen, rejected}")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- dry run, bench, dashboard
def test_dry_run_states_the_method_the_pair_layout_and_the_reference_pass():
    result = megatrain("train", DPO_TINY, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "method: dpo, the loss a mean over each step's pairs; each pair's chosen and rejected sequences side " \
           "by side in one row" in result.output
    assert "reference pass: one streamed forward over every training sequence" in result.output
    simpo = megatrain("train", DPO_TINY, "train.method=simpo", "--dry-run")
    assert "reference pass: none (simpo is reference-free)" in simpo.output


def test_bench_times_the_method_sft_and_the_reference_pass_on_the_same_tokens(tmp_path):
    out = tmp_path / "bench.json"
    result = megatrain("bench", "train.method=dpo", "--model", "tiny", "--device", "cpu", "model.dtype=fp32",
                       "--seq", "128", "--batch", "2", "--steps", "1", "--output", out, "logging.dashboard=off")
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["dpo", "sft", "reference"]
    assert all(r["batch"] == 2 and r["seq"] == 128 and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["dpo"]["losses"][0] == pytest.approx(math.log(2), abs=1e-12)  # the reference pass's scores
    assert "dpo / sft:" in result.output and "dpo / reference:" in result.output
    refused(megatrain("bench", "train.method=dpo", "--model", "tiny", "--device", "cpu", "--gpus", "2"), 2,
            "train.method=dpo: not with --gpus")


def test_the_dashboard_shows_the_pairs_metrics():
    import io

    from rich.console import Console

    from megatrain_cli.dashboard import Dashboard
    from megatrain_cli.metrics.record import StepMetrics

    m = StepMetrics(step=3, total_steps=10, loss=0.61, lr=1e-3, grad_norm=0.5, tokens=1024, loss_tokens=300,
                    step_time_s=1.0, tokens_per_s=1024.0, val_loss=0.65,
                    preference={"rewards/accuracies": 0.875, "rewards/margins": 0.25, "rewards/chosen": 0.1},
                    val_preference={"rewards/accuracies": 0.75})
    console = Console(file=io.StringIO(), width=200, force_terminal=False, color_system=None, record=True)
    dash = Dashboard("plain", total_steps=10, console=console, val_every=3, preference=True)
    dash.update(m)
    dash.progress("reference pass (training)", 5, 10)
    header, line, progress = console.export_text().splitlines()
    assert [c.strip() for c in header.split("|")][:4] == ["step", "loss", "acc", "margin"]
    assert header.split("|")[-1].strip() == "val acc" and line.split("|")[-1].strip() == "0.750"
    assert [c.strip() for c in line.split("|")][2:4] == ["0.875", "0.2500"]
    assert progress == "reference pass (training): 5/10 rows (50%)"
    console.print(dash.render(m))
    frame = console.export_text()
    assert "preference" in frame and "rewards/accuracies" in frame and "held-out accuracies" in frame
