"""Thread counts of the engine's host threads: machine.limit_this_thread and OptimizerWorker(threads=...)."""

from __future__ import annotations

import threading

import pytest
import torch

from megatrain_cli.machine import limit_this_thread
from megatrain_cli.optim.host_adamw import HostAdamW
from megatrain_cli.optim.worker import OptimizerWorker
from megatrain_cli.recipe import TrainConfig
from tests.optim.test_speculation import make_store


def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_the_limit_holds_in_its_thread_only():
    before = torch.get_num_threads()
    assert in_thread(lambda: (limit_this_thread(1), torch.get_num_threads())) == (None, 1)
    assert torch.get_num_threads() == before
    fresh = in_thread(torch.get_num_threads)  # what a new thread starts with
    assert in_thread(lambda: (limit_this_thread(None), torch.get_num_threads())) == (None, fresh)  # None: kept


@pytest.mark.parametrize("bad", [0, -1])
def test_a_bad_limit_raises_naming_it(bad):
    def attempt():
        with pytest.raises(ValueError, match=f"got {bad}"):
            limit_this_thread(bad)
        return torch.get_num_threads()

    assert in_thread(attempt) == in_thread(torch.get_num_threads)  # and changes nothing


class _Recording(HostAdamW):
    def update(self, tile, lr, clip=1.0):
        self.seen = torch.get_num_threads()
        tile.step += 1


def worker_threads_seen(threads: int | None):
    store = make_store()
    opt = _Recording(TrainConfig(lr=1e-3), kernel="torch")
    worker = OptimizerWorker(opt, store, forward_order=["embed", *store.layer_names, "head"], max_grad_norm=None,
                             speculate=False, threads=threads)
    worker.begin_step(1e-3)
    worker.landed("head", 1e-6)
    worker.resolve(1.0, finite=True)
    try:
        worker.wait("head")
    finally:
        worker.close()
    return opt.seen


def test_the_optimizer_worker_runs_with_its_limit():
    assert worker_threads_seen(1) == 1


def test_the_optimizer_worker_without_a_limit_keeps_the_default():
    assert worker_threads_seen(None) == in_thread(torch.get_num_threads)


@pytest.mark.parametrize("bad", [0, -1])
def test_a_bad_worker_limit_raises_naming_it(bad):
    with pytest.raises(ValueError, match=f"threads must be >= 1.*got {bad}"):
        worker_threads_seen(bad)
