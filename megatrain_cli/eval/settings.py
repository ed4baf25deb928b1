"""What `megatrain eval` runs: a recipe's data (data.*), protocol and generation (eval.*) and engine.device,
read by the same load_recipe as `train` and `bench` from [RECIPE] key=value ... (no RECIPE: the schema's
defaults, data.source builtin:sample_math), and the measurement options: the model, its mode, the split
and the output folder. The recipe's model and training keys are not read; --model names the model.

The flags eval had before the recipe are answered with the key that replaced them. eval.limit has one
default, the schema's 64 (the old --limit's was every example; eval.limit=null is that).
"""

from __future__ import annotations

from pathlib import Path

from megatrain_cli.recipe import EvalConfig, Recipe, command_line

SPLITS = ("test", "train", "all")

# eval's flags before the recipe: each is now a recipe key. (flag, takes a value, what to write instead)
MOVED_FLAGS: command_line.MovedFlags = {
    "--data": (True, "data.source=SOURCE"),
    "--test-data": (True, "data.test_source=SOURCE"),
    "--registry": (True, "data.registry=FILE"),
    "--system-prompt": (True, "data.system_prompt='TEXT'"),
    "--limit": (True, "eval.limit=N (null: every example)"),
    "--batch-size": (True, "eval.batch_size=N"),
    "--max-new-tokens": (True, "eval.max_new_tokens=N"),
    "--prompt": (True, "eval.prompt=auto|chat|plain"),
    "--num-fewshot": (True, "eval.num_fewshot=N"),
    "--fewshot-seed": (True, "eval.fewshot_seed=N"),
    "--extract": (True, "eval.extract=strict|flexible"),
    "--device": (True, "engine.device=auto|cpu|cuda"),
}
SETTINGS = "data and eval settings"  # what the recipe keys hold, in the answer to an unknown option


def eval_recipe(args: list[str] = ()) -> Recipe:
    """The eval's recipe from the command line's words ([RECIPE] key=value ... ~key), validated by
    load_recipe without the rules only training has (a model, a run length). Raises RecipeError listing
    every problem, the old flags' included."""
    return command_line.command_recipe(args, MOVED_FLAGS, "eval", settings=SETTINGS, for_training=False)


def default_output_dir(model: str) -> Path:
    """MODEL/eval/, beside the model's files; runs/eval/NAME/ for preset:NAME (no folder of its own)."""
    from megatrain_cli.eval.source import PRESET_PREFIX

    if model.startswith(PRESET_PREFIX):
        return Path("runs") / "eval" / model.removeprefix(PRESET_PREFIX)
    return Path(model) / "eval"


def check_options(eval_cfg: EvalConfig, *, split: str, mode: str) -> None:
    """The measurement options and the protocol's one rule across them, before anything is read (the
    recipe's own values were checked by load_recipe: recipe/checks.py)."""
    from megatrain_cli.eval.source import check_mode

    if split not in SPLITS:
        raise ValueError(f"--split: expected one of {', '.join(SPLITS)}, got {split!r}")
    check_mode(mode)
    if eval_cfg.num_fewshot and split != "test":
        raise ValueError(f"eval.num_fewshot: the few-shot examples come from the train split, so the eval split "
                         f"must be test (--split test), got {split!r}")
