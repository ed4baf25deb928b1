"""Thread-count knobs of the engine's host threads (megatrain_cli/host_threads.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from megatrain_cli.machine import ADAMW_THREADS_ENV, PACKER_THREADS_ENV, limit_this_thread
from megatrain_cli.optim.host_adamw import HostAdamW
from megatrain_cli.optim.worker import OptimizerWorker
from megatrain_cli.recipe import TrainConfig
from tests.test_speculation import make_store


def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_the_limit_holds_in_its_thread_only(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv(PACKER_THREADS_ENV, "1")
    assert in_thread(lambda: (limit_this_thread(PACKER_THREADS_ENV), torch.get_num_threads())) == (1, 1)
    assert torch.get_num_threads() == before
    monkeypatch.delenv(PACKER_THREADS_ENV)
    assert in_thread(lambda: limit_this_thread(PACKER_THREADS_ENV)) is None
    monkeypatch.setenv(PACKER_THREADS_ENV, "many")
    with pytest.raises(ValueError, match=PACKER_THREADS_ENV):
        limit_this_thread(PACKER_THREADS_ENV)


class _Recording(HostAdamW):
    def update(self, tile, lr, clip=1.0):
        self.seen = torch.get_num_threads()
        tile.step += 1


def worker_threads_seen(monkeypatch, value: str):
    monkeypatch.setenv(ADAMW_THREADS_ENV, value)
    store = make_store()
    opt = _Recording(TrainConfig(lr=1e-3), kernel="torch")
    worker = OptimizerWorker(opt, store, forward_order=["embed", *store.layer_names, "head"], max_grad_norm=None,
                             speculate=False)
    worker.begin_step(1e-3)
    worker.landed("head", 1e-6)
    worker.resolve(1.0, finite=True)
    try:
        worker.wait("head")
    finally:
        worker._closed = True  # a failed worker cannot drain; let its thread end
        with worker._cv:
            worker._cv.notify_all()
    return opt.seen


def test_the_optimizer_worker_runs_with_its_limit(monkeypatch):
    assert worker_threads_seen(monkeypatch, "1") == 1


def test_a_bad_limit_fails_the_first_wait(monkeypatch):
    with pytest.raises(RuntimeError, match="host AdamW failed"):
        worker_threads_seen(monkeypatch, "0")
