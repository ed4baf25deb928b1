"""The C++ host AdamW kernel (optim/adamw_cpp.py) against the torch path of HostAdamW.

update: bit-identical to torch._fused_adamw_ (fp32 gradients) and to widening + torch._fused_adamw_
(bf16 gradients), weight decay on a leading range, several steps, clip coefficients 1 and 0.3,
sizes that are not multiples of the kernel's blocks or vector width.
correct: equal to the direct update with the clip coefficient, and to the torch path's
update(1) + correct, to fp32 rounding (the tolerances of tests/optim/test_speculation.py).
Skipped as a whole if the kernel cannot be compiled here (no compiler, no ninja)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatrain_cli.optim import adamw_cpp
from megatrain_cli.optim.host_adamw import HostAdamW
from megatrain_cli.recipe import TrainConfig

CFG = TrainConfig(lr=1e-3, weight_decay=0.1, eps=1e-6)
LR = 1e-3
# (numel, decay_numel): odd sizes around the vector width (8/16), the 1024-element units and the
# 64K-element grain of the kernel's threads; decay splits at odd offsets; all-decay and no-decay.
SIZES = [(1, 1), (17, 9), (1041, 1024), (3 * 65536 + 1037, 70001), (40000, 0), (4097, 4097)]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    try:
        return adamw_cpp.load()
    except RuntimeError as e:
        pytest.skip(f"C++ host kernel does not compile here: {e}")


def make_tile(numel: int, decay_numel: int, grad_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        layout=SimpleNamespace(decay_numel=decay_numel), numel=numel, step=0, moments="fp32", origin=0,
        master=torch.randn(numel, generator=g) * 0.02, exp_avg=torch.zeros(numel),
        exp_avg_sq=torch.zeros(numel), grad=torch.zeros(numel, dtype=grad_dtype))


def clone_tile(t):
    return SimpleNamespace(layout=t.layout, numel=t.numel, step=t.step, moments="fp32", origin=0, master=t.master.clone(),
                           exp_avg=t.exp_avg.clone(), exp_avg_sq=t.exp_avg_sq.clone(), grad=t.grad.clone())


def grads(numel: int, dtype: torch.dtype, steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(numel, generator=g) * 1e-2).to(dtype) for _ in range(steps)]


def assert_state_equal(a, b):
    assert a.step == b.step
    for name in ("master", "exp_avg", "exp_avg_sq"):
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x, y), f"{name}: {(x != y).sum().item()} of {x.numel()} differ"


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [1.0, 0.3])
@pytest.mark.parametrize("numel,decay_numel", SIZES)
def test_update_is_bit_identical_to_torch_fused_adamw(grad_dtype, clip, numel, decay_numel):
    ref = make_tile(numel, decay_numel, grad_dtype)
    cpp = clone_tile(ref)
    opt_torch, opt_cpp = HostAdamW(CFG, kernel="torch"), HostAdamW(CFG, kernel="cpp")
    assert opt_cpp.kernel == "cpp"
    for g in grads(numel, grad_dtype, steps=3):
        ref.grad.copy_(g)  # torch's kernel writes grad/scale back into an fp32 grad: fresh copies
        cpp.grad.copy_(g)
        opt_torch.update(ref, LR, clip)
        opt_cpp.update(cpp, LR, clip)
        assert torch.equal(cpp.grad, g), "the C++ update never writes the gradient"
        assert_state_equal(cpp, ref)


def test_update_matches_torch_called_directly_with_other_hyperparameters():
    # beta1 >= 0.5 takes the other branch of torch's lerp; lr, eps and decay vary too.
    n = 70001
    torch_t = make_tile(n, n, torch.float32, seed=3)
    cpp_t = clone_tile(torch_t)
    for step, (b1, b2, lr, eps, wd) in enumerate([(0.3, 0.95, 3e-4, 1e-8, 0.01), (0.3, 0.95, 1e-2, 1e-8, 0.0),
                                                  (0.9, 0.99, 2e-3, 1e-5, 0.5)], start=1):
        g = grads(n, torch.float32, 1, seed=step)[0]
        torch._fused_adamw_([torch_t.master], [g.clone()], [torch_t.exp_avg], [torch_t.exp_avg_sq], [],
                            [torch.tensor(float(step))], amsgrad=False, lr=lr, beta1=b1, beta2=b2,
                            weight_decay=wd, eps=eps, maximize=False, grad_scale=torch.tensor(1 / 0.7),
                            found_inf=None)
        adamw_cpp.update(cpp_t.master, g, cpp_t.exp_avg, cpp_t.exp_avg_sq, step=step, lr=lr, beta1=b1,
                            beta2=b2, eps=eps, weight_decay=wd, clip=0.7)
        cpp_t.step = torch_t.step = step
        assert_state_equal(cpp_t, torch_t)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel,decay_numel", [(17, 9), (3 * 65536 + 1037, 70001)])
def test_correct_gives_the_clipped_update_to_fp32_rounding(grad_dtype, numel, decay_numel):
    direct = make_tile(numel, decay_numel, grad_dtype)  # update(0.3)
    cpp, via_torch = clone_tile(direct), clone_tile(direct)  # update(1) + correct(0.3), C++ / torch
    opt_torch, opt_cpp = HostAdamW(CFG, kernel="torch"), HostAdamW(CFG, kernel="cpp")
    for g in grads(numel, grad_dtype, steps=2):  # two steps: moments and bias corrections not trivial
        for t in (direct, cpp, via_torch):
            t.grad.copy_(g)
        opt_cpp.update(direct, LR, 0.3)
        opt_cpp.update(cpp, LR, 1.0)
        opt_cpp.correct(cpp, LR, 0.3)
        opt_torch.update(via_torch, LR, 1.0)
        opt_torch.correct(via_torch, LR, 0.3)
        assert torch.equal(cpp.grad, g)
    for other in (direct, via_torch):
        assert cpp.step == other.step == 2
        # As tests/optim/test_speculation.py: about one ulp of a weight (|w| ~ 0.02), a few of m and v.
        torch.testing.assert_close(cpp.master, other.master, rtol=1e-6, atol=2e-9)
        torch.testing.assert_close(cpp.exp_avg, other.exp_avg, rtol=1e-5, atol=5e-10)
        torch.testing.assert_close(cpp.exp_avg_sq, other.exp_avg_sq, rtol=1e-5, atol=1e-14)
    if numel > 1000:  # on average the C++ correction lands on the direct update at least as closely
        assert (cpp.master - direct.master).abs().mean() <= (via_torch.master - direct.master).abs().mean()
        assert (cpp.master == direct.master).sum() >= (via_torch.master == direct.master).sum()


def test_correct_with_coefficient_one_changes_nothing():
    t = make_tile(1041, 1024, torch.bfloat16)
    t.grad.copy_(grads(1041, torch.bfloat16, 1)[0])
    opt = HostAdamW(CFG, kernel="cpp")
    opt.update(t, LR, 1.0)
    before = clone_tile(t)
    adamw_cpp.correct(t.master, t.grad, t.exp_avg, t.exp_avg_sq, step=t.step, lr=LR, beta1=0.9,
                         beta2=0.999, eps=1e-6, clip=1.0)
    assert_state_equal(t, before)


def test_kernel_choice():
    assert HostAdamW(CFG).kernel == "cpp"  # the default ('auto'): it compiles here
    assert HostAdamW(CFG, kernel="cpp").kernel == "cpp"
    assert HostAdamW(CFG, kernel="auto").kernel == "cpp"
    assert HostAdamW(CFG, kernel="torch").kernel == "torch"
    with pytest.raises(ValueError):
        HostAdamW(CFG, kernel="fast")


def test_speculative_engine_with_the_cpp_kernel_matches_the_torch_path():
    # The optimizer worker thread runs the kernel (its OpenMP team starts from a non-main thread);
    # a clipped step: speculated tiles are corrected by adamw_correct.
    from tests.optim.test_speculation import train

    _, probe = train(1e9, overlap=False, steps=1)
    max_norm = probe[0].grad_norm * 0.999
    plain, plain_res = train(max_norm, overlap=False, steps=1)
    spec, spec_res = train(max_norm, overlap=True, steps=1, host_adamw="cpp")
    assert spec_res[0].speculation["corrected"] >= 1
    assert spec_res[0].losses == plain_res[0].losses
    for name, tile in plain.tiles.items():
        torch.testing.assert_close(spec.tiles[name].master, tile.master, rtol=1e-6, atol=2e-9)
        torch.testing.assert_close(spec.tiles[name].exp_avg, tile.exp_avg, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(spec.tiles[name].exp_avg_sq, tile.exp_avg_sq, rtol=1e-5, atol=1e-12)


def test_the_kernel_releases_the_gil():
    # The optimizer worker runs it beside the training thread, which must keep going meanwhile.
    import sys
    import threading
    import time

    n = 1 << 23
    t = make_tile(n, n, torch.bfloat16)
    span, started = [], threading.Event()

    def work():
        started.set()
        for _ in range(3):
            t0 = time.perf_counter()
            adamw_cpp.correct(t.master, t.grad, t.exp_avg, t.exp_avg_sq, step=1, lr=LR, beta1=0.9,
                                 beta2=0.999, eps=1e-6, clip=0.5)
            span.append((t0, time.perf_counter()))  # Python ticks only inside a call: GIL released

    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)  # leave a core to this thread
    sys.setswitchinterval(10.0)  # no forced GIL hand-overs: this thread runs only when the worker lets go
    try:
        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        ticks = []
        while worker.is_alive():
            ticks.append(time.perf_counter())
            time.sleep(0.001)
        worker.join()
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)
    assert any(a < x < b for a, b in span for x in ticks), "no Python ran while the kernel did"


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [1.0, 0.3])
@pytest.mark.parametrize("numel,decay_numel", SIZES)
def test_weights_then_moments_is_bit_identical_to_the_update(grad_dtype, clip, numel, decay_numel):
    whole, split = HostAdamW(CFG, kernel="cpp", defer_moments=False), HostAdamW(CFG, kernel="cpp", defer_moments=True)
    a = make_tile(numel, decay_numel, grad_dtype)
    b = clone_tile(a)
    for g in grads(numel, grad_dtype, 3):
        a.grad.copy_(g)
        b.grad.copy_(g)
        whole.update(a, LR, clip)
        moments = b.exp_avg.clone(), b.exp_avg_sq.clone()
        split.update_weights(b, LR, clip)
        assert torch.equal(b.exp_avg, moments[0]) and torch.equal(b.exp_avg_sq, moments[1])  # not yet
        assert torch.equal(b.master, a.master)  # the weights are final after the first pass
        split.update_moments(b, clip)
        assert_state_equal(a, b)


def test_the_engine_passes_its_choices_to_host_adamw():
    from megatrain_cli.models.loader import build_store
    from tests.engines import make_engine
    from tests.reference import tiny_config

    store = build_store(tiny_config("Qwen2ForCausalLM", layers=2), torch.float32, seed=0)
    engine = make_engine(store, CFG, device="cpu", checkpoint_interval=1, host_adamw="torch", overlap_optimizer=True)
    try:
        assert engine.optimizer.kernel == "torch" and not engine.optimizer.defer_moments
    finally:
        engine.close()
    engine = make_engine(store, CFG, device="cpu", checkpoint_interval=1, defer_moments=False,
                         overlap_optimizer=True)
    try:
        assert engine.optimizer.kernel == "cpp" and not engine.optimizer.defer_moments  # 'auto': it compiles here
    finally:
        engine.close()


def test_defer_moments_choice():
    assert HostAdamW(CFG, kernel="cpp").defer_moments
    assert not HostAdamW(CFG, kernel="torch").defer_moments  # the torch path has no split passes
    assert not HostAdamW(CFG, kernel="cpp", defer_moments=False).defer_moments
    with pytest.raises(RuntimeError):
        HostAdamW(CFG, kernel="torch").update_weights(make_tile(8, 8, torch.float32), LR)


@pytest.mark.parametrize("speculate", [False, True])
def test_engine_with_deferred_moments_is_bit_identical(speculate):
    # Clipped steps defer every update (no speculation after a clipped step), so the moments of step t
    # are written while step t+1 runs, and its gradients land only after them (updates.wait_state).
    from tests.optim.test_speculation import train

    _, probe = train(1e9, overlap=False, steps=1, host_adamw="cpp")
    max_norm = probe[0].grad_norm * 0.5  # every step clipped
    whole, whole_res = train(max_norm, overlap=True, speculate=speculate, steps=4, host_adamw="cpp",
                             defer_moments=False)
    split, split_res = train(max_norm, overlap=True, speculate=speculate, steps=4, host_adamw="cpp",
                             defer_moments=True)
    assert [r.losses for r in split_res] == [r.losses for r in whole_res]
    assert [r.grad_norm for r in split_res] == [r.grad_norm for r in whole_res]
    for name, tile in whole.tiles.items():
        other = split.tiles[name]
        assert other.step == tile.step
        for section in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(other, section), getattr(tile, section)), (name, section)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [1.0, 0.3])
@pytest.mark.parametrize("numel,decay_numel", SIZES)
def test_weights_in_pieces_with_their_bf16_cast_equal_the_weights_pass(grad_dtype, clip, numel, decay_numel):
    """update_weights_span over a tile in uneven pieces (across the decay split and into the sections'
    scalar tails) stores the weights update_weights stores, and their bf16 cast as torch casts them."""
    opt = HostAdamW(CFG, kernel="cpp", defer_moments=True)
    a = make_tile(numel, decay_numel, grad_dtype)
    b = clone_tile(a)
    for s, g in enumerate(grads(numel, grad_dtype, 3)):
        a.grad.copy_(g)
        b.grad.copy_(g)
        opt.update_weights(a, LR, clip)
        out = torch.full((numel,), float("nan"), dtype=torch.bfloat16)
        cuts = sorted({0, numel, *(int(x) for x in torch.randint(0, numel + 1, (3,), generator=torch.Generator().manual_seed(s)))})
        for lo, hi in zip(cuts, cuts[1:]):
            opt.update_weights_span(b, LR, clip, lo, hi, out[lo:hi])
        opt.count_step(b)
        assert_state_equal(a, b)
        assert torch.equal(out.view(torch.int16), a.master.to(torch.bfloat16).view(torch.int16))
        opt.update_moments(a, clip)
        opt.update_moments(b, clip)


def test_the_bf16_cast_rounds_ties_to_even_as_torch():
    """Weights that land exactly between two bf16 values, the largest finite floats, infinities and quiet
    NaNs: the emitted cast is torch's, bit for bit (in vector lanes and in the scalar tail)."""
    opt = HostAdamW(TrainConfig(lr=0.0, weight_decay=0.0, eps=1e-6), kernel="cpp", defer_moments=True)
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x80018000,
                         0x3F800001, 0x7F800000, 0x00000001, 0x4049_0FDB, 0xBF7F_8000, 0x3F80_7FFF, 0x7FC00000,
                         0xFFC00001, 0xFF800000, 0x7FC12345], dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)
    numel = values.numel()
    tile = make_tile(numel, 0, torch.float32)
    tile.master.copy_(values)
    out = torch.empty(numel, dtype=torch.bfloat16)
    opt.update_weights_span(tile, 0.0, 1.0, 0, numel, out)  # lr 0: the weights stay as they are
    assert torch.equal(tile.master.view(torch.int32), values.view(torch.int32))
    assert torch.equal(out.view(torch.int16), values.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("speculate,tied", [(False, False), (True, False), (False, True)])
def test_updates_applied_on_read_are_bit_identical(speculate, tied):
    """Update on read (optim/worker.py): with bf16 compute the streamer claims each clipped step's deferred
    weight update and applies it as it casts the tile for the next forward; losses, norms and the whole
    state equal the worker's own weights pass + cast bit for bit, and the claims did happen."""
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.optim.host_adamw import lr_at
    from tests.engines import make_engine
    from tests.reference import random_batches, tiny_config

    config = tiny_config("Qwen2ForCausalLM", layers=4, tied=tied)
    cfg = TrainConfig(steps=4, lr=1e-3, weight_decay=0.1, max_grad_norm=1e-3, warmup_steps=1, grad_accum=2, eps=1e-6)
    batches = random_batches(config.vocab_size, 4, 2, batch=2, seq=16, seed=5)
    runs = []
    for on_read in (False, True):
        store = build_store(config, torch.bfloat16, seed=3)
        engine = make_engine(store, cfg, device="cpu", checkpoint_interval=2, loss_chunk_tokens=7,
                             overlap_optimizer=True, speculate_optimizer=speculate, host_adamw="cpp",
                             defer_moments=True, update_on_read=on_read)
        assert engine.update_on_read == on_read
        claimed = []
        if on_read:
            claim = engine.worker.claim  # what the streamer calls (engine/transfer/updates.py)

            def counted(tile, claim=claim):
                update = claim(tile)
                if update is not None:
                    claimed.append(tile)
                return update

            engine.worker.claim = counted
        results = [engine.step(mbs, lr_at(s, cfg, 4)) for s, mbs in enumerate(batches)]
        engine.close()
        runs.append(([r.losses for r in results], [r.grad_norm for r in results], store, claimed))
    (loss0, norm0, store0, _), (loss1, norm1, store1, claimed) = runs
    assert loss1 == loss0 and norm1 == norm0
    assert {"layers.0", "layers.3", "head"} <= set(claimed)  # the streamer applied them
    assert "embed" not in claimed  # read on the host first (its rows), so the worker updates it
    for name, tile in store0.tiles.items():
        other = store1.tiles[name]
        assert other.step == tile.step, name
        for section in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(other, section), getattr(tile, section)), (name, section)


