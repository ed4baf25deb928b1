"""Several `bench_engine` variants over ONE host store (the 7B store takes ~15 s to initialise and
~100 GiB: building it once per variant wastes device time), then optionally the native baseline.

    python scripts/bench_variants.py --model 7b --seq 4096 --batch 8 --steps 3 --out $OUT/7b.json \
        --variant default: --variant nospec:speculate=False --variant keep0:keep_activations=0 --native

A variant is NAME:key=value,key=value with bench_engine's keyword arguments (ints, floats, True/False,
None or strings), plus batch= and seq= to change the shape (the store does not depend on it) and
host_kernel=torch|cpp|auto, defer_moments=0|1, packer_threads=N and adamw_threads=N (environment settings
of the engine, VARIANT_ENV, for that variant only).
--deepspeed runs the ZeRO-3 Offload baseline after the variants (the store freed first), in its watched
child process: on a host too small for it, the row says when and at what RSS it was killed. Prints one table at the end; writes every result as JSON to --out.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import os
import sys
import time
from dataclasses import asdict

import torch

from megatrain_cli.bench import short as b
from megatrain_cli.machine import ADAMW_THREADS_ENV, PACKER_THREADS_ENV
from megatrain_cli.optim.host_adamw import DEFER_ENV, KERNEL_ENV

# variant keys that are environment settings of the engine, for that variant only
VARIANT_ENV = {"host_kernel": KERNEL_ENV, "defer_moments": DEFER_ENV, "packer_threads": PACKER_THREADS_ENV,
               "adamw_threads": ADAMW_THREADS_ENV}
from megatrain_cli.models.loader import build_store
from megatrain_cli.presets import PRESETS


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return name, kwargs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="7b")
    ap.add_argument("--seq", default="4096")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--deepspeed", action="store_true")
    ap.add_argument("--frame-dir", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    seq = b.parse_tokens(args.seq)
    p = PRESETS[args.model]
    config = p.hf_config(vocab_size=p.vocab_size or 1024, max_position_embeddings=max(seq, 4096))
    t0 = time.perf_counter()
    store = build_store(config, torch.bfloat16, seed=0)
    print(f"store: {time.perf_counter() - t0:.1f} s", flush=True)
    log = lambda m: print(m, flush=True)  # noqa: E731
    results, out = [], {}
    for text in args.variant or ["default:"]:
        name, kwargs = parse_variant(text)
        print(f"=== variant {name}: {kwargs}", flush=True)
        frame = f"{args.frame_dir}/{args.model}-{name}.txt" if args.frame_dir else None
        batch_v, seq_v = kwargs.pop("batch", args.batch), b.parse_tokens(kwargs.pop("seq", seq))
        env = {k: str(kwargs.pop(key)) for key, k in VARIANT_ENV.items() if key in kwargs}
        saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            r = b.bench_engine(args.model, batch_v, seq_v, args.steps, store=store, log=log, frame_path=frame,
                               **kwargs)
        except b.DoesNotFit as err:
            print(f"variant {name}: {err}", flush=True)
            continue
        except torch.cuda.OutOfMemoryError as err:
            print(f"variant {name}: CUDA out of memory: {str(err).splitlines()[0]}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        r.name = name
        results.append(r)
        out[name] = asdict(r)
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    del store
    gc.collect()
    baselines = []
    if args.native:
        baselines.append(("native", lambda: b.bench_native(args.model, args.batch, seq, args.steps, log=log)))
    if args.deepspeed:
        from megatrain_cli.bench.deepspeed import bench_deepspeed

        baselines.append(("deepspeed", lambda: bench_deepspeed(args.model, args.batch, seq, args.steps, log=log)))
    for name, run in baselines:
        r = run()
        results.append(r)
        out[name] = asdict(r)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    print(b.format_table(results), flush=True)
    for r in results:
        print(f"{r.name}: split {r.split} | {r.notes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
