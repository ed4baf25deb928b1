"""The dataset registry (names -> path or hub, format, columns) and weighted mixing of several datasets."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from megatrain_cli.data import DataError, load_examples, split_examples
from megatrain_cli.data import sample_chat
from megatrain_cli.data.mixing import mix, mix_counts
from megatrain_cli.data.registry import resolve
from megatrain_cli.recipe import DataConfig, RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def math_records(tag: str, n: int) -> list[dict]:
    return [{"query": f"{tag} problem {i}?", "response": f"The answer is: {i}"} for i in range(n)]


@pytest.fixture()
def registry(tmp_path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "chats.jsonl", [{"conversations": [{"from": "human", "value": "2 + 2?"},
                                                          {"from": "gpt", "value": "The answer is: 4"}],
                                        "sys": "Be brief."}])
    write_jsonl(data / "alpaca.jsonl", [{"q": "Add 1 and 2.", "a": "The answer is: 3"}])
    for tag, n in (("a", 300), ("b", 200), ("c", 100)):
        write_jsonl(data / f"{tag}.jsonl", math_records(tag, n))
    entries = {
        "chats": {"path": "data/chats.jsonl", "format": "messages", "columns": {"messages": "conversations",
                                                                                "system": "sys"}},
        "lf_alpaca": {"file_name": "data/alpaca.jsonl", "formatting": "alpaca",
                      "columns": {"prompt": "q", "response": "a"}},  # LLaMA-Factory's names
        "gsm8k": {"hub": "openai/gsm8k", "subset": "main", "split": "train", "format": "gsm8k", "max_samples": 50},
        **{tag: {"path": f"data/{tag}.jsonl", "format": "metamathqa"} for tag in "abc"},
    }
    path = tmp_path / "dataset_info.yaml"
    path.write_text(yaml.safe_dump(entries))
    return path


# ---------------------------------------------------------------- resolution
def test_a_name_resolves_to_its_path_format_and_columns(registry):
    spec = resolve(str(registry), "chats")
    assert (spec.source, spec.format, spec.fields) == (
        str(registry.parent / "data" / "chats.jsonl"), "messages", {"messages": "conversations", "system": "sys"})
    lf = resolve(str(registry), "lf_alpaca")
    assert (lf.source, lf.format, lf.fields) == (str(registry.parent / "data" / "alpaca.jsonl"), "alpaca",
                                                 {"instruction": "q", "output": "a"})
    hub = resolve(str(registry), "gsm8k")
    assert (hub.source, hub.split, hub.max_samples) == ("openai/gsm8k:main", "train", 50)
    # Loaded through a recipe's data section: the entry's own layout, the system prompt from its column.
    ex, = load_examples(DataConfig(source="registry:chats", registry=str(registry)))
    assert (ex.prompt, ex.answer, ex.chat, ex.history) == ("2 + 2?", "4", True,
                                                           [{"role": "system", "content": "Be brief."}])
    ex, = load_examples(DataConfig(source="registry:lf_alpaca", registry=str(registry)))
    assert (ex.prompt, ex.answer) == ("Add 1 and 2.", "3")


def test_an_unknown_name_is_refused_naming_the_registry_and_the_known_names(registry):
    with pytest.raises(DataError) as err:
        load_examples(DataConfig(source="registry:chat", registry=str(registry)))
    message = str(err.value)
    assert f"no dataset 'chat' in the registry {registry}" in message and "did you mean 'chats'?" in message
    assert "(known: a, b, c, chats, gsm8k, lf_alpaca)" in message
    with pytest.raises(DataError, match=r"data.datasets\[1\].name: no dataset 'd'"):
        load_examples(DataConfig(datasets=["a", "d"], registry=str(registry)))
    with pytest.raises(DataError, match="data.registry: file not found"):
        load_examples(DataConfig(source="registry:a", registry=str(registry.parent / "nope.yaml")))


def test_bad_entries_are_refused_by_name(tmp_path):
    bad = {"x": {"path": "x.jsonl", "ranking": True, "columns": {"kto_tag": "tag"}},
           "y": {"path": "y.jsonl", "hub": "o/n"}, "z": {"path": "z.jsonl", "images": "img"},
           "w": {"path": "w.jsonl", "format": "dpo"}, "t": {"path": "t.jsonl", "tags": {"role_tag": "speaker"}}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(bad))  # JSON, as LLaMA-Factory writes it
    for name, pattern in (("x", "ranking: true, or format preference.*kto_tag.*at once"), ("y", "exactly one of path"),
                          ("z", "unsupported key.*'images'"), ("w", "unknown format 'dpo'"),
                          ("t", "tags.role_tag='speaker'")):
        with pytest.raises(DataError, match=pattern):
            resolve(str(path), name)


def test_recipe_checks_of_the_registry_keys():
    def problems(*overrides) -> str:
        with pytest.raises(RecipeError) as err:
            load_recipe(ROOT / "recipes" / "tiny.yaml", list(overrides))
        return "\n".join(err.value.problems)

    assert "data.source: 'registry:x' names a registry dataset; set data.registry" in problems("data.source=registry:x")
    assert "data.datasets: names registry datasets; set data.registry" in problems("data.datasets=[a]")
    found = problems("data.registry=r.yaml", "data.datasets=[{name: a, weight: 2}, b, {name: a, wieght: 1}]")
    assert "data.datasets[2]: unknown key(s) wieght" in found and "a listed more than once" in found
    assert "give every dataset a weight, or none" in found
    assert "data.mix_size: needs weights" in problems("data.registry=r.yaml", "data.datasets=[a, b]",
                                                       "data.mix_size=10")
    assert "data.fields: does not apply to registry datasets" in problems(
        "data.registry=r.yaml", "data.source=registry:a", "data.fields={query: q}")
    assert "data.datasets: replaces data.source" in problems("data.registry=r.yaml", "data.datasets=[a]",
                                                             "data.source=x.jsonl")
    assert "data.datasets[0].weight: must be a number > 0" in problems("data.registry=r.yaml",
                                                                        "data.datasets=[{name: a, weight: 0}]")


# ---------------------------------------------------------------- mixing
def tags(examples) -> collections.Counter:
    return collections.Counter(ex.prompt.split()[0] for ex in examples)


def test_mixing_proportions_follow_the_weights_and_the_seed(registry):
    cfg = DataConfig(registry=str(registry), datasets=[{"name": "a", "weight": 2}, {"name": "b", "weight": 1},
                                                       {"name": "c", "weight": 1}])
    mixed = load_examples(cfg)
    # Default size: the most that repeats nothing; c (100 examples, a quarter) runs out first.
    assert tags(mixed) == {"a": 200, "b": 100, "c": 100} and len({ex.prompt for ex in mixed}) == 400
    # Deterministic for a seed; another seed draws other examples of a, in the same proportions.
    assert [e.prompt for e in load_examples(cfg)] == [e.prompt for e in mixed]
    other = load_examples(dataclasses.replace(cfg, split_seed=7))
    assert tags(other) == tags(mixed) and {e.prompt for e in other} != {e.prompt for e in mixed}
    # Interleaved, not blocked: the first 100 and the held-out split keep the shares within a tolerance.
    train, test = split_examples(mixed, cfg)
    for part in (mixed[:100], train, test):
        for tag, share in (("a", 0.5), ("b", 0.25), ("c", 0.25)):
            assert abs(tags(part)[tag] / len(part) - share) < 0.1, (tag, tags(part))
    # A larger mixture repeats the smaller datasets, every example once per pass.
    big = load_examples(dataclasses.replace(cfg, mix_size=1000))
    assert tags(big) == {"a": 500, "b": 250, "c": 250}
    assert set(collections.Counter(e.prompt for e in big if e.prompt.startswith("c")).values()) == {2, 3}
    # max_samples caps the total and keeps the shares; no weights: every example of each, once.
    assert tags(load_examples(dataclasses.replace(cfg, max_samples=40))) == {"a": 20, "b": 10, "c": 10}
    assert tags(load_examples(dataclasses.replace(cfg, datasets=["a", "c"]))) == {"a": 300, "c": 100}


def test_mix_counts_are_the_weights_share_to_within_one():
    for weights, total in (([1, 1, 1], 100), ([0.7, 0.2, 0.1], 33), ([5, 3], 7), ([1, 2, 3, 4], 1001)):
        counts = mix_counts([10**6] * len(weights), weights, total)
        assert sum(counts) == total
        assert all(abs(c - total * w / sum(weights)) < 1 for c, w in zip(counts, weights))
    with pytest.raises(DataError, match="dataset 1 has no examples"):
        mix([[1], []], [1.0, 1.0], seed=0)


# ---------------------------------------------------------------- the shipped example
def test_the_byo_recipe_reads_the_shipped_registry_and_chats():
    r = load_recipe(ROOT / "recipes" / "byo-chat.yaml", ["model.preset=null", "model.path=/models/any"])
    data = dataclasses.replace(r.data, registry=str(ROOT / r.data.registry))
    examples = load_examples(data)
    assert len(examples) == 80 and all(ex.chat and ex.history[0]["role"] == "system" for ex in examples)
    assert collections.Counter(ex.prompt in {c[-2]["content"] for c in sample_chat.chats(0, 120)}
                               for ex in examples) == {True: 60, False: 20}  # weights 3 : 1
    for name in sample_chat.FILES:  # the shipped files are what the generator writes
        assert (ROOT / "docs" / "byo" / name).read_text() == sample_chat.render(name)
