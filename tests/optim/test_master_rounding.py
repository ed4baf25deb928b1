"""bf16 master weights rounded stochastically (train.master_rounding=stochastic): the C++ host kernels
(adamw_cpp.cpp with fp32 moments, adamw_state.cpp with bf16 / int8 ones), HostAdamW's torch path and the
resident layers' torch ops (optim/state_adamw.py, engine/resident.py) against a plain-PyTorch reference of the
same update written here: fp32 AdamW on the widened weights (torch's own AdamW for fp32 moments), the result
rounded to bf16 with 16 random bits mix32(key ^ element) added below the kept ones, key =
sr_key(train.seed, tile, step, MASTER). Bit for bit over several steps, clipped and not, odd sizes (vector
tails, short int8 blocks), decay boundaries inside a block; the deferred pair and the update on read; a
rank's shard; a whole run with resident layers equal to one without. Then what it buys: small updates survive
on average where round-to-nearest drops them."""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.optim import adamw_cpp
from megatrain_cli.optim.host_adamw import HostAdamW, lr_at
from megatrain_cli.recipe import TrainConfig, load_recipe
from megatrain_cli.store.moments import MASTER, sr_key
from megatrain_cli.store.tiles import TileLayout, allocate_tile
from tests.optim.test_state_precision import grads, ref_stochastic_bf16, ref_update

BF16 = torch.bfloat16
CFG = dict(lr=1e-3, weight_decay=0.1, eps=1e-8, seed=7, master_weights="bf16", master_rounding="stochastic")
SIZES = [(1, 1), (200, 77), (20_011, 13_003), (64 * 1100 + 13, 64 * 500 + 5)]
NAME = "layers.3"


def _cpp_or_skip(kernel: str) -> None:
    if kernel == "cpp" and not adamw_cpp.available():
        pytest.skip("the C++ host kernel does not compile here")


def make_tile(numel: int, decay: int, moments: str, grad=BF16, origin: int = 0):
    tile = allocate_tile(NAME, TileLayout([], numel, decay), grad, BF16, moments)
    tile.origin = origin
    tile.master.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 0.02)
    for s in (tile.exp_avg, tile.exp_avg_sq, tile.exp_avg_exp, tile.exp_avg_sq_exp):
        s.zero_()
    return tile


class Reference:
    """The update written out: torch.optim.AdamW (fused, as the fp32 setting promises) or test_state_precision's
    quantised-moment update on the fp32-widened weights, then stochastic rounding to bf16 (numpy's mix32)."""

    def __init__(self, tile, moments: str):
        self.moments, self.decay, self.n = moments, tile.layout.decay_numel, tile.numel
        self.p = tile.master.float()
        if moments == "fp32":
            self.parts = [self.p[:self.decay].clone(), self.p[self.decay:].clone()]
            groups = [{"params": [x], "weight_decay": wd} for x, wd in zip(self.parts, (0.1, 0.0)) if x.numel()]
            self.opt = torch.optim.AdamW(groups, lr=1e-3, eps=1e-8, fused=True)
        else:
            self.state = {"p": self.p.clone(), "m": tile.exp_avg.clone(), "v": tile.exp_avg_sq.clone(),
                          "me": tile.exp_avg_exp.clone(), "ve": tile.exp_avg_sq_exp.clone()}

    def step(self, g: torch.Tensor, step: int, lr: float, clip: float) -> torch.Tensor:
        if self.moments == "fp32":
            gg = g.float() if clip == 1.0 else g.float() / torch.tensor(1.0 / clip, dtype=torch.float32)
            for x, part in zip(self.parts, (gg[:self.decay], gg[self.decay:])):
                x.grad = part.clone()
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.opt.step()
            wide = torch.cat([x.detach() for x in self.parts])
        else:
            self.state["p"] = self.state["p"].float()  # fp32 in: ref_update leaves its fp32 result unrounded
            ref_update(self.state, g, step=step, lr=lr, clip=clip, decay_numel=self.decay, name=NAME,
                       moments=self.moments)
            wide = self.state["p"]
        new = ref_stochastic_bf16(wide, sr_key(7, NAME, step, MASTER), 0)
        if self.moments == "fp32":  # go on from the rounded weight, as the bf16 master does
            with torch.no_grad():
                self.parts[0].copy_(new[:self.decay].float())
                self.parts[1].copy_(new[self.decay:].float())
        else:
            self.state["p"] = new.float()
        return new


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("kernel", ["cpp", "torch"])
def test_update_equals_reference_bit_for_bit(moments, kernel):
    _cpp_or_skip(kernel)
    opt = HostAdamW(TrainConfig(**CFG, optimizer_state=moments), kernel=kernel, defer_moments=False)
    for numel, decay in SIZES:
        tile = make_tile(numel, decay, moments)
        ref = Reference(tile, moments)
        for i, (g, clip) in enumerate(zip(grads(numel, 4, BF16), (1.0, 0.3, 1.0, 0.7))):
            tile.grad.copy_(g)
            opt.update(tile, 1e-3, clip)
            want = ref.step(g, i + 1, 1e-3, clip)
            a, b = _bits(tile.master), _bits(want)
            assert torch.equal(a, b), f"{kernel} {moments} numel {numel} step {i + 1}: {(a != b).sum()} bytes"
        assert tile.step == 4


