"""The planner's prediction for the plan a bench row runs, and the probe it stands on (issue #22: every row
records the machine's measured figures, so rows of different machine starts compare, and the predicted
step beside the measured one).

The probe runs before the store and the engine exist (its layer timing needs device memory they would
hold); it is cached per machine, so only a new machine or shape costs its few seconds. The prediction
itself is arithmetic, made after the run, for the step the run turned out to be: clipped or not.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from megatrain_cli.engine.plan.probe import Probe


def probe_for(planned, *, cache_dir: str | Path | None = None, log=print) -> Probe:
    """This machine's figures and the layer's timing at the row's shape, packed rows' documents and a VLM's
    images (its tower's timing) included (measured now when not cached)."""
    from megatrain_cli.bench.loop import probe_docs
    from megatrain_cli.bench.vision_rows import VisionRows
    from megatrain_cli.engine.layer_probe import measure_layer, to_measure
    from megatrain_cli.engine.plan.probe import default_cache_dir, load_or_probe, recipe_shape
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.train.preflight import check_output_dir

    adapter = ModelAdapter(planned.config)
    images = VisionRows(planned.r, planned.config, micro_batches=1).probe_images if adapter.vision else None
    shape = recipe_shape(planned.r, planned.device, planned.plan, probe_docs(planned.r, adapter.vocab_size), images)
    if any(to_measure(adapter, cache_dir=cache_dir, **shape)):  # its figures go to the cache after measuring
        check_output_dir(cache_dir or default_cache_dir(), "bench: the probe cache", "move that file or make the "
                         "folder writable (the planner's probe, whose prediction each row records, writes there)")
    return load_or_probe(adapter, measure_layer=measure_layer, **shape, cache_dir=cache_dir,
                         log=lambda line: log(f"[bench] {line}"))


def predicted_row(planned, probe: Probe, *, clipped: bool) -> dict:
    """What BenchResult.predicted holds: the predicted step (None where a figure is unknown), its phases and
    resources, and the probe's figures."""
    from megatrain_cli.engine.plan.predict import predict_plan
    from megatrain_cli.models.adapter import ModelAdapter

    p = predict_plan(planned.r, ModelAdapter(planned.config), planned.device, planned.plan, probe.machine,
                     probe.layer, clipped=clipped)
    return {"step_s": p.total, "clipped": clipped, "phases": p.phases, "busy": p.parts, "unknown": p.unknown,
            "probe": asdict(probe.machine), "layer": asdict(probe.layer) if probe.layer is not None else None}


def summary(predicted: dict, measured_s: float, steady_s: float) -> str:
    """One line: predicted against measured, and by how much the model missed."""
    step = predicted["step_s"]
    if step is None:
        return f"no prediction: unknown {', '.join(predicted['unknown'])}"
    ref = steady_s or measured_s
    vision = predicted["phases"].get("vision")  # a VLM's tower, inside the step
    tower = "" if vision is None else f" (the vision tower {vision:.3f} of it)"
    return (f"predicted {step:.3f} s/step{tower} for a{' ' if predicted['clipped'] else 'n un'}clipped step, measured "
            f"{measured_s:.3f} (steady {steady_s:.3f}): {step / ref - 1:+.0%} against "
            f"{'steady' if steady_s else 'measured'}")
