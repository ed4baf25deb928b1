"""Every optimizer-state setting on data-parallel shards (store/sharded.py): per-shard decay ranges, and for
bf16 and int8 moments (train.optimizer_state) a rank's shard
counts the whole tile's elements for stochastic rounding and starts on a 64-element block of the whole tile,
so AdamW over the shards is AdamW over the whole tile, every byte: masters, moment codes, block exponents;
the padding stays zero."""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import HostAdamW
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.store.moments import BLOCK, block_count
from megatrain_cli.store.sharded import ShardedHostStore
from tests.reference import tiny_config


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("world", [2, 3])
def test_host_adamw_on_shards_equals_the_whole_tile(world, moments):
    config = tiny_config("Qwen2ForCausalLM", layers=1, hidden=64, heads=4, inter=96)
    assert config.hidden_size % BLOCK == 0, "embedding shards (whole rows) start on blocks"
    whole = build_store(config, torch.float32, seed=3, moments=moments)
    shards = [ShardedHostStore.from_full(whole, r, world) for r in range(world)]
    opt = HostAdamW(TrainConfig(lr=1e-2, weight_decay=0.5, eps=1e-6, optimizer_state=moments))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for name, tile in whole.tiles.items():
            tile.grad.copy_(torch.randn(tile.numel, generator=g) * 10.0 ** (-4 * torch.rand(tile.numel, generator=g)))
            for s in shards:
                spec = s.shards[name]
                s.tiles[name].grad[:spec.valid].copy_(tile.grad[spec.start:spec.start + spec.valid])
                opt.update(s.tiles[name], 1e-2, 0.7)
            opt.update(tile, 1e-2, 0.7)
    for name, tile in whole.tiles.items():
        for section in ("master", "exp_avg", "exp_avg_sq"):
            cat = torch.cat([getattr(s.tiles[name], section).view(torch.uint8) for s in shards])
            mine = getattr(tile, section).view(torch.uint8)
            assert torch.equal(cat[:mine.numel()], mine), (name, section)
            assert not cat[mine.numel():].any(), "the padding stays zero"
        if moments == "int8":
            for section in ("exp_avg_exp", "exp_avg_sq_exp"):
                cat = torch.cat([getattr(s.tiles[name], section) for s in shards])
                assert torch.equal(cat[:block_count(tile.numel)], getattr(tile, section)), (name, section)
