"""The planner's predicted step for a training run, from the machine's CACHED probe (issue #22: train and
--dry-run show predicted against measured). Nothing is measured here: `megatrain plan` and `megatrain
bench` probe (a few seconds, and device memory a run would rather keep); without a cached probe of this
machine and shape the line says how to get one.
"""

from __future__ import annotations

import math

import torch


def prediction(r, adapter, device: torch.device, plan, cache_dir=None, docs: int | None = None, images=None):
    """The Prediction for `plan` from the cached probe (a clipped step when train.max_grad_norm is set), or
    None when this machine was never probed. `docs`: packed rows' docs_per_row (engine/plan/probe.py), once the
    data is read; their timing is used when `megatrain plan` or `bench` cached it, else one document a row's.
    `images`: a VLM's (images a micro-batch, patches a side) from its data; where `megatrain plan` never timed
    them, the timing without images if one is cached (the tower at 0, the line says so)."""
    from megatrain_cli.engine.plan.predict import predict_plan
    from megatrain_cli.engine.plan.probe import read_cached, recipe_shape

    probe = read_cached(adapter, **recipe_shape(r, device, plan, docs, images), cache_dir=cache_dir)
    if probe is not None and probe.layer is None and images is not None:  # `megatrain plan` never timed them
        probe = read_cached(adapter, **recipe_shape(r, device, plan, docs), cache_dir=cache_dir)
    packed = "within documents" if docs is not None else "as one document per row"
    if probe is not None and probe.layer is None and docs is not None:
        probe, packed = read_cached(adapter, **recipe_shape(r, device, plan), cache_dir=cache_dir), \
            "as one document per row"
    if probe is None:
        return None
    pred = predict_plan(r, adapter, device, plan, probe.machine, probe.layer,
                        clipped=r.train.max_grad_norm is not None)
    pred.packed = packed if r.data.packing else ""
    return pred


def data_images(r, adapter, log=None) -> tuple[int, int] | None:
    """A VLM's images as `train` reads them (its processor over the data's training split), as the probe times
    the tower (data/image_rows.ImageTrainData.probe_images): what `megatrain plan` times and the dry run reads
    back (before train's own data is built). None: a text model, text rows, another method."""
    from megatrain_cli.data import load_examples, split_examples

    if adapter.vision is None or r.train.method != "sft":
        return None
    examples = load_examples(r.data)
    if not any(ex.images for ex in examples):
        return None
    from megatrain_cli.data.image_rows import build_image_data
    from megatrain_cli.models.processor import load_processor

    processor = load_processor(r.model.tokenizer or r.model.path, r.model.trust_remote_code)
    data = build_image_data(split_examples(examples, r.data)[0], processor, r.data, r.train.seq_len, r.train.seed)
    images = data.probe_images(r.train.micro_batch_size)
    if images is not None and log is not None:
        log(f"images: {images[0]} a micro-batch, {images[1]} x {images[1]} patches each on average "
            f"({r.data.source}); the vision tower is timed at that")
    return images


def describe(pred) -> str:
    """One line for the dry run and the start of training."""
    if pred is None:
        return ("planner: no probe of this machine cached; `megatrain plan RECIPE` measures one (a few seconds) "
                "and predicts each plan's step")
    if pred.total is None:
        return (f"planner: at least {pred.lower_bound:.3f} s/step for this plan (unknown here: "
                f"{', '.join(pred.unknown)})")
    ph = pred.phases
    packed = "" if not pred.packed else f"; packed rows' attention priced {pred.packed}" + (
        "" if pred.packed == "within documents" else ": `megatrain plan RECIPE` times this data's documents")
    return (f"planner: predicted {pred.total:.3f} s/step for this plan (forward {ph['forward']:.3f}, head "
            f"{ph['head']:.3f}, backward {ph['backward']:.3f}, not overlapped {ph['serial']:.3f}"
            f"{vision_part(ph)}{packed}; docs/planner.md)")


def vision_part(phases: dict) -> str:
    """A VLM's tower in a prediction's parts ('' for a text model). 0: no images timed: text rows, the dry run
    (before the data is read), or images `megatrain plan` has not timed on this machine."""
    if "vision" not in phases:
        return ""
    v = phases["vision"]
    if v is None:
        return ", vision ?"
    return f", vision {v:.3f}" + ("" if v else " (no images timed: `megatrain plan RECIPE` times the data's)")


def disk_lines(r, plan, pred) -> list[str]:
    """The disk tier's lines (store.disk): its bytes, the I/O a step needs against a quick probe of the folder,
    and the step the disk allows beside the predicted one; [] without a tier."""
    from megatrain_cli.engine.plan.disk_tier import report

    total = pred.total if pred is not None else None
    return report(plan.memory, plan.disk_state, r.store.disk, total)[0]


def against(pred, measured_s: float, steps: int) -> str:
    """The end-of-run line: measured mean against predicted ('' without a whole prediction)."""
    if pred is None or pred.total is None or steps < 1:
        return ""
    return (f"mean step {measured_s:.3f} s over {steps} steps; the planner predicted {pred.total:.3f} s "
            f"({pred.total / measured_s - 1:+.0%})")


def reference_pass_s(r, adapter, device: torch.device, plan, cache_dir=None) -> float | None:
    """A preference method's reference pass, per streamed pass of a step's rows (train.micro_batch_size x
    grad_accum), from the cached probe: the step's forward phase (no optimizer update to apply on the way) and
    a third of its head (the head's forward matmul of its forward + backward). None without a probe."""
    from megatrain_cli.engine.plan.predict import predict_plan
    from megatrain_cli.engine.plan.probe import read_cached, recipe_shape

    probe = read_cached(adapter, **recipe_shape(r, device, plan), cache_dir=cache_dir)
    if probe is None:
        return None
    p = predict_plan(r, adapter, device, plan, probe.machine, probe.layer, clipped=False)
    forward, head = p.phases.get("forward"), p.phases.get("head")
    return None if forward is None or head is None else forward + head / 3


def method_lines(r, adapter, device: torch.device, plan, rows: int | None = None, cache_dir=None) -> str:
    """What --dry-run (and a run, with its `rows`) says of a preference method: the pair layout and the
    reference pass's predicted time."""
    from megatrain_cli.methods import make_method
    from megatrain_cli.train.preference import pair_layout

    method = make_method(r.train.method, r.preference)
    t = r.train
    units = "pairs" if method.paired else "examples"
    lines = [f"method: {method.name}, the loss a mean over each step's {units}; {pair_layout(method, r.data.packing)}; "
             f"device memory as an SFT step of the same rows (the head's two passes hold one [chunk, vocab] logits "
             f"buffer at a time, plus a weight per token)"]
    if not method.needs_reference:
        lines.append(f"reference pass: none ({method.name} is reference-free)")
        return "\n".join(lines)
    per = reference_pass_s(r, adapter, device, plan, cache_dir)
    batch = t.micro_batch_size * t.grad_accum
    what = "reference pass: one streamed forward over every training sequence before the first step (cached)"
    if per is None:
        lines.append(f"{what}; its time is unknown here: no cached probe of this machine with the forward's figures "
                     f"for this shape (`megatrain plan RECIPE` measures one)")
    else:
        total = f"; {rows} rows: {per * math.ceil(rows / batch):.1f} s" if rows else ""
        lines.append(f"{what}: predicted {per:.3f} s per {batch} rows (a step's forward and a third of its head, "
                     f"from the cached probe){total}")
    return "\n".join(lines)
