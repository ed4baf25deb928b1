"""The lean plan: how a step fits the device when the short-context plan (memory.py) would not: long
sequences (the long-context path) and, as `plan_memory_lean`, any step shape that does not fit (the
memory-lean path). Pure arithmetic over the model shape (nothing allocated): the checkpoint interval, the
MLP chunk, the loss chunk, how many checkpoints go to pinned host memory (engine/transfer/offload.py), and
the device peak term by term for each phase of the step (lean_terms.py).

When the host cannot hold the checkpoints the device cannot, the plan drops the fewest that make both fit:
the backward rebuilds dropped checkpoint j from j-1 with one more no-grad forward of layer j-1
(engine/rebuild.py). Dropped are 1, 3, 5, ...: each needs the one before it stored, and the backward reaches
them last, when the fewest other checkpoints are still on the device.

Checkpoint interval is always 1: a block of k layers costs L/k checkpoints plus k layer graphs, and a layer
graph is ~13 checkpoints, so one layer per block is the least memory for any L (and it streams each layer's
weights twice per step, as any interval up to the 2 weight slots does). The step's tokens (every micro-batch)
set the checkpoints and a recorded layer's saved tensors; one micro-batch's tokens the head's logits chunk,
an MLP chunk, SDPA's backward and the forward's temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatrain_cli.engine.plan.lean_terms import ModelShape, checkpoint_bytes, device_terms
from megatrain_cli.engine.transfer.slots import embedding_rows_pinned, transfer_chunk

GiB = 2**30


def fmt_bytes(n: int) -> str:
    """'22.57 GiB', or MiB below a tenth of a GiB (the tiny models of the tests)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 or n == 0 else f"{n / 2**20:.2f} MiB"


