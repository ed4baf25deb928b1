"""Where a decode token step's time goes on the GPU: a preset-shaped model with --layers decoder layers, all on the
device (as a trainer holding them resident), --batch rows after a --prompt-token prefill. Prints the wall time per
token step of the CUDA-graph decode and of the eager one, the GPU's busy time per eager step and its kernels by
GPU time (torch.profiler), so a step's cost splits into host and device and the device's into its kernels.

Usage: python scripts/profile_decode.py [--preset 7b] [--layers 4] [--batch 64] [--prompt 256] [--new 64]
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch


def main() -> None:
    from megatrain_cli.bench.runner import build, plan_bench
    from megatrain_cli.bench.settings import bench_recipe
    from megatrain_cli.eval import streamed
    from megatrain_cli.eval.generate import greedy
    from megatrain_cli.train.rollout import TrainerLayerFeed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="7b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no graph, no kernels)")
    a = p.parse_args()
    cuda = torch.device(a.device)
    if cuda.type == "cpu":
        torch.cuda.synchronize = lambda: None
    # The trainer's own engine and feed: the planner keeps the few layers resident on a GPU, as GRPO reads them.
    r = bench_recipe([f"model.preset={a.preset}", f"engine.device={a.device}", "logging.dashboard=off"])
    built = build(plan_bench(r, a.layers, log=lambda *_: None), log=lambda *_: None)
    feed = TrainerLayerFeed(built.engine, cuda)
    model = streamed.StreamedModel(built.store, cuda, feed=feed, head=feed.head())
    config = built.store.adapter.config
    ids = torch.randint(1, config.vocab_size, (a.batch, a.prompt))
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=a.new, eos_ids=[], pad_id=0, stop_criteria=[], pick=greedy)

    def timed(label):
        with torch.inference_mode():
            model.decode_batch(ids, mask, **{**kw, "max_new_tokens": 1})  # the prefill alone
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.decode_batch(ids, mask, **{**kw, "max_new_tokens": 1})
            torch.cuda.synchronize()
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.decode_batch(ids, mask, **kw)
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
        step = (total - prefill) / (a.new - 1)
        print(f"{label}: prefill {prefill * 1e3:.1f} ms, token step {step * 1e3:.2f} ms "
              f"({step / a.layers * 1e3:.3f} ms a layer; path {model.decode_path})", flush=True)
        return step

    global RUN
    RUN = (model, ids, mask, kw)
    stepwise(model, ids, mask, kw, "graph")
    graph = timed("graph")
    with mock.patch.object(streamed, "why_not_graph", lambda m: "forced"):
        eager = timed("eager")
        by_op = [profiled(n) for n in (1, 9)]  # the prefill alone, then with 8 token steps: the difference / 8
    per_step = {k: (by_op[1].get(k, 0.0) - by_op[0].get(k, 0.0)) / 8 for k in by_op[1]}
    busy = sum(per_step.values())
    print(f"eager token step: GPU busy {busy:.2f} ms of {eager * 1e3:.2f} ms wall ({a.layers} layers, batch {a.batch}); "
          f"by op (ms a step):")
    for name, ms in sorted(per_step.items(), key=lambda kv: -kv[1])[:22]:
        print(f"  {ms:8.3f}  {name[:110]}")
    print(f"graph / eager token step: {eager / graph:.2f}x")


def stepwise(model, ids, mask, kw, label: str) -> None:
    """Each token step's wall time, and how much of it the host waited for the GPU (a sync before the pick):
    a step = host work (its launches, the ids' read, the stop rules, the next inputs) + the GPU's wait."""
    stamps = []

    def pick(logits):
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        stamps.append((t0, time.perf_counter()))
        return kw["pick"](logits)

    for _ in range(2):  # the second call's figures: shapes seen, kernels compiled
        stamps.clear()
        with torch.inference_mode():
            model.decode_batch(ids, mask, **{**kw, "pick": pick})
        torch.cuda.synchronize()
    walls = [b[1] - a[1] for a, b in zip(stamps, stamps[1:])]
    waits = [b[1] - b[0] for b in stamps[1:]]
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    print(f"{label}: token step median {med(walls):.2f} ms, of it waiting for the GPU {med(waits):.2f} ms; "
          f"first steps {[round(w * 1e3, 1) for w in walls[:4]]} ms; path {model.decode_path}", flush=True)


def profiled(n: int) -> dict[str, float]:
    """GPU ms by kernel name over one decode_batch of n new tokens (set up by main through globals)."""
    from torch.profiler import ProfilerActivity, profile

    model, ids, mask, kw = RUN
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        model.decode_batch(ids, mask, **{**kw, "max_new_tokens": n})
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages() if e.self_device_time_total > 0 or not torch.cuda.is_available()}


RUN: tuple = ()


if __name__ == "__main__":
    main()
