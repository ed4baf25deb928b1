"""Micro-benchmark of host AdamW: HostAdamW's torch path vs the C++ kernel (optim/adamw_cpp.py).

Run:  python scripts/bench_host_adamw.py [--threads 16] [--numel 233000000] [--grad-dtype bf16] [--reps 5]

One tile the size of a Qwen2.5-7B decoder layer (233 M parameters; all but the norms and biases
weight-decayed), grads in the compute dtype (bf16 on GPU runs). Times, each the median of --reps
after one warm-up call, through HostAdamW as the engine calls it:
  update   update(tile, lr, clip=1)        torch: fused AdamW over 16M-element chunks widened
                                           through an fp32 scratch; cpp: one pass reading bf16
  correct  correct(tile, lr, clip=0.3)     torch: elementwise ops over 1M-element chunks; cpp: one pass
  weights  update_weights(tile, lr, 1)     cpp only: the weights of an update (deferred moments)
  moments  update_moments(tile, 1)         cpp only: its moments, the pass that runs later
  cast     staging.copy_(master)           the packer's fp32 -> bf16 cast into staging (6 B/param)
  emit     update_weights_span(..., staging)  cpp only: the update on read, weights + bf16 cast
                                           into staging in one pass (20 B/param), against weights + cast
  bf16 m,v / int8 m,v  update(tile, lr, 1) over a tile whose moments are bf16 / int8 (train.optimizer_state:
                                           adamw_state.cpp, one pass; 18 / 14 B/param with bf16 grads)
Staging is page-locked where CUDA is present (as the packer's), plain memory otherwise.
The torch and C++ calls alternate within each repetition. G params/s = numel / time; GB/s = the bytes one pass must move (fp32 master, m, v read and written,
grad read: 26 B/param with bf16 grads, 28 with fp32) / time, a floor on the traffic, the same for
both paths (the torch path moves more). The state drifts over the calls; that does not change the
work. The first compile of the C++ kernel (or its load from the cache) is reported, not timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from megatrain_cli.optim import adamw_cpp
from megatrain_cli.optim.host_adamw import HostAdamW
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.store.moments import moment_bytes_per_param, write_moments
from megatrain_cli.store.tiles import TileLayout, allocate_tile

NO_DECAY = 2 * 3584 + 3584 + 2 * 512  # a Qwen2.5-7B layer's norms and q/k/v biases


def make_tile(numel: int, grad_dtype: torch.dtype) -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    master = torch.empty(numel).normal_(0, 0.02, generator=g)
    tile = SimpleNamespace(layout=SimpleNamespace(decay_numel=max(0, numel - NO_DECAY)), numel=numel, step=0,
                           moments="fp32", master=master, exp_avg=torch.empty(numel).normal_(0, 1e-3, generator=g),
                           exp_avg_sq=torch.empty(numel).uniform_(1e-8, 1e-6, generator=g),
                           grad=torch.empty(numel).normal_(0, 1e-2, generator=g).to(grad_dtype))
    return tile


def timed(fns: list, reps: int) -> list[float]:
    """Median seconds of each fn; the fns alternate within each repetition, so that a noisy host
    (other jobs, frequency changes) weighs on all of them alike."""
    for fn in fns:
        fn()  # warm-up: page faults, OpenMP team start, scratch allocation
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--numel", type=int, default=233_000_000)
    ap.add_argument("--grad-dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    grad_dtype = torch.bfloat16 if args.grad_dtype == "bf16" else torch.float32
    bytes_per_param = 24 + grad_dtype.itemsize

    t0 = time.perf_counter()
    adamw_cpp.load()
    print(f"C++ kernel loaded in {time.perf_counter() - t0:.1f} s (compile or cache); "
          f"AVX2 path: {adamw_cpp.load().uses_avx2()}")
    print(f"threads {torch.get_num_threads()}, numel {args.numel:,}, grads {args.grad_dtype}, "
          f"median of {args.reps}, torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")

    tile = make_tile(args.numel, grad_dtype)
    cfg = TrainConfig(lr=1e-4, weight_decay=0.1, eps=1e-8)
    opts = {kernel: HostAdamW(cfg, kernel=kernel) for kernel in ("torch", "cpp")}
    rows = []
    for op in ("update", "correct"):
        if op == "update":
            fns = [lambda o=o: o.update(tile, 1e-4, 1.0) for o in opts.values()]
        else:
            fns = [lambda o=o: o.correct(tile, 1e-4, 0.3) for o in opts.values()]
        secs = timed(fns, args.reps)
        for kernel, s in zip(opts, secs):
            rows.append((op, kernel, s, args.numel / s / 1e9, args.numel * bytes_per_param / s / 1e9, secs[0] / s))
    # The deferred-moments split: bytes of each pass (grad read in its dtype, fp32 state), speed-up
    # against the torch update (the pass the next forward waited for before).
    split = HostAdamW(cfg, kernel="cpp", defer_moments=True)
    torch_update = rows[0][2]
    secs = timed([lambda: split.update_weights(tile, 1e-4, 1.0), lambda: split.update_moments(tile, 1.0)], args.reps)
    for op, s, nbytes in zip(("weights", "moments"), secs, (16 + grad_dtype.itemsize, 16 + grad_dtype.itemsize)):
        rows.append((op, "cpp", s, args.numel / s / 1e9, args.numel * nbytes / s / 1e9, torch_update / s))
    # The forward's work per tile after a clipped step: the worker's weights pass + the packer's cast,
    # against the update on read that does both in one pass (optim/worker.py).
    staging = torch.empty(args.numel, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
    secs = timed([lambda: staging.copy_(tile.master),
                  lambda: split.update_weights_span(tile, 1e-4, 1.0, 0, args.numel, staging)], args.reps)
    weights_s = rows[-2][2]
    for op, s, nbytes in zip(("cast", "emit"), secs, (6, 18 + grad_dtype.itemsize)):
        rows.append((op, "cpp" if op == "emit" else "torch", s, args.numel / s / 1e9, args.numel * nbytes / s / 1e9,
                     torch_update / s))
    # bf16 / int8 moments (train.optimizer_state): the one-pass update over a tile of the same size, its floor
    # of traffic read p, m, v, g + write p, m, v (adamw_state.cpp).
    for moments in ("bf16", "int8"):
        coded = allocate_tile("layers.0", TileLayout([], args.numel, max(0, args.numel - NO_DECAY)), grad_dtype,
                              torch.float32, moments)
        coded.master.copy_(tile.master)
        coded.grad.copy_(tile.grad)
        write_moments(coded, tile.exp_avg, tile.exp_avg_sq)
        opt = HostAdamW(TrainConfig(lr=1e-4, weight_decay=0.1, eps=1e-8, optimizer_state=moments), kernel="cpp")
        s = timed([lambda: opt.update(coded, 1e-4, 1.0)], args.reps)[0]
        nbytes = 8 + grad_dtype.itemsize + 2 * moment_bytes_per_param(moments)
        rows.append((f"{moments} m,v", "cpp", s, args.numel / s / 1e9, args.numel * nbytes / s / 1e9, torch_update / s))
        del coded
    print(f"weights pass + cast {weights_s + secs[0]:.3f} s, emit {secs[1]:.3f} s: "
          f"{(weights_s + secs[0]) / secs[1]:.2f}x for the update on read")
    print(f"\n| op      | path  | median s | G params/s | GB/s (floor) | speed-up |")
    print(f"|---------|-------|----------|------------|--------------|----------|")
    for op, kernel, s, gps, gbs, speedup in rows:
        print(f"| {op:<7} | {kernel:<5} | {s:8.3f} | {gps:10.2f} | {gbs:12.1f} | {speedup:7.2f}x |")


if __name__ == "__main__":
    main()
