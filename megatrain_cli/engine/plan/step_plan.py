"""The one planner: from a recipe and a model shape to how a step runs and whether it fits.

`plan_step` is what `train`, `train --dry-run` and `bench` ask. It chooses the engine's path:

    short-context   the memory plan (memory.py): checkpoint interval and kept blocks from the recipe;
    long-context    train.seq_len >= engine.long_context_min_seq: the lean plan (lean.py), interval 1,
                    the MLP chunked over the sequence, checkpoints offloaded to pinned host memory (or,
                    when host memory is short, some recomputed from the one before: the path line says);
    memory-lean     the short-context plan does not fit the device budget and engine.memory_fallback:
                    the lean machinery at any length (lean.plan_memory_lean);

and lists every problem that would make the run fail for memory (`problems`, each saying what to
change). Pure arithmetic over the shape plus a read of the host's memory ceilings (/proc/meminfo and
the cgroup limits, machine.effective_host_limit): nothing is allocated. `render` ends with the verdict
for this machine, which `--dry-run` prints and turns into its exit code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megatrain_cli.engine.plan.lean import LeanPlan, fmt_bytes, plan_for_training, plan_memory_lean, refusal
from megatrain_cli.engine.plan.memory import (MemoryPlan, device_problem, host_problems, kept_block_ids, make_plan,
                                              resident_device_bytes, resolve_keep_blocks, resolve_resident_layers)
from megatrain_cli.engine.schedule import blocks
from megatrain_cli.machine import HostLimit, effective_host_limit
from megatrain_cli.recipe import Recipe, parse_bytes
from megatrain_cli.store.tiles import MASTER_DTYPES, HostStore

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class StepPlan:
    """How a step runs: `memory` holds the host figures (and the device figures of the short-context path);
    `lean`, when set, replaces the device figures; `problems` is empty when the run fits."""

    memory: MemoryPlan
    checkpoint_interval: int
    loss_chunk_tokens: int
    keep_blocks: frozenset = frozenset()
    lean: LeanPlan | None = None
    resident_layers: int = 0
    path: str = ""
    problems: list = field(default_factory=list)
    host_limit: HostLimit | None = None  # the smallest host ceiling when planned; None: host not checked
    device_checked: bool = True  # False: no device budget known (CUDA planned on a machine without it)

    @property
    def fits(self) -> bool:
        return not self.problems

    def render(self) -> str:
        """The memory plan, the path line, the lean plan and the verdict (what `--dry-run` prints)."""
        lines = [self.memory.render(), self.path]
        if self.lean is not None:
            lines.append(self.lean.render())
            if not self.lean.fits:
                lines.append(f"would not fit: {refusal(self.lean)}")
        lines.append(f"verdict for this machine: {self.verdict()}")
        return "\n".join(lines)

    def verdict(self) -> str:
        """'fits (...)' or 'will not fit: <each problem: which limit, how much is needed, how much there is>'."""
        if self.problems:
            return "will not fit:" + "".join(f"\n  - {problem}" for problem in self.problems)
        need = self.memory.host_total + self.memory.pinned_total
        limit = self.host_limit
        host = ("host not checked (store built)" if limit is None else
                f"host not checked ({limit.source})" if not limit.available else
                f"host {fmt_bytes(need)} needed, {fmt_bytes(limit.available)} free under {limit.source}")
        device = "" if self.device_checked else ("; device memory not checked: no CUDA device here and no "
                                                 "engine.max_gpu_mem")
        return f"fits ({host}{device})"


def device_budget(r: Recipe, device: torch.device) -> int | None:
    """The recipe's engine.max_gpu_mem, else what the CUDA device has; None when unknown (CPU, or CUDA
    planned on a machine without it)."""
    if r.engine.max_gpu_mem:
        return parse_bytes(r.engine.max_gpu_mem)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    return None


def plan_step(r: Recipe, adapter, device: torch.device, *, store_built: bool = False,
              budget: int | None = None, one_process: bool = True) -> StepPlan:
    """The step's plan for `r` on `device` (a dry run may plan for CUDA on a machine without it).

    `store_built`: the host store already exists, so MemAvailable no longer counts its bytes: the host
    check is skipped and the lean plan's host budget is what is free now. `budget`: device bytes to plan
    for instead of device_budget(r, device) (e.g. less what NCCL's buffers take). `one_process` False: a
    data-parallel rank, which keeps no layer resident (engine/resident.py), so 'auto' resident layers are 0."""
    t, e = r.train, r.engine
    if not one_process and e.resident_layers == "auto":
        e = dataclasses.replace(e, resident_layers=0)
        r = dataclasses.replace(r, engine=e)
    dtype = DTYPES[r.model.dtype]
    budget = device_budget(r, device) if budget is None else budget
    args = dict(adapter=adapter, compute_dtype=dtype, micro_batch_size=t.micro_batch_size, seq_len=t.seq_len,
                grad_accum=t.grad_accum, checkpoint_interval=e.checkpoint_interval, grad_slabs=e.grad_slabs,
                layer_slots=e.layer_slots, loss_chunk_tokens=e.loss_chunk_tokens, device_type=device.type,
                master_dtype=MASTER_DTYPES[t.master_weights])
    shape_store = HostStore(adapter, dtype, allocate=False, master_dtype=args["master_dtype"])
    to_come = 0 if store_built else shape_store.host_bytes()
    # An explicit engine.resident_layers holds on the lean paths too, out of their budget; 'auto' is 0 there.
    lean_resident = 0 if e.resident_layers == "auto" else resolve_resident_layers(e.resident_layers, budget, **args)
    lean_budget = budget if budget is None or not lean_resident else \
        budget - resident_device_bytes(shape_store, lean_resident, torch.finfo(dtype).bits // 8)
    lean_args = dict(seq_len=t.seq_len, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum, dtype=dtype,
                     device_type=device.type, device_budget=lean_budget, grad_slabs=e.grad_slabs,
                     layer_slots=e.layer_slots, loss_chunk_tokens=e.loss_chunk_tokens, store_bytes_to_come=to_come)
    host = [] if store_built else None  # None: checked below
    limit = None if store_built else effective_host_limit()
    checked = dict(host_limit=limit, device_checked=budget is not None or device.type != "cuda")

    if e.long_context_min_seq is not None and t.seq_len >= e.long_context_min_seq:
        lean = plan_for_training(adapter, **lean_args, min_seq_len=e.long_context_min_seq)
        plan = _lean_host_plan(args, lean, lean_resident)
        checkpoints = lean.recompute_choice() or (f"{lean.offloaded_checkpoints} of {lean.num_checkpoints} "
                                                  "checkpoints offloaded to host memory")
        path = (f"path: long-context engine (train.seq_len {t.seq_len} >= {e.long_context_min_seq}): checkpoint "
                f"interval {lean.checkpoint_interval}, {_mlp(lean)}, {checkpoints}, no kept activations"
                f"{_resident(lean_resident)}")
        problems = _named(host_problems(plan), limit) if host is None else host
        if not lean.fits:
            problems.append(f"long context: {refusal(lean)}. Use a shorter train.seq_len, a smaller "
                            f"train.micro_batch_size or train.grad_accum, or a larger engine.max_gpu_mem; "
                            f"`megatrain train RECIPE --dry-run` shows the plan.")
        return StepPlan(plan, lean.checkpoint_interval, lean.loss_chunk_tokens, frozenset(), lean, lean_resident,
                        path, problems, **checked)

    resident = resolve_resident_layers(e.resident_layers, budget, **args)
    keep = resolve_keep_blocks(e.keep_activations, budget, **args, resident_layers=resident)
    plan = make_plan(**args, keep_blocks=keep, resident_layers=resident)
    autos = [k for k in ("keep_activations", "resident_layers") if getattr(e, k) == "auto"]
    if autos and budget is None and device.type == "cuda":
        plan.notes.append(f"{' and '.join(autos)} 'auto' decided on the GPU from its memory (0 assumed here)")
    too_big = device_problem(plan, device=device, device_budget=budget) if budget is not None else ""
    problems = _named(host_problems(plan), limit) if host is None else host
    if too_big and e.memory_fallback and not problems:
        lean = plan_memory_lean(adapter, **lean_args)
        # Against the whole device budget: the short plan's figure counts its resident layers too.
        short = (f"the short-context plan{f' with {resident} resident layers' if resident else ''} needs about "
                 f"{fmt_bytes(plan.device_total)} of the {fmt_bytes(budget)}")
        plan = _lean_host_plan(args, lean, lean_resident)
        path = (f"path: memory-lean engine ({short} device budget): {lean.summary()}, no kept activations"
                f"{_resident(lean_resident)}")
        if not lean.fits:
            problems.append(f"device memory: {short} budget, and the memory-lean plan does not fit either: "
                            f"{refusal(lean)}. Use a smaller train.micro_batch_size, train.grad_accum or "
                            f"train.seq_len, or a larger engine.max_gpu_mem; `megatrain train RECIPE --dry-run` "
                            f"shows both plans.")
        return StepPlan(plan, lean.checkpoint_interval, lean.loss_chunk_tokens, frozenset(), lean, lean_resident,
                        path, problems, **checked)
    if too_big:
        problems.append(too_big)
    elif e.resident_layers == "auto" and not keep and e.memory_fallback and budget and device.type == "cuda" \
            and not problems:
        wider = _more_resident_lean(r, adapter, device, resident, store_built=store_built, budget=budget)
        if wider is not None:
            return wider
    threshold = "never" if e.long_context_min_seq is None else e.long_context_min_seq
    path = (f"path: short-context engine (train.seq_len {t.seq_len} < {threshold}; checkpoint interval "
            f"{e.checkpoint_interval}{_resident(resident)})")
    kept = kept_block_ids(len(blocks(adapter.num_layers, e.checkpoint_interval)), keep)
    return StepPlan(plan, e.checkpoint_interval, e.loss_chunk_tokens, kept, None, resident, path, problems, **checked)


def _more_resident_lean(r: Recipe, adapter, device: torch.device, resident: int, **plan_args) -> StepPlan | None:
    """'auto' resident layers beyond the short-context plan's `resident` (which keeps no block): the most layers
    with which the memory-lean plan fits at the same compute (interval 1 recomputes every layer, as that
    short-context plan does; nothing offloaded or dropped, the MLP whole, the loss chunk not halved). More
    resident layers only take transfers and host work off the step. None: no such plan. Costs one plan per
    layer count tried, arithmetic."""
    e = r.engine
    whole_chunk = min(e.loss_chunk_tokens, r.train.micro_batch_size * r.train.seq_len)
    for n in range(adapter.num_layers, resident, -1):
        variant = dataclasses.replace(r, engine=dataclasses.replace(e, resident_layers=n))
        plan = plan_step(variant, adapter, device, **plan_args)
        lean = plan.lean
        if plan.fits and lean is not None and lean.label == "memory-lean" and not lean.offloaded_checkpoints \
                and not lean.dropped_checkpoints and lean.mlp_chunk_tokens is None \
                and lean.loss_chunk_tokens == whole_chunk:
            plan.path += (f"; engine.resident_layers auto: {n} layers resident on the memory-lean path, the "
                          f"short-context plan's compute, rather than {resident} on the short-context path")
            return plan
    return None


def _named(problems: list[str], limit: HostLimit) -> list[str]:
    """The host-memory problems with the ceiling they were measured against (a container's or a job's
    cgroup limit is not the machine's RAM, and the fix differs)."""
    return [f"{p} The smallest host limit: {limit.describe()}." for p in problems]


def _resident(n: int) -> str:
    return f"; first {n} layers resident on the device" if n else ""


def _lean_host_plan(args: dict, lean: LeanPlan, resident: int = 0) -> MemoryPlan:
    """The memory plan whose host figures stand on a lean path; its device figures are the short-context
    engine's, which the lean plan replaces (said in its notes; the lean budget left the resident layers out)."""
    plan = make_plan(**{**args, "checkpoint_interval": lean.checkpoint_interval,
                        "loss_chunk_tokens": lean.loss_chunk_tokens}, keep_blocks=0, resident_layers=resident)
    plan.notes.append(f"{lean.label} path: the device figures above are the short-context engine's; the "
                      f"{lean.label} plan replaces them")
    return plan


def _mlp(lean: LeanPlan) -> str:
    return f"MLP chunked by {lean.mlp_chunk_tokens}" if lean.mlp_chunk_tokens else "MLP unchunked"
