"""`megatrain bench train.method=dpo` (any preference method): three rows from one engine, on the same tokens.

The batches are synthetic pairs laid out as the training data lays them (data/preference_rows.py): each row
one pair, its chosen sequence then its rejected one (train.seq_len / 2 tokens each, position ids restarting
at the second), both opening with the same prompt (an eighth of a sequence, no labels), the rest labelled.
The rows hold exactly the tokens of the SFT bench's (micro_batch_size x seq_len per micro-batch).

    reference  the reference pass over every step's micro-batches (engine/validate.score_passes, one call,
               a step's grad_accum micro-batches per streamed pass): forward only, pass 1 of the preference
               head. Its scores are the ones the steps then read. The first pass is its warm-up (and loads
               the resident layers' weights, once, as a run's reference pass does).
    dpo (the method's name)  full training steps with the method's head (short.measure)
    sft        the same steps, rows and engine with the SFT head (the method swapped on the engine)

The table prints the method's row against the two others in tokens/s (dpo / sft: the step's cost over
SFT's; dpo / reference: the reference pass's speed-up is its inverse).
"""

from __future__ import annotations

import time

import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.bench import short
from megatrain_cli.bench.result import BenchResult
from megatrain_cli.machine import host_rss_bytes, peak_rss_bytes
from megatrain_cli.methods import SFT, PreferenceLayout, PreferenceMicroBatch, SequenceScores
from megatrain_cli.metrics.flops import streamed_step_flops


def run_preference_bench(r, run, *, planned, log=print, dashboard: str | None = None) -> list[BenchResult]:
    """Plan (planned: runner.plan_bench's), build with the method handed to the engine, then `measure`."""
    import gc

    from megatrain_cli.bench.runner import DoesNotFit, build
    from megatrain_cli.methods import make_method

    if planned.problems:
        raise DoesNotFit("the bench would not fit:\n  " + "\n  ".join(planned.problems))
    if planned.long_context:
        raise DoesNotFit(f"train.method={r.train.method}: the short-context (or memory-lean) path only; "
                         f"train.seq_len {r.train.seq_len} takes the long-context one")
    built = build(planned, log=log, method=make_method(r.train.method, r.preference))
    try:
        return measure(planned, built.store, built.engine, run, log=log, dashboard=dashboard)
    finally:
        del built
        gc.collect()
        if planned.device.type == "cuda":
            torch.cuda.empty_cache()


def synthetic_pairs(vocab: int, batch: int, seq: int, seed: int) -> PreferenceMicroBatch:
    """`batch` rows, each one pair of seq / 2 tokens a sequence sharing a prompt (module doc)."""
    g = torch.Generator().manual_seed(seed)
    half = seq // 2
    prompt = max(1, half // 8)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    ids[:, half:half + prompt] = ids[:, :prompt]
    labels = ids.clone()
    labels[:, :prompt] = IGNORE_INDEX
    labels[:, half:half + prompt] = IGNORE_INDEX
    pos = torch.cat([torch.arange(half), torch.arange(seq - half)]).expand(batch, seq).clone()
    chosen = torch.arange(0, 2 * batch, 2)
    layout = PreferenceLayout(torch.arange(2 * batch), torch.arange(2 * batch) % 2 == 0, chosen, chosen + 1)
    return PreferenceMicroBatch(ids, labels, pos, layout=layout)


def measure(planned, store, engine, run, *, log=print, dashboard: str | None = None) -> list[BenchResult]:
    """[the method's row, SFT's, the reference pass's]; closes the engine."""
    from megatrain_cli.engine.validate import score_passes

    r, dev = planned.r, planned.device
    t = r.train
    batch, seq, accum = t.micro_batch_size, t.seq_len, t.grad_accum
    warmup, steps = run.warmup_steps(False), run.steps
    vocab = planned.config.vocab_size
    steps_batches = [[synthetic_pairs(vocab, batch, seq, seed=s * 97 + k) for k in range(accum)]
                     for s in range(warmup + steps)]
    method = engine.method

    def keep(mb, scores) -> None:  # the reference's scores, which the steps read
        if method.needs_reference:
            mb.reference = SequenceScores(scores.logps.cpu(), scores.tokens.cpu())

    try:
        # One score_passes over every step's micro-batches, a step's worth per streamed pass, as the
        # trainer's reference pass runs over its data: the resident weights load once, in the first pass
        # (its warm-up). A call per pass paid that load every time (7B, 28 layers resident: 12 s a pass).
        pass_times = []
        clock = [0.0]

        def timed(mbs) -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # a host sync per pass, for the pass's own time
            now = time.perf_counter()
            pass_times.append(now - clock[0])
            clock[0] = now
            s = len(pass_times) - 1
            log(f"[bench] reference pass {s}{' (warm-up: loads the resident weights)' if s == 0 else ''}: "
                f"{pass_times[-1]:.2f} s")

        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        clock[0] = time.perf_counter()
        score_passes(engine, [mb for mbs in steps_batches for mb in mbs], accum, keep, on_pass=timed)
        reference = _reference_row(planned, store, engine, pass_times[1:] or pass_times, first=pass_times[0])
        rows = []
        for name, m in ((method.name, method), ("sft", SFT())):
            engine.method = m
            row = short.measure(planned, store, engine, run, log=log, dashboard=dashboard, close=False,
                                batches=lambda s: steps_batches[s], name=name)
            rows.append(row)
    finally:
        engine.method = method
        engine.close()
    return [*rows, reference]


def _reference_row(planned, store, engine, times: list[float], first: float) -> BenchResult:
    r, dev = planned.r, planned.device
    t = r.train
    step_s = sum(times) / len(times)
    tokens = t.micro_batch_size * t.grad_accum * t.seq_len
    flops, _ = streamed_step_flops(store, rows=t.micro_batch_size * t.grad_accum, seq=t.seq_len,
                                   recomputed_layers=0, mlp_chunk_tokens=None)
    forward = flops / 3  # a step's model FLOPs are forward + backward (2x): the forward is a third
    return BenchResult(
        name="reference", model=planned.label, batch=t.micro_batch_size * t.grad_accum, seq=t.seq_len,
        steps=len(times), step_time_s=step_s, tokens_per_s=tokens / step_s, model_tflops=forward / step_s / 1e12,
        executed_tflops=forward / step_s / 1e12,
        peak_device_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0,
        host_rss_bytes=host_rss_bytes(), host_peak_rss_bytes=peak_rss_bytes(),
        bytes_per_param=store.host_bytes() / store.num_params(),
        notes=f"the reference pass of train.method={t.method}: forward only (no autograd, no optimizer), the "
              f"preference head's pass 1, {t.grad_accum} micro-batch(es) of {t.micro_batch_size} pairs per "
              f"streamed pass; mean of {len(times)} pass(es) after the first ({first:.2f} s: the resident weights' "
              f"load, once per run, and the warm-up)")
