"""The memory plan: what the recipe needs, by kind, on the host (pageable and pinned) and, on the
short-context path, on the device, computed from the model shape alone (nothing allocated). `--dry-run`
prints it; the pre-flight check compares it with what the machine has and refuses a run that would not fit.
On a lean path the lean plan (lean.py) holds the device figures and this plan only the host's.

Activation figures come from lean_terms.py's per-layer model (the lean plan's too: one model, measured
against real layers there) and say "estimate"; the weight, gradient, optimizer and staging figures are
exact byte counts of what the engine allocates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatrain_cli.engine.plan.lean_terms import ModelShape, checkpoint_bytes, layer_saved_bytes
from megatrain_cli.engine.resident import CAST_CHUNK, resident_bytes_per_param
from megatrain_cli.engine.schedule import blocks, build_schedule, transfers_per_layer
from megatrain_cli.engine.transfer.slots import embedding_rows_pinned, transfer_chunk
from megatrain_cli.machine import available_host_bytes
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.optim.state_adamw import CHUNK as STATE_CHUNK, LIVE_BYTES as STATE_LIVE_BYTES
from megatrain_cli.store.moments import BLOCK, MOMENT_DTYPES, block_count
from megatrain_cli.store.tiles import HostStore

GiB = 2**30


@dataclass
class MemoryPlan:
    params: int
    host: dict = field(default_factory=dict)  # kind -> bytes (pageable tiles)
    pinned: dict = field(default_factory=dict)
    disk: dict = field(default_factory=dict)  # kind -> bytes the disk tier holds (store.disk_state), not the host
    device: dict = field(default_factory=dict)  # empty on a lean path: the lean plan holds the device figures
    h2d_per_layer: float = 0.0
    keep_blocks: int = 0  # last blocks whose activations are kept instead of recomputed
    resident_layers: int = 0  # first layers whose optimizer state lives on the device
    notes: list = field(default_factory=list)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def disk_total(self) -> int:
        return sum(self.disk.values())

    @property
    def pinned_total(self) -> int:
        return sum(self.pinned.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    def render(self) -> str:
        lines = [f"memory plan for {self.params / 1e9:.3f} B parameters"]

        width = max(len(k) for k in [*self.host, *self.pinned, *self.device, *self.disk])

        def table(title: str, items: dict, total: int) -> None:
            lines.append(f"  {title}")
            for k, v in items.items():
                lines.append(f"    {k:<{width}} {v / GiB:10.2f} GiB   {v / self.params:6.2f} B/param")
            lines.append(f"    {'total':<{width}} {total / GiB:10.2f} GiB   {total / self.params:6.2f} B/param")

        table("host, pageable (the tiles)", self.host, self.host_total)
        table("host, pinned (staging + gradient slabs)", self.pinned, self.pinned_total)
        if self.disk:
            table("disk tier (store.disk: per-layer files, a few layers in host memory at a time)", self.disk,
                  self.disk_total)
        if self.device:
            table("device, peak (estimate)", self.device, self.device_total)
        lines.append(f"  host bytes per parameter, all state: {(self.host_total + self.pinned_total) / self.params:.2f}")
        lines.append(f"  H2D weight transfers per layer per step: {self.h2d_per_layer:.2f}")
        lines.append(f"  blocks keeping their activations (no recompute): {self.keep_blocks}")
        lines.append(f"  layers resident on the device (updated there, never streamed): {self.resident_layers}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def make_plan(adapter: ModelAdapter, compute_dtype: torch.dtype, *, micro_batch_size: int, seq_len: int,
              grad_accum: int, checkpoint_interval: int, grad_slabs: int, layer_slots: int = 2,
              loss_chunk_tokens: int = 4096, device_type: str = "cuda", keep_blocks: int = 0,
              resident_layers: int = 0, master_dtype: torch.dtype = torch.float32, moments: str = "fp32",
              device_figures: bool = True, disk_state: str | None = None, rollout_bytes: int = 0) -> MemoryPlan:
    """The plan; `keep_blocks`: how many of the last blocks keep their activations (no recompute);
    `resident_layers`: how many of the first layers keep their optimizer state on the device;
    `master_dtype`: train.master_weights; `moments`: train.optimizer_state; `device_figures` False: the host
    figures alone (a lean path); `disk_state`: what the disk tier holds (store.disk_state; None: nothing);
    `rollout_bytes`: GRPO's rollouts' own device bytes (rollout_memory.py; 0: no rollouts)."""
    store = HostStore(adapter, compute_dtype, allocate=False, master_dtype=master_dtype, moments=moments,
                      disk_state=disk_state)
    n = store.num_params()
    width = torch.finfo(compute_dtype).bits // 8
    plan = MemoryPlan(params=n)

    def state(section: str, kind: str, nbytes: int) -> None:  # on the host, or in the disk tier's files
        (plan.disk if section in store.on_disk else plan.host)[kind] = nbytes

    master = torch.finfo(store.master_dtype).bits // 8  # train.master_weights: 4 (fp32) or 2 (bf16)
    state("master", f"{'fp32' if master == 4 else 'bf16'} master weights", master * n)
    code = MOMENT_DTYPES[moments].itemsize  # train.optimizer_state: 4, 2 or 1 byte per moment
    state("exp_avg", f"{moments} Adam exp_avg", code * n)
    state("exp_avg_sq", f"{moments} Adam exp_avg_sq", code * n)
    if moments == "int8":
        state("exp_avg_exp", f"int8 block exponents (1 byte per {BLOCK} elements and moment)",
              2 * sum(block_count(l.numel) for l in store.layouts.values()))
    plan.host[f"gradients ({str(compute_dtype).removeprefix('torch.')})"] = width * n
    plan.host["4 KiB alignment padding"] = max(0, store.host_bytes() - sum(plan.host.values()))
    if store.on_disk:
        plan.disk["4 KiB alignment padding"] = max(0, store.disk_bytes() - sum(plan.disk.values()))
    big = store.largest_layer_numel()
    if device_type == "cuda":
        chunk = transfer_chunk(big)
        plan.pinned[f"weight staging (2 x {chunk / 1e6:.0f} M-element chunks)"] = 2 * chunk * width
        plan.pinned[f"gradient slabs (K={grad_slabs} x {chunk / 1e6:.0f} M elements)"] = grad_slabs * chunk * width
        plan.pinned["embedding rows in / gradients out (power of 2)"] = embedding_rows_pinned(
            micro_batch_size * seq_len * grad_accum, adapter.vocab_size, adapter.hidden_size, width)
    layers = adapter.num_layers
    resident_layers = max(0, min(resident_layers, layers))
    bl = blocks(layers, checkpoint_interval)
    keep_blocks = max(0, min(keep_blocks, len(bl)))
    if device_figures:
        _device_figures(plan, store, width, micro_batch_size=micro_batch_size, seq_len=seq_len,
                        grad_accum=grad_accum, checkpoint_interval=checkpoint_interval, layer_slots=layer_slots,
                        loss_chunk_tokens=loss_chunk_tokens, keep_blocks=keep_blocks, resident_layers=resident_layers,
                        rollout_bytes=rollout_bytes)
    plan.keep_blocks = keep_blocks
    counts = transfers_per_layer(build_schedule(layers, checkpoint_interval, kept_block_ids(len(bl), keep_blocks)),
                                 layer_slots)
    plan.h2d_per_layer = sum(counts.get(f"layers.{i}", 0) for i in range(resident_layers, layers)) / layers
    plan.resident_layers = resident_layers
    if checkpoint_interval > layer_slots:
        plan.notes.append(f"checkpoint_interval {checkpoint_interval} > {layer_slots} weight slots: part of "
                          "each block is streamed a third time for its backward")
    return plan


def _device_figures(plan: MemoryPlan, store: HostStore, width: int, *, micro_batch_size: int, seq_len: int,
                    grad_accum: int, checkpoint_interval: int, layer_slots: int, loss_chunk_tokens: int,
                    keep_blocks: int, resident_layers: int, rollout_bytes: int = 0) -> None:
    """The short-context engine's device peak, term by term, into plan.device."""
    adapter = store.adapter
    h, layers, vocab = adapter.hidden_size, adapter.num_layers, adapter.vocab_size
    tokens, big = micro_batch_size * seq_len, store.largest_layer_numel()
    plan.device[f"layer weight slots ({layer_slots} x largest layer)"] = layer_slots * big * width
    plan.device["head weights (norm + LM head)"] = store.layouts["head"].numel * width
    if adapter.tied:
        plan.device["tied embedding table"] = store.layouts["embed"].numel * width
    plan.device["layer gradient (fp32 accumulator + cast)"] = big * (4 + width) + big * width
    plan.device["LM head gradient (fp32)"] = vocab * h * 4
    if resident_layers:
        plan.device[f"resident: {resident_layers} layers + head (master, moments, weights, gradient)"] = \
            resident_device_bytes(store, resident_layers, width)
    bl = blocks(layers, checkpoint_interval)
    kept_layers = sum(len(b) for b in bl[len(bl) - keep_blocks:])
    plan.device["activation checkpoints (estimate)"] = \
        (len(bl) - keep_blocks) * grad_accum * checkpoint_bytes(tokens, h, width)
    shape = ModelShape.of(adapter)
    # What autograd keeps for one recorded layer (SDPA, HF norms, the MLP whole: the short-context engine's).
    per_layer = sum(layer_saved_bytes(shape, tokens, width, mlp_chunked=False, lean_norms=False,
                                      seq_len=seq_len).values())
    if shape.eager:
        plan.notes.append("eager attention (no SDPA for this family): each layer keeps its [T, T] attention "
                          "probabilities per head; shorter rows or a smaller micro-batch cut it quadratically")
    chunk = min(loss_chunk_tokens, tokens)
    loss_chunk = chunk * vocab * (width + 4 + 4)
    # Kept blocks are the LAST ones: their activations live from their forward to their backward,
    # which runs first; by the time a block is recomputed they are gone. So the peak is the larger
    # of (kept activations + the loss chunk at the head) and (one recomputed block).
    recomputed = checkpoint_interval * grad_accum * per_layer if keep_blocks < len(bl) else 0
    kept = kept_layers * grad_accum * per_layer
    if kept + loss_chunk >= recomputed:
        plan.device[f"kept activations, last {keep_blocks} blocks = {kept_layers} layers (estimate)"] = kept
        plan.device["loss chunk logits + grads"] = loss_chunk
    else:
        plan.device["recomputed block activations (estimate)"] = recomputed
    # GRPO's rollouts run before the step's forward: only what they need beyond its activations adds to the peak
    activations = plan.device["activation checkpoints (estimate)"] + max(kept + loss_chunk, recomputed)
    if rollout_bytes > activations:
        plan.device["GRPO rollouts: KV caches + prefill, beyond the step's activations"] = rollout_bytes - activations


