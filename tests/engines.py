"""The tests' one way to build an Engine: the recipe schema's engine section (EngineConfig) with a test's
overrides, and the StepPlan they describe. Whatever a test does not name is the schema's default, as in a
recipe; the product's choices on top (train/setup.py's build_engine: no optimizer thread on the CPU) are
not made here, so a test of the optimizer thread can run it on the CPU.
"""

from __future__ import annotations

import dataclasses

import torch

from megatrain_cli.engine.plan.step_plan import StepPlan
from megatrain_cli.engine.step import Engine
from megatrain_cli.recipe import EngineConfig, TrainConfig


def make_engine(store, train: TrainConfig, *, device, dist=None, keep_blocks=frozenset(), lean=None, method=None,
                frozen=frozenset(), **settings) -> Engine:
    """An Engine over `store`. `settings`: engine.* keys (an unknown one is a TypeError naming it);
    `checkpoint_interval`, `loss_chunk_tokens` and `resident_layers` go into the plan, the rest stay
    settings. `keep_blocks`: the blocks that keep their activations; `lean`: a LeanPlan; `method`: a
    preference method (methods/; None: SFT); `frozen`: a VLM's tiles that do not train."""
    e = dataclasses.replace(EngineConfig(), **settings)
    # A lean plan's interval and loss chunk are the plan's, whatever the settings say (as plan_step's).
    interval, chunk = (lean.checkpoint_interval, lean.loss_chunk_tokens) if lean is not None else \
        (e.checkpoint_interval, e.loss_chunk_tokens)
    # 'auto' resident layers are the planner's to count (0 on the CPU); a test that wants some names them.
    resident = e.resident_layers if isinstance(e.resident_layers, int) else 0
    # The engine reads how the step runs, never the plan's memory figures: none here.
    plan = StepPlan(memory=None, checkpoint_interval=interval, loss_chunk_tokens=chunk,
                    keep_blocks=frozenset(keep_blocks), lean=lean, resident_layers=resident)
    return Engine(store, plan, e, train, device=torch.device(device), dist=dist, method=method, frozen=frozen)
