"""What a bench run reports: one BenchResult per row (ours, each baseline), as a table or as JSON.

The lowest module of bench/: every path (short, long-context, ranks) and both baselines fill a
BenchResult, and nothing here imports torch or the engine, so the DeepSpeed watcher stays light.

Model TFLOPS = (6 x matmul params x tokens + 6 x batch x seq^2 x hidden x layers) / step time: the
causal-attention term is half of full attention's 12bs^2hL; recompute is NOT counted; the embedding
lookup is not a matmul and is not counted (the LM head is). Packed rows (data.packing) count attention
within documents only: 6 x sum(doc_len^2) x hidden x layers instead of the batch x seq^2 term, and the
table says so under its rows. Executed TFLOPS adds the recomputed forward (2 x params x tokens per
recomputed layer, and its attention).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class BenchResult:
    name: str
    model: str
    batch: int
    seq: int
    steps: int
    step_time_s: float
    tokens_per_s: float
    model_tflops: float
    executed_tflops: float
    peak_device_bytes: int
    host_rss_bytes: int
    host_peak_rss_bytes: int = 0
    bytes_per_param: float = 0.0
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    overlap: float | None = None
    split: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    notes: str = ""
    # A run of fewer layers than the model's (--layers) on the long-context path: the full model's step,
    # extrapolated from the measured per-layer times, and its planned memory (long_context.extrapolate).
    extrapolated: dict = field(default_factory=dict)
    # Steady state: the mean of timed steps 2..N, each carrying the previous step's optimizer work
    # (loop.TimedSteps.steady_step_s); 0 when fewer than 2 timed steps.
    steady_step_time_s: float = 0.0
    grad_norms: list = field(default_factory=list)  # the timed steps' global gradient norms
    # The planner's prediction for the plan that ran and the probe's figures (bench/predicted.py); {}: none
    predicted: dict = field(default_factory=dict)
    # Packed rows (data.packing): documents per row, fill, and that the TFLOPS count attention within documents
    # (loop.BenchRows.describe); '': one document per row.
    packed: str = ""
    images_per_s: float = 0.0  # a vision-language model's bench: images through the whole step per second


def model_label(name: str, layers: int | None, full_layers: int | None = None) -> str:
    """'7b', or '7b[2 of 28 layers]' when the bench runs another layer count than the model's
    (`full_layers`; default: the preset's)."""
    if full_layers is None:
        from megatrain_cli.presets import PRESETS

        full_layers = PRESETS[name].num_hidden_layers
    return name if layers is None or layers == full_layers else f"{name}[{layers} of {full_layers} layers]"


def format_table(results: list[BenchResult]) -> str:
    """One row per result, then ours (the first) against each baseline in tokens/s."""
    mw = max([6, *(len(r.model) for r in results)])  # '7b[2 of 28 layers]' widens the column
    head = (f"{'run':<10} {'model':<{mw}} {'tokens':>9} {'step s':>7} {'tok/s':>8} {'model TF':>9} {'exec TF':>8} "
            f"{'H2D GB/s':>9} {'D2H GB/s':>9} {'overlap':>8} {'dev GiB':>8} {'RSS GiB':>8} {'B/param':>8}")
    lines = [head]
    for r in results:
        f = lambda v, fmt: "n/a" if v is None else format(v, fmt)  # noqa: E731
        lines.append(f"{r.name:<10} {r.model:<{mw}} {r.batch}x{r.seq:<6} {r.step_time_s:7.2f} {r.tokens_per_s:8.0f} "
                     f"{r.model_tflops:9.1f} {r.executed_tflops:8.1f} {f(r.h2d_gbps, '9.1f'):>9} "
                     f"{f(r.d2h_gbps, '9.1f'):>9} {f(r.overlap, '8.1%'):>8} {r.peak_device_bytes / 2**30:8.1f} "
                     f"{r.host_rss_bytes / 2**30:8.1f} {r.bytes_per_param:8.1f}")
    ours = results[0] if results else None
    lines += [f"{r.name} {r.packed}" for r in results if r.packed]
    lines += [f"{r.name}: {r.images_per_s:.1f} images/s" for r in results if r.images_per_s]
    if ours is not None and ours.predicted.get("step_s"):
        lines.append(f"{ours.name} predicted by the planner: {ours.predicted['step_s']:.2f} s/step "
                     f"(docs/planner.md; the probe's figures are in the JSON)")
    for base in results[1:]:
        if base.tokens_per_s > 0:
            lines.append(f"{ours.name} / {base.name}: {ours.tokens_per_s / base.tokens_per_s:.2f}x tokens/s")
        else:
            lines.append(f"{ours.name} / {base.name}: {base.name} produced no result ({base.notes})")
    return "\n".join(lines)


def to_json(results: list[BenchResult]) -> str:
    return json.dumps([asdict(r) for r in results], indent=2)


def from_dict(data: dict) -> BenchResult:
    """A BenchResult from a dict that may carry more keys (a child's JSON, the data-parallel report)."""
    return BenchResult(**{k: v for k, v in data.items() if k in BenchResult.__dataclass_fields__})
