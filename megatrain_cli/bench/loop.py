"""The timed step loop of `megatrain bench` and its batches, shared by every path (short.py,
long_context.py, ranks.py): warm-up steps, then timed ones; the wall clock runs from the first timed step
until the last step's host optimizer updates have landed, so a pipelined optimizer's tail is paid for.

The batches (`BenchRows`): one synthetic document per row, or with data.packing packed rows of
documents (bench.doc_lengths: lengths from a log-normal, or the training data's own rows), each step's
sum of squared document lengths noted for the FLOP count (attention within documents only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatrain_cli.engine.step import Engine, MicroBatch, StepResult
from megatrain_cli.metrics.flops import attention_pairs

BENCH_LR = 1e-5
POOL_ROWS = 64  # packed rows: documents for at least this many rows are drawn, so the fill is the data's


def synthetic_batch(vocab: int, batch: int, seq: int, seed: int) -> MicroBatch:
    """Uniform random tokens, one document per row (no packing, no mask): step s, micro-batch k takes seed
    s * 97 + k on every path and in the baselines (deepspeed_child.synthetic_ids draws the same ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return MicroBatch(ids, ids.clone())


class BenchRows:
    """Step s's micro-batches: synthetic_batch's rows (seeds s * 97 + k), or, with data.packing, the next rows of
    packed documents (data/train_data.py's rows: synthetic documents, or data.source's, as `train` builds
    them). `attended[s]`: step s's attention_pairs (sum of squared document lengths)."""

    def __init__(self, r, vocab: int, *, steps: int, micro_batches: int, tokenizer=None):
        self.vocab, self.micro_batches = vocab, micro_batches
        self.batch, self.seq = r.train.micro_batch_size, r.train.seq_len
        self.attended: dict[int, float] = {}
        self.data = packed_rows(r, vocab, rows=steps * micro_batches * self.batch, tokenizer=tokenizer) \
            if r.data.packing else None

    def __call__(self, s: int) -> list[MicroBatch]:
        """Every micro-batch of step s (a data-parallel rank keeps its share of them)."""
        if self.data is None:
            mbs = [synthetic_batch(self.vocab, self.batch, self.seq, seed=s * 97 + k) for k in range(self.micro_batches)]
        else:
            mbs = self.data.next_step(self.batch, self.micro_batches)
        self.attended[s] = attention_pairs(mbs)
        return mbs

    def attended_per_step(self, steps) -> float | None:
        """The mean attention_pairs of these steps; None without packing (one document per row)."""
        if self.data is None:
            return None
        return sum(self.attended[s] for s in steps) / len(steps)

    def describe(self) -> str:
        """What the packed rows hold (for the table's note); '' without packing."""
        if self.data is None:
            return ""
        st = self.data.stats()
        return (f"packed rows: {st['examples'] / st['rows']:.1f} documents/row, fill {st['fill']:.1%} "
                f"(real tokens / row tokens); model and executed TFLOPS count attention within documents only "
                f"(6 x sum(doc_len^2) x hidden x layers)")


def probe_docs(r, vocab: int) -> int | None:
    """The planner probe's docs_per_row for the packed rows this bench times (None: one document per row)."""
    from megatrain_cli.engine.plan.probe import docs_per_row

    if not r.data.packing:
        return None
    return docs_per_row(packed_rows(r, vocab, rows=POOL_ROWS).attention_pairs_per_row(), r.train.seq_len)


def packed_rows(r, vocab: int, *, rows: int, tokenizer=None):
    """The TrainData the packed bench draws its rows from. bench.doc_lengths 'synthetic': documents for at
    least max(rows, POOL_ROWS) rows, lengths from the recipe's log-normal; 'data': data.source's training rows,
    built as `train` builds them (the model's tokenizer: `tokenizer`, loaded here when None)."""
    from megatrain_cli.data.train_data import synthetic_lengths, synthetic_train_data

    b, t = r.bench, r.train
    if b.doc_lengths == "synthetic":
        lengths = synthetic_lengths(max(rows, POOL_ROWS) * t.seq_len, b.doc_len_mean, b.doc_len_spread, t.seq_len,
                                    seed=t.seed)
        return synthetic_train_data(lengths, vocab, t.seq_len, seed=t.seed)
    from megatrain_cli.data import build_train_data, load_examples, split_examples
    from megatrain_cli.models.tokenizer import load_tokenizer

    train, _ = split_examples(load_examples(r.data), r.data)
    data = build_train_data(train, tokenizer or load_tokenizer(r.model), r.data, t.seq_len, t.seed)
    if int(data.tokens.max()) >= vocab:
        raise ValueError(f"bench.doc_lengths=data: {r.data.source}'s token ids reach {int(data.tokens.max())}, past "
                         f"the model's vocabulary ({vocab}); use a model whose tokenizer wrote them, or "
                         f"bench.doc_lengths=synthetic")
    return data


@dataclass
class TimedSteps:
    results: list[StepResult] = field(default_factory=list)  # the timed steps'
    losses: list[float] = field(default_factory=list)  # every step's, warm-up included
    step_times: list[float] = field(default_factory=list)  # each timed step's engine call, in seconds
    # First timed step to the last step's host updates landed (a pipelined optimizer finishes after the call
    # returns). After a failure: the sum of the timed steps that finished (the failed one is not a step).
    wall_s: float = 0.0
    stall_s: float = 0.0  # CUDA: the compute stream's idle time waiting for weights, over the timed steps
    offload_d2h_bytes: int = 0  # checkpoints sent to / brought back from host memory in the timed steps
    offload_h2d_bytes: int = 0
    failure: str = ""  # 'out of memory: ...' when stop_on_oom caught one; the steps before it are kept

    def steady_step_s(self) -> float | None:
        """Mean engine-call time of timed steps 2..N: each carries the previous step's host optimizer
        work (its deferred updates run into the next forward and backward), as in a long run. The first
        timed step carries none (the warm-up's updates were drained) and the final drain runs the last
        step's updates with no next step to overlap, so `wall_s / steps` is biased; None below 2 steps."""
        return sum(self.step_times[1:]) / (len(self.step_times) - 1) if len(self.step_times) >= 2 else None


def run_timed_steps(engine: Engine, batches: Callable[[int], list[MicroBatch]], *, warmup: int, steps: int,
                    optimizer: bool = True, on_step: Callable[[int, StepResult, float], None] | None = None,
                    stop_on_oom: bool = False) -> TimedSteps:
    """`warmup` + `steps` calls of engine.step (forward_backward alone when not `optimizer`) on
    batches(step index). on_step(index, result, seconds of the call) runs after each, warm-up included.
    `stop_on_oom`: a CUDA out-of-memory error ends the loop and is reported in `failure` instead of raised."""
    dev = engine.device
    cuda = dev.type == "cuda"
    off = engine.offloader
    out = TimedSteps()
    t_timed = None
    offload0 = (0, 0)
    try:
        for s in range(warmup + steps):
            mbs = batches(s)
            if s == warmup:
                engine.synchronize(masters=False)  # the warm-up's host updates are not the timed steps' work
                if cuda:
                    torch.cuda.synchronize(dev)
                t_timed = time.perf_counter()
                if off is not None:
                    offload0 = (off.d2h_bytes, off.h2d_bytes)
            t_s = time.perf_counter()
            res = engine.step(mbs, BENCH_LR) if optimizer else engine.forward_backward(mbs)
            took = time.perf_counter() - t_s
            out.losses.append(res.loss)
            if s >= warmup:
                out.results.append(res)
                out.step_times.append(took)
                if cuda:
                    out.stall_s += engine.streamer.stall_seconds()
            if on_step is not None:
                on_step(s, res, took)
        engine.synchronize(masters=False)  # the last step's updates count too (not a checkpoint's copy home)
        if cuda:
            torch.cuda.synchronize(dev)
    except torch.cuda.OutOfMemoryError as err:
        if not stop_on_oom:
            raise
        out.failure = f"out of memory: {str(err).splitlines()[0]}"
    if out.failure:
        out.wall_s = sum(out.step_times)
    elif t_timed is not None:
        out.wall_s = time.perf_counter() - t_timed
    if off is not None and out.results:
        out.offload_d2h_bytes, out.offload_h2d_bytes = off.d2h_bytes - offload0[0], off.h2d_bytes - offload0[1]
    return out
