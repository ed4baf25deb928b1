"""GRPO's bench steps (bench/grpo.measure: rollouts of the recipe's shape, then the training step) with the rollouts
decoded both ways, in one process over one engine and its weights: eager token steps (every layer launched from
Python, StreamedModel's loop) and the CUDA-graph replay (eval/static_decode.py), which training picks when every
layer is resident. The baseline of the graph's row in docs/benchmarks.md.

Usage: python scripts/decode_paths.py [RECIPE] [KEY=VALUE ...]   (default recipes/grpo-7b.yaml; --steps N timed
steps per path after one warm-up, default 2). Prints each path's rows and one summary line per path.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from unittest import mock

from megatrain_cli.bench.grpo import measure
from megatrain_cli.bench.runner import build, plan_bench
from megatrain_cli.bench.settings import BenchRun, bench_recipe
from megatrain_cli.eval import streamed
from megatrain_cli.methods import make_method


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("words", nargs="*", help="RECIPE and key=value overrides, as for megatrain bench")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--breakdown", action="store_true",
                        help="the graph path alone, each token step split: the GPU's wait, the sampler, the rest")
    a = parser.parse_args()
    words = a.words if a.words and a.words[0].endswith(".yaml") else ["recipes/grpo-7b.yaml", *a.words]
    r = bench_recipe(words)
    planned = plan_bench(r)
    if planned.problems:
        print("does not fit:\n  " + "\n  ".join(planned.problems), file=sys.stderr)
        return 2
    built = build(planned, method=make_method("grpo", grpo=r.grpo))
    run = BenchRun(steps=a.steps, warmup=1)
    try:
        if a.breakdown:
            return breakdown(planned, built, run)
        summary = {}
        for path in ("graph", "eager"):
            if path == "eager":  # the loop every rollout ran before the graph: forced, for the comparison
                with mock.patch.object(streamed, "why_not_graph", lambda model: "forced for the comparison"):
                    rows = measure(planned, built.store, built.engine, run)
            else:
                rows = measure(planned, built.store, built.engine, run)
            for row in rows:
                print(json.dumps({"path": path, **asdict(row)}), flush=True)
            roll = rows[0]
            summary[path] = roll.tokens_per_s
            print(f"[decode_paths] {path}: rollout {roll.tokens_per_s:,.0f} generated tok/s "
                  f"({roll.batch} rows x {roll.seq} new tokens in {roll.step_time_s:.2f} s, "
                  f"{roll.step_time_s / roll.seq * 1e3:.1f} ms a token step); {roll.notes}", flush=True)
        print(f"[decode_paths] graph / eager: {summary['graph'] / summary['eager']:.2f}x", flush=True)
    finally:
        built.engine.close()
    return 0


def breakdown(planned, built, run) -> int:
    """GRPO bench steps with every sampler call timed: the host syncs first (what it then waited is the GPU's
    work still queued), then samples (its own kernels and syncs); the rest of a step is host work."""
    import time

    import torch

    from megatrain_cli.eval.generate import Sampler

    stamps, original = [], Sampler.__call__

    def timed(self, logits):
        t0 = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        ids = original(self, logits)
        stamps.append((t0, t1, time.perf_counter()))
        return ids

    with mock.patch.object(Sampler, "__call__", timed):
        rows = measure(planned, built.store, built.engine, run)
    last = stamps[-rows[0].seq:]  # the last rollout's token steps
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    walls = [b[1] - a[1] for a, b in zip(last, last[1:])]
    waits = [s[1] - s[0] for s in last[1:]]
    picks = [s[2] - s[1] for s in last[1:]]
    print(f"[decode_paths] breakdown ({rows[0].notes.split('; ')[-2]}): token step median {med(walls):.2f} ms = GPU "
          f"wait {med(waits):.2f} + sampler {med(picks):.2f} + other host {med(walls) - med(waits) - med(picks):.2f}; "
          f"rollout {rows[0].tokens_per_s:,.0f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
