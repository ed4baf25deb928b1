"""The bundled `builtin:sample_math` data set: arithmetic word problems in MetaMathQA format.

Every record is generated here from a handful of templates and small random numbers, so the file is
ours (Apache-2.0, like the project), reproducible byte for byte, and learnable by the `tiny` preset
in a few minutes on a CPU: few templates, operands up to 15, one short worked line per answer.

Regenerate the shipped file with `python -m megatrain_cli.data.sample_math`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

SAMPLE_MATH_PATH = Path(__file__).resolve().parent.parent / "assets" / "sample_math.jsonl"
SAMPLE_MATH_SIZE = 2000
SAMPLE_MATH_SEED = 20240601

NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Leo", "Emma", "Max", "Zoe", "Jack", "Lily"]
ITEMS = ["apples", "pencils", "marbles", "cookies", "stickers", "books", "cards", "shells", "coins",
         "balloons"]
THINGS = ["notebook", "toy car", "sandwich", "ticket", "kite", "puzzle"]  # priced things (singular)

Problem = tuple[str, str, int]  # query, worked solution (without the answer line), answer


def _add(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(1, 9), r.randint(1, 9)
    return (f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
            f"{name} has {a} {item} and buys {b} more, so {name} has {a} + {b} = {a + b} {item}.", a + b)


def _subtract(r: random.Random) -> Problem:
    name, friend = r.sample(NAMES, 2)
    item = r.choice(ITEMS)
    a = r.randint(2, 15)
    b = r.randint(1, a - 1)
    return (f"{name} has {a} {item} and gives {b} of them to {friend}. How many {item} does {name} have left?",
            f"{name} gives away {b} of {a} {item}, so {name} has {a} - {b} = {a - b} {item} left.", a - b)


def _multiply(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 5), r.randint(2, 5)
    return (f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy in total?",
            f"There are {a} bags with {b} {item} each, so {name} buys {a} * {b} = {a * b} {item}.", a * b)


def _divide(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    each, friends = r.randint(2, 5), r.randint(2, 4)
    total = each * friends
    return (f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend "
            f"get?",
            f"Each friend gets {total} / {friends} = {each} {item}.", each)


def _price(r: random.Random) -> Problem:
    thing = r.choice(THINGS)
    price, count = r.randint(2, 6), r.randint(2, 5)
    return (f"One {thing} costs ${price}. How much do {count} of them cost in dollars?",
            f"{count} of them cost {count} * {price} = {count * price} dollars.", count * price)


def _two_steps(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(3, 9), r.randint(1, 5)
    c = r.randint(1, a + b - 1)
    return (f"{name} has {a} {item}, finds {b} more and then loses {c}. How many {item} does {name} have now?",
            f"{name} has {a} + {b} = {a + b} {item}, then loses {c}, so {a + b} - {c} = {a + b - c} {item}.",
            a + b - c)


def _compare(r: random.Random) -> Problem:
    name, friend = r.sample(NAMES, 2)
    item = r.choice(ITEMS)
    b = r.randint(1, 9)
    a = b + r.randint(1, 6)
    return (f"{name} has {a} {item} and {friend} has {b} {item}. How many more {item} does {name} have than "
            f"{friend}?",
            f"{name} has {a} - {b} = {a - b} more {item} than {friend}.", a - b)


def _distance(r: random.Random) -> Problem:
    speed, hours = r.randint(1, 5) * 10, r.randint(2, 4)
    return (f"A car drives {speed} miles per hour for {hours} hours. How many miles does it drive?",
            f"It drives {speed} * {hours} = {speed * hours} miles.", speed * hours)


TEMPLATES: list[Callable[[random.Random], Problem]] = [
    _add, _subtract, _multiply, _divide, _price, _two_steps, _compare, _distance]


def generate_sample_math(n: int = SAMPLE_MATH_SIZE, seed: int = SAMPLE_MATH_SEED) -> list[dict]:
    """`n` distinct MetaMathQA-style records ({query, response}), the same ones for the same seed."""
    r = random.Random(seed)
    seen: set[str] = set()
    records: list[dict] = []
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 100 * n:  # the templates cannot yield n distinct queries
            raise ValueError(f"could not generate {n} distinct problems")
        query, worked, answer = r.choice(TEMPLATES)(r)
        if query in seen:
            continue
        seen.add(query)
        records.append({"query": query, "response": f"{worked}\nThe answer is: {answer}"})
    return records


def write_sample_math(path: Path = SAMPLE_MATH_PATH) -> Path:
    lines = [json.dumps(rec, ensure_ascii=False) for rec in generate_sample_math()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


if __name__ == "__main__":
    print(f"wrote {write_sample_math()}")
