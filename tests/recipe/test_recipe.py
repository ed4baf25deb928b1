"""Recipe schema: shipped recipes, errors (all at once, dotted paths, did-you-mean), overrides, round trip."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from megatrain_cli.recipe import Recipe, RecipeError, load_recipe, render_yaml

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SHIPPED = sorted(RECIPES.glob("*.yaml"))
# Recipes whose model.path is a placeholder, and a preset of the same shape to validate them with.
PLACEHOLDER_PRESET = {"qwen7b": "7b", "qwen14b": "14b", "qwen32b": "32b", "llama3-8b": "llama3-8b"}


def _load_shipped(path: Path) -> Recipe:
    raw = yaml.safe_load(path.read_text())
    if raw.get("model", {}).get("path"):
        return load_recipe(path, ["model.path=null", f"model.preset={PLACEHOLDER_PRESET[path.stem]}"])
    return load_recipe(path)


def test_recipes_shipped():
    assert {p.stem for p in SHIPPED} >= {"tiny", "qwen7b", "qwen14b", "qwen32b", "llama3-8b"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipe_loads_and_names_its_command(path):
    r = _load_shipped(path)
    assert isinstance(r, Recipe)
    first = path.read_text().splitlines()[0]
    m = re.fullmatch(r"# (megatrain train (\S+)(?: .*)?)", first)
    assert m, f"{path.name}: first line is not a `megatrain train` command: {first!r}"
    assert m.group(2) == f"recipes/{path.name}", first
    # Every override on the command line is a key of the schema (no stale key names in the comment).
    overrides = m.group(1).split()[3:]
    if overrides:
        load_recipe(path, overrides)


def test_tiny_is_a_preset_recipe_without_overrides():
    r = load_recipe(RECIPES / "tiny.yaml")
    assert r.model.preset == "tiny" and r.model.path is None


def test_unknown_key_names_dotted_path_and_near_miss():
    with pytest.raises(RecipeError) as ei:
        load_recipe(RECIPES / "tiny.yaml", ["train.lrr=1"])
    msg = str(ei.value)
    assert "train.lrr" in msg
    assert "did you mean 'train.lr'" in msg
    assert len(ei.value.problems) == 1


def test_wrong_type_reported_with_path():
    with pytest.raises(RecipeError) as ei:
        load_recipe(RECIPES / "tiny.yaml", ["train.micro_batch_size=abc"])
    (problem,) = ei.value.problems
    assert problem.startswith("train.micro_batch_size:")
    assert "int" in problem and "'abc'" in problem


def test_bad_literal_reported():
    with pytest.raises(RecipeError) as ei:
        load_recipe(RECIPES / "tiny.yaml", ["train.schedule=cosin"])
    assert any(p.startswith("train.schedule:") for p in ei.value.problems)


def test_all_errors_reported_at_once():
    with pytest.raises(RecipeError) as ei:
        load_recipe(RECIPES / "tiny.yaml", ["train.lrr=1", "engine.devicee=cpu", "train.seq_len=long"])
    joined = "\n".join(ei.value.problems)
    assert len(ei.value.problems) == 3, joined
    assert "train.lrr" in joined and "engine.devicee" in joined and "train.seq_len" in joined
    assert "did you mean 'engine.device'" in joined


def test_override_sets_nested_value_and_parses_yaml():
    r = load_recipe(RECIPES / "tiny.yaml", ["train.lr=1.0e-4", "train.steps=7", "engine.max_gpu_mem=24GiB",
                                             "train.betas=[0.8, 0.95]"])
    assert r.train.lr == pytest.approx(1e-4) and isinstance(r.train.lr, float)
    assert r.train.steps == 7
    assert r.engine.max_gpu_mem == "24GiB"
    assert r.train.betas == [0.8, 0.95]


# PyYAML (YAML 1.1) reads '1e-5' (no dot) as a string; `train.lr=1e-5` is the example in --help.
def test_override_exponent_without_dot_is_a_float():
    r = load_recipe(RECIPES / "tiny.yaml", ["train.lr=1e-5"])
    assert r.train.lr == pytest.approx(1e-5) and isinstance(r.train.lr, float)
    with pytest.raises(RecipeError, match="train.lr: expected float"):
        load_recipe(RECIPES / "tiny.yaml", ["train.lr=fast"])


def test_override_int_coerced_to_float():
    r = load_recipe(RECIPES / "tiny.yaml", ["train.lr=1"])
    assert r.train.lr == 1.0 and isinstance(r.train.lr, float)


def test_delete_override_restores_default():
    base = load_recipe(RECIPES / "tiny.yaml")
    assert base.train.warmup_steps == 10
    r = load_recipe(RECIPES / "tiny.yaml", ["~train.warmup_steps", "~eval"])
    assert r.train.warmup_steps == 0  # schema default
    assert r.eval == Recipe().eval  # the whole section back to defaults


def test_override_without_equals_is_an_error():
    with pytest.raises(RecipeError) as ei:
        load_recipe(RECIPES / "tiny.yaml", ["train.lr"])
    assert "train.lr" in str(ei.value)


def test_path_and_preset_together_is_an_error(tmp_path):
    with pytest.raises(RecipeError) as ei:
        load_recipe(RECIPES / "tiny.yaml", [f"model.path={tmp_path}"])
    assert any("model.path" in p and "model.preset" in p for p in ei.value.problems)


def test_neither_path_nor_preset_is_an_error():
    with pytest.raises(RecipeError) as ei:
        load_recipe(RECIPES / "tiny.yaml", ["model.preset=null"])
    assert any("exactly one of model.path and model.preset" in p for p in ei.value.problems)


def test_steps_and_epochs_together_is_an_error():
    with pytest.raises(RecipeError) as ei:
        load_recipe(RECIPES / "tiny.yaml", ["train.epochs=1"])
    assert any("train.steps" in p and "train.epochs" in p for p in ei.value.problems)


def test_unknown_preset_suggests_near_miss():
    with pytest.raises(RecipeError) as ei:
        load_recipe(RECIPES / "tiny.yaml", ["model.preset=tinyy"])
    assert any("did you mean 'tiny'" in p for p in ei.value.problems)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError) as ei:
        load_recipe(tmp_path / "nope.yaml")
    assert "not found" in str(ei.value)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_render_yaml_round_trips(tmp_path, path):
    r = _load_shipped(path)
    text = render_yaml(r)
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(text)
    again = load_recipe(dumped)
    assert again == r
    assert dataclasses.asdict(again) == dataclasses.asdict(r)
    assert "# " in text.splitlines()[0]  # docs travel as comments


def test_render_yaml_round_trips_odd_values(tmp_path):
    r = load_recipe(RECIPES / "tiny.yaml", ["output_dir='runs/a b: c'", "data.fields={query: 'q # x'}",
                                             "engine.max_gpu_mem=24GiB", "checkpoint.resume=auto",
                                             "train.max_grad_norm=null", "engine.packer_threads=4"])
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(render_yaml(r))
    assert load_recipe(dumped) == r


def test_host_adamw_keys():
    r = load_recipe(RECIPES / "tiny.yaml", ["engine.host_adamw=torch", "engine.defer_moments=false"])
    assert (r.engine.host_adamw, r.engine.defer_moments) == ("torch", False)
    assert (load_recipe(RECIPES / "tiny.yaml").engine.host_adamw, load_recipe(RECIPES / "tiny.yaml").engine.defer_moments) \
        == ("auto", True)
    with pytest.raises(RecipeError, match="host_adamw"):
        load_recipe(RECIPES / "tiny.yaml", ["engine.host_adamw=fast"])


def test_a_bare_off_reaches_a_literal_that_has_it():
    """YAML 1.1 reads `off` as false: a key whose choices include 'off' takes it as the word; others refuse."""
    assert load_recipe(RECIPES / "tiny.yaml", ["logging.dashboard=off"]).logging.dashboard == "off"
    with pytest.raises(RecipeError, match=re.escape("engine.kernels: expected 'auto' | 'torch' | 'triton', got True")):
        load_recipe(RECIPES / "tiny.yaml", ["engine.kernels=on"])
