"""Every bad input of `megatrain train` answered before anything is built: one message naming the culprit
(the recipe key, the file), the documented exit code (2 bad input, 3 will not fit), no traceback, and no
file of the user's lost or changed. The other commands: test_bad_commands.py.

In-process through the CLI (typer's CliRunner on megatrain_cli.cli.app) with a tiny model folder made once
per module (tests/helpers_bad_inputs.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatrain_cli.train import preflight
from tests.helpers_bad_inputs import GiB, TINY, copy_model, fake_cgroup, make_models, megatrain, refused, snapshot

FIXTURES = Path(__file__).parents[1] / "fixtures" / "data"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return make_models(tmp_path_factory.mktemp("models"))


@pytest.fixture
def model_copy(models, tmp_path):
    return lambda name: copy_model(models, name, tmp_path / "model")


def train(tmp_path: Path, *overrides: str):
    """`megatrain train recipes/tiny.yaml` into tmp_path/out; the output folder must not appear on a refusal."""
    return megatrain("train", TINY, f"output_dir={tmp_path / 'out'}", *overrides)


# ---------------------------------------------------------------- recipe values (exit 2, the key named)
RECIPE_VALUES = [
    ("train.lr=nan", "train.lr"), ("train.lr=inf", "train.lr"), ("train.lr=.inf", "train.lr"),
    ("train.lr=0", "train.lr"), ("train.lr=-1e-5", "train.lr"), ("train.weight_decay=-0.01", "train.weight_decay"),
    ("train.eps=0", "train.eps"), ("train.epochs=nan", "train.epochs"), ("train.max_grad_norm=inf", "train.max_grad_norm"),
    ("train.min_lr_ratio=-.nan", "train.min_lr_ratio"), ("data.test_fraction=nan", "data.test_fraction"),
    ("train.seq_len=1", "train.seq_len"), ("train.warmup_steps=-1", "train.warmup_steps"),
    ("checkpoint.every_n_steps=0", "checkpoint.every_n_steps"), ("checkpoint.every_n_steps=-5", "checkpoint.every_n_steps"),
    ("logging.every_n_steps=0", "logging.every_n_steps"), ("eval.limit=0", "eval.limit"),
    ("eval.batch_size=0", "eval.batch_size"), ("eval.max_new_tokens=-1", "eval.max_new_tokens"),
    ("checkpoint.export_final=false", "checkpoint.export_final=true"),  # tiny.yaml has eval.enabled
    ("train.max_wall_time=soon", "train.max_wall_time"), ("train.max_wall_time=0s", "train.max_wall_time"),
    ("data.num_proc=0", "data.num_proc"), ("data.max_samples=0", "data.max_samples"),
    ("data.cache_dir=''", "data.cache_dir"), ("data.cache_dir=true", "data.cache_dir"),
    ("engine.max_gpu_mem=0GiB", "engine.max_gpu_mem"),
]


@pytest.mark.parametrize("override,key", RECIPE_VALUES, ids=[o for o, _ in RECIPE_VALUES])
def test_recipe_value_is_refused_naming_its_key(tmp_path, override, key):
    refused(train(tmp_path, override), 2, key)
    assert not (tmp_path / "out").exists()


def test_documented_cache_dir_off_is_accepted(tmp_path):
    from megatrain_cli.recipe import load_recipe, render_yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(TINY.read_text().replace("  packing: true", "  packing: true\n  cache_dir: off"))
    r = load_recipe(recipe)
    assert r.data.cache_dir == "off"
    (tmp_path / "again.yaml").write_text(render_yaml(r))
    assert load_recipe(tmp_path / "again.yaml") == r
    result = megatrain("train", recipe, "--dry-run", f"output_dir={tmp_path / 'out'}")
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- the model folder (exit 2, the file named)
def truncate(path: Path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def break_model(name: str, model: Path) -> str:
    """Damage a copy of the tiny model the way a stopped download or a slip of the editor does; returns
    what the message must name."""
    shard = "model-00002-of-00004.safetensors"
    if name == "config-missing":
        (model / "config.json").unlink()
        return "config.json"
    if name == "config-broken":
        truncate(model / "config.json", 40)
        return "config.json"
    if name == "config-not-object":
        (model / "config.json").write_text("[1, 2]")
        return "config.json"
    if name == "config-bad-value":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "hidden_size": "wide"}))
        return "hidden_size"
    if name == "config-unknown-type":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "model_type": "nonsense"}))
        return "nonsense"
    if name == "shard-truncated-data":
        truncate(model / "model.safetensors", (model / "model.safetensors").stat().st_size - 100)
        return "model.safetensors"
    if name == "shard-truncated-header":
        truncate(model / "model.safetensors", 20)
        return "model.safetensors"
    if name == "shard-not-safetensors":
        (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
        return "model.safetensors"
    if name == "no-shards":
        (model / "model.safetensors").rename(model / "pytorch_model.bin")
        return "convert them to safetensors"
    if name == "sharded-one-missing":
        (model / shard).unlink()
        return shard
    if name == "sharded-one-truncated":
        truncate(model / shard, (model / shard).stat().st_size // 2)
        return shard
    if name == "index-broken":
        truncate(model / "model.safetensors.index.json", 30)
        return "model.safetensors.index.json"
    raise AssertionError(name)


BROKEN = ["config-missing", "config-broken", "config-not-object", "config-bad-value", "config-unknown-type",
          "shard-truncated-data", "shard-truncated-header",
          "shard-not-safetensors", "no-shards", "sharded-one-missing", "sharded-one-truncated", "index-broken"]


@pytest.mark.parametrize("damage", BROKEN)
def test_train_on_a_broken_model_folder(tmp_path, model_copy, damage):
    model = model_copy("sharded" if damage.startswith(("sharded", "index")) else "one")
    culprit = break_model(damage, model)
    before = snapshot(model)
    refused(train(tmp_path, "model.preset=null", f"model.path={model}"), 2, "model.path", culprit)
    assert snapshot(model) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["config-broken", "config-bad-value", "sharded-one-truncated"])
def test_eval_on_a_broken_model_folder(tmp_path, model_copy, damage):
    model = model_copy("sharded" if damage.startswith("sharded") else "one")
    culprit = break_model(damage, model)
    before = snapshot(model)
    refused(megatrain("eval", "--model", model, "engine.device=cpu"), 2, "--model", culprit)
    assert snapshot(model) == before


def test_model_path_missing_or_a_file(tmp_path):
    refused(train(tmp_path, "model.preset=null", f"model.path={tmp_path / 'nope'}"), 2, "model.path",
            str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    refused(train(tmp_path, "model.preset=null", f"model.path={tmp_path / 'file'}"), 2, "model.path", "is a file")
    assert (tmp_path / "file").read_text() == "x" and not (tmp_path / "out").exists()


def test_seq_len_above_the_models_positions(tmp_path, models):
    out = refused(train(tmp_path, "model.preset=null", f"model.path={models / 'one'}", "train.seq_len=8192"), 2,
                  "train.seq_len", "max_position_embeddings 4096", "<= 4096")
    assert str(models / "one" / "config.json") in out and not (tmp_path / "out").exists()


def test_train_from_a_checkpoint_folder_says_export_it(tmp_path, models):
    step = models / "run" / "step_1"
    refused(train(tmp_path, "model.preset=null", f"model.path={step}"), 2, "model.path", "megatrain export")


# ---------------------------------------------------------------- paths of the run
def test_output_dir_is_a_file(tmp_path):
    (tmp_path / "out").write_text("my notes")
    refused(train(tmp_path), 2, "output_dir", "is a file")
    assert (tmp_path / "out").read_text() == "my notes"


def test_output_dir_under_a_file(tmp_path):
    (tmp_path / "notes").write_text("keep")
    refused(megatrain("train", TINY, f"output_dir={tmp_path / 'notes' / 'run'}"), 2, "output_dir",
            str(tmp_path / "notes"))
    assert (tmp_path / "notes").read_text() == "keep"


def test_output_dir_on_a_filesystem_that_refuses_writes(tmp_path):
    if not Path("/sys/kernel").is_dir():
        pytest.skip("needs Linux sysfs")
    refused(megatrain("train", TINY, "output_dir=/sys/kernel/megatrain-run"), 2, "output_dir", "/sys/kernel")


def test_output_dir_read_only_folder(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        refused(megatrain("train", TINY, f"output_dir={ro / 'run'}"), 2, "output_dir", str(ro))
    finally:
        ro.chmod(0o755)


def test_resume_path_missing_or_not_a_checkpoint(tmp_path):
    refused(train(tmp_path, f"checkpoint.resume={tmp_path / 'nope'}"), 2, "checkpoint.resume")
    (tmp_path / "empty").mkdir()
    refused(train(tmp_path, f"checkpoint.resume={tmp_path / 'empty'}"), 2, "checkpoint.resume", "manifest.json")
    assert not (tmp_path / "out").exists()


def test_cache_dir_is_a_file(tmp_path):
    (tmp_path / "cache").write_text("x")
    refused(train(tmp_path, f"data.cache_dir={tmp_path / 'cache'}"), 2, "data.cache_dir")
    assert (tmp_path / "cache").read_text() == "x"


@pytest.mark.parametrize("key", ["data.source", "data.test_source"])
def test_data_file_missing(tmp_path, key):
    refused(train(tmp_path, f"{key}={tmp_path / 'gone.jsonl'}"), 2, key, "gone.jsonl")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("evaluate", ["true", "false"], ids=["eval-on", "eval-off"])
def test_data_in_no_known_format(tmp_path, evaluate):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"problem": "1 + 1", "solution": "2"}\n' * 10)
    before = snapshot(data)
    refused(train(tmp_path, f"data.source={data}", f"eval.enabled={evaluate}"), 2, "data.source", "data.fields")
    assert snapshot(data) == before and not (tmp_path / "out").exists()


def test_unknown_builtin_data(tmp_path):
    refused(train(tmp_path, "data.source=builtin:nope"), 2, "data.source", "builtin:sample_math")


# ---------------------------------------------------------------- eval settings, checked before training
def test_eval_with_an_empty_test_split_is_refused_before_training(tmp_path):
    refused(train(tmp_path, "data.test_fraction=0"), 2, "eval.enabled", "test split is empty")
    assert not (tmp_path / "out").exists()  # no step ran, no folder made


def test_eval_on_data_without_gold_answers_is_refused_before_training(tmp_path):
    refused(train(tmp_path, f"data.source={FIXTURES / 'no_gold.jsonl'}"), 2, "eval.enabled", "no gold answer")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- disk and memory (exit 3, both figures)
def test_disk_too_small_for_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 2**20)
    out = refused(train(tmp_path), 3, "disk", "output_dir", "1.0 MiB free", "a checkpoint")
    assert "--force" in out and not (tmp_path / "out").exists()
    dry = megatrain("train", TINY, "--dry-run", f"output_dir={tmp_path / 'out'}")
    assert dry.exit_code == 3 and "will not fit:" in dry.output and "1.0 MiB free" in dry.output


@pytest.mark.parametrize("version", [2, 1])
def test_dry_run_verdict_names_the_cgroup_limit(tmp_path, monkeypatch, version):
    limit_file = fake_cgroup(tmp_path, monkeypatch, 2 * GiB, version)
    result = megatrain("train", TINY, "--dry-run", "model.preset=0.5b", f"output_dir={tmp_path / 'out'}")
    assert result.exit_code == 3, result.output
    verdict = result.output.split("verdict for this machine: ", 1)[1]
    assert verdict.startswith("will not fit:") and "host memory: the plan needs" in verdict
    assert f"cgroup v{version}" in verdict and str(limit_file) in verdict and "2.00 GiB limit" in verdict


def test_real_run_over_the_cgroup_limit_is_refused_before_allocating(tmp_path, monkeypatch):
    fake_cgroup(tmp_path, monkeypatch, 2 * GiB)
    refused(train(tmp_path, "model.preset=0.5b", "eval.enabled=false"), 3, "would not fit", "cgroup v2 memory.max",
            "--force")
    assert not (tmp_path / "out").exists()


def test_dry_run_that_fits_says_so(tmp_path):
    result = megatrain("train", TINY, "--dry-run", f"output_dir={tmp_path / 'out'}")
    assert result.exit_code == 0, result.output
    assert "verdict for this machine: fits (host" in result.output and "free under" in result.output


def test_eval_over_the_host_limit_exits_3_before_loading(tmp_path, monkeypatch, models):
    fake_cgroup(tmp_path, monkeypatch, 64 * 2**20)
    before = snapshot(models / "one")
    refused(megatrain("eval", "--model", models / "one", "engine.device=cpu", "eval.limit=2",
                      "--output-dir", tmp_path / "ev"), 3, "host memory", "cgroup v2 memory.max", "eval.batch_size")
    assert snapshot(models / "one") == before and not (tmp_path / "ev").exists()


def test_bench_over_the_host_limit_exits_3(tmp_path, monkeypatch):
    fake_cgroup(tmp_path, monkeypatch, 2 * GiB)
    refused(megatrain("bench", "--model", "0.5b", "--device", "cpu", "--steps", "1", "logging.dashboard=off"), 3,
            "would not fit", "cgroup v2 memory.max")
