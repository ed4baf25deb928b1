"""The planner's predicted step for a training run, from the machine's CACHED probe (issue #22: train and
--dry-run show predicted against measured). Nothing is measured here: `megatrain plan` and `megatrain
bench` probe (a few seconds, and device memory a run would rather keep); without a cached probe of this
machine and shape the line says how to get one.
"""

from __future__ import annotations

import torch


def prediction(r, adapter, device: torch.device, plan, cache_dir=None):
    """The Prediction for `plan` from the cached probe (a clipped step when train.max_grad_norm is set), or
    None when this machine was never probed."""
    from megatrain_cli.engine.plan.predict import predict_plan
    from megatrain_cli.engine.plan.probe import read_cached, recipe_shape

    probe = read_cached(adapter, **recipe_shape(r, device, plan), cache_dir=cache_dir)
    if probe is None:
        return None
    return predict_plan(r, adapter, device, plan, probe.machine, probe.layer,
                        clipped=r.train.max_grad_norm is not None)


def describe(pred) -> str:
    """One line for the dry run and the start of training."""
    if pred is None:
        return ("planner: no probe of this machine cached; `megatrain plan RECIPE` measures one (a few seconds) "
                "and predicts each plan's step")
    if pred.total is None:
        return (f"planner: at least {pred.lower_bound:.3f} s/step for this plan (unknown here: "
                f"{', '.join(pred.unknown)})")
    ph = pred.phases
    return (f"planner: predicted {pred.total:.3f} s/step for this plan (forward {ph['forward']:.3f}, head "
            f"{ph['head']:.3f}, backward {ph['backward']:.3f}, not overlapped {ph['serial']:.3f}; docs/planner.md)")


def against(pred, measured_s: float, steps: int) -> str:
    """The end-of-run line: measured mean against predicted ('' without a whole prediction)."""
    if pred is None or pred.total is None or steps < 1:
        return ""
    return (f"mean step {measured_s:.3f} s over {steps} steps; the planner predicted {pred.total:.3f} s "
            f"({pred.total / measured_s - 1:+.0%})")
