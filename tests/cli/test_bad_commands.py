"""Every bad input of `megatrain eval`, `export`, `recipes cp` and `bench` answered before anything runs:
one message naming the option or path, the documented exit code, no traceback, no file of the user's
lost or changed; and what was silently wrong (eval's results in the current folder, the dashboard's
"waiting" while steps ran, --debug). `train`'s bad inputs: test_bad_inputs.py.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain_cli.train import preflight
from tests.helpers_bad_inputs import ROOT, TINY, make_models, megatrain, refused, snapshot


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return make_models(tmp_path_factory.mktemp("models"))


# ---------------------------------------------------------------- megatrain eval
@pytest.mark.parametrize("args,culprit", [
    (["eval.limit=0"], "eval.limit"), (["eval.batch_size=0"], "eval.batch_size"),
    (["eval.max_new_tokens=0"], "eval.max_new_tokens"), (["--split", "dev"], "--split"),
    (["engine.device=tpu"], "engine.device"), (["--mode", "fast"], "--mode"),
    (["data.source=/no/such/data.jsonl"], "data.jsonl"), (["eval.limt=8"], "did you mean 'eval.limit'"),
], ids=["limit", "batch-size", "max-new-tokens", "split", "device", "mode", "data", "typo"])
def test_eval_option_refused(tmp_path, models, args, culprit):
    before = snapshot(models / "one")
    refused(megatrain("eval", "--model", models / "one", "--output-dir", tmp_path / "ev", *args), 2, culprit)
    assert snapshot(models / "one") == before and not (tmp_path / "ev").exists()


# Every option `megatrain eval` had before it took the recipe: a recipe key now, answered with it.
OLD_EVAL_FLAGS = [
    ("--data", "x.jsonl", "data.source="), ("--test-data", "x.jsonl", "data.test_source="),
    ("--registry", "r.yaml", "data.registry="), ("--system-prompt", "Be brief.", "data.system_prompt="),
    ("--limit", "8", "eval.limit="), ("--batch-size", "2", "eval.batch_size="),
    ("--max-new-tokens", "8", "eval.max_new_tokens="), ("--prompt", "chat", "eval.prompt="),
    ("--num-fewshot", "5", "eval.num_fewshot="), ("--fewshot-seed", "7", "eval.fewshot_seed="),
    ("--extract", "strict", "eval.extract="), ("--device", "cpu", "engine.device="),
]


@pytest.mark.parametrize("flag,value,key", OLD_EVAL_FLAGS, ids=[f for f, _, _ in OLD_EVAL_FLAGS])
def test_old_eval_flag_answers_with_its_recipe_key(tmp_path, models, flag, value, key):
    """Its value is not taken for the recipe; the key it names exists in the schema and takes that value."""
    from megatrain_cli.eval.settings import eval_recipe

    out = refused(megatrain("eval", "--model", models / "one", "--output-dir", tmp_path / "ev", flag, value), 2,
                  f"{flag}: now a recipe key: {key}")
    assert "recipe file not found" not in out and not (tmp_path / "ev").exists()
    section, name = key.removesuffix("=").split(".")
    assert str(getattr(getattr(eval_recipe([f"{key}{value}"]), section), name)) == value


def test_eval_with_a_recipe_and_overrides(tmp_path, models):
    """`megatrain eval RECIPE key=value`: the recipe's data and eval keys (tiny.yaml: eval.max_new_tokens 48),
    the overrides over them; its model and training keys are not read (--model is the model)."""
    out = tmp_path / "ev"
    result = megatrain("eval", TINY, "eval.limit=2", "engine.device=cpu", "--model", models / "one",
                       "--output-dir", out)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert (results["total"], results["limit"], results["max_new_tokens"]) == (2, 2, 48)
    assert results["model_path"] == str(models / "one") and results["data_source"] == "builtin:sample_math"


def test_eval_on_a_step_checkpoint_says_export_it(models):
    refused(megatrain("eval", "--model", models / "run" / "step_1"), 2, "--model", "megatrain export", "final/")


def test_eval_on_a_run_folder_points_at_final(tmp_path, models):
    shutil.copytree(models / "one", tmp_path / "run" / "final")
    refused(megatrain("eval", "--model", tmp_path / "run"), 2, "--model", str(tmp_path / "run" / "final"))


def test_eval_output_dir_is_a_file(tmp_path, models):
    (tmp_path / "results").write_text("old")
    refused(megatrain("eval", "--model", models / "one", "--output-dir", tmp_path / "results"), 2, "--output-dir")
    assert (tmp_path / "results").read_text() == "old"


def test_eval_writes_under_the_models_folder_not_the_current_one(tmp_path, models, monkeypatch):
    model = Path(shutil.copytree(models / "one", tmp_path / "model"))
    before = snapshot(model)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    result = megatrain("eval", "--model", model, "engine.device=cpu", "eval.limit=1", "eval.max_new_tokens=2")
    assert result.exit_code == 0, result.output
    assert list(cwd.iterdir()) == []
    assert json.loads((model / "eval" / "results.json").read_text())["total"] == 1
    assert {k: v for k, v in snapshot(model).items() if "/eval/" not in k} == before


# ---------------------------------------------------------------- megatrain export
def test_export_into_a_file(tmp_path, models):
    (tmp_path / "out").write_text("mine")
    refused(megatrain("export", models / "run" / "step_1", tmp_path / "out"), 2, "OUT", "is a file")
    assert (tmp_path / "out").read_text() == "mine"


def test_export_into_a_folder_of_other_files(tmp_path, models):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    refused(megatrain("export", models / "run" / "step_1", tmp_path / "out"), 2, "OUT", "not empty")
    assert snapshot(tmp_path / "out") == {str(tmp_path / "out" / "notes.txt"): b"mine"}


def test_export_over_a_previous_export_needs_force(tmp_path, models):
    previous = Path(shutil.copytree(models / "one", tmp_path / "out"))
    before = snapshot(previous)
    refused(megatrain("export", models / "run" / "step_1", previous), 2, "OUT", "--force")
    assert snapshot(previous) == before
    result = megatrain("export", models / "run" / "step_1", previous, "--force", "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    assert (previous / "config.json").is_file()


def test_export_from_a_file(tmp_path):
    (tmp_path / "step_3").write_text("x")
    refused(megatrain("export", tmp_path / "step_3", tmp_path / "out"), 2, "CHECKPOINT", "is a file")


def test_export_disk_too_small(tmp_path, models, monkeypatch):
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 1000)
    refused(megatrain("export", models / "run" / "step_1", tmp_path / "out"), 3, "disk", "OUT", "free")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- megatrain recipes cp
def test_recipes_cp_into_a_missing_folder(tmp_path):
    refused(megatrain("recipes", "cp", "tiny", tmp_path / "nope" / "my.yaml"), 2, str(tmp_path / "nope"), "mkdir")
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("into_folder", [False, True], ids=["file", "folder"])
def test_recipes_cp_keeps_an_edited_file_unless_forced(tmp_path, into_folder):
    mine = tmp_path / "tiny.yaml"
    mine.write_text("# my edits\n")
    refused(megatrain("recipes", "cp", "tiny", tmp_path if into_folder else mine), 2, str(mine), "--force")
    assert mine.read_text() == "# my edits\n"
    assert megatrain("recipes", "cp", "tiny", mine, "--force").exit_code == 0
    assert mine.read_bytes() == TINY.read_bytes()


# ---------------------------------------------------------------- megatrain bench (refused before measuring)
@pytest.mark.parametrize("args,culprit", [
    (["--baseline", "native", "--device", "cpu"], "--baseline native"),
    (["--baseline", "both", "--device", "cpu"], "--baseline"),
    (["--output", "/no/such/folder/r.json"], "--output"),
    (["--frame", "/no/such/folder/f.txt"], "--frame"),
    (["--steps", "0"], "--steps"),
], ids=["native-on-cpu", "both-on-cpu", "output-folder-missing", "frame-folder-missing", "steps"])
def test_bench_refused_before_measuring(args, culprit):
    out = refused(megatrain("bench", "--model", "tiny", "--device", "cpu", *args), 2, culprit)
    assert "memory plan" not in out  # refused before planning, nothing measured


def test_bench_output_is_a_folder(tmp_path):
    refused(megatrain("bench", "--model", "tiny", "--device", "cpu", "--output", tmp_path), 2, "--output", "folder")


# ---------------------------------------------------------------- nothing silently wrong
def test_dashboard_does_not_claim_to_wait_while_steps_run():
    from rich.console import Console

    from megatrain_cli.dashboard import Dashboard

    screen = io.StringIO()
    with Dashboard("rich", total_steps=10, console=Console(file=screen, force_terminal=True, width=160)):
        pass
    assert "running for 0:00:0" in screen.getvalue() and "waiting" not in screen.getvalue()


def test_debug_reraises_in_process(tmp_path):
    from megatrain_cli.train.errors import TrainingError

    result = megatrain("train", TINY, "--debug", f"output_dir={tmp_path / 'out'}", "model.preset=null",
                       f"model.path={tmp_path / 'nope'}")
    assert isinstance(result.exception, TrainingError) and result.exception.code == 2


def test_a_shell_sees_one_message_and_debug_the_traceback(tmp_path):
    """What the user's terminal gets (a real process): exit 2 with one line; --debug adds the traceback."""
    cmd = [sys.executable, "-m", "megatrain_cli", "train", str(TINY), "train.lr=nan", f"output_dir={tmp_path}/o"]
    plain = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and "train.lr: must be a finite number" in plain.stderr
    assert "Traceback" not in plain.stderr + plain.stdout
    debug = subprocess.run([*cmd, "--debug"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "RecipeError" in debug.stderr


# ---------------------------------------------------------------- advice that works
def test_eval_without_a_chat_template_suggests_what_eval_takes(tmp_path, models):
    """It suggested model.tokenizer, a key `megatrain eval` refuses."""
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 1 + 1?"},
                                             {"role": "assistant", "content": "The answer is: 2"}]}) + "\n")
    args = ["eval", "--model", models / "one", f"data.source={data}", "--split", "all", "engine.device=cpu",
            "eval.max_new_tokens=2", "--output-dir", tmp_path / "ev"]
    for prompt, key in (("auto", "data.template"), ("chat", "eval.prompt")):
        out = refused(megatrain(*args, f"eval.prompt={prompt}"), 2, f"{key}: ", "has none", "--model",
                      "eval.prompt=plain (or data.template=plain)")
        assert "model.tokenizer" not in out and not (tmp_path / "ev").exists()
    for fix in ("eval.prompt=plain", "data.template=plain"):  # each suggestion works
        assert megatrain(*args, fix).exit_code == 0


