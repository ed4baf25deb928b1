"""The training loop end to end on the tiny preset (CPU): exact resume, export, NaN policy, signals, eval."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatrain_cli.recipe import load_recipe
from megatrain_cli.train.loop import run_training

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.yaml"
FAST = ["train.steps=4", "train.seq_len=64", "train.micro_batch_size=2", "logging.dashboard=plain",
        "logging.every_n_steps=1", "checkpoint.export_final=false", "train.warmup_steps=1", "eval.enabled=false"]
SECTIONS = ("master", "exp_avg", "exp_avg_sq")


def recipe(out: Path, *extra: str):
    return load_recipe(TINY, [*FAST, f"output_dir={out}", *extra])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def load_store(ckpt: Path):
    """A store built like the trainer builds it, filled from a checkpoint."""
    from megatrain_cli.checkpoint import load_checkpoint
    from megatrain_cli.models.loader import build_store, load_hf_config

    store = build_store(load_hf_config(str(ckpt)), torch.float32, seed=123)  # seed irrelevant: all overwritten
    state = load_checkpoint(store, ckpt)
    return store, state


def megatrain(*args, **kw):
    return subprocess.run([sys.executable, "-m", "megatrain_cli", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=kw.pop("timeout", 120), **kw)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """4 steps in one go, a checkpoint every 2 steps and the final export."""
    out = tmp_path_factory.mktemp("straight")
    assert run_training(recipe(out, "checkpoint.every_n_steps=2", "checkpoint.export_final=true")) == 0
    return out


# ---------------------------------------------------------------- (a) exact resume
def test_straight_run_writes_checkpoints_metrics_and_final(straight):
    assert sorted(p.name for p in straight.glob("step_*")) == ["step_2", "step_4"]
    m = metrics(straight)
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    assert all(x["total_steps"] == 4 and x["skipped_steps"] == 0 for x in m)
    assert all(torch.isfinite(torch.tensor(x["loss"])) for x in m)
    assert (straight / "final" / "config.json").is_file()
    assert load_recipe(straight / "recipe.yaml") == recipe(straight, "checkpoint.every_n_steps=2",
                                                           "checkpoint.export_final=true")
    _, state = load_store(straight / "step_4")
    assert state["step"] == 4 and state["skipped_steps"] == 0


def test_resume_is_bit_identical(straight, tmp_path, monkeypatch):
    from megatrain_cli.engine import step as engine_step

    out = tmp_path / "resumed"
    # First leg: SIGTERM to ourselves during step 2; the trainer finishes the step, checkpoints, exits 0.
    real_step = engine_step.Engine.step
    calls = {"n": 0}

    def step_then_term(self, *a, **kw):
        calls["n"] += 1
        res = real_step(self, *a, **kw)
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return res

    monkeypatch.setattr(engine_step.Engine, "step", step_then_term)
    assert run_training(recipe(out, "checkpoint.every_n_steps=2")) == 0
    monkeypatch.setattr(engine_step.Engine, "step", real_step)
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2"]
    assert [x["step"] for x in metrics(out)] == [1, 2]
    # The trainer restored the previous handlers: SIGTERM is not swallowed after the run.
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.default_int_handler)

    # Second leg: resume from step_2 and finish.
    assert run_training(recipe(out, "checkpoint.every_n_steps=2", "checkpoint.resume=auto")) == 0
    assert [x["step"] for x in metrics(out)] == [1, 2, 3, 4]  # appended across the resume
    assert [x["loss"] for x in metrics(out)] == [x["loss"] for x in metrics(straight)]
    assert [x["grad_norm"] for x in metrics(out)] == [x["grad_norm"] for x in metrics(straight)]
    assert [x["lr"] for x in metrics(out)] == [x["lr"] for x in metrics(straight)]

    a, sa = load_store(straight / "step_4")
    b, sb = load_store(out / "step_4")
    assert sa == sb  # step, skipped steps and the data position
    assert list(a.tiles) == list(b.tiles)
    for name, tile in a.tiles.items():
        assert tile.step == b.tiles[name].step == 4, name
        for section in SECTIONS:
            assert torch.equal(getattr(tile, section), getattr(b.tiles[name], section)), (name, section)
    # And the run really trained: the step-4 masters differ from step 2's.
    c, _ = load_store(out / "step_2")
    assert any(not torch.equal(t.master, c.tiles[n].master) for n, t in a.tiles.items())


def test_resume_from_explicit_path_and_missing_path(straight, tmp_path, capsys):
    out = tmp_path / "explicit"
    code = run_training(recipe(out, f"checkpoint.resume={straight / 'step_2'}", "train.steps=3"))
    assert code == 0
    assert f"resumed from {straight / 'step_2'} at step 2" in capsys.readouterr().err
    assert [x["step"] for x in metrics(out)] == [3]
    code = run_training(recipe(tmp_path / "x", f"checkpoint.resume={tmp_path / 'nope'}"))
    assert code == 2
    assert "checkpoint.resume" in capsys.readouterr().err


# ---------------------------------------------------------------- (b) final/ export
def test_final_loads_with_transformers_and_matches_last_checkpoint(straight, tmp_path):
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(straight / "final", torch_dtype=torch.float32).eval()
    store, _ = load_store(straight / "step_4")
    assert sum(p.numel() for p in final.parameters()) == store.num_params()

    # Reference: the last checkpoint's masters exported independently with `megatrain export`.
    p = megatrain("export", straight / "step_4", tmp_path / "ref", "--dtype", "fp32")
    assert p.returncode == 0, p.stderr
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", torch_dtype=torch.float32).eval()
    ids = torch.randint(0, final.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = final(ids).logits, ref(ids).logits
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)

    # The export carries the masters exactly (fp32 run -> fp32 export): the embedding tile is the embedding.
    embed = dict(final.named_parameters())["model.embed_tokens.weight"].detach().flatten()
    assert torch.equal(store.tiles["embed"].master[: embed.numel()], embed)


# ---------------------------------------------------------------- (c) NaN policy
NAN = ["train.lr=1.0e+30", "train.warmup_steps=0", "train.max_grad_norm=null"]


def test_nan_policy_stop_exits_1_naming_the_step(tmp_path, capsys):
    out = tmp_path / "stop"
    code = run_training(recipe(out, *NAN, "train.nan_policy=stop"))
    err = capsys.readouterr().err
    assert code == 1
    assert "step 2" in err and "not finite" in err and "nan_policy" in err
    assert [x["step"] for x in metrics(out)] == [1]  # step 1 (finite) logged, then stopped


def test_nan_policy_skip_finishes_and_counts(tmp_path):
    out = tmp_path / "skip"
    # 3 of 4 steps skipped: a diverged run, which the default train.max_skipped_fraction (0.5) stops
    # (test_bad_inputs_more.py); 1.0 lifts the limit, to see the counting.
    assert run_training(recipe(out, *NAN, "train.nan_policy=skip", "checkpoint.every_n_steps=4",
                               "train.max_skipped_fraction=1.0")) == 0
    m = metrics(out)
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    assert [x["skipped_steps"] for x in m] == [0, 1, 2, 3]
    _, state = load_store(out / "step_4")
    assert state["skipped_steps"] == 3


# ---------------------------------------------------------------- (d) signals
def _run_until_first_metrics(out: Path, steps: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "megatrain_cli", "train", str(TINY), *FAST,
                             f"train.steps={steps}", f"output_dir={out}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    jsonl = out / "metrics.jsonl"
    while not (jsonl.is_file() and jsonl.read_text().strip()):
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early ({proc.returncode}): {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("no metrics line within 90 s")
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_checkpoints_and_resume_continues(tmp_path, sig, code):
    out = tmp_path / "sig"
    proc = _run_until_first_metrics(out, steps=100000)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    ckpts = sorted(out.glob("step_*"))
    assert len(ckpts) == 1, ckpts
    n = int(ckpts[0].name.split("_")[1])
    assert n >= 1
    assert metrics(out)[-1]["step"] == n  # every step up to the checkpoint was logged, none after
    _, state = load_store(ckpts[0])
    assert state["step"] == n

    p = megatrain("train", TINY, *FAST, f"train.steps={n + 2}", f"output_dir={out}", "checkpoint.resume=auto")
    assert p.returncode == 0, p.stderr
    assert f"at step {n}" in p.stderr
    assert [x["step"] for x in metrics(out)][-2:] == [n + 1, n + 2]


# ---------------------------------------------------------------- (e) eval on the trained model
def test_eval_on_trained_model_writes_results(straight, tmp_path):
    d = tmp_path / "eval"
    p = megatrain("eval", "--model", straight / "final", "eval.limit=4", "eval.max_new_tokens=8", "engine.device=cpu",
                  "--output-dir", d)
    assert p.returncode == 0, p.stderr
    results = json.loads((d / "results.json").read_text())
    preds = [json.loads(line) for line in (d / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 4
    assert results["total"] == 4 and results["limit"] == 4 and 0 <= results["correct"] <= 4
    assert results["accuracy"] == results["correct"] / 4
    assert results["generated_tokens"] > 0


@pytest.mark.parametrize("phase,advice", [("_head", "loss_chunk_tokens"), ("_backward_layer", "checkpoint_interval")])
def test_cuda_out_of_memory_names_the_phase_and_what_to_change(tmp_path, capsys, monkeypatch, phase, advice):
    from megatrain_cli.engine import step as engine_step

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    if phase == "_head":  # the head phase is engine/head.py's run_head, which step.py calls
        monkeypatch.setattr(engine_step, "run_head", out_of_memory)
    else:
        monkeypatch.setattr(engine_step.Engine, phase, out_of_memory)
    out = tmp_path / "oom"
    code = run_training(recipe(out, "train.steps=2", "checkpoint.every_n_steps=1"))
    err = capsys.readouterr().err
    assert code == 1
    assert "CUDA out of memory during " + ("head" if phase == "_head" else "backward (layer") in err
    assert advice in err and "--dry-run" in err and "Traceback" not in err
    assert not (out / "final").exists()  # nothing half-written is presented as a result


def test_tensorboard_without_its_package_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    """logging.tensorboard writes events (metrics/logs.py); asked for without the package, the run stops at
    once with what to do, instead of training without the log it was asked for."""
    from megatrain_cli.metrics import logs

    monkeypatch.setattr(logs, "tensorboard_available", lambda: False)
    out = tmp_path / "tb"
    assert run_training(recipe(out, "logging.tensorboard=true")) == 2
    err = capsys.readouterr().err
    assert "logging.tensorboard is on but the tensorboard package is not installed" in err
    assert "Traceback" not in err and not out.exists()


def test_tensorboard_log_gets_every_logged_step(tmp_path, monkeypatch):
    """With the package there (a stand-in writer here), every metrics line also goes to TensorBoard."""
    from megatrain_cli.metrics import logs

    written = []

    class Recorder:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def write(self, m):
            written.append(m.step)

        def close(self):
            written.append("closed")

    monkeypatch.setattr(logs, "tensorboard_available", lambda: True)
    monkeypatch.setattr(logs, "TensorBoardLog", Recorder)
    assert run_training(recipe(tmp_path / "tb", "logging.tensorboard=true", "train.steps=2")) == 0
    assert written == [1, 2, "closed"]