@dataclass
class LeanPlan:
    seq_len: int
    batch: int
    budget: int  # device bytes (the whole device's: resident layers included)
    usable: int  # what the predicted peak must stay under: the headroom of what the resident layers leave, + them
    checkpoint_interval: int
    mlp_chunk_tokens: int | None  # None: the MLP runs unchunked
    loss_chunk_tokens: int
    lean_norms: bool
    num_checkpoints: int
    offloaded_checkpoints: int  # the first k stored checkpoints live in pinned host memory
    checkpoint_bytes: int  # one checkpoint
    fixed: dict = field(default_factory=dict)  # term -> bytes, alive the whole step
    phases: dict = field(default_factory=dict)  # phase -> {term: bytes}, on top of `fixed`
    host_budget: int | None = None
    notes: list = field(default_factory=list)
    grad_accum: int = 1  # micro-batches per step, each of `batch` rows: the engine records them all at once
    label: str = "long-context"  # or "memory-lean": the fallback of a short sequence (plan_memory_lean)
    # Checkpoints not stored, rebuilt in the backward from the one before (engine/rebuild.py), and how many
    # would have gone to pinned host memory without them (what the host budget could not hold).
    dropped_checkpoints: tuple = ()
    offloads_wanted: int = 0
    # Device bytes of the resident layers and the head (engine/resident.py) the step runs beside: a fixed term,
    # so the predicted peak is the whole device's; the plan's choices are made on what they leave.
    resident_bytes: int = 0

    @property
    def tokens(self) -> int:
        """The step's tokens: every micro-batch's checkpoints and layer graph are alive together."""
        return self.batch * self.grad_accum * self.seq_len

    @property
    def micro_tokens(self) -> int:
        """One micro-batch's tokens: what the head's chunk loop, SDPA's backward and an MLP chunk work on."""
        return self.batch * self.seq_len

    def phase_total(self, phase: str) -> int:
        return sum(self.fixed.values()) + sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def predicted_peak(self) -> int:
        return self.phase_total(self.peak_phase)

    @property
    def host_pinned_bytes(self) -> int:
        return self.offloaded_checkpoints * self.checkpoint_bytes

    @property
    def fits(self) -> bool:
        host_ok = self.host_budget is None or self.host_pinned_bytes <= self.host_budget
        return self.predicted_peak <= self.usable and host_ok

    @property
    def offload_keys(self) -> list[int]:
        """Checkpoint (block) indices to give CheckpointOffloader: the first stored ones, read last in backward."""
        stored = [b for b in range(self.num_checkpoints) if b not in self.dropped_checkpoints]
        return stored[:self.offloaded_checkpoints]

    @property
    def device_checkpoints(self) -> int:
        """Checkpoints kept on the device from the forward to their block's recompute."""
        return self.num_checkpoints - self.offloaded_checkpoints - len(self.dropped_checkpoints)

    def recompute_choice(self) -> str:
        """What was traded for host memory, and why ('' when no checkpoint is dropped)."""
        n = len(self.dropped_checkpoints)
        if not n:
            return ""
        why = ("host memory short (" + (f"{fmt_bytes(self.host_budget)} free for checkpoints, "
               f"{fmt_bytes(self.offloads_wanted * self.checkpoint_bytes)} needed" if self.host_budget is not None
               else "no host budget given") + ")") if self.offloads_wanted else "checkpoints dropped as asked"
        return (f"{why}: {n} of {self.num_checkpoints} checkpoints recomputed from the one before "
                f"(+{n * self.checkpoint_interval} layer forward{'s' if n * self.checkpoint_interval > 1 else ''} per "
                f"step), {self.offloaded_checkpoints} offloaded "
                f"to pinned host memory")

    def render(self) -> str:
        gib = lambda b: f"{b / GiB:7.2f} GiB"  # noqa: E731
        mlp = f"chunked by {self.mlp_chunk_tokens} tokens" if self.mlp_chunk_tokens else "unchunked"
        accum = f" x {self.grad_accum} micro-batches" if self.grad_accum > 1 else ""
        lines = [f"{self.label} plan: {self.batch} x {self.seq_len} tokens{accum}; device budget {gib(self.budget)}, "
                 f"planned to {gib(self.usable)}",
                 f"  checkpoint interval {self.checkpoint_interval}; MLP {mlp}; loss chunk "
                 f"{self.loss_chunk_tokens} tokens; RMSNorm {'lean' if self.lean_norms else 'HF'}",
                 f"  checkpoints: {self.num_checkpoints} x {gib(self.checkpoint_bytes).strip()}; "
                 f"{self.device_checkpoints} on the device, {self.offloaded_checkpoints} "
                 f"in pinned host memory ({gib(self.host_pinned_bytes).strip()})"
                 + (f", {len(self.dropped_checkpoints)} rebuilt in the backward ({_ranges(self.dropped_checkpoints)})"
                    if self.dropped_checkpoints else "")]
        if self.dropped_checkpoints:
            lines.append(f"  {self.recompute_choice()}")
        lines.append(f"  whole step: {gib(sum(self.fixed.values()))}")
        lines.extend(f"    {k:<64} {gib(v)}" for k, v in self.fixed.items() if v)
        for phase, terms in self.phases.items():
            mark = "   <- peak" if phase == self.peak_phase else ""
            lines.append(f"  {phase}: {gib(self.phase_total(phase))} with the above{mark}")
            lines.extend(f"    {k:<64} {gib(v)}" for k, v in terms.items() if v)
        lines.append(f"  predicted device peak {gib(self.predicted_peak).strip()} ({self.peak_phase}): "
                     + ("fits" if self.fits else "DOES NOT FIT"))
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def summary(self) -> str:
        """The plan in one line (the trainer's path line, the bench's notes)."""
        mlp = f"MLP chunked by {self.mlp_chunk_tokens}" if self.mlp_chunk_tokens else "MLP unchunked"
        checkpoints = (self.recompute_choice() or f"{self.offloaded_checkpoints} of {self.num_checkpoints} "
                       "checkpoints offloaded to pinned host memory") + f" ({fmt_bytes(self.host_pinned_bytes)})"
        return (f"checkpoint interval {self.checkpoint_interval}, {mlp}, loss chunk {self.loss_chunk_tokens}, RMSNorm "
                f"{'lean' if self.lean_norms else 'HF'}, {checkpoints}, predicted device peak "
                f"{fmt_bytes(self.predicted_peak)} of {fmt_bytes(self.budget)} ({self.peak_phase})")


