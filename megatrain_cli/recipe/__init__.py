"""The recipe: one typed schema (schema.py), the rules its values obey (checks.py), how a YAML file plus
overrides becomes one (load.py), and a command's recipe from its command line (command_line.py)."""

from megatrain_cli.recipe.checks import parse_bytes, parse_duration
from megatrain_cli.recipe.load import apply_overrides, load_recipe, render_yaml, schema_help, to_dict
from megatrain_cli.recipe.schema import (BenchConfig, CheckpointConfig, DataConfig, EngineConfig, EvalConfig, LoggingConfig,
                                         ModelConfig, Recipe, RecipeError, StoreConfig, TrainConfig)

__all__ = ["BenchConfig", "CheckpointConfig", "DataConfig", "EngineConfig", "EvalConfig", "LoggingConfig", "ModelConfig", "Recipe",
           "RecipeError", "StoreConfig", "TrainConfig", "apply_overrides", "load_recipe", "parse_bytes", "parse_duration",
           "render_yaml", "schema_help", "to_dict"]