def host_state_line(adapter: ModelAdapter, compute_dtype: torch.dtype, master_dtype: torch.dtype,
                    moments: str, disk_state: str | None = None) -> str:
    """One line of the host tiles' size, and the disk tier's (`megatrain plan`; `train --dry-run` itemises them)."""
    store = HostStore(adapter, compute_dtype, allocate=False, master_dtype=master_dtype, moments=moments,
                      disk_state=disk_state)
    total, n = store.host_bytes(), store.num_params()
    master = "bf16" if master_dtype == torch.bfloat16 else "fp32"
    disk = (f"; disk tier (store.disk_state={disk_state}): {store.disk_bytes() / GiB:.1f} GiB, "
            f"{store.disk_bytes() / n:.2f} bytes/param" if disk_state else "")
    return (f"host state: {total / GiB:.1f} GiB of tiles, {total / n:.2f} bytes/param (train.master_weights={master}, "
            f"train.optimizer_state={moments}){disk}; `train --dry-run` itemises them with the pinned buffers")


def resident_device_bytes(store: HostStore, n: int, width: int) -> int:
    """Device bytes of the first n layers and the head kept resident (engine/resident.py), with its fp32
    scratch for widening a bf16 master or gradient; 0 for n = 0."""
    if n <= 0:
        return 0
    master = torch.finfo(store.master_dtype).bits // 8
    per_param = resident_bytes_per_param(master, width, width, store.moments)
    scratch = 2 * CAST_CHUNK * 4 if min(width, master) != 4 else 0
    if store.moments != "fp32":  # optim/state_adamw.py's temporaries over one chunk
        scratch = max(scratch, STATE_LIVE_BYTES * STATE_CHUNK)
    numel = sum(store.layouts[name].numel for name in [*store.layer_names[:n], "head"])
    return int(numel * per_param) + scratch


