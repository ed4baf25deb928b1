"""`megatrain bench` once its arguments are parsed (cli.py hands over here): the recipe and the options
checked, then one process (the baselines, ours, the table) or N ranks (ranks.py; rank 0 reports).

Messages go to stderr, the table or the JSON to stdout; every function returns the command's exit code
(2 bad input, 3 would not fit; bench/settings.py checks the options, runner.py plans).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from megatrain_cli.bench.settings import BASELINES, BenchRun, bench_problems, bench_recipe, shorthands


def _say(text: str) -> None:
    print(text, flush=True)


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _fail(message: str, code: int = 2) -> int:
    _err(f"error: {message}")
    return code


def bench(args: list[str], run: BenchRun, *, shorthand: dict, baseline: str | None, gpus: int | None,
          as_json: bool, output: Path | None) -> int:
    """The recipe (bench.yaml or the one named in `args`, then the overrides and the `shorthand` options:
    bench/settings.shorthands' keywords), every option and path checked before the plan (nothing is
    measured that would then be refused or lost), then the measurement."""
    import torch

    try:
        short = shorthands(**shorthand)
    except ValueError as err:
        return _fail(f"--seq: {err}")
    r = bench_recipe(args, shorthand=short)
    problems = bench_problems(r, run, baseline=baseline, gpus=gpus, output=str(output) if output else None,
                              cuda=torch.cuda.is_available())
    if problems:
        return _fail("\n  ".join(problems) if len(problems) == 1 else "bench:\n  " + "\n  ".join(problems))
    if gpus is not None or "WORLD_SIZE" in os.environ:
        return bench_ranks(r, run, gpus, as_json=as_json, output=output)
    return bench_one(r, run, BASELINES[baseline], as_json=as_json, output=output)


def bench_one(r, run: BenchRun, baselines: list, *, as_json: bool, output: Path | None) -> int:
    """One process: plan (refused before allocating when it does not fit), the baselines, ours, the table."""
    from megatrain_cli.bench.result import format_table, to_json
    from megatrain_cli.bench.runner import DoesNotFit, plan_bench, run_bench

    planned = plan_bench(r, run.layers, log=_err)
    if planned.long_context and baselines:
        return _fail(f"--baseline: the short-context path only (train.seq_len {r.train.seq_len} takes the "
                     "long-context one)")
    results = []
    if "deepspeed" in baselines:
        # First, in a watched child process: DeepSpeed gets the host memory to itself (ours is not
        # allocated yet) and returns all of it when it exits (or is killed for memory).
        from megatrain_cli.bench.deepspeed import bench_deepspeed

        t = r.train
        results.append(bench_deepspeed(r.model.preset, t.micro_batch_size * t.grad_accum, t.seq_len, run.steps,
                                       warmup=run.warmup_steps(False), log=_err, timeout_s=540))
    dashboard = "off" if as_json else r.logging.dashboard
    try:
        if r.train.method == "grpo":  # rollouts and the training step on them, with the step's split
            from megatrain_cli.bench.grpo import run_grpo_bench

            results = run_grpo_bench(r, run, planned=planned, log=_err)
        elif r.train.method != "sft":  # the method's step, SFT's on the same tokens, the reference pass
            from megatrain_cli.bench.preference import run_preference_bench

            results = run_preference_bench(r, run, planned=planned, log=_err, dashboard=dashboard)
        else:
            results.insert(0, run_bench(r, run, log=_err, dashboard=dashboard, planned=planned))
    except DoesNotFit as e:
        return _fail(f"{e}\n(the plan above has each term; engine.max_gpu_mem sets the device budget)", 3)
    ours = results[0]
    if "native" in baselines:
        from megatrain_cli.bench.short import bench_native

        results.insert(1, bench_native(planned, run, log=_err))
    if planned.long_context:
        from megatrain_cli.bench.long_context import format_extrapolation

        extrapolated = f"\n{format_extrapolation(ours.extrapolated)}" if ours.extrapolated else ""
        _say(to_json(results) if as_json else f"{format_table(results)}\nnotes: {ours.notes}{extrapolated}")
    else:
        lean_notes = [f"notes ({x.name}): {x.notes}" for x in results if x.notes.startswith("memory-lean path")]
        _say(to_json(results) if as_json else "\n".join([format_table(results), *lean_notes]))
    if output:
        output.write_text(to_json(results))
    if ours.tokens_per_s <= 0:  # the long-context row of a plan that does not fit, or of a failed run
        return _fail("the bench would not fit:\n  " + "\n  ".join(planned.problems) if planned.problems
                     else f"no timed step finished: {ours.notes}", 3)
    return 0


def bench_ranks(r, run: BenchRun, gpus: int | None, *, as_json: bool, output: Path | None) -> int:
    """`bench --gpus N` (or under torchrun): bench/ranks.py; rank 0 (or the launcher) prints and writes."""
    from megatrain_cli.bench import ranks
    from megatrain_cli.bench.result import format_table, from_dict
    from megatrain_cli.bench.runner import DoesNotFit

    try:
        report = ranks.bench_ranks(r, run, gpus, log=_err)
    except ranks.RanksFailed as err:  # the ranks and the launcher have said why
        return err.code
    except (DoesNotFit, ValueError) as err:
        return _fail(str(err), 3)
    if report is not None:  # rank 0, or the process that spawned the ranks
        text = json.dumps(report, indent=2)
        if as_json:
            _say(text)
        else:
            result = from_dict(report)
            _say(f"{format_table([result])}\nnotes: {result.notes}")
        if output:
            output.write_text(text)
    return 0
