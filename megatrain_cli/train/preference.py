"""A preference run's part of the loop (train.method dpo, ipo, simpo, orpo, kto; docs/preference.md): its data,
the reference's scores, each micro-batch's share of them, and the held-out pairs' eval.

`prepare` reads, splits and tokenises the pairs before anything is written (every refusal names the record and
the field: exit 2). `score_reference` runs the reference pass (train/reference_pass.py) over the initial
weights, before a resume loads a checkpoint, or reuses the cached scores (the log says which); reference-free
methods (SimPO, ORPO) skip it. `attach` gives each micro-batch its sequences' reference scores (its layout's
`sequences` index the data's). `evaluate` scores the held-out pairs with the policy as it is now, through the
same pass, and reduces the method's loss and metrics over all of them: every `eval.every_n_steps` steps on the
first `eval.val_batches` micro-batches, and with `eval.enabled` at the end on the whole split
(output_dir/eval/results.json).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from megatrain_cli.data.errors import DataError
from megatrain_cli.methods import MetricTotals, PreferenceMethod, SequenceScores, make_method
from megatrain_cli.recipe import Recipe
from megatrain_cli.train.errors import TrainingError


@dataclass
class PreferenceRun:
    method: PreferenceMethod
    data: object  # PreferenceData: the training pairs
    held_out: object | None  # PreferenceData of the test split's pairs, when an eval reads them
    reference: SequenceScores | None = None  # every training sequence's, in the data's order
    held_reference: SequenceScores | None = None

    def attach(self, mbs: list) -> list:
        """Each micro-batch with its sequences' reference scores (a reference-free method: none)."""
        if self.reference is not None:
            for mb in mbs:
                seq = mb.layout.sequences
                mb.reference = SequenceScores(self.reference.logps[seq], self.reference.tokens[seq])
        return mbs

    def describe(self, seq_len: int, packing: bool) -> str:
        units = "examples" if not self.method.paired else "pairs"
        held = f", {self.held_out.num_units} held out" if self.held_out is not None else ""
        return (f"{self.method.name}: {self.data.num_units} {units}{held} ({self.data.num_sequences} sequences) in "
                f"{self.data.num_rows} rows of {seq_len} tokens, {pair_layout(self.method, packing)}")


def pair_layout(method, packing: bool) -> str:
    """How the units lie in rows (what --dry-run and the start of a run say)."""
    if not method.paired:
        return "each example one sequence, " + ("packed into rows" if packing else "one per row")
    return ("each pair's chosen and rejected sequences side by side in one row (a pair never split), "
            + ("pairs packed into rows" if packing else "one pair per row"))


def prepare(r: Recipe, tokenizer) -> PreferenceRun:
    """The method and its pairs, tokenised and laid out in rows; refused (exit 2) before anything is written."""
    from megatrain_cli.data.preference import load_preference_examples, split_preference_examples
    from megatrain_cli.data.preference_rows import build_preference_data

    method = make_method(r.train.method, r.preference)
    t, ev = r.train, r.eval
    try:
        examples = load_preference_examples(r.data, t.method)
        train_ex, test_ex = split_preference_examples(examples, r.data, t.method)
        data = build_preference_data(train_ex, tokenizer, r.data, t.seq_len, t.seed)
        wanted = ev.enabled or ev.every_n_steps is not None
        if wanted and not test_ex:
            key = "eval.enabled" if ev.enabled else f"eval.every_n_steps={ev.every_n_steps}"
            raise TrainingError(f"{key} scores the held-out pairs, but the test split of {r.data.source} is empty: "
                                f"set data.test_fraction above 0 or data.test_source, or turn the eval off", 2)
        held = build_preference_data(test_ex, tokenizer, r.data, t.seq_len, t.seed) if wanted else None
    except DataError as err:
        raise TrainingError(str(err), 2) from None
    return PreferenceRun(method, data, held)


def score_reference(run: PreferenceRun, r: Recipe, engine, tokenizer, config, dist, log, progress) -> None:
    """The reference's scores of the training (and held-out) sequences: from the cache, or by the reference pass
    over the weights in the engine now (the initial ones: call it before a resume loads a checkpoint)."""
    from megatrain_cli.train.reference_pass import reference_cache, score_data

    if not run.method.needs_reference:
        log(f"{run.method.name} is reference-free: no reference pass")
        return
    lead = dist is None or dist.rank == 0
    group = max(1, math.ceil(r.train.grad_accum / (dist.world if dist is not None else 1)))
    for name, data in (("training", run.data), ("held-out", run.held_out)):
        if data is None:
            continue
        cache = reference_cache(r, data, tokenizer, config, engine)
        scores = cache.load(data.num_sequences)
        found = scores is not None
        if dist is not None:  # the ranks decide together: a pass has collectives
            found = dist.sum_scalars([found])[0] == dist.world
        if found:
            log(f"reference: the {name} sequences' scores ({data.num_sequences}) reused from the cache "
                f"({cache.path}): no reference pass")
        else:
            t0 = time.perf_counter()
            scores = score_data(engine, data, r.train.micro_batch_size, group, dist,
                                lambda done, rows: progress(f"reference pass ({name})", done, rows))
            took = time.perf_counter() - t0
            tokens = data.num_rows * r.train.seq_len
            saved = cache.save(scores) if lead else False
            where = f"; cached at {cache.path}" if saved else \
                ("" if cache.path is None else f"; could not write the cache at {cache.path}")
            log(f"reference pass ({name}): {data.num_sequences} sequences in {data.num_rows} rows, {took:.1f} s, "
                f"{tokens / max(took, 1e-9):,.0f} tokens/s{where}")
        if name == "training":
            run.reference = scores
        else:
            run.held_reference = scores


def evaluate(run: PreferenceRun, r: Recipe, engine, dist, rows: int | None = None) -> tuple[float, dict]:
    """(mean unit loss, metrics) of the policy now on the held-out pairs (the first `rows` rows; None: all)."""
    from megatrain_cli.methods.sequences import sequence_grads
    from megatrain_cli.train.reference_pass import score_data

    data = run.held_out
    rows = data.num_rows if rows is None else min(rows, data.num_rows)
    group = max(1, math.ceil(r.train.grad_accum / (dist.world if dist is not None else 1)))
    policy = score_data(engine, data, r.train.micro_batch_size, group, dist, num_rows=rows)
    layout = data.layout([s for row in data.rows[:rows] for s in row])  # pairs by local index
    seq = layout.sequences
    pick = SequenceScores(policy.logps[seq], policy.tokens[seq])
    ref = None if run.held_reference is None else SequenceScores(run.held_reference.logps[seq],
                                                                 run.held_reference.tokens[seq])
    losses, _, metrics = sequence_grads(run.method, pick, ref, layout, 1.0)
    totals = MetricTotals()
    totals.add(metrics)
    return float(losses.mean()), totals.means()


def write_results(out: Path, method: str, loss: float, metrics: dict, units: int) -> Path:
    path = out / "eval" / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"method": method, "held_out_units": units, "loss": loss, **metrics}, indent=1) + "\n")
    return path


def metrics_line(loss: float, metrics: dict) -> str:
    keys = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")
    return f"loss {loss:.4f}, " + ", ".join(f"{k} {metrics[k]:.4f}" for k in keys if k in metrics)
