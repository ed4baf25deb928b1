"""Where a step's time goes, op by op, on the GPU: the engine's own probe (engine/layer_probe.py: every layer
resident, nothing streamed) against the real plan's step, and both against one bare HF layer.

    python scripts/profile_ops.py [RECIPE] [key=value ...] --model 7b --seq 4096 --batch 8 --steps 2 \
        [--kernels N] --out $OUT/ops.json

For the real step: a CUDA event after each op's launches (engine.on_op), so each op's figure is the device
time from the previous op's end, waits included (a streamed layer waiting for its weights, the backward
waiting for a gradient slab). Ops are grouped by kind and by resident / streamed. With --kernels N, one
more step runs under torch.profiler and the N kernels with the most device time are listed, beside the
same for the bare layer's forward + backward x layers. Costs: the probe's cut-model store, the full store,
one bench-sized step per --steps, and the profiler's overhead on its step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from megatrain_cli.bench.loop import BENCH_LR, synthetic_batch
from megatrain_cli.bench.runner import build, plan_bench
from megatrain_cli.bench.settings import bench_recipe, shorthands
from megatrain_cli.engine.layer_probe import OpClock, measure_layer
from megatrain_cli.engine.plan.probe import recipe_shape
from megatrain_cli.models.adapter import ModelAdapter


ACTIVITY = torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU


def grouped(durations, resident: set[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for op, took in durations:
        if op is None:
            key = "inputs"
        elif op.kind in ("forward", "recompute", "backward"):
            key = f"{op.kind} ({'resident' if op.tile in resident else 'streamed'})"
        else:
            key = op.kind
        out.setdefault(key, []).append(took)
    return out


def bare_layer(adapter, shape, reps: int = 3) -> dict:
    """One HF layer under plain autograd (the probe before session 8), for comparison."""
    from megatrain_cli.engine import kernel_patch

    dev, dtype = shape["device"], shape["dtype"]
    layer = adapter.make_layer_template(0).to_empty(device=dev)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
    layer = layer.to(dtype).train()
    if shape["kernels"] == "triton":
        kernel_patch.install_kernels(layer)
    b, t = shape["micro_batch_size"], shape["seq_len"]
    call = adapter.make_layer_inputs(dev)(torch.randn(b, t, adapter.hidden_size, device=dev, dtype=dtype),
                                          torch.arange(t, device=dev).expand(b, t))
    x, kw = call.hidden.detach(), call.kwargs[0]

    def first(o):
        return o[0] if isinstance(o, (tuple, list)) else o

    def fwd():
        with torch.no_grad():
            first(layer(x, **kw))

    def fb():
        xg = x.detach().requires_grad_()
        y = first(layer(xg, **kw))
        y.backward(torch.ones_like(y))

    def timed(fn):
        fn()
        ts = []
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    out = {"forward_s": timed(fwd), "forward_backward_s": timed(fb)}
    return out, layer, fb


def top_kernels(prof, n: int) -> list[tuple[str, float, int]]:
    rows = []
    for e in prof.key_averages():
        t = (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
             or getattr(e, "self_cpu_time_total", 0))
        if t > 0:
            rows.append((e.key[:90], t / 1e6, e.count))
    return sorted(rows, key=lambda r: -r[1])[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--seq")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--kernels", type=int, default=0, help="profile one more step: list the top N kernels")
    ap.add_argument("--out", required=True)
    args, words = ap.parse_known_args()
    r = bench_recipe(words, shorthand=shorthands(model=args.model, seq=args.seq, batch=args.batch))
    planned = plan_bench(r)
    adapter = ModelAdapter(planned.config)
    shape = recipe_shape(planned.r, planned.device, planned.plan)
    report: dict = {"recipe_overrides": words, "plan": planned.plan.path}
    report["engine_probe"] = vars(measure_layer(adapter, **shape))
    bare, layer, bare_fb = bare_layer(adapter, shape)
    report["bare_layer"] = bare
    print("engine probe:", json.dumps(report["engine_probe"]), "\nbare layer:", json.dumps(bare), flush=True)
    if args.kernels:
        with torch.profiler.profile(activities=[ACTIVITY]) as prof:
            for _ in range(adapter.num_layers):
                bare_fb()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        report["bare_kernels"] = top_kernels(prof, args.kernels)
    del layer, bare_fb
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    built = build(planned)
    engine = built.engine
    resident = {t for t in engine.store.layouts if t in engine.resident}
    clock = OpClock(engine)
    b, t, vocab = planned.r.train.micro_batch_size, planned.r.train.seq_len, adapter.vocab_size
    steps = []
    for s in range(1 + args.steps):
        mbs = [synthetic_batch(vocab, b, t, s * 97 + k) for k in range(planned.r.train.grad_accum)]
        clock.start()
        res = engine.step(mbs, BENCH_LR)
        groups = grouped(clock.durations(), resident)
        steps.append({k: {"n": len(v), "sum_s": sum(v), "median_s": statistics.median(v)} for k, v in groups.items()})
        print(f"step {s}: loss {res.loss:.4f} host phases {json.dumps({k: round(v, 3) for k, v in res.times.items()})}")
        for k, v in steps[-1].items():
            print(f"  {k:<24} n={v['n']:>3}  sum {v['sum_s']:.3f} s  median {v['median_s'] * 1e3:.2f} ms")
    report["steps"] = steps
    if args.kernels:
        mbs = [synthetic_batch(vocab, b, t, 999 + k) for k in range(planned.r.train.grad_accum)]
        with torch.profiler.profile(activities=[ACTIVITY]) as prof:
            engine.step(mbs, BENCH_LR)
            engine.synchronize(masters=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        report["engine_kernels"] = top_kernels(prof, args.kernels)
        for name in ("bare_kernels", "engine_kernels"):
            print(name)
            for k, s_, c in report[name]:
                print(f"  {s_:8.3f} s  x{c:<6} {k}")
    engine.close()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