def test_a_claim_waiting_for_the_verdict_gives_way_to_a_wait_that_released_the_update():
    """worker.claim blocks for the step's verdict; if a wait() hands the held update to the worker thread
    meanwhile, the claim returns None (the caller then waits as usual) instead of taking it twice."""
    import threading

    from megatrain_cli.optim.worker import OptimizerWorker
    from tests.optim.test_speculation import make_store

    store = make_store()
    opt = HostAdamW(CFG, kernel="cpp", defer_moments=True)
    worker = OptimizerWorker(opt, store, forward_order=["embed", *store.layer_names, "head"], max_grad_norm=1e-9)
    worker.update_on_read = frozenset(["layers.1"])
    tile = store.tiles["layers.1"]
    tile.grad.normal_(0, 1e-2)
    before = tile.master.clone()
    worker.begin_step(LR)
    worker.landed("layers.1", 1.0)  # clipped for sure (norm 1 > 1e-9): held for the reader
    got = []
    claimer = threading.Thread(target=lambda: got.append(worker.claim("layers.1")))
    claimer.start()
    claimer.join(0.2)
    assert claimer.is_alive()  # no verdict yet
    waiter = threading.Thread(target=worker.wait, args=("layers.1",))
    waiter.start()  # releases the held update to the worker thread (which still needs the verdict)
    worker.resolve(1e-9 / (1.0 + 1e-6), finite=True)
    claimer.join(5)
    waiter.join(5)
    assert not claimer.is_alive() and not waiter.is_alive()
    assert got == [None]
    worker.drain()
    assert tile.step == 1 and not torch.equal(tile.master, before)  # updated once, by the worker
    worker.close()
