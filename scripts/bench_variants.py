"""Several bench variants over ONE host store (a 7B store takes seconds to initialise and ~100 GiB:
building it once per variant wastes device time), then optionally the baselines.

    python scripts/bench_variants.py [RECIPE] [key=value ...] --model 7b --seq 4096 --batch 8 --steps 3 \
        --out $OUT/7b.json --variant default: --variant nospec:engine.speculate_optimizer=false \
        --variant keep0:engine.keep_activations=0 --native

Losses: variants share the store, and every variant draws the same batches (bench's seeds), so a later
variant re-runs batches an earlier one has trained on, and its losses start low and climb back (Adam's first
steps are nearly sign descent; docs/benchmarks.md, session 8, has what the H200 showed). The step times are
unaffected; compare losses only within a variant, or across separate invocations.

The base is `megatrain bench`'s: RECIPE (default recipes/bench.yaml), its key=value overrides and the same
shorthands (--model, --seq, --batch). A variant is NAME:key=value,key=value: recipe overrides on top of the
base (train.seq_len= and train.micro_batch_size= change the shape; the store does not depend on it; the
model.* keys must stay the base's, the store is shared), and optimizer=false to time forward + backward
alone. --native runs the all-on-GPU baseline after the
variants; --deepspeed the ZeRO-3 Offload one (the store freed first), in its watched child process: on a
host too small for it, the row says when and at what RSS it was killed. Prints one table at the end;
writes every result as JSON to --out, each variant's with the planner's prediction for the plan it ran
(`predicted`: the step and the probe's figures; bench/predicted.py), so a planner check is one call, e.g.
`--variant auto: --variant plan:` (the variant named `plan` takes the planner's choice, as `megatrain plan`
gives it, and its candidate table goes into the log and the JSON). --layers: the preset's layer shape,
that many layers (as `megatrain bench --layers`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict

import torch

from megatrain_cli.bench import predicted
from megatrain_cli.bench.result import format_table
from megatrain_cli.bench.runner import DoesNotFit, plan_bench, run_bench
from megatrain_cli.bench.settings import BenchRun, bench_model_config, bench_recipe, shorthands
from megatrain_cli.train.setup import build_store


def parse_variant(text: str) -> tuple[str, list[str], bool]:
    """NAME:key=value,... -> (name, recipe overrides, whether the optimizer runs)."""
    name, _, rest = text.partition(":")
    items = [item for item in rest.split(",") if item]
    optimizer = "optimizer=false" not in [item.lower() for item in items]
    return name, [item for item in items if not item.lower().startswith("optimizer=")], optimizer


def planner_choice(base, layers: int | None, out: dict) -> list[str]:
    """The overrides of the fastest candidate `megatrain plan` would choose for `base` (probing as it does),
    its table printed and kept in `out['plan']`."""
    from megatrain_cli.engine.plan.predict import choose, overrides
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.plan_cmd import table

    planned = plan_bench(base, layers, log=lambda _: None)
    probe = predicted.probe_for(planned, log=lambda m: print(m, flush=True))
    preds = choose(base, ModelAdapter(planned.config), planned.device, probe.machine, probe.layer)
    chosen = overrides(preds[0].candidate, base).split()
    text = table(preds[:12])
    print(f"planner's choice: {' '.join(chosen)}\n{text}", flush=True)
    out["plan"] = {"chosen": chosen, "table": text}
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="shorthand for model.preset")
    ap.add_argument("--seq", default=None, help="shorthand for train.seq_len (512k = 524288)")
    ap.add_argument("--batch", type=int, default=None, help="shorthand for train.micro_batch_size")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--layers", type=int, default=None, help="the preset's layer shape, this many layers")
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--deepspeed", action="store_true")
    ap.add_argument("--frame-dir", default=None)
    ap.add_argument("--out", required=True)
    args, words = ap.parse_known_args()
    short = shorthands(model=args.model, seq=args.seq, batch=args.batch)
    base = bench_recipe(words, shorthand=short)
    label = base.model.preset or "model"
    log = lambda m: print(m, flush=True)  # noqa: E731
    results, out = [], {}
    # Every variant's probe first (cached per shape; run_bench then reads it): the probe's own store and
    # device memory come and go before the shared store takes ~100 GiB of the host.
    variants = []
    for text in args.variant or ["default:"]:
        name, overrides, optimizer = parse_variant(text)
        if name == "plan":  # the measured planner's choice (`megatrain plan`) on top of the base
            overrides = [*overrides, *planner_choice(base, args.layers, out)]
        r = bench_recipe([*words, *overrides], shorthand=short)
        if r.model != base.model:
            print(f"variant {name}: model.* must stay the base's (the host store is shared)", flush=True)
            continue
        predicted.probe_for(plan_bench(r, args.layers, log=lambda _: None), log=log)
        variants.append((name, overrides, optimizer, r))
    t0 = time.perf_counter()
    store = build_store(base, bench_model_config(base, args.layers))
    print(f"store: {time.perf_counter() - t0:.1f} s", flush=True)
    for name, overrides, optimizer, r in variants:
        print(f"=== variant {name}: {overrides}", flush=True)
        frame = f"{args.frame_dir}/{label}-{name}.txt" if args.frame_dir else None
        try:
            res = run_bench(r, BenchRun(steps=args.steps, frame=frame, optimizer=optimizer, predict=True,
                                        layers=args.layers), store=store, log=log)
        except DoesNotFit as err:
            print(f"variant {name}: {err}", flush=True)
            continue
        except torch.cuda.OutOfMemoryError as err:
            print(f"variant {name}: CUDA out of memory: {str(err).splitlines()[0]}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        res.name = name
        results.append(res)
        out[name] = asdict(res)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    del store
    gc.collect()
    baselines = []
    if args.native:
        from megatrain_cli.bench.short import bench_native

        baselines.append(("native", lambda: bench_native(plan_bench(base, args.layers, log=lambda _: None),
                                                         BenchRun(steps=args.steps, layers=args.layers), log=log)))
    if args.deepspeed:
        from megatrain_cli.bench.deepspeed import bench_deepspeed

        t = base.train
        baselines.append(("deepspeed", lambda: bench_deepspeed(base.model.preset, t.micro_batch_size * t.grad_accum,
                                                               t.seq_len, args.steps, log=log)))
    for name, run in baselines:
        res = run()
        results.append(res)
        out[name] = asdict(res)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    print(format_table(results), flush=True)
    for res in results:
        print(f"{res.name}: split {res.split} | {res.notes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