def _ranges(keys) -> str:
    """'0..3, 5, 7' for the checkpoint indices [0, 1, 2, 3, 5, 7]."""
    runs: list[list[int]] = []
    for k in sorted(keys):
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}..{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def plan_long_context(model: Any, seq_len: int, *, batch: int = 1, grad_accum: int = 1, device_budget_bytes: int,
                      host_budget_bytes: int | None = None, dtype: torch.dtype = torch.bfloat16,
                      layer_slots: int = 2, mlp_chunk_tokens: int = 8192, chunk_mlp: bool | None = None,
                      loss_chunk_tokens: int = 4096, offload: bool | None = None, drop: int | None = None,
                      lean_norms: bool = False, headroom: float = 0.95, device_type: str = "cuda",
                      fallback: bool = False, resident_bytes: int = 0) -> LeanPlan:
    """The activation plan for one step of `grad_accum` micro-batches of `batch` x `seq_len` tokens (the engine
    records every micro-batch's graph of a layer before its backward: the module doc says what scales how).

    chunk_mlp: None chunks it when the unchunked MLP's activations would take over 10% of the budget, or when
    chunking avoids offloading. offload: None offloads as few checkpoints as keep the peak under
    `headroom` x the budget; True offloads all, False none. `host_budget_bytes`, when given, is the
    pinned host memory the offloaded checkpoints may take (what the host store leaves free). drop: None
    drops checkpoints (each rebuilt in the backward from the one before, one more layer forward per step)
    only when the host budget cannot hold the offloaded ones, as few as make the plan fit; a number drops
    that many (1, 3, 5, ...; 0 never).
    `device_type` 'cuda' reserves 1 GiB for the CUDA context and library workspaces (nothing on CPU).
    `fallback`: the memory-lean plan of a step the short-context plan does not fit (plan_memory_lean):
    the loss chunk is halved (down to LEAN_MIN_LOSS_CHUNK) before checkpoints are offloaded, and the MLP
    is chunked only when that offloads fewer checkpoints or is needed to fit.
    `resident_bytes`: the resident layers' and head's device bytes (step_plan.plan_step), counted exactly
    beside the rest; the headroom and the MLP-chunking rule apply to what they leave of the budget.
    """
    options = dict(batch=batch, grad_accum=grad_accum, device_budget_bytes=device_budget_bytes,
                   host_budget_bytes=host_budget_bytes, dtype=dtype, layer_slots=layer_slots,
                   mlp_chunk_tokens=mlp_chunk_tokens, chunk_mlp=chunk_mlp, loss_chunk_tokens=loss_chunk_tokens,
                   offload=offload, drop=drop, headroom=headroom,
                   reserve_bytes=GiB if device_type == "cuda" else 0, fallback=fallback,
                   resident_bytes=resident_bytes)
    shape = ModelShape.of(model)
    plan = _choose(shape, seq_len, lean_norms=lean_norms, **options)
    _add_notes(plan)
    if not lean_norms:
        lean = _choose(shape, seq_len, lean_norms=True, **options)
        plan.notes.append(f"lean RMSNorm (lean_layers.slim_norms): peak {lean.predicted_peak / GiB:.1f} GiB with "
                          f"{lean.offloaded_checkpoints} checkpoints offloaded"
                          + (f", {len(lean.dropped_checkpoints)} recomputed" if lean.dropped_checkpoints else ""))
    return plan


def choose_plan(model: Any, seq_len: int, *, lean_norms: bool | None = None, **options) -> LeanPlan:
    """plan_long_context, with lean_norms=None choosing: HF's RMSNorm when that plan fits without dropping
    checkpoints, else the lean one when it fits with fewer dropped (it offloads fewer checkpoints: less
    pinned host memory and PCIe, and a lean norm costs less than a layer's forward), else the HF plan
    (which may not fit; its notes give the lean figures)."""
    if lean_norms is not None:
        return plan_long_context(model, seq_len, lean_norms=lean_norms, **options)
    plan = plan_long_context(model, seq_len, **options)
    if plan.fits and not plan.dropped_checkpoints:
        return plan
    lean = plan_long_context(model, seq_len, lean_norms=True, **options)
    better = not plan.fits or len(lean.dropped_checkpoints) < len(plan.dropped_checkpoints)
    return lean if lean.fits and better else plan


# Left for what the process allocates after MemAvailable is read and nothing else counts: the CUDA context
# and libraries (a plan may run before CUDA starts), Python, the data (perf-notes, session 9: measured growth).
HOST_MARGIN = 6 * GiB


def host_budget_bytes(pinned_engine_bytes: int, margin_bytes: int = HOST_MARGIN, available: int | None = None) -> int:
    """Host memory the offloaded checkpoints may pin: MemAvailable (or `available`), read now, minus the
    engine's own pinned buffers (weight staging, gradient slabs, the embedding rows) minus the margin. Never
    below 0. A caller that reads it before the host store is built subtracts the store itself."""
    if available is None:
        from megatrain_cli.machine import available_host_bytes

        available = available_host_bytes()
    return max(0, available - pinned_engine_bytes - margin_bytes)


# `megatrain train`: sequences this long take the long-context path (plan_for_training).
LONG_CONTEXT_MIN_SEQ = 32768
# The memory-lean fallback halves the loss chunk down to this before it offloads checkpoints (a [1024, vocab]
# logits GEMM still runs at full speed; an offloaded checkpoint costs pinned memory and two PCIe crossings).
LEAN_MIN_LOSS_CHUNK = 1024


def plan_for_training(adapter: Any, *, seq_len: int, micro_batch_size: int, grad_accum: int, dtype: torch.dtype,
                      device_type: str, device_budget: int | None, grad_slabs: int = 12, layer_slots: int = 2,
                      loss_chunk_tokens: int = 4096, store_bytes_to_come: int = 0,
                      min_seq_len: int = LONG_CONTEXT_MIN_SEQ, host_available: int | None = None,
                      fallback: bool = False, resident_bytes: int = 0, **choices) -> LeanPlan | None:
    """The trainer's long-context plan, or None below `min_seq_len` (the short-context engine).

    The plan is for grad_accum micro-batches of micro_batch_size x seq_len tokens (the engine records every
    micro-batch of a step at once). `device_budget` None: on CPU, what the host has free. The host budget
    is read now (MemAvailable, or `host_available` bytes): pass `store_bytes_to_come` = the host store's
    bytes when it is not built yet (a dry run). `fallback`, `resident_bytes`: see plan_long_context.
    `choices`: choose_plan's lean_norms and chunk_mlp, forced (step_plan.plan_step's `like`).
    """
    if seq_len < min_seq_len:
        return None
    width = torch.finfo(dtype).bits // 8
    big = max(sum(sp.numel for sp in adapter.layer_specs(i)) for i in range(adapter.num_layers))
    rows = embedding_rows_pinned(micro_batch_size * seq_len * grad_accum, adapter.vocab_size, adapter.hidden_size,
                                 width)
    pinned = (2 + grad_slabs) * transfer_chunk(big) * width + rows if device_type == "cuda" else 0
    host = max(0, host_budget_bytes(pinned, available=host_available) - store_bytes_to_come)
    if device_budget is None:
        if device_type == "cuda":
            raise ValueError("the long-context plan needs the device's memory: set engine.max_gpu_mem (e.g. 140GiB) "
                             "when planning without the GPU")
        device_budget = host_budget_bytes(0, 0, available=host_available)  # the CPU "device" is the host
    return choose_plan(adapter, seq_len, batch=micro_batch_size, grad_accum=grad_accum,
                       device_budget_bytes=device_budget, host_budget_bytes=host, dtype=dtype,
                       layer_slots=layer_slots, loss_chunk_tokens=loss_chunk_tokens, device_type=device_type,
                       fallback=fallback, resident_bytes=resident_bytes, **choices)


def plan_memory_lean(adapter: Any, **training) -> LeanPlan:
    """The memory-lean plan for any step shape (batch > 1, several micro-batches, short sequences): the
    fallback when the short-context plan (engine/plan.make_plan) does not fit the device budget. The
    long-context machinery at any length: checkpoint interval 1, a loss chunk halved until the head is
    no longer what offloads checkpoints, the MLP chunked only where that helps, and as few checkpoints as
    needed in pinned host memory (the host budget checked). Arguments: plan_for_training's, except
    min_seq_len and fallback. The plan's label is 'memory-lean'; check plan.fits."""
    plan = plan_for_training(adapter, **training, min_seq_len=0, fallback=True)
    plan.label = "memory-lean"
    return plan


def refusal(plan: LeanPlan) -> str:
    """Why `plan` does not fit, in one line ('' when it fits)."""
    reasons = []
    dropped = f" and {len(plan.dropped_checkpoints)} recomputed" if plan.dropped_checkpoints else ""
    if plan.predicted_peak > plan.usable:
        reasons.append(f"predicted device peak {fmt_bytes(plan.predicted_peak)} ({plan.peak_phase}) > "
                       f"{fmt_bytes(plan.usable)} usable of {fmt_bytes(plan.budget)} with "
                       f"{plan.offloaded_checkpoints} of {plan.num_checkpoints} checkpoints offloaded{dropped}")
    if plan.host_budget is not None and plan.host_pinned_bytes > plan.host_budget:
        reasons.append(f"the offloaded checkpoints need {fmt_bytes(plan.host_pinned_bytes)} of pinned host "
                       f"memory, {fmt_bytes(plan.host_budget)} is free after the host store"
                       + (dropped.replace(" and", ", with") if dropped else
                          ", and recomputing checkpoints from the one before instead (at most every other one) "
                          "does not fit either" if plan.offloads_wanted else ""))
    return "; ".join(reasons)


def _choose(shape: ModelShape, seq_len: int, *, batch, grad_accum, device_budget_bytes, host_budget_bytes, dtype,
            layer_slots, mlp_chunk_tokens, chunk_mlp, loss_chunk_tokens, offload, drop, headroom, lean_norms,
            reserve_bytes, fallback, resident_bytes) -> LeanPlan:
    w = torch.finfo(dtype).bits // 8
    micro = batch * seq_len  # one micro-batch: the head's chunks, an MLP chunk and SDPA's backward work on it
    tokens = micro * grad_accum  # the step: each checkpoint holds every micro-batch's hidden states
    free = device_budget_bytes - resident_bytes  # what the resident layers leave to the step
    usable = int(free * headroom) + resident_bytes

    def build(chunked: bool, chunk: int, offloaded: int, dropped: int = 0, wanted: int = 0) -> LeanPlan:
        plan = LeanPlan(seq_len, batch, device_budget_bytes, usable, 1, mlp_chunk_tokens if chunked else None,
                        chunk, lean_norms, shape.layers, offloaded, checkpoint_bytes(tokens, shape.hidden, w),
                        host_budget=host_budget_bytes, grad_accum=grad_accum,
                        dropped_checkpoints=tuple(range(1, 2 * dropped, 2)), offloads_wanted=wanted,
                        resident_bytes=resident_bytes)
        plan.fixed, plan.phases = device_terms(shape, plan, w, layer_slots, reserve_bytes)
        return plan

    def fewest_offloads(chunked: bool, chunk: int, dropped: int, most: int) -> LeanPlan:
        # Each offloaded checkpoint lowers the device peak by one checkpoint: offload as few as needed.
        for k in range(most + 1):
            plan = build(chunked, chunk, k, dropped)
            if plan.predicted_peak <= usable:
                break
        return plan

    def with_offload(chunked: bool, chunk: int) -> LeanPlan:
        dropped = min(drop or 0, shape.layers // 2)
        if offload is not None:
            return build(chunked, chunk, shape.layers - dropped if offload else 0, dropped)
        plan = fewest_offloads(chunked, chunk, dropped, shape.layers - dropped)
        if drop is not None or host_budget_bytes is None or plan.host_pinned_bytes <= host_budget_bytes:
            return plan
        # Host memory short: drop checkpoints instead, the fewest with which the rest fit device and host.
        # A dropped checkpoint costs one layer forward per step; an offloaded one only PCIe time.
        host_holds = host_budget_bytes // plan.checkpoint_bytes
        for dropped in range(1, shape.layers // 2 + 1):
            traded = fewest_offloads(chunked, chunk, dropped, min(host_holds, shape.layers - dropped))
            if traded.fits:
                traded.offloads_wanted = plan.offloaded_checkpoints
                return traded
        plan.offloads_wanted = plan.offloaded_checkpoints  # tried: no number of drops fits
        return plan

    can_chunk = micro > mlp_chunk_tokens  # below one chunk the chunked MLP runs the plain forward anyway
    if fallback:
        # Every loss chunk from the given one down to LEAN_MIN_LOSS_CHUNK (the logits chunk is the one term
        # that does not scale with the step's tokens), chunked and not: the plan that fits with the fewest
        # offloaded checkpoints, then unchunked (no recomputed gate/up), then the largest chunk.
        chunks = [min(loss_chunk_tokens, micro)]
        while chunks[-1] // 2 >= LEAN_MIN_LOSS_CHUNK:
            chunks.append(chunks[-1] // 2)
        chunkings = [False, True] if chunk_mlp is None and can_chunk else [bool(chunk_mlp) and can_chunk]
        plan = min((with_offload(chunked, chunk) for chunked in chunkings for chunk in chunks),
                   key=lambda p: (not p.fits, len(p.dropped_checkpoints), p.offloaded_checkpoints,
                                  0 if p.fits else p.predicted_peak, p.mlp_chunk_tokens is not None,
                                  -p.loss_chunk_tokens))
    else:
        if chunk_mlp is None:
            unchunked_mlp = w * shape.intermediate * (4 * tokens + 3 * micro)  # 4 kept per token, 3 bwd temporaries
            chunked = can_chunk and unchunked_mlp > 0.10 * free
        else:
            chunked = chunk_mlp and can_chunk
        plan = with_offload(chunked, min(loss_chunk_tokens, micro))
        if chunk_mlp is None and not chunked and can_chunk and (plan.offloaded_checkpoints or plan.dropped_checkpoints
                                                                or not plan.fits):
            plan = with_offload(True, plan.loss_chunk_tokens)  # chunk before offloading: compute is cheaper than RAM
    # The head is rarely the peak, but its logits chunk is the one term that does not scale with T.
    while plan.peak_phase.startswith("head") and plan.predicted_peak > usable and plan.loss_chunk_tokens > 512:
        plan = build(plan.mlp_chunk_tokens is not None, plan.loss_chunk_tokens // 2, plan.offloaded_checkpoints,
                     len(plan.dropped_checkpoints), plan.offloads_wanted)
    return plan


def _add_notes(plan: LeanPlan) -> None:
    if plan.offloaded_checkpoints:
        plan.notes.append(f"checkpoints {_ranges(plan.offload_keys)} go to pinned host memory: "
                          f"{plan.host_pinned_bytes / GiB:.1f} GiB on top of the host store; each crosses PCIe "
                          f"twice per step ({plan.checkpoint_bytes / GiB:.2f} GiB, ~{plan.checkpoint_bytes / 25e9:.2f} "
                          "s at 25 GB/s, hidden behind a layer's compute)")
    if plan.dropped_checkpoints:
        plan.notes.append(f"checkpoints {_ranges(plan.dropped_checkpoints)} are not stored: the backward rebuilds "
                          "each from the one before with a no-grad forward of that layer, and holds the one before "
                          "on the device until its own recompute")
    if plan.host_budget is not None and plan.host_pinned_bytes > plan.host_budget:
        plan.notes.append(f"host: the offloaded checkpoints need {plan.host_pinned_bytes / GiB:.1f} GiB pinned, "
                          f"{plan.host_budget / GiB:.1f} GiB is free")
    if plan.predicted_peak > plan.usable:
        plan.notes.append(f"over budget with {plan.offloaded_checkpoints} checkpoints offloaded: offload more, "
                          "a shorter seq_len, lean RMSNorm, a smaller MLP chunk or loss chunk")
