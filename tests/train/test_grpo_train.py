"""GRPO runs end to end on the CPU (recipes/grpo-tiny.yaml, shortened): a run stopped mid-way and resumed ends
bit-identical to the uninterrupted one (tiles, trainer state with the sampler's generator, metrics), with the
KL term and top-p on; a reward that raises, returns NaN or a non-number is reported with its example and the
run goes on; each bad input is refused at the start with its message and exit 2, nothing written.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from megatrain_cli.recipe import RecipeError, load_recipe
from megatrain_cli.train.loop import run_training
from tests.train.test_faults import assert_same_checkpoint, on_step, steps_logged

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "recipes" / "grpo-tiny.yaml"
FAST = ["train.steps=4", "train.seq_len=128", "train.micro_batch_size=4", "train.grad_accum=2",
        "grpo.num_generations=4", "grpo.max_new_tokens=12", "grpo.top_p=0.9", "grpo.beta=0.05",
        "logging.dashboard=off", "checkpoint.export_final=false", "data.max_samples=40",
        "grpo.rewards=[exact_match,format,tests.train.test_grpo_train:letters]"]


def letters(prompt: str, completion: str, example) -> float:
    """A user reward that a random-init model's completions differ in (exact match rarely does): the letters
    of the completion's text, so the advantages are not all 0 and the weights move."""
    return sum(c.isalpha() for c in completion) / 10


def recipe(out: Path, *extra: str):
    return load_recipe(GRPO, [*FAST, f"output_dir={out}", *extra])


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-straight")
    assert run_training(recipe(out, "checkpoint.every_n_steps=1", "checkpoint.keep_last_n=4")) == 0
    return out


def test_a_run_logs_rewards_rollout_speed_and_the_split(straight):
    logged = records(straight)
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    for m in logged:
        assert m["rollout_tokens"] > 0 and m["rollout_tokens_per_s"] > 0 and m["train_tokens_per_s"] > 0
        assert min(m["time/generate"], m["time/score"], m["time/train"], m["time/reference"]) > 0
        assert m["reward"] > 0 and m["reward_std"] > 0 and m["reward_errors"] == 0
        assert m["clip_ratio"] == 0.0 and m["grad_norm"] > 0  # one update per generation batch: the ratio is 1
    assert logged[0]["kl"] == 0.0  # the first step's policy is the initial one, scored by the same pass
    assert logged[-1]["kl"] > 0.0