def choose_resident_layers(budget_bytes: int, headroom: float = 0.88, **plan_args) -> int:
    """The most leading layers whose device-resident state fits the budget beside the plan without kept
    activations (kept blocks then take what is left)."""
    base = make_plan(**plan_args).device_total  # the resident term is the only one that grows with n
    store = HostStore(plan_args["adapter"], plan_args["compute_dtype"], allocate=False,
                      master_dtype=plan_args.get("master_dtype"), moments=plan_args.get("moments", "fp32"))
    width = torch.finfo(plan_args["compute_dtype"]).bits // 8
    best = 0
    for n in range(1, plan_args["adapter"].num_layers + 1):
        if base + resident_device_bytes(store, n, width) > headroom * budget_bytes:
            break
        best = n
    return best


def resolve_resident_layers(setting: int | str, budget_bytes: int | None, **plan_args) -> int:
    """The recipe's engine.resident_layers: 'auto' fills the device budget first (CUDA only), N keeps N."""
    if setting != "auto":
        return max(0, min(int(setting), plan_args["adapter"].num_layers))
    if plan_args.get("device_type", "cuda") != "cuda" or not budget_bytes:
        return 0
    return choose_resident_layers(budget_bytes, **plan_args)


def kept_block_ids(n_blocks: int, keep_blocks: int) -> frozenset[int]:
    return frozenset(range(n_blocks - keep_blocks, n_blocks))


