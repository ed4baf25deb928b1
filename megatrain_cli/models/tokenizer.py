"""Tokenizers: a model directory's own, or the small bundled one for presets (fully offline).

The bundled tokenizer is a byte-level BPE trained on the bundled `sample_math` data, so any text
encodes (no unknown tokens) while the sample's words are single tokens. Digits are always split one
per token: a tiny model then learns arithmetic over ten digit tokens instead of memorising a token
per number. It ships as `assets/tokenizer.json`; rebuild it with `python -m megatrain_cli.models.tokenizer`
(training is deterministic, a test checks the shipped file matches).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from megatrain_cli.recipe import ModelConfig

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_TOKENIZER_PATH = ASSETS_DIR / "tokenizer.json"
BUNDLED_PROCESSOR_DIR = ASSETS_DIR / "vlm"  # the VLM presets' processor (models/processor.py)
BUNDLED_VOCAB_SIZE = 1024  # an upper bound: training stops earlier when the sample has no more pairs
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# The `tiny` preset's max_position_embeddings; generation and truncation read it from the tokenizer.
BUNDLED_MODEL_MAX_LENGTH = 4096
# Files any one of which makes a directory hold a tokenizer `AutoTokenizer` can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(directory: str | Path) -> bool:
    d = Path(directory)
    return d.is_dir() and any((d / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_cfg: "ModelConfig") -> "PreTrainedTokenizerFast":
    """The recipe's tokenizer: `model.tokenizer`, else `model.path`, else the bundled one (a VLM preset's:
    the bundled processor's)."""
    from megatrain_cli.presets import is_vision_preset

    directory = model_cfg.tokenizer or model_cfg.path
    if directory is None and is_vision_preset(model_cfg.preset):  # the bundled processor's (models/processor.py)
        directory = BUNDLED_PROCESSOR_DIR
    if directory is None:
        return load_bundled_tokenizer()
    return load_tokenizer_dir(directory, trust_remote_code=model_cfg.trust_remote_code)


def load_tokenizer_dir(directory: str | Path, trust_remote_code: bool = False) -> "PreTrainedTokenizerFast":
    from transformers import AutoTokenizer

    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"tokenizer directory does not exist: {d}")
    if not has_tokenizer_files(d):
        raise ValueError(f"no tokenizer in {d} (expected one of {', '.join(TOKENIZER_FILES)}); "
                         f"set model.tokenizer to a directory that has one")
    tokenizer = AutoTokenizer.from_pretrained(str(d), local_files_only=True, trust_remote_code=trust_remote_code)
    ensure_pad_token(tokenizer)
    return tokenizer


def ensure_pad_token(tokenizer) -> None:
    """Batching needs a pad id; many base models ship without one, so reuse eos (pads never carry loss)."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token


def load_bundled_tokenizer() -> "PreTrainedTokenizerFast":
    from transformers import PreTrainedTokenizerFast

    if not BUNDLED_TOKENIZER_PATH.is_file():
        raise ValueError(f"the bundled tokenizer is missing: {BUNDLED_TOKENIZER_PATH} "
                         f"(rebuild it with `python -m megatrain_cli.models.tokenizer`)")
    return PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_TOKENIZER_PATH), eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, model_max_length=BUNDLED_MODEL_MAX_LENGTH,
                                   clean_up_tokenization_spaces=False)


# ---------------------------------------------------------------- building the bundled tokenizer
def sample_texts() -> list[str]:
    """The training text: every query and response of the bundled sample, in file order."""
    from megatrain_cli.data.sample_math import SAMPLE_MATH_PATH

    texts = []
    with open(SAMPLE_MATH_PATH, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            texts += [record["query"], record["response"]]
    # The plain prompt template's words, twice so that BPE (min_frequency 2) makes them whole tokens.
    texts += ["Question: \nAnswer: "] * 2
    return texts


def train_bundled_tokenizer(texts: list[str], vocab_size: int = BUNDLED_VOCAB_SIZE):
    """A byte-level BPE (`tokenizers.Tokenizer`) with single-digit tokens, eos and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_bundled_tokenizer(path: Path = BUNDLED_TOKENIZER_PATH) -> Path:
    train_bundled_tokenizer(sample_texts()).save(str(path), pretty=True)
    return path


if __name__ == "__main__":
    print(f"wrote {write_bundled_tokenizer()}")
