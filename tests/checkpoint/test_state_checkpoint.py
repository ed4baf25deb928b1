"""Checkpoints of bf16 and int8 moments (train.optimizer_state): the files hold them as fp32, and coding them
again on loading gives back the same values, so a resume continues bit for bit (masters, moment codes, block
exponents, step counts); a checkpoint written under one setting loads under another, converted, with a note."""

from __future__ import annotations

import json

import pytest
import torch

from megatrain_cli.checkpoint import load_checkpoint, save_checkpoint
from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import HostAdamW
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.store.moments import read_moments, write_moments
from tests.reference import tiny_config

STATE = {"global_step": 3}
SECTIONS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp")


def store_of(moments: str):
    return build_store(tiny_config(layers=2), torch.float32, seed=1, moments=moments)


def train(store, moments: str, steps: range) -> None:
    """Host AdamW steps on every tile with gradients drawn from the step index (the same on a resumed run)."""
    opt = HostAdamW(TrainConfig(lr=1e-3, weight_decay=0.1, optimizer_state=moments), kernel="auto")
    for s in steps:
        gen = torch.Generator().manual_seed(s)
        for tile in store.tiles.values():
            tile.grad.copy_(torch.randn(tile.numel, generator=gen) * 10.0 ** (-4 * torch.rand(tile.numel, generator=gen)))
            opt.update(tile, 1e-3, 0.5 if s % 2 else 1.0)


def same_bytes(a, b) -> None:
    for name, t in a.tiles.items():
        assert t.step == b.tiles[name].step, name
        for section in SECTIONS:
            x, y = getattr(t, section).view(torch.uint8), getattr(b.tiles[name], section).view(torch.uint8)
            assert torch.equal(x, y), f"{name}.{section}: {(x != y).sum().item()} bytes differ"


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_resume_is_bit_exact(tmp_path, capsys, moments):
    straight = store_of(moments)
    train(straight, moments, range(3))
    path = save_checkpoint(straight, tmp_path, 3, STATE)
    assert json.loads((path / "manifest.json").read_text())["optimizer_state"] == moments
    train(straight, moments, range(3, 6))

    resumed = store_of(moments)
    assert load_checkpoint(resumed, path) == STATE
    assert "note:" not in capsys.readouterr().err  # the same setting: nothing to say
    train(resumed, moments, range(3, 6))
    same_bytes(straight, resumed)


@pytest.mark.parametrize("written,loaded", [("int8", "fp32"), ("bf16", "int8"), ("fp32", "bf16"), ("int8", "bf16")])
def test_loads_under_another_setting(tmp_path, capsys, written, loaded):
    source = store_of(written)
    train(source, written, range(2))
    path = save_checkpoint(source, tmp_path, 2, STATE)
    target = store_of(loaded)
    load_checkpoint(target, path)
    assert capsys.readouterr().err == (f"note: {path} was written with train.optimizer_state={written}; its Adam "
                                       f"moments are coded as train.optimizer_state={loaded} on loading "
                                       "(docs/precision.md)\n")
    reference = store_of(loaded)  # what coding the source's fp32 values directly gives
    for name, tile in target.tiles.items():
        m, v = read_moments(source.tiles[name])
        assert torch.equal(tile.master, source.tiles[name].master) and tile.step == source.tiles[name].step
        got_m, got_v = read_moments(tile)
        if loaded == "fp32":
            assert torch.equal(got_m, m) and torch.equal(got_v, v)  # decoding is exact
        else:
            write_moments(reference.tiles[name], m, v)
            assert torch.equal(got_m, read_moments(reference.tiles[name])[0])
            assert torch.equal(got_v, read_moments(reference.tiles[name])[1])
            # e4m3 holds 3 mantissa bits (bf16: 8) down to its subnormals, whose step is 2^-9 of the block's
            # scale (< its largest value / 224): the bound with the largest value of the tile for the block's
            torch.testing.assert_close(got_m, m, rtol=0.07, atol=m.abs().max().item() / (224 * 1024))
