"""The memory plan: what the recipe needs, by kind, on the host (pageable and pinned) and on the
device, computed from the model shape alone (nothing allocated). `--dry-run` prints it; the
pre-flight check compares it with what the machine has and refuses a run that would not fit.

Activation figures are estimates for SDPA attention in bf16 and say so; the weight, gradient,
optimizer and staging figures are exact byte counts of what the engine allocates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatrain_cli.engine.schedule import blocks, build_schedule, transfers_per_layer
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.store.tiles import HostStore

GiB = 2**30


@dataclass
class MemoryPlan:
    params: int
    host: dict = field(default_factory=dict)  # kind -> bytes (pageable tiles)
    pinned: dict = field(default_factory=dict)
    device: dict = field(default_factory=dict)
    h2d_per_layer: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def pinned_total(self) -> int:
        return sum(self.pinned.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    def render(self) -> str:
        lines = [f"memory plan for {self.params / 1e9:.3f} B parameters"]

        def table(title: str, items: dict, total: int) -> None:
            lines.append(f"  {title}")
            for k, v in items.items():
                lines.append(f"    {k:<38} {v / GiB:10.2f} GiB   {v / self.params:6.2f} B/param")
            lines.append(f"    {'total':<38} {total / GiB:10.2f} GiB   {total / self.params:6.2f} B/param")

        table("host, pageable (the tiles)", self.host, self.host_total)
        table("host, pinned (staging + gradient slabs)", self.pinned, self.pinned_total)
        table("device, peak (estimate)", self.device, self.device_total)
        lines.append(f"  host bytes per parameter, all state: {(self.host_total + self.pinned_total) / self.params:.2f}")
        lines.append(f"  H2D weight transfers per layer per step: {self.h2d_per_layer:.2f}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def make_plan(adapter: ModelAdapter, compute_dtype: torch.dtype, *, micro_batch_size: int, seq_len: int,
              grad_accum: int, checkpoint_interval: int, grad_slabs: int, layer_slots: int = 2,
              loss_chunk_tokens: int = 4096, device_type: str = "cuda") -> MemoryPlan:
    store = HostStore(adapter, compute_dtype, allocate=False)
    n = store.num_params()
    width = torch.finfo(compute_dtype).bits // 8
    plan = MemoryPlan(params=n)
    plan.host["fp32 master weights"] = 4 * n
    plan.host["fp32 Adam exp_avg"] = 4 * n
    plan.host["fp32 Adam exp_avg_sq"] = 4 * n
    plan.host[f"gradients ({str(compute_dtype).removeprefix('torch.')})"] = width * n
    plan.host["4 KiB alignment padding"] = max(0, store.host_bytes() - (12 + width) * n)
    big = store.largest_layer_numel()
    if device_type == "cuda":
        plan.pinned["weight staging (2 x largest layer)"] = 2 * big * width
        plan.pinned[f"gradient slabs (K={grad_slabs} x largest layer)"] = grad_slabs * big * width
    h, layers, vocab = adapter.hidden_size, adapter.num_layers, adapter.vocab_size
    tokens = micro_batch_size * seq_len
    inter = int(getattr(adapter.config, "intermediate_size", 4 * h))
    plan.device[f"layer weight slots ({layer_slots} x largest layer)"] = layer_slots * big * width
    plan.device["head weights (norm + LM head)"] = store.layouts["head"].numel * width
    if adapter.tied:
        plan.device["tied embedding table"] = store.layouts["embed"].numel * width
    plan.device["layer gradient (fp32 accumulator + cast)"] = big * (4 + width) + big * width
    plan.device["LM head gradient (fp32)"] = vocab * h * 4
    n_blocks = len(blocks(layers, checkpoint_interval))
    hidden_bytes = tokens * h * width
    plan.device["activation checkpoints (estimate)"] = n_blocks * grad_accum * hidden_bytes
    # Per layer per micro-batch, what autograd keeps for SDPA attention + SwiGLU MLP: about
    # 10 hidden-sized and 4 intermediate-sized tensors (an estimate, checked against measured peaks).
    per_layer = tokens * (10 * h + 4 * inter) * width
    plan.device["recomputed block activations (estimate)"] = checkpoint_interval * grad_accum * per_layer
    chunk = min(loss_chunk_tokens, tokens)
    plan.device["loss chunk logits + grads"] = chunk * vocab * (width + 4 + 4)
    counts = transfers_per_layer(build_schedule(layers, checkpoint_interval), layer_slots)
    plan.h2d_per_layer = sum(counts.get(f"layers.{i}", 0) for i in range(layers)) / layers
    if checkpoint_interval > layer_slots:
        plan.notes.append(f"checkpoint_interval {checkpoint_interval} > {layer_slots} weight slots: part of "
                          "each block is streamed a third time for its backward")
    return plan


def available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def preflight(plan: MemoryPlan, *, device: torch.device, device_budget: int | None = None) -> list[str]:
    """Problems that would make the run fail for memory, each with what to change; [] if it fits."""
    problems = []
    need_host = plan.host_total + plan.pinned_total
    have_host = available_host_bytes()
    if have_host and need_host > 0.95 * have_host:
        problems.append(f"host memory: the plan needs {need_host / GiB:.1f} GiB, {have_host / GiB:.1f} GiB is "
                        f"available. Use a machine with more RAM or a smaller model; fewer gradient slabs "
                        f"(engine.grad_slabs) save {plan.pinned_total / GiB:.1f} GiB at most.")
    if device.type == "cuda":
        total = device_budget or torch.cuda.get_device_properties(device).total_memory
        if plan.device_total > 0.95 * total:
            problems.append(f"device memory: the plan needs about {plan.device_total / GiB:.1f} GiB, the budget is "
                            f"{total / GiB:.1f} GiB. Use a smaller train.micro_batch_size or train.seq_len, a "
                            f"smaller engine.checkpoint_interval, or a smaller engine.loss_chunk_tokens.")
    return problems