def test_stopped_mid_run_and_resumed_is_bit_exact(straight, tmp_path, monkeypatch):
    out = tmp_path / "run"
    on_step(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    assert run_training(recipe(out, "checkpoint.every_n_steps=3")) == 75
    monkeypatch.undo()
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2"] and steps_logged(out) == [1, 2]
    assert_same_checkpoint(straight / "step_2", out / "step_2")
    assert run_training(recipe(out, "checkpoint.resume=auto", "checkpoint.every_n_steps=3")) == 0
    assert steps_logged(out) == [1, 2, 3, 4]
    keys = ("loss", "grad_norm", "reward", "rollout_tokens", "completion_length", "kl")
    assert [[m[k] for k in keys] for m in records(out)] == [[m[k] for k in keys] for m in records(straight)]
    assert_same_checkpoint(straight / "step_4", out / "step_4")


def test_a_checkpoint_sampled_on_another_device_is_refused_on_resume(straight, tmp_path):
    """The rollout sampler's generator state is a CUDA or a CPU one (set_state raised a RuntimeError, a
    traceback): resuming across devices is refused with the device to use, exit 2."""
    import shutil
    import zlib

    from typer.testing import CliRunner

    from megatrain_cli.cli import app
    from tests.helpers_bad_inputs import refused

    out = tmp_path / "run"
    shutil.copytree(straight / "step_2", out / "step_2")
    state_file, manifest_file = out / "step_2" / "trainer_state.json", out / "step_2" / "manifest.json"
    state = json.loads(state_file.read_text())
    assert state["data"]["sampler_device"] == "cpu"
    state["data"]["sampler_device"] = "cuda"
    state_file.write_text(json.dumps(state))
    manifest = json.loads(manifest_file.read_text())
    raw = state_file.read_bytes()
    manifest["files"]["trainer_state.json"].update(crc32=zlib.crc32(raw), bytes=len(raw))
    manifest_file.write_text(json.dumps(manifest))
    res = CliRunner().invoke(app, ["train", str(GRPO), f"output_dir={out}", *FAST, "checkpoint.resume=auto"])
    refused(res, 2, "the checkpoint's rollout sampler ran on cuda, this run samples on cpu: resume with "
                    "engine.device=cuda")
    assert sorted(p.name for p in out.iterdir()) == ["step_2"]


REWARDS = '''
import math

def flaky(prompt, completion, example):
    if example.record % 3 == 0:
        raise ZeroDivisionError("no luck")
    if example.record % 3 == 1:
        return math.nan
    return "high"
'''


def test_a_reward_that_raises_or_returns_nan_or_text_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert run_training(recipe(out, "train.steps=2", "grpo.beta=0", "grpo.rewards=[exact_match,my_rewards:flaky]")) == 0
    err = capsys.readouterr().err
    assert "reward my_rewards:flaky raised ZeroDivisionError: no luck on example record" in err
    assert "reward my_rewards:flaky returned nan on example record" in err
    assert "reward my_rewards:flaky returned a str ('high'), not a number on example record" in err
    assert "that prompt's completions get advantage 0 this step (nothing is learnt from them)" in err
    assert "Traceback" not in err
    logged = records(out)
    assert [m["step"] for m in logged] == [1, 2] and all(m["reward_errors"] == 8 for m in logged)
    assert (out / "step_2").is_dir()


def test_num_generations_below_two_is_refused_at_load():
    with pytest.raises(RecipeError) as err:
        load_recipe(GRPO, ["grpo.num_generations=1", "grpo.top_p=0", "grpo.rewards=[exact_match,nope]",
                           "eval.every_n_steps=5"])
    assert err.value.problems == [
        "grpo.num_generations: must be >= 2 (advantages are relative to the other completions of the same prompt), "
        "got 1",
        "grpo.top_p: must be in (0, 1], got 0.0",
        "grpo.rewards: 'nope' is not a reward; give exact_match, format or a Python function as module:function "
        "(e.g. my_rewards:length_penalty)",
        "eval.every_n_steps: train.method grpo has no validation loss; remove it (eval.enabled scores held-out "
        "problems by exact match at the end)"]
    with pytest.raises(RecipeError) as err:
        load_recipe(GRPO, ["grpo.num_generations=3"])
    assert err.value.problems == [
        "train.micro_batch_size: a GRPO step trains on train.micro_batch_size x train.grad_accum = 16 completions, "
        "not a multiple of grpo.num_generations=3 (every prompt's completions train in the same step); make it one"]


def test_bad_inputs_exit_2_before_anything_is_written(tmp_path):
    from typer.testing import CliRunner

    from megatrain_cli.cli import app

    def run(*overrides):
        out = tmp_path / "out"
        res = CliRunner().invoke(app, ["train", str(GRPO), f"output_dir={out}", *FAST, *overrides])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert not out.exists(), "nothing written"
        return res.output

    assert "grpo.num_generations: must be >= 2" in run("grpo.num_generations=1")
    assert ("grpo.rewards: 'no_such_module:f': cannot import module 'no_such_module' (No module named "
            "'no_such_module'); put it on the Python path") in run("grpo.rewards=[no_such_module:f]")
    plain = tmp_path / "no_answers.jsonl"
    plain.write_text("".join(json.dumps({"instruction": f"Say hello {i}", "output": "hello there"}) + "\n"
                             for i in range(10)))
    assert (f"error: {plain}: no example has a gold answer, which the exact_match reward of train.method grpo "
            f"compares with") in " ".join(run(f"data.source={plain}").split())


def test_a_prompt_answer_file_trains_and_an_end_eval_that_cannot_read_it_is_refused(tmp_path, capsys):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(12)))
    out = tmp_path / "run"
    assert run_training(recipe(out, f"data.source={data}", "train.steps=1", "grpo.beta=0")) == 0
    assert [m["step"] for m in records(out)] == [1]
    again = tmp_path / "again"
    assert run_training(recipe(again, f"data.source={data}", "train.steps=1", "eval.enabled=true",
                               "checkpoint.export_final=true")) == 2
    assert not again.exists()
    assert "error: eval.enabled: the end-of-training eval cannot read the data (" in capsys.readouterr().err
