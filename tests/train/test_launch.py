"""`megatrain train --gpus 2` on the CPU (gloo): the data-parallel trainer must train as one process does.

Tiny preset, fp32, 4 steps of grad_accum 2 (one micro-batch per rank): the exported final weights equal
the single-process run's within 1e-5 (summation order differs), and resuming from the 2-rank run's
per-shard checkpoint at step 2 gives step 4 bit-identical to the uninterrupted 2-rank run; a checkpoint
resumes on another number of ranks (2 -> 1, 1 -> 2) within the same 1e-5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatrain_cli.train import launch as dist_train
from megatrain_cli.recipe import load_recipe
from megatrain_cli.train.loop import run_training

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.yaml"
FAST = ["train.steps=4", "train.seq_len=64", "train.micro_batch_size=2", "train.grad_accum=2",
        "logging.dashboard=plain", "logging.every_n_steps=1", "checkpoint.export_final=true",
        "checkpoint.every_n_steps=2", "train.warmup_steps=1", "eval.enabled=false"]


def recipe(out: Path, *extra: str):
    return load_recipe(TINY, [*FAST, f"output_dir={out}", *extra])


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    assert run_training(recipe(one)) == 0
    assert dist_train.train(recipe(two), gpus=2) == 0
    return one, two


def test_two_ranks_train_as_one_process(runs):
    one, two = runs
    a, b = load_file(one / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == torch.float32
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    # per-shard checkpoints, rank 0 alone wrote the logs
    manifest = json.loads((two / "step_4" / "manifest.json").read_text())
    assert manifest["world"] == 2 and manifest["tiles"] == [] and len(manifest["shards"]) == 2
    assert sorted(p.name for p in (two / "step_4" / "tiles").iterdir()) == ["rank0", "rank1"]
    assert len(losses(two)) == 4


def test_resume_on_two_ranks_is_bit_identical(runs, tmp_path):
    _, two = runs
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(two / "step_2", out / "step_2")  # what a run stopped after step 2 leaves
    assert dist_train.train(recipe(out, "checkpoint.resume=auto"), gpus=2) == 0
    for f in sorted((two / "step_4" / "tiles").rglob("*.safetensors")):
        rel = f.relative_to(two)
        assert (out / rel).read_bytes() == f.read_bytes(), rel
    assert (out / "final" / "model.safetensors").read_bytes() == (two / "final" / "model.safetensors").read_bytes()
    assert losses(out) == losses(two)[2:]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def assert_close_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)


def test_a_two_rank_checkpoint_resumes_in_one_process(runs, tmp_path):
    one, two = runs
    out = tmp_path / "one"
    out.mkdir()
    shutil.copytree(two / "step_2", out / "step_2")
    assert run_training(recipe(out, "checkpoint.resume=auto")) == 0
    assert_close_weights(final_weights(one), final_weights(out))
    assert losses(out) == pytest.approx(losses(one)[2:], rel=1e-5)
    # the resumed process checkpoints whole tiles again
    assert "world" not in json.loads((out / "step_4" / "manifest.json").read_text())


def test_a_one_process_checkpoint_resumes_on_two_ranks(runs, tmp_path):
    one, two = runs
    out = tmp_path / "two"
    out.mkdir()
    shutil.copytree(one / "step_2", out / "step_2")
    assert dist_train.train(recipe(out, "checkpoint.resume=auto"), gpus=2) == 0
    assert_close_weights(final_weights(two), final_weights(out))
    assert losses(out) == pytest.approx(losses(two)[2:], rel=1e-5)


def test_export_of_a_two_rank_checkpoint_equals_its_final(runs, tmp_path):
    from megatrain_cli.checkpoint import export_checkpoint

    _, two = runs
    export_checkpoint(two / "step_4", tmp_path / "hf", dtype=torch.float32)  # the run's dtype, as final/
    exported, final = load_file(tmp_path / "hf" / "model.safetensors"), final_weights(two)
    assert exported.keys() == final.keys()
    for k in final:
        assert torch.equal(exported[k], final[k]), k


def test_a_corrupted_shard_is_refused_when_resharding(runs, tmp_path):
    from megatrain_cli.checkpoint import CheckpointError, load_checkpoint
    from megatrain_cli.models.loader import build_store, load_hf_config

    _, two = runs
    ckpt = tmp_path / "step_2"
    shutil.copytree(two / "step_2", ckpt)
    victim = ckpt / "tiles" / "rank1" / "layers.0.safetensors"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # a flipped byte in the last section (exp_avg_sq)
    victim.write_bytes(bytes(data))
    store = build_store(load_hf_config(ckpt), torch.float32, seed=0)
    with pytest.raises(CheckpointError, match="checksum mismatch in section exp_avg_sq"):
        load_checkpoint(store, ckpt)


def test_grad_accum_must_be_a_multiple_of_the_ranks(tmp_path, capsys):
    assert dist_train.train(recipe(tmp_path, "train.grad_accum=3"), gpus=2) == 2
    assert "train.grad_accum (3) must be a multiple of 2" in capsys.readouterr().err