def test_the_deferred_pair_and_the_update_on_read_equal_the_update():
    """fp32 moments, C++ kernel: update_weights + update_moments, and update_weights_span in pieces (whose bf16
    copy for the device is the stored master itself), give update's bits."""
    _cpp_or_skip("cpp")
    opt = HostAdamW(TrainConfig(**CFG), kernel="cpp", defer_moments=True)
    whole, deferred, on_read = (make_tile(20_011, 13_003, "fp32") for _ in range(3))
    out = torch.empty(20_011, dtype=BF16)
    for g, clip in zip(grads(20_011, 3, BF16), (1.0, 0.4, 0.9)):
        for t in (whole, deferred, on_read):
            t.grad.copy_(g)
        opt.update(whole, 1e-3, clip)
        opt.update_weights(deferred, 1e-3, clip)
        opt.update_moments(deferred, clip)
        for lo, hi in ((0, 7_001), (7_001, 13_010), (13_010, 20_011)):  # one piece across the decay boundary
            opt.update_weights_span(on_read, 1e-3, clip, lo, hi, out[lo:hi])
        opt.count_step(on_read)
        opt.update_moments(on_read, clip)
        assert torch.equal(_bits(out), _bits(on_read.master))
        for t in (deferred, on_read):
            for s in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(_bits(getattr(t, s)), _bits(getattr(whole, s))), s


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_a_shard_draws_the_whole_tiles_bits(moments):
    """A rank's shard (origin > 0) rounds its elements with the whole tile's bits: its update equals the
    matching part of the whole tile's."""
    _cpp_or_skip("cpp")
    opt = HostAdamW(TrainConfig(**CFG, optimizer_state=moments), kernel="cpp", defer_moments=False)
    whole = make_tile(1024, 400, moments)
    part = make_tile(512, 0, moments, origin=512)
    part.master.copy_(whole.master[512:])
    for g in grads(1024, 3, BF16):
        whole.grad.copy_(g)
        part.grad.copy_(g[512:])
        opt.update(whole, 1e-3)
        opt.update(part, 1e-3)
    assert torch.equal(_bits(part.master), _bits(whole.master[512:]))


def _train(moments: str, resident: int, rounding: str):
    from megatrain_cli.models.loader import build_store
    from tests.engines import make_engine
    from tests.reference import random_batches, tiny_config

    config = tiny_config("LlamaForCausalLM", layers=3)
    store = build_store(config, BF16, seed=3, master_dtype=BF16, moments=moments)
    cfg = TrainConfig(steps=3, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, grad_accum=2, eps=1e-6,
                      optimizer_state=moments, master_weights="bf16", master_rounding=rounding)
    batches = random_batches(config.vocab_size, 3, 2, batch=2, seq=16, seed=5)
    engine = make_engine(store, cfg, device="cpu", checkpoint_interval=2, loss_chunk_tokens=7,
                         resident_layers=resident, kernels="torch", host_adamw="cpp" if adamw_cpp.available() else "torch")
    losses = [engine.step(mbs, lr_at(s, cfg, 3)).losses for s, mbs in enumerate(batches)]
    engine.close()
    return store, losses


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_resident_layers_round_as_the_host_kernel(moments):
    """On the CPU a run whose first layers and head are updated by engine/resident.py (torch ops) equals the run
    updated by the host kernel, every byte of every tile; and it differs from the nearest-rounding run."""
    streamed, l0 = _train(moments, 0, "stochastic")
    resident, l1 = _train(moments, 2, "stochastic")
    nearest, _ = _train(moments, 0, "nearest")
    assert l0 == l1
    for name, a in streamed.tiles.items():
        for section in ("master", "exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp"):
            x, y = _bits(getattr(a, section)), _bits(getattr(resident.tiles[name], section))
            assert torch.equal(x, y), f"{name}.{section}: {(x != y).sum().item()} bytes differ"
    assert any(not torch.equal(a.master, nearest.tiles[n].master) for n, a in streamed.tiles.items())


