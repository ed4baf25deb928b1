"""The data path: sources and formats (or registry names, mixed by weight) -> examples -> seeded
train/test split -> rendered turns (chat template or plain) -> ids with a loss mask -> packed rows.

`datasets` is only imported where a source needs it (saved / hub data sets, parallel tokenisation).
"""

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.data.load import load_examples, split_examples
from megatrain_cli.data.prompts import encode_prompt, render_prompt, stop_strings
from megatrain_cli.data.train_data import TrainData, build_train_data

__all__ = ["DataError", "Example", "TrainData", "build_train_data", "encode_prompt", "load_examples",
           "render_prompt", "split_examples", "stop_strings"]