def test_export_of_a_damaged_checkpoint_names_it_and_the_one_to_use(tmp_path, models):
    run = tmp_path / "run"
    shutil.copytree(models / "run" / "step_1", run / "step_1")
    shutil.copytree(models / "run" / "step_1", run / "step_2")
    tile = run / "step_2" / "tiles" / "layers.0.safetensors"
    data = bytearray(tile.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 16):
        data[i] ^= 0xFF  # found only when read
    tile.write_bytes(bytes(data))
    before = snapshot(run)
    for given in (run / "step_2", run):  # the checkpoint, or the run's folder (its latest)
        refused(megatrain("export", given, tmp_path / "out"), 2, f"{run / 'step_2'} is damaged", "checksum mismatch",
                f"`megatrain export {run / 'step_1'} {tmp_path / 'out'}`")
    assert snapshot(run) == before and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- megatrain export stopped half-way
@pytest.mark.parametrize("how,code", [("ctrl-c", 130), ("sigterm", 143)])
def test_export_stopped_half_way_leaves_nothing(tmp_path, models, monkeypatch, how, code):
    """No message and a hidden .NAME.tmp left behind, before."""
    import os
    import signal
    import time

    from megatrain_cli.checkpoint import export as export_module

    def stopped(*args, **kwargs):  # the signal arrives while the weights are being written
        (tmp_path / ".out.tmp" / "model.safetensors").write_bytes(b"partial")
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in this thread before the sleep ends
        raise AssertionError("SIGTERM was not turned into an exception")

    monkeypatch.setattr(export_module, "_write_shard", stopped)
    handler = signal.getsignal(signal.SIGTERM)
    out = refused(megatrain("export", models / "run" / "step_1", tmp_path / "out"), code,
                  f"export stopped by {'SIGINT' if how == 'ctrl-c' else 'SIGTERM'}", "partial files were removed")
    assert str(tmp_path / "out") in out and sorted(p.name for p in tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is handler  # put back after the export


# ---------------------------------------------------------------- the first run's compile, said; a dead one's lock
def test_the_host_kernel_compile_is_said_with_its_progress(tmp_path, monkeypatch):
    """1.5-2 minutes of compiling on two cores printed nothing, before."""
    import time

    from megatrain_cli.optim import adamw_cpp
    from megatrain_cli.train import host_kernel

    monkeypatch.setattr(host_kernel, "compile_lock", lambda: tmp_path / "lock")
    monkeypatch.setattr(host_kernel, "NOTICE_AFTER_S", 0.05)
    monkeypatch.setattr(host_kernel, "PROGRESS_S", 0.1)
    monkeypatch.setattr(adamw_cpp, "available", lambda: time.sleep(0.35) or True)
    said = []
    host_kernel.prepare("auto", log=said.append)
    assert said[0].startswith("host AdamW: compiling the C++ kernel (the first run in this environment")
    assert any(line.startswith("host AdamW: still compiling, ") for line in said[1:-1])
    assert said[-1].startswith("host AdamW: the C++ kernel is ready (")
    said.clear()
    host_kernel.prepare("torch", log=said.append)
    assert said == []


def test_a_compile_lock_left_by_a_killed_process_is_named(tmp_path, monkeypatch):
    """torch waits for it forever: the next run hung without a word."""
    import os
    import time

    from megatrain_cli.train import host_kernel

    lock = tmp_path / "lock"
    lock.write_text("")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setattr(host_kernel, "compile_lock", lambda: lock)
    refused(megatrain("train", TINY, f"output_dir={tmp_path / 'out'}", "train.steps=1", "eval.enabled=false",
                      "eval.every_n_steps=null"), 2, f"compile lock {lock} is 60 min old", f"rm {lock}",
            "engine.host_adamw=torch")
    assert lock.exists() and not (tmp_path / "out").exists()


def test_a_test_session_removes_a_stale_compile_lock(tmp_path, monkeypatch, capsys):
    """Tests load the kernel in-process, not through prepare(): a stale lock hung the suite at 0% CPU, and CI
    shares the build cache with killed runs (stop 37 failed on one): the session removes it, saying so."""
    import os
    import sys
    import time

    from megatrain_cli.train import host_kernel

    conftest = next(m for m in list(sys.modules.values())
                    if getattr(m, "__file__", None) and m.__file__.endswith(os.path.join("tests", "conftest.py")))
    lock = tmp_path / "lock"
    lock.write_text("")
    monkeypatch.setattr(host_kernel, "compile_lock", lambda: lock)
    conftest.pytest_sessionstart(None)  # a fresh lock: another process compiling, left alone
    assert lock.exists() and capsys.readouterr().err == ""
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    conftest.pytest_sessionstart(None)
    assert not lock.exists()
    assert capsys.readouterr().err == f"tests: removing the stale compile lock {lock} (60 min old)\n"


@pytest.mark.parametrize("command", ["train", "bench", "eval"])
def test_help_keeps_the_extras_brackets(command):
    """`pip install 'megatrain'`: rich markup ate '[tensorboard]'."""
    out = megatrain(command, "--help").output
    for extra in ("tensorboard", "wandb", "mlflow"):
        assert f"megatrain[{extra}]" in out, extra
    assert "'megatrain'`" not in out and "\\[" not in out