def test_small_updates_survive_on_average():
    """A constant gradient on weights near 1 at lr 1e-4: each step moves a weight by ~1e-4, under half a bf16
    step (2^-8 = 3.9e-3 just below 1), so round-to-nearest never moves it; stochastic rounding moves it by the
    right amount on average (100 steps: ~1e-2; within 20%)."""
    n, steps = 4096, 100
    out = {}
    for rounding in ("nearest", "stochastic"):
        tile = allocate_tile(NAME, TileLayout([], n, 0), BF16, BF16, "fp32")
        tile.master.fill_(0.99)
        tile.exp_avg.zero_()
        tile.exp_avg_sq.zero_()
        tile.grad.fill_(1.0)
        opt = HostAdamW(TrainConfig(**{**CFG, "master_rounding": rounding}), kernel="torch")
        start = tile.master.float().clone()
        for _ in range(steps):
            opt.update(tile, 1e-4)
        out[rounding] = (start - tile.master.float()).mean().item()
    assert out["nearest"] == 0.0
    assert out["stochastic"] == pytest.approx(steps * 1e-4, rel=0.2), out


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_fp32_masters_store_the_update_as_it_is_whatever_the_rounding(kernel, moments):
    """stochastic is the default (docs/precision.md's SmolLM2 runs); on fp32 masters it changes no byte of any
    section, through either host kernel and every moment format (the resident update takes update_state, the torch
    path's own function)."""
    from pathlib import Path

    _cpp_or_skip(kernel)
    root = Path(__file__).resolve().parents[2]
    assert load_recipe(root / "recipes" / "tiny.yaml").train.master_rounding == "stochastic"
    n = 64 * 70 + 3
    start, out = torch.randn(n, generator=torch.Generator().manual_seed(0)), {}
    for rounding in ("nearest", "stochastic"):
        tile = allocate_tile(NAME, TileLayout([], n, 2048), BF16, torch.float32, moments)
        tile.master.copy_(start)
        for section in (tile.exp_avg, tile.exp_avg_sq, tile.exp_avg_exp, tile.exp_avg_sq_exp):
            section.zero_()  # allocate_tile leaves the state unwritten
        cfg = TrainConfig(**{**CFG, "master_weights": "fp32", "master_rounding": rounding, "optimizer_state": moments})
        opt = HostAdamW(cfg, kernel=kernel, defer_moments=False)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            tile.grad.copy_(torch.randn(n, generator=gen).to(BF16))
            opt.update(tile, 1e-3)
        out[rounding] = tile
    a, b = out["nearest"], out["stochastic"]
    for section in ("master", "exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp"):
        assert torch.equal(_bits(getattr(a, section)), _bits(getattr(b, section))), section
    assert not torch.equal(a.master, start)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_cuda_rounding_equals_the_host_kernel(moments):
    """The resident path's rounding on CUDA: for bf16 / int8 moments the whole update (state_adamw.update_state)
    against the C++ kernel, every byte; for fp32 moments (torch's fused CUDA AdamW computes the fp32 weight) the
    rounding of the same fp32 weights (state_adamw.store_master) against the host's."""
    from megatrain_cli.optim.state_adamw import StepConsts, store_master, update_state

    n, decay = 64 * 1000 + 37, 64 * 400 + 9
    if moments == "fp32":
        p = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 0.02
        host, dev = torch.empty(n, dtype=BF16), torch.empty(n, dtype=BF16, device="cuda")
        store_master(host, p, sr_key(7, NAME, 3, MASTER), 5)
        store_master(dev, p.cuda(), sr_key(7, NAME, 3, MASTER), 5)
        assert torch.equal(_bits(host), _bits(dev.cpu()))
        return
    _cpp_or_skip("cpp")
    host = make_tile(n, decay, moments)
    sections = ("master", "grad", "exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp")
    dev = {k: getattr(host, k).cuda() for k in sections}
    opt = HostAdamW(TrainConfig(**CFG, optimizer_state=moments), kernel="cpp")
    for step, g in enumerate(grads(n, 3, BF16), start=1):
        host.grad.copy_(g)
        dev["grad"].copy_(g)
        opt.update(host, 1e-3, 0.6)
        update_state(*(dev[k] for k in sections), moments=moments, decay_numel=decay,
                     k=StepConsts.make(step, 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.6), key_m=sr_key(7, NAME, step, 0),
                     key_v=sr_key(7, NAME, step, 1), origin=0, key_p=sr_key(7, NAME, step, MASTER))
    for k in sections:
        a, b = _bits(getattr(host, k)), _bits(dev[k].cpu())
        assert torch.equal(a, b), f"{k}: {(a != b).sum().item()} bytes differ"