def choose_keep_blocks(budget_bytes: int, headroom: float = 0.88, **plan_args) -> int:
    """Memory-adaptive recompute: the most trailing blocks whose activations fit the device budget
    (with `headroom` left for the allocator's fragmentation and cuBLAS/SDPA workspaces)."""
    n_blocks = len(blocks(plan_args["adapter"].num_layers, plan_args["checkpoint_interval"]))
    best = 0
    for n in range(1, n_blocks + 1):
        if make_plan(**plan_args, keep_blocks=n).device_total <= headroom * budget_bytes:
            best = n
    return best


def resolve_keep_blocks(setting: int | str, budget_bytes: int | None, **plan_args) -> int:
    """The recipe's engine.keep_activations: 'auto' fills the device budget (CUDA only), N keeps N."""
    if setting != "auto":
        return max(0, int(setting))
    if plan_args.get("device_type", "cuda") != "cuda" or not budget_bytes:
        return 0
    return choose_keep_blocks(budget_bytes, **plan_args)


def host_problems(plan: MemoryPlan) -> list[str]:
    need_host = plan.host_total + plan.pinned_total
    have_host = available_host_bytes()
    if have_host and need_host > 0.95 * have_host:
        return [f"host memory: the plan needs {need_host / GiB:.1f} GiB, {have_host / GiB:.1f} GiB is "
                f"available. Use a machine with more RAM or a smaller model, smaller optimizer state "
                f"(train.optimizer_state, train.master_weights) or the disk tier (store.disk); fewer gradient "
                f"slabs (engine.grad_slabs) save {plan.pinned_total / GiB:.1f} GiB at most."]
    return []


def device_problem(plan: MemoryPlan, *, device: torch.device, device_budget: int | None = None) -> str:
    """The device-memory problem ('' when the plan fits): against `device_budget` when given (on any
    device: an explicit budget drives the plan on CPU too), else a CUDA device's total memory."""
    if device_budget is None and device.type != "cuda":
        return ""
    total = device_budget or torch.cuda.get_device_properties(device).total_memory
    if plan.device_total > 0.95 * total:
        return (f"device memory: the plan needs about {plan.device_total / GiB:.1f} GiB, the budget is "
                f"{total / GiB:.1f} GiB. Use a smaller train.micro_batch_size or train.seq_len, a "
                f"smaller engine.checkpoint_interval, or a smaller engine.loss_chunk_tokens.")
    return ""
