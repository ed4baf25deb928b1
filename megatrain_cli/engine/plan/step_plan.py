"""The one planner: from a recipe and a model shape to how a step runs and whether it fits.

`plan_step` is what `train`, `train --dry-run` and `bench` ask. It chooses the engine's path:

    short-context   the memory plan (memory.py): checkpoint interval and kept blocks from the recipe;
    long-context    train.seq_len >= engine.long_context_min_seq: the lean plan (lean.py), interval 1,
                    the MLP chunked over the sequence, checkpoints offloaded to pinned host memory (or,
                    when host memory is short, some recomputed from the one before: the path line says);
    memory-lean     the short-context plan does not fit the device budget and engine.memory_fallback:
                    the lean machinery at any length (lean.plan_memory_lean);

and lists every problem that would make the run fail for memory (`problems`, each saying what to
change). Below the long-context length it lists the candidate plans in its order of preference
(`_candidates`: more resident layers on the memory-lean path, the short-context plan, its memory-lean
fallback) and takes the first that fits. A plan holds one device figure (`StepPlan.device_bytes`): the
memory plan's on the short-context path, the lean plan's on a lean path. Pure arithmetic over the shape
plus a read of the host's memory ceilings (/proc/meminfo and the cgroup limits,
machine.effective_host_limit): nothing is allocated. `render` ends with the verdict
for this machine, which `--dry-run` prints and turns into its exit code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from megatrain_cli.engine.plan.disk_tier import choose_disk_state
from megatrain_cli.engine.plan.lean import LeanPlan, fmt_bytes, plan_for_training, plan_memory_lean, refusal
from megatrain_cli.engine.plan.memory import (MemoryPlan, device_problem, host_problems, kept_block_ids, make_plan,
                                              resident_device_bytes, resolve_keep_blocks, resolve_resident_layers)
from megatrain_cli.engine.plan.rollout_memory import recipe_rollout_bytes, rollout_problem
from megatrain_cli.engine.schedule import blocks
from megatrain_cli.machine import HostLimit, effective_host_limit
from megatrain_cli.recipe import Recipe, parse_bytes
from megatrain_cli.store.tiles import MASTER_DTYPES, HostStore

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class StepPlan:
    """How a step runs: `memory` holds the host figures (and on the short-context path the device's, term by
    term), `lean` the lean plan of a lean path (which holds the device's there); `device_bytes` is the one
    device figure; `problems` is empty when the run fits."""

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
    disk_state: str | None = None  # what the disk tier holds (store.disk_state, 'auto' decided); None: no tier

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def device_bytes(self) -> int:
        """The step's device peak: the memory plan's on the short-context path, the lean plan's predicted peak
        (its resident layers counted) on a lean path."""
        return self.memory.device_total if self.lean is None else self.lean.predicted_peak

    def render(self) -> str:
        """The memory plan, the path line, the lean plan and the verdict (what `--dry-run` prints)."""
        lines = [self.memory.render(), self.path]
        if self.disk_state is not None:
            lines.append(f"disk tier: the {self.disk_state} of every tile in per-layer files under store.disk, "
                         "read ahead of the host AdamW and written behind it (no speculation, no deferred moments)")
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
              budget: int | None = None, one_process: bool = True, like: LeanPlan | None = None) -> StepPlan:
    """The step's plan for `r` on `device` (a dry run may plan for CUDA on a machine without it): on the
    long-context path its lean plan, else the first of `_candidates` that fits (the last when none does).

    `store_built`: the host store already exists, so MemAvailable no longer counts its bytes: the host
    check is skipped and the lean plan's host budget is what is free now. `budget`: device bytes to plan
    for instead of device_budget(r, device) (e.g. less what NCCL's buffers take). `one_process` False: a
    data-parallel rank, which keeps no layer resident (engine/resident.py), so 'auto' resident layers are 0.
    `like`: on the long-context path, another lean plan whose choices to take (lean.plan_for_training)."""
    if not one_process and r.engine.resident_layers == "auto":
        r = dataclasses.replace(r, engine=dataclasses.replace(r.engine, resident_layers=0))
    s = _Setup.of(r, adapter, device, store_built, device_budget(r, device) if budget is None else budget)
    e, t = r.engine, r.train
    if e.long_context_min_seq is not None and t.seq_len >= e.long_context_min_seq:
        return _long_context(s, s.lean_resident, like)
    return _first_fitting(_candidates(s))


@dataclass(frozen=True)
class _Setup:
    """What every candidate plan of one recipe shares."""

    r: Recipe
    adapter: object
    device: torch.device
    budget: int | None  # device bytes; None: unknown (a CPU plan, or CUDA planned on a machine without it)
    args: dict  # make_plan's
    store: HostStore  # unallocated: the shape
    store_built: bool
    limit: HostLimit | None
    disk_note: str  # how store.disk_state 'auto' was decided ('' when it was not)

    @classmethod
    def of(cls, r: Recipe, adapter, device: torch.device, store_built: bool, budget: int | None) -> "_Setup":
        t, e = r.train, r.engine
        args = dict(adapter=adapter, compute_dtype=DTYPES[r.model.dtype], micro_batch_size=t.micro_batch_size,
                    seq_len=t.seq_len, grad_accum=t.grad_accum, checkpoint_interval=e.checkpoint_interval,
                    grad_slabs=e.grad_slabs, layer_slots=e.layer_slots, loss_chunk_tokens=e.loss_chunk_tokens,
                    device_type=device.type, master_dtype=MASTER_DTYPES[t.master_weights],
                    moments=t.optimizer_state)
        args["rollout_bytes"] = recipe_rollout_bytes(r, adapter, torch.finfo(args["compute_dtype"]).bits // 8)
        args["disk_state"], note = choose_disk_state(r, args, check_host=not store_built)
        store = HostStore(adapter, args["compute_dtype"], allocate=False, master_dtype=args["master_dtype"],
                          moments=t.optimizer_state, disk_state=args["disk_state"])
        return cls(r, adapter, device, budget, args, store, store_built,
                   None if store_built else effective_host_limit(), note)

    @property
    def lean_resident(self) -> int:
        """Resident layers on a lean path: an explicit engine.resident_layers holds there too; 'auto' is 0."""
        setting = self.r.engine.resident_layers
        return 0 if setting == "auto" else resolve_resident_layers(setting, self.budget, **self.args)

    def lean_args(self, resident: int) -> dict:
        """plan_for_training's arguments with `resident` layers on the device beside the lean plan (counted
        against a known budget; without one the CPU's budget is the host's)."""
        t, e = self.r.train, self.r.engine
        beside = resident_device_bytes(self.store, resident, self.width) if self.budget is not None else 0
        return dict(seq_len=t.seq_len, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                    dtype=self.args["compute_dtype"], device_type=self.device.type, device_budget=self.budget,
                    grad_slabs=e.grad_slabs, layer_slots=e.layer_slots, loss_chunk_tokens=e.loss_chunk_tokens,
                    store_bytes_to_come=0 if self.store_built else self.store.host_bytes(), resident_bytes=beside)

    @property
    def width(self) -> int:
        return torch.finfo(self.args["compute_dtype"]).bits // 8

    def rollout_room(self, resident: int) -> str:
        """'' when GRPO's rollouts (none: '') fit the device beside `resident` layers, else the problem."""
        if not self.args["rollout_bytes"] or self.budget is None:
            return ""
        t = self.r.train
        return rollout_problem(make_plan(**self.args).device, resident_device_bytes(self.store, resident, self.width),
                               self.args["rollout_bytes"], self.budget, rows=t.micro_batch_size * t.grad_accum,
                               seq_len=t.seq_len, resident=resident)

    def host_problems(self, memory: MemoryPlan) -> list[str]:
        """The host-memory problems with the ceiling they were measured against ([] once the store is built)."""
        return [] if self.store_built else _named(host_problems(memory), self.limit)

    def plan(self, memory: MemoryPlan, interval: int, loss_chunk: int, keep: frozenset, lean: LeanPlan | None,
             resident: int, path: str, problems: list) -> StepPlan:
        checked = self.budget is not None or self.device.type != "cuda"
        if self.disk_note:
            path += f"; {self.disk_note}"
        return StepPlan(memory, interval, loss_chunk, keep, lean, resident, path, problems, self.limit, checked,
                        self.args["disk_state"])


def _candidates(s: _Setup) -> Iterator[StepPlan]:
    """A short-context recipe's plans, the planner's preference first (plan_step takes the first that fits):

    1. with 'auto' resident layers and nothing kept: the memory-lean plans with more resident layers than the
       short-context plan, most first, at its compute (interval 1 recomputes every layer, as that plan
       does; nothing offloaded or dropped, the MLP whole, the loss chunk not halved), each what asking for
       that many layers gives (its short-context plan over the budget): fewer transfers and less host work;
    2. the short-context plan (kept blocks and resident layers from the recipe, 'auto' filling the budget);
    3. its memory-lean fallback, when it is over the device budget and engine.memory_fallback.
    Lazy: the plans after the first that fits are never made (each is arithmetic)."""
    e, t = s.r.engine, s.r.train
    resident = resolve_resident_layers(e.resident_layers, s.budget, **s.args)
    keep = resolve_keep_blocks(e.keep_activations, s.budget, **s.args, resident_layers=resident)
    memory = make_plan(**s.args, keep_blocks=keep, resident_layers=resident)
    autos = [k for k in ("keep_activations", "resident_layers") if getattr(e, k) == "auto"]
    if autos and s.budget is None and s.device.type == "cuda":
        memory.notes.append(f"{' and '.join(autos)} 'auto' decided on the GPU from its memory (0 assumed here)")
    too_big = device_problem(memory, device=s.device, device_budget=s.budget) if s.budget is not None else ""
    host = s.host_problems(memory)
    lean_ok = e.memory_fallback and not host
    if not too_big and lean_ok and e.resident_layers == "auto" and not keep and s.budget and s.device.type == "cuda":
        yield from _more_resident(s, resident)
    threshold = "never" if e.long_context_min_seq is None else e.long_context_min_seq
    path = (f"path: short-context engine (train.seq_len {t.seq_len} < {threshold}; checkpoint interval "
            f"{e.checkpoint_interval}{_resident(resident)})")
    kept = kept_block_ids(len(blocks(s.adapter.num_layers, e.checkpoint_interval)), keep)
    rollouts = s.rollout_room(resident)
    yield s.plan(memory, e.checkpoint_interval, e.loss_chunk_tokens, kept, None, resident, path,
                 host + ([too_big] if too_big else []) + ([rollouts] if rollouts else []))
    if too_big and lean_ok:
        yield _memory_lean(s, memory, s.lean_resident)


def _more_resident(s: _Setup, resident: int) -> Iterator[StepPlan]:
    """_candidates' first kind: the memory-lean plans with n > `resident` layers resident at the short-context
    plan's compute, n from all layers down."""
    t, e = s.r.train, s.r.engine
    whole_chunk = min(e.loss_chunk_tokens, t.micro_batch_size * t.seq_len)
    for n in range(s.adapter.num_layers, resident, -1):
        if s.rollout_room(n):
            continue  # GRPO's rollouts would not fit beside n resident layers
        keep = resolve_keep_blocks(e.keep_activations, s.budget, **s.args, resident_layers=n)
        memory = make_plan(**s.args, keep_blocks=keep, resident_layers=n)
        if not device_problem(memory, device=s.device, device_budget=s.budget):
            continue  # asking for n layers gives the short-context path
        plan = _memory_lean(s, memory, n)
        lean = plan.lean
        if lean.offloaded_checkpoints or lean.dropped_checkpoints or lean.mlp_chunk_tokens is not None \
                or lean.loss_chunk_tokens != whole_chunk:
            continue
        plan.path += (f"; engine.resident_layers auto: {n} layers resident on the memory-lean path, the "
                      f"short-context plan's compute, rather than {resident} on the short-context path")
        yield plan


def _first_fitting(plans: Iterable[StepPlan]) -> StepPlan:
    """The first plan that fits, else the last one (whose problems say why nothing fits)."""
    plan = None
    for plan in plans:
        if plan.fits:
            return plan
    return plan


def _memory_lean(s: _Setup, short: MemoryPlan, resident: int) -> StepPlan:
    """The memory-lean fallback of the short-context plan `short` (over the device budget), with `resident`
    layers resident."""
    lean = plan_memory_lean(s.adapter, **s.lean_args(resident))
    # Against the whole device budget: the short plan's figure counts its resident layers too.
    why = (f"the short-context plan{f' with {short.resident_layers} resident layers' if short.resident_layers else ''}"
           f" needs about {fmt_bytes(short.device_total)} of the {fmt_bytes(s.budget)}")
    memory = _lean_host_plan(s, lean, resident)
    path = (f"path: memory-lean engine ({why} device budget): {lean.summary()}, no kept activations"
            f"{_resident(resident)}")
    problems = s.host_problems(memory)
    if not lean.fits:
        problems.append(f"device memory: {why} budget, and the memory-lean plan does not fit either: "
                        f"{refusal(lean)}. Use a smaller train.micro_batch_size, train.grad_accum or "
                        f"train.seq_len, or a larger engine.max_gpu_mem; `megatrain train RECIPE --dry-run` "
                        f"shows both plans.")
    problems += [p for p in [s.rollout_room(resident)] if p]
    return s.plan(memory, lean.checkpoint_interval, lean.loss_chunk_tokens, frozenset(), lean, resident, path,
                  problems)


def _long_context(s: _Setup, resident: int, like: LeanPlan | None) -> StepPlan:
    t, e = s.r.train, s.r.engine
    # `like`'s choices taken: only where the checkpoints go is decided here.
    choices = {} if like is None else dict(loss_chunk_tokens=like.loss_chunk_tokens, lean_norms=like.lean_norms,
                                           chunk_mlp=like.mlp_chunk_tokens is not None)
    lean = plan_for_training(s.adapter, **{**s.lean_args(resident), **choices}, min_seq_len=e.long_context_min_seq)
    memory = _lean_host_plan(s, lean, resident)
    checkpoints = lean.recompute_choice() or (f"{lean.offloaded_checkpoints} of {lean.num_checkpoints} "
                                              "checkpoints offloaded to host memory")
    path = (f"path: long-context engine (train.seq_len {t.seq_len} >= {e.long_context_min_seq}): checkpoint "
            f"interval {lean.checkpoint_interval}, {_mlp(lean)}, {checkpoints}, no kept activations"
            f"{_resident(resident)}")
    problems = s.host_problems(memory)
    if not lean.fits:
        problems.append(f"long context: {refusal(lean)}. Use a shorter train.seq_len, a smaller "
                        f"train.micro_batch_size or train.grad_accum, or a larger engine.max_gpu_mem; "
                        f"`megatrain train RECIPE --dry-run` shows the plan.")
    problems += [p for p in [s.rollout_room(resident)] if p]
    return s.plan(memory, lean.checkpoint_interval, lean.loss_chunk_tokens, frozenset(), lean, resident, path,
                  problems)


def _named(problems: list[str], limit: HostLimit) -> list[str]:
    """The host-memory problems with the ceiling they were measured against (a container's or a job's
    cgroup limit is not the machine's RAM, and the fix differs)."""
    return [f"{p} The smallest host limit: {limit.describe()}." for p in problems]


def _resident(n: int) -> str:
    return f"; first {n} layers resident on the device" if n else ""


def _lean_host_plan(s: _Setup, lean: LeanPlan, resident: int) -> MemoryPlan:
    """The memory plan of a lean path: the host figures (and the transfers at the lean plan's interval); the
    device figures are the lean plan's."""
    return make_plan(**{**s.args, "checkpoint_interval": lean.checkpoint_interval,
                        "loss_chunk_tokens": lean.loss_chunk_tokens}, keep_blocks=0, resident_layers=resident,
                     device_figures=False)


def _mlp(lean: LeanPlan) -> str:
    return f"MLP chunked by {lean.mlp_chunk_tokens}" if lean.mlp_chunk_tokens else "MLP unchunked"
