"""A command's recipe from its command line's words ([RECIPE] key=value ... ~key), as `bench` and `eval` take
them. The flags a command had before its settings became recipe keys (`moved`: flag -> (takes a value, what
to write instead)) are answered with their key, so an old command line fails with its fix instead of a bare
'unknown option'.
"""

from __future__ import annotations

from pathlib import Path

from megatrain_cli.recipe.load import load_recipe
from megatrain_cli.recipe.schema import Recipe, RecipeError

MovedFlags = dict[str, tuple[bool, str | None]]  # None: the feature is gone, no key replaced it


def split_args(args: list[str], moved: MovedFlags, command: str,
               settings: str = "settings") -> tuple[str | None, list[str], list[str]]:
    """The words besides the options, in order: (the recipe path or None, the key=value / ~key overrides,
    problems). One word without '=' is the recipe; a moved flag is answered with its key, its value
    skipped. `settings` names what the keys hold in the answer to an unknown option."""
    recipe, overrides, problems, i = None, [], [], 0
    while i < len(args):
        arg = args[i]
        flag = arg.split("=", 1)[0]
        i += 1
        if flag in moved:
            takes_value, key = moved[flag]
            i += int(takes_value and "=" not in arg and i < len(args))
            problems.append(f"{flag}: removed (the feature is gone)" if key is None else
                            f"{flag}: now a recipe key: {key}")
        elif arg.startswith("-") and not arg.startswith("~"):
            problems.append(f"{arg}: no such option of `megatrain {command}` ({settings} are recipe keys, "
                            f"key.sub=value; `megatrain {command} --help` lists them)")
        elif "=" in arg or arg.startswith("~"):
            overrides.append(arg)
        elif recipe is None:
            recipe = arg
        else:
            problems.append(f"{arg}: one recipe at most (already {recipe}); overrides are key.sub=value")
    return recipe, overrides, problems


def command_recipe(args: list[str], moved: MovedFlags, command: str, *, settings: str = "settings",
                   default: str | Path | None = None, shorthand: list[str] = (),
                   for_training: bool = True) -> Recipe:
    """RECIPE (else `default`; None: the schema's defaults) with the `shorthand` overrides, then the words'
    (explicit keys win), validated by load_recipe. Raises RecipeError listing every problem, the moved
    flags' included."""
    path, overrides, problems = split_args(list(args), moved, command, settings)
    path = path or default
    try:
        r = load_recipe(path, [*shorthand, *overrides], for_training=for_training)
    except RecipeError as err:
        problems += err.problems
    if problems:
        raise RecipeError(problems, str(path) if path else f"megatrain {command}")
    return r
