"""The disk tier (store.disk, store/disk.py) under the engine on the CPU: a run whose moments (and masters) live
in per-layer files equals the run in memory, every byte of every tile; the tier holds no more than its
read-ahead once a step's writes are behind it; its files vanish from the folder as soon as they are mapped; the
engine turns speculation and deferred moments off for it; checkpoints are the same files; and the planner puts
the chosen state on disk, picks it itself ('auto') when the host is short, and prices the disk's time."""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.store.disk import DiskTier
from tests.engines import make_engine
from tests.reference import random_batches, tiny_config

STEPS, ACCUM = 3, 2
SECTIONS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp")


def _train(tmp_path, state: str | None, moments: str = "fp32", master=torch.float32, **engine):
    config = tiny_config("LlamaForCausalLM", layers=4)
    tier = DiskTier(tmp_path, state, in_flight=2) if state else None
    dtype = torch.bfloat16 if master == torch.bfloat16 else torch.float32
    store = build_store(config, dtype, seed=3, master_dtype=master, moments=moments, tier=tier)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, grad_accum=ACCUM,
                      eps=1e-6, optimizer_state=moments, master_weights="bf16" if master == torch.bfloat16 else "fp32",
                      master_rounding="stochastic" if master == torch.bfloat16 else "nearest")
    batches = random_batches(config.vocab_size, STEPS, ACCUM, batch=2, seq=16, seed=5)
    eng = make_engine(store, cfg, device="cpu", checkpoint_interval=2, loss_chunk_tokens=7, kernels="torch", **engine)
    held = []
    for s, mbs in enumerate(batches):
        eng.step(mbs, lr_at(s, cfg, STEPS))
        if tier is not None:
            eng.synchronize(masters=False)  # the optimizer thread's updates of the step done (it runs them late)
            tier.drain()  # the step's writes behind it: what is left in memory is the next step's read-ahead
            held.append(tier.resident_bytes())
    eng.close()
    return store, tier, held


def _same(a, b) -> None:
    for name, x in a.tiles.items():
        y = b.tiles[name]
        assert x.step == y.step
        for section in SECTIONS:
            p, q = getattr(x, section).view(torch.uint8), getattr(y, section).view(torch.uint8)
            assert torch.equal(p, q), f"{name}.{section}: {(p != q).sum().item()} bytes differ"


@pytest.mark.parametrize("state,moments,master", [("moments", "fp32", torch.float32),
                                                  ("moments+masters", "int8", torch.bfloat16),
                                                  ("moments", "bf16", torch.float32)])
def test_a_tiered_run_equals_the_run_in_memory(tmp_path, state, moments, master):
    plain, _, _ = _train(tmp_path, None, moments, master)
    tiered, tier, held = _train(tmp_path, state, moments, master)
    _same(plain, tiered)
    assert list(tmp_path.iterdir()) == []  # the files were unlinked once mapped, their folder removed
    largest = max(t.disk_bytes for t in tiered.tiles.values())
    assert len(held) == STEPS and all(h <= 2 * largest for h in held), (held, largest)  # in_flight = 2 tiles
    assert tier.written_bytes >= STEPS * sum(t.disk_bytes for n, t in tiered.tiles.items())
    on_disk = ("master",) if state == "moments+masters" else ()
    for t in tiered.tiles.values():  # the masters' bytes moved with the moments, or stayed in memory
        assert t.disk_bytes > 0
        assert t.master.data_ptr() - t.buffer.data_ptr() not in range(t.nbytes) if on_disk else \
            t.master.data_ptr() - t.buffer.data_ptr() in range(t.nbytes)
    tiered.close()


def test_resident_layers_and_the_worker_beside_the_tier(tmp_path):
    """Resident layers (their host tiles in the tier, copied in and home) and the optimizer thread, which
    speculates without a tier and must not with one: the same bytes as the run in memory."""
    plain, _, _ = _train(tmp_path, None, resident_layers=1, overlap_optimizer=True)
    tiered, _, _ = _train(tmp_path, "moments", resident_layers=1, overlap_optimizer=True)
    _same(plain, tiered)
    config = tiny_config("LlamaForCausalLM", layers=2)
    store = build_store(config, torch.float32, tier=DiskTier(tmp_path, "moments"))
    eng = make_engine(store, TrainConfig(steps=1), device="cpu", overlap_optimizer=True, kernels="torch")
    assert not eng.worker.speculate and not eng.optimizer.defer_moments
    eng.close()
    store.close()


