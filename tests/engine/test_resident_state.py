"""bf16 and int8 moments (train.optimizer_state) on device-resident layers (engine/resident.py): the resident
update (optim/state_adamw.py, torch ops) is the host kernel's to the bit, so on the CPU a run with resident
layers equals the run with none, every tile's masters, moment codes, block exponents and step counts; and
the host store's tiles hold the moments in their format."""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import HostAdamW, lr_at
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.reference import random_batches, tiny_config

STEPS, ACCUM = 3, 2


def train(moments: str, resident: int, kernel: str):
    config = tiny_config("LlamaForCausalLM", layers=3)
    store = build_store(config, torch.float32, seed=3, moments=moments)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, grad_accum=ACCUM,
                      eps=1e-6, optimizer_state=moments)
    batches = random_batches(config.vocab_size, STEPS, ACCUM, batch=2, seq=16, seed=5)
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=2, loss_chunk_tokens=7,
                         resident_layers=resident, kernels="torch", host_adamw=kernel)
    losses = [engine.step(mbs, lr_at(s, cfg, STEPS)).losses for s, mbs in enumerate(batches)]
    engine.close()  # the resident state comes home
    return store, losses


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_resident_equals_streamed_bit_for_bit(moments):
    streamed, l0 = train(moments, 0, "cpp")
    resident, l1 = train(moments, 2, "cpp")
    assert l0 == l1
    for name, a in streamed.tiles.items():
        b = resident.tiles[name]
        assert a.moments == b.moments == moments and a.step == b.step == STEPS
        for section in ("master", "exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp"):
            x, y = getattr(a, section).view(torch.uint8), getattr(b, section).view(torch.uint8)
            assert torch.equal(x, y), f"{name}.{section}: {(x != y).sum().item()} bytes differ"
    assert streamed.tiles["layers.0"].exp_avg.dtype == {"bf16": torch.bfloat16, "int8": torch.float8_e4m3fn}[moments]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("master,rounding", [(torch.float32, "nearest"), (torch.bfloat16, "nearest"),
                                             (torch.bfloat16, "stochastic")])
@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_device_update_equals_the_host_kernel(moments, master, rounding):
    """The resident layers' update on CUDA (optim/state_adamw.py) against the C++ host kernel on the same
    tile and gradients: every byte of masters, moment codes and block exponents, over three steps; bf16 masters
    rounded either way, the device given the master key as engine/resident.py gives it."""
    from megatrain_cli.optim.state_adamw import StepConsts, master_key, update_state
    from megatrain_cli.store.moments import sr_key
    from megatrain_cli.store.tiles import TileLayout, allocate_tile

    n, decay = 64 * 1000 + 37, 64 * 400 + 9
    cfg = TrainConfig(lr=1e-3, weight_decay=0.1, optimizer_state=moments, master_rounding=rounding)
    host = allocate_tile("layers.0", TileLayout([], n, decay), torch.bfloat16, master, moments)
    host.master.copy_(torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02)
    for s in (host.exp_avg, host.exp_avg_sq, host.exp_avg_exp, host.exp_avg_sq_exp):
        s.zero_()
    sections = ("master", "grad", "exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp")
    dev = {k: getattr(host, k).cuda() for k in sections}
    opt = HostAdamW(cfg, kernel="cpp")
    gen = torch.Generator().manual_seed(1)
    for step in (1, 2, 3):
        g = (torch.randn(n, generator=gen) * 10.0 ** (-4 * torch.rand(n, generator=gen))).to(torch.bfloat16)
        host.grad.copy_(g)
        dev["grad"].copy_(g)
        opt.update(host, 1e-3, 0.6)
        update_state(*(dev[k] for k in sections), moments=moments, decay_numel=decay,
                     k=StepConsts.make(step, 1e-3, 0.9, 0.999, cfg.eps, 0.1, 0.6),
                     key_m=sr_key(cfg.seed, "layers.0", step, 0), key_v=sr_key(cfg.seed, "layers.0", step, 1), origin=0,
                     key_p=master_key(rounding, dev["master"], cfg.seed, "layers.0", step))
    for k in sections:
        a, b = getattr(host, k).view(torch.uint8), dev[k].cpu().view(torch.uint8)
        assert torch.equal(a, b), f"{k}: {(a != b).sum().item()} bytes differ"
