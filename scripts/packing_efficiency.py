"""How full packed rows are: real tokens / row tokens, for a recipe's training data or a synthetic length mix.

The rows are the trainer's (data/train_data.py: the recipe's tokenizer and template, documents cut to
train.seq_len, data/packing.py's best-fit decreasing). For reference each line also gives the in-order
greedy packer (a row is closed when the next document does not fit, as a streaming packer does) and the
bound no packer can beat (ceil(tokens / seq_len) rows). docs/benchmarks.md, "Packing efficiency (issue 31)".

    python scripts/packing_efficiency.py recipes/tiny.yaml --seq 256 --seq 2048 --seq 4096
    python scripts/packing_efficiency.py recipes/byo-chat.yaml model.preset=tiny --seq 2048
    python scripts/packing_efficiency.py --synthetic 512,1.0 --seq 4096 --seq 32768
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatrain_cli.data.packing import pack_rows  # noqa: E402
from megatrain_cli.data.train_data import synthetic_lengths  # noqa: E402


def greedy_rows(lengths: list[int], seq_len: int) -> int:
    rows, free = 0, 0
    for n in lengths:
        if n > free:
            rows, free = rows + 1, seq_len
        free -= n
    return rows


def recipe_lengths(recipe: str, overrides: list[str], seq_len: int) -> tuple[list[int], int]:
    """The training split's document lengths after the trainer's cut to seq_len, and how many were cut."""
    from megatrain_cli.data import build_train_data, load_examples, split_examples
    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.recipe import load_recipe

    r = load_recipe(recipe, [*overrides, f"train.seq_len={seq_len}"])
    train, _ = split_examples(load_examples(r.data), r.data)
    data = build_train_data(train, load_tokenizer(r.model), r.data, seq_len, r.train.seed)
    return (data.offsets[1:] - data.offsets[:-1]).tolist(), data.truncated


def line(label: str, lengths: list[int], seq_len: int, cut: int) -> str:
    total = sum(lengths)
    best = len(pack_rows(lengths, seq_len))
    greedy = greedy_rows(lengths, seq_len)
    bound = math.ceil(total / seq_len)
    fill = lambda rows: f"{total / (rows * seq_len):.2%}"  # noqa: E731
    return (f"| {label} | {seq_len} | {len(lengths)} | {total} | {cut} | {best} ({fill(best)}) | "
            f"{greedy} ({fill(greedy)}) | {bound} ({fill(bound)}) |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", nargs="?", help="a recipe whose training data is measured")
    ap.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    ap.add_argument("--seq", type=int, action="append", required=True, help="train.seq_len (repeatable)")
    ap.add_argument("--synthetic", help="MEAN,SPREAD: log-normal document lengths instead of a recipe's data")
    ap.add_argument("--tokens", type=int, default=4_000_000, help="synthetic tokens drawn (default 4M)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if (a.recipe is None) == (a.synthetic is None):
        ap.error("give a recipe or --synthetic MEAN,SPREAD")
    print("| data | seq_len | documents | tokens | cut to seq_len | best-fit decreasing rows (fill) | "
          "in-order greedy rows (fill) | bound rows (fill) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for seq_len in a.seq:
        if a.synthetic:
            mean, spread = a.synthetic.split(",")
            raw = synthetic_lengths(a.tokens, int(mean), float(spread), 1 << 30, a.seed)
            lengths = [min(n, seq_len) for n in raw]
            print(line(f"synthetic log-normal mean {mean} spread {spread}", lengths, seq_len,
                       sum(n > seq_len for n in raw)))
        else:
            lengths, cut = recipe_lengths(a.recipe, a.overrides, seq_len)
            print(line(" ".join([Path(a.recipe).name, *a.overrides]), lengths, seq_len, cut))
    return 0


if __name__ == "__main__":
    sys.exit(main())