def test_checkpoints_of_a_tiered_store_are_the_same_files_and_load_either_way(tmp_path):
    from megatrain_cli.checkpoint import load_checkpoint, save_checkpoint
    from tests.train.test_faults import assert_same_checkpoint

    plain, _, _ = _train(tmp_path, None)
    (tmp_path / "b").mkdir()
    tiered, tier, _ = _train(tmp_path / "b", "moments+masters")
    a = save_checkpoint(plain, tmp_path / "ck_plain", STEPS, {"step": STEPS})
    b = save_checkpoint(tiered, tmp_path / "ck_tier", STEPS, {"step": STEPS})
    assert_same_checkpoint(a, b)
    assert tier.resident_bytes() == 0  # saving read every tile; each went out of memory after it
    config = tiny_config("LlamaForCausalLM", layers=4)
    (tmp_path / "c").mkdir()
    into_tier = build_store(config, torch.float32, seed=9, tier=DiskTier(tmp_path / "c", "moments"))
    load_checkpoint(into_tier, a)
    into_memory = build_store(config, torch.float32, seed=9)
    load_checkpoint(into_memory, b)
    assert into_tier.tier.resident_bytes() == 0  # each tile written back as soon as it was read in
    _same(plain, into_tier)
    _same(plain, into_memory)


def test_a_full_disk_is_said_when_the_store_is_built(tmp_path, monkeypatch):
    from megatrain_cli.store import disk

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk.os, "posix_fallocate", full)
    with pytest.raises(disk.TierError, match=rf"store\.disk: {tmp_path} has .* GiB free, too little for the optimizer "
                                             r"state store\.disk_state=moments puts there \(No space left on device\); "
                                             r"free space there or point store\.disk at a larger disk"):
        build_store(tiny_config("LlamaForCausalLM", layers=2), torch.float32, tier=DiskTier(tmp_path, "moments"))


def test_zeroing_the_state_keeps_masters_that_live_beside_the_moments_on_disk(tmp_path):
    """store.disk_state=moments+masters: a tile's file holds its masters too. zero_state zeroes the moments (and
    the gradient) only, whether the file was written back already (a step, a checkpoint's load) or is still
    fresh (only its masters written, as a store's build writes them)."""
    config = tiny_config("LlamaForCausalLM", layers=2)
    store = build_store(config, torch.float32, seed=3, tier=DiskTier(tmp_path, "moments+masters"))
    masters = {n: t.master.clone() for n, t in store.tiles.items()}
    for name in ("embed", "layers.0"):
        t = store.tiles[name]
        t.exp_avg.fill_(0.5)
        t.exp_avg_sq.fill_(0.25)
        t.grad.fill_(1.0)
        t.step = 4
        store.settle(name)  # written back to its file, out of memory: no longer a fresh file
    store.zero_state()
    for name, t in store.tiles.items():
        assert torch.equal(t.master, masters[name]), name
        assert not t.exp_avg.any() and not t.exp_avg_sq.any() and not t.grad.any(), name
        assert t.step == 0
    store.close()


def test_the_folder_probe_leaves_no_file_even_while_it_runs(tmp_path, monkeypatch):
    """The probe's file is unlinked as soon as it is made, so a run killed mid-probe leaves nothing in store.disk;
    the rates count whole 8 MiB blocks, the bytes the probe really wrote and read."""
    from megatrain_cli.store import disk

    seen, written = [], []
    pwrite = disk.os.pwrite
    monkeypatch.setattr(disk.os, "pwrite", lambda fd, data, off: seen.append(list(tmp_path.iterdir())) or
                        written.append(len(data)) or pwrite(fd, data, off))
    write, read = disk.measure(tmp_path, nbytes=(20 << 20) + 123)
    assert write > 0 and read > 0
    assert seen == [[], []] and sum(written) == 16 << 20  # two whole blocks, no file visible while writing
    assert list(tmp_path.iterdir()) == []
