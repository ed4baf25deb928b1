"""The activation plan for one long sequence (issue #9); the offloader it drives is engine/offload.py.

`plan_long_context` is pure arithmetic over the model shape: it picks the checkpoint interval, the
MLP tile, the loss chunk and how many layer checkpoints go to pinned host memory, and predicts the
device peak term by term for each phase of the step. Nothing is allocated; it runs on the CPU.

Where the bytes are, per token, for one recomputed layer (counted from what autograd saves for the
HF decoder layer with SDPA; test_tiling.py measures the saved tensors of a real layer against it):

    layer input (the checkpoint, now a leaf)     w*H
    input RMSNorm (HF)                           4*H fp32 upcast + w*H normalised + 4 (1/rms)
    q/k/v projections' input                     w*H
    q, k, v after rotary (SDPA's inputs)         w*(q + 2*kv)
    SDPA output (= o_proj input), logsumexp      w*q + 4*heads
    post-attention RMSNorm, MLP input            same as the input norm, w*H
    MLP intermediates                            4*w*I untiled (gate, act, up, product); 0 tiled
    layer output (held by the engine)            w*H

`w` is the compute dtype's width. For Qwen2.5-7B in bf16 that is 95 KB per token: 50 GB at 512K with
the MLP tiled (the untiled MLP would add 152 KB/token, 79 GB). A checkpoint is w*H = 7 KB/token,
3.76 GB at 512K, 28 of them 105 GB: at long context they, not the layer, decide what fits.

Checkpoint interval is always 1: a block of k layers costs L/k checkpoints plus k layer graphs, and a
layer graph is ~13 checkpoints, so one layer per block is the least memory for any L (and it streams
each layer's weights the same twice per step as any interval up to the 2 weight slots).

The same plan is the memory-lean fallback of any step shape (`plan_memory_lean`: batch > 1, several
micro-batches, short sequences) whose short-context plan (engine/plan.py) does not fit the device: the
step's tokens (every micro-batch) set the checkpoints and a recorded layer's saved tensors, one
micro-batch's tokens the head's logits chunk, an MLP tile, SDPA's backward and the forward's temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

GiB = 2**30


def fmt_bytes(n: int) -> str:
    """'22.57 GiB', or MiB below a tenth of a GiB (the tiny models of the tests)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 or n == 0 else f"{n / 2**20:.2f} MiB"


# ---------------------------------------------------------------------------------------------- shape


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k
    layer_numel: int  # parameters of the largest decoder layer (one weight slot)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def of(cls, model: Any) -> "ModelShape":
        """From a ModelAdapter (exact layer size from its parameter specs) or an HF config."""
        config = getattr(model, "config", model)
        h, heads = int(config.hidden_size), int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or h // heads)
        inter = int(config.intermediate_size)
        qk_norm = getattr(config, "model_type", "") == "qwen3"
        if hasattr(model, "layer_specs"):
            numel = max(sum(s.numel for s in model.layer_specs(i)) for i in range(model.num_layers))
        else:
            q, kv = heads * head_dim, kv_heads * head_dim
            qkv_bias = getattr(config, "model_type", "") == "qwen2" or bool(getattr(config, "attention_bias", False))
            o_bias = getattr(config, "model_type", "") != "qwen2" and bool(getattr(config, "attention_bias", False))
            mlp_bias = bool(getattr(config, "mlp_bias", False))
            numel = (h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
                     + (q + 2 * kv) * qkv_bias + h * o_bias + (2 * inter + h) * mlp_bias
                     + 2 * head_dim * qk_norm)
        return cls(int(config.num_hidden_layers), h, inter, heads, kv_heads, head_dim, int(config.vocab_size),
                   bool(getattr(config, "tie_word_embeddings", False)), qk_norm, numel)


def _norm_saved(h: int, width: int, lean: bool, input_saved_elsewhere: bool) -> int:
    """Bytes per row an RMSNorm of width h keeps for backward (its output is counted by its reader)."""
    rstd = 4
    if lean:
        return rstd + (0 if input_saved_elsewhere else width * h)
    # HF: pow and the x*rstd product keep the fp32 upcast (the input itself when it already is fp32),
    # the weight product keeps the normalised tensor cast back to the input dtype.
    upcast = 0 if (width == 4 and input_saved_elsewhere) else 4 * h
    return upcast + width * h + rstd


def layer_saved_bytes(shape: ModelShape, tokens: int, width: int, *, mlp_tiled: bool, lean_norms: bool
                      ) -> dict[str, int]:
    """What autograd keeps for one recomputed decoder layer over `tokens` tokens, by term."""
    s, w = shape, width
    per_token = {
        "layer input (the checkpoint, now a leaf)": w * s.hidden,
        "input RMSNorm": _norm_saved(s.hidden, w, lean_norms, input_saved_elsewhere=True),
        "q/k/v projections' input": w * s.hidden,
        "q, k, v after rotary (SDPA inputs)": w * (s.q_dim + 2 * s.kv_dim),
        "SDPA output + logsumexp": w * s.q_dim + 4 * s.heads,
        "post-attention RMSNorm": _norm_saved(s.hidden, w, lean_norms, input_saved_elsewhere=False),
        "MLP input": w * s.hidden,
        "MLP intermediates": 0 if mlp_tiled else 4 * w * s.intermediate,
        "layer output": w * s.hidden,
    }
    if s.qk_norm:  # q_norm / k_norm read the projections' outputs, which nothing else keeps
        per_token["q/k RMSNorms"] = (_norm_saved(s.head_dim, w, lean_norms, False) * (s.heads + s.kv_heads))
    return {k: v * tokens for k, v in per_token.items()}


# ---------------------------------------------------------------------------------------------- plan

# Terms of the attention half: what is still alive while SDPA's backward runs (the MLP half is freed).
_ATTENTION_HALF = ("layer input (the checkpoint, now a leaf)", "input RMSNorm", "q/k/v projections' input",
                   "q, k, v after rotary (SDPA inputs)", "SDPA output + logsumexp", "layer output",
                   "q/k RMSNorms")


@dataclass
class LongContextPlan:
    seq_len: int
    batch: int
    budget: int  # device bytes
    usable: int  # budget x headroom: what the predicted peak must stay under
    checkpoint_interval: int
    mlp_tile_tokens: int | None  # None: the MLP runs untiled
    loss_chunk_tokens: int
    lean_norms: bool
    num_checkpoints: int
    offloaded_checkpoints: int  # checkpoints 0..k-1 live in pinned host memory
    checkpoint_bytes: int  # one checkpoint
    fixed: dict = field(default_factory=dict)  # term -> bytes, alive the whole step
    phases: dict = field(default_factory=dict)  # phase -> {term: bytes}, on top of `fixed`
    host_budget: int | None = None
    notes: list = field(default_factory=list)
    grad_accum: int = 1  # micro-batches per step, each of `batch` rows: the engine records them all at once
    label: str = "long-context"  # or "memory-lean": the fallback of a short sequence (plan_memory_lean)

    @property
    def tokens(self) -> int:
        """The step's tokens: every micro-batch's checkpoints and layer graph are alive together."""
        return self.batch * self.grad_accum * self.seq_len

    @property
    def micro_tokens(self) -> int:
        """One micro-batch's tokens: what the head's chunk loop, SDPA's backward and an MLP tile work on."""
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
    def offload_keys(self) -> range:
        """Checkpoint (block) indices to give CheckpointOffloader: the first ones, read last in backward."""
        return range(self.offloaded_checkpoints)

    def render(self) -> str:
        gib = lambda b: f"{b / GiB:7.2f} GiB"  # noqa: E731
        mlp = f"tiled by {self.mlp_tile_tokens} tokens" if self.mlp_tile_tokens else "untiled"
        accum = f" x {self.grad_accum} micro-batches" if self.grad_accum > 1 else ""
        lines = [f"{self.label} plan: {self.batch} x {self.seq_len} tokens{accum}; device budget {gib(self.budget)}, "
                 f"planned to {gib(self.usable)}",
                 f"  checkpoint interval {self.checkpoint_interval}; MLP {mlp}; loss chunk "
                 f"{self.loss_chunk_tokens} tokens; RMSNorm {'lean' if self.lean_norms else 'HF'}",
                 f"  checkpoints: {self.num_checkpoints} x {gib(self.checkpoint_bytes).strip()}; "
                 f"{self.num_checkpoints - self.offloaded_checkpoints} on the device, {self.offloaded_checkpoints} "
                 f"in pinned host memory ({gib(self.host_pinned_bytes).strip()})",
                 f"  whole step: {gib(sum(self.fixed.values()))}"]
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
        mlp = f"MLP tiled by {self.mlp_tile_tokens}" if self.mlp_tile_tokens else "MLP untiled"
        return (f"checkpoint interval {self.checkpoint_interval}, {mlp}, loss chunk {self.loss_chunk_tokens}, RMSNorm "
                f"{'lean' if self.lean_norms else 'HF'}, {self.offloaded_checkpoints} of {self.num_checkpoints} "
                f"checkpoints offloaded to pinned host memory ({fmt_bytes(self.host_pinned_bytes)}), predicted "
                f"device peak {fmt_bytes(self.predicted_peak)} of {fmt_bytes(self.budget)} ({self.peak_phase})")


def plan_long_context(model: Any, seq_len: int, *, batch: int = 1, grad_accum: int = 1, device_budget_bytes: int,
                      host_budget_bytes: int | None = None, dtype: torch.dtype = torch.bfloat16,
                      layer_slots: int = 2, mlp_tile_tokens: int = 8192, tile_mlp: bool | None = None,
                      loss_chunk_tokens: int = 4096, offload: bool | None = None, lean_norms: bool = False,
                      headroom: float = 0.95, device_type: str = "cuda", fallback: bool = False) -> LongContextPlan:
    """The activation plan for one step of `grad_accum` micro-batches of `batch` x `seq_len` tokens.

    The engine runs the micro-batches as the inner loop: every micro-batch's checkpoints are kept per
    block and one layer's recompute records the graphs of all of them before its backward, so the
    checkpoints and a layer's saved tensors scale with the step's tokens; the head's logits chunk, an MLP
    tile, SDPA's backward and the forward's temporaries work on one micro-batch at a time.

    tile_mlp: None tiles when the untiled MLP's activations would take over 10% of the budget, or when
    tiling avoids offloading. offload: None offloads as few checkpoints as keep the peak under
    `headroom` x the budget; True offloads all, False none. `host_budget_bytes`, when given, is the
    pinned host memory the offloaded checkpoints may take (what the host store leaves free).
    `device_type` 'cuda' reserves 1 GiB for the CUDA context and library workspaces (nothing on CPU).
    `fallback`: the memory-lean plan of a step the short-context plan does not fit (plan_memory_lean):
    the loss chunk is halved (down to LEAN_MIN_LOSS_CHUNK) before checkpoints are offloaded, and the MLP
    is tiled only when that offloads fewer checkpoints or is needed to fit.
    """
    options = dict(batch=batch, grad_accum=grad_accum, device_budget_bytes=device_budget_bytes,
                   host_budget_bytes=host_budget_bytes, dtype=dtype, layer_slots=layer_slots,
                   mlp_tile_tokens=mlp_tile_tokens, tile_mlp=tile_mlp, loss_chunk_tokens=loss_chunk_tokens,
                   offload=offload, headroom=headroom, reserve_bytes=GiB if device_type == "cuda" else 0,
                   fallback=fallback)
    shape = ModelShape.of(model)
    plan = _choose(shape, seq_len, lean_norms=lean_norms, **options)
    _add_notes(plan)
    if not lean_norms:
        lean = _choose(shape, seq_len, lean_norms=True, **options)
        plan.notes.append(f"lean RMSNorm (tiling.slim_norms): peak {lean.predicted_peak / GiB:.1f} GiB with "
                          f"{lean.offloaded_checkpoints} checkpoints offloaded")
    return plan


def choose_plan(model: Any, seq_len: int, *, lean_norms: bool | None = None, **options) -> LongContextPlan:
    """plan_long_context, with lean_norms=None choosing: HF's RMSNorm when that plan fits, else the lean
    one when it fits (it offloads fewer checkpoints: less pinned host memory and PCIe), else the HF plan
    (which does not fit; its notes give the lean figures). The engine's path for `bench_long_context`
    and for the trainer."""
    if lean_norms is not None:
        return plan_long_context(model, seq_len, lean_norms=lean_norms, **options)
    plan = plan_long_context(model, seq_len, **options)
    if plan.fits:
        return plan
    lean = plan_long_context(model, seq_len, lean_norms=True, **options)
    return lean if lean.fits else plan


def host_budget_bytes(pinned_engine_bytes: int, margin_bytes: int = 4 * GiB, available: int | None = None) -> int:
    """Host memory the offloaded checkpoints may pin, read now (after the host store is built, so it is
    already counted): MemAvailable (or `available`) minus the engine's own pinned buffers (weight
    staging, gradient slabs) minus a margin for the process (Python, the allocator, the data). Never
    below 0."""
    if available is None:
        from megatrain_cli.machine import available_host_bytes

        available = available_host_bytes()
    return max(0, available - pinned_engine_bytes - margin_bytes)


# `megatrain train`: sequences this long take the long-context path (plan_for_training).
LONG_CONTEXT_MIN_SEQ = 32768
# The memory-lean fallback halves the loss chunk down to this many tokens before it offloads checkpoints
# (a [1024, vocab] logits GEMM still runs at full speed; an offloaded checkpoint costs pinned host memory
# and two PCIe crossings per step).
LEAN_MIN_LOSS_CHUNK = 1024


def plan_for_training(adapter: Any, *, seq_len: int, micro_batch_size: int, grad_accum: int, dtype: torch.dtype,
                      device_type: str, device_budget: int | None, grad_slabs: int = 12, layer_slots: int = 2,
                      loss_chunk_tokens: int = 4096, store_bytes_to_come: int = 0,
                      min_seq_len: int = LONG_CONTEXT_MIN_SEQ, host_available: int | None = None,
                      fallback: bool = False) -> LongContextPlan | None:
    """The trainer's long-context plan, or None below `min_seq_len` (the short-context engine).

    The plan is for grad_accum micro-batches of micro_batch_size x seq_len tokens (the engine records every
    micro-batch of a step at once). `device_budget` None: on CPU, what the host has free. The host budget
    is read now (MemAvailable, or `host_available` bytes): pass `store_bytes_to_come` = the host store's
    bytes when it is not built yet (a dry run). `fallback`: see plan_long_context (plan_memory_lean).
    """
    if seq_len < min_seq_len:
        return None
    width = torch.finfo(dtype).bits // 8
    big = max(sum(sp.numel for sp in adapter.layer_specs(i)) for i in range(adapter.num_layers))
    pinned = (2 + grad_slabs) * big * width if device_type == "cuda" else 0
    host = max(0, host_budget_bytes(pinned, available=host_available) - store_bytes_to_come)
    if device_budget is None:
        if device_type == "cuda":
            raise ValueError("the long-context plan needs the device's memory: set engine.max_gpu_mem (e.g. 140GiB) "
                             "when planning without the GPU")
        device_budget = host_budget_bytes(0, 0, available=host_available)  # the CPU "device" is the host
    return choose_plan(adapter, seq_len, batch=micro_batch_size, grad_accum=grad_accum,
                       device_budget_bytes=device_budget, host_budget_bytes=host, dtype=dtype,
                       layer_slots=layer_slots, loss_chunk_tokens=loss_chunk_tokens, device_type=device_type,
                       fallback=fallback)


def plan_memory_lean(adapter: Any, **training) -> LongContextPlan:
    """The memory-lean plan for any step shape (batch > 1, several micro-batches, short sequences): the
    fallback when the short-context plan (engine/plan.make_plan) does not fit the device budget. The
    long-context machinery at any length: checkpoint interval 1, a loss chunk halved until the head is
    no longer what offloads checkpoints, the MLP tiled only where that helps, and as few checkpoints as
    needed in pinned host memory (the host budget checked). Arguments: plan_for_training's, except
    min_seq_len and fallback. The plan's label is 'memory-lean'; check plan.fits."""
    plan = plan_for_training(adapter, **training, min_seq_len=0, fallback=True)
    plan.label = "memory-lean"
    return plan


def refusal(plan: LongContextPlan) -> str:
    """Why `plan` does not fit, in one line ('' when it fits)."""
    reasons = []
    if plan.predicted_peak > plan.usable:
        reasons.append(f"predicted device peak {fmt_bytes(plan.predicted_peak)} ({plan.peak_phase}) > "
                       f"{fmt_bytes(plan.usable)} usable of {fmt_bytes(plan.budget)} with "
                       f"{plan.offloaded_checkpoints} of {plan.num_checkpoints} checkpoints offloaded")
    if plan.host_budget is not None and plan.host_pinned_bytes > plan.host_budget:
        reasons.append(f"the offloaded checkpoints need {fmt_bytes(plan.host_pinned_bytes)} of pinned host "
                       f"memory, {fmt_bytes(plan.host_budget)} is free after the host store")
    return "; ".join(reasons)


def _choose(shape: ModelShape, seq_len: int, *, batch, grad_accum, device_budget_bytes, host_budget_bytes, dtype,
            layer_slots, mlp_tile_tokens, tile_mlp, loss_chunk_tokens, offload, headroom, lean_norms, reserve_bytes,
            fallback) -> LongContextPlan:
    w = torch.finfo(dtype).bits // 8
    micro = batch * seq_len  # one micro-batch: the head's chunks, an MLP tile and SDPA's backward work on it
    tokens = micro * grad_accum  # the step: each checkpoint holds every micro-batch's hidden states
    usable = int(device_budget_bytes * headroom)

    def build(tiled: bool, chunk: int, offloaded: int) -> LongContextPlan:
        plan = LongContextPlan(seq_len, batch, device_budget_bytes, usable, 1, mlp_tile_tokens if tiled else None,
                               chunk, lean_norms, shape.layers, offloaded, tokens * shape.hidden * w,
                               host_budget=host_budget_bytes, grad_accum=grad_accum)
        plan.fixed, plan.phases = _terms(shape, plan, w, layer_slots, reserve_bytes)
        return plan

    def with_offload(tiled: bool, chunk: int) -> LongContextPlan:
        if offload is not None:
            return build(tiled, chunk, shape.layers if offload else 0)
        # Each offloaded checkpoint lowers the device peak by one checkpoint: offload as few as needed.
        for k in range(shape.layers + 1):
            plan = build(tiled, chunk, k)
            if plan.predicted_peak <= usable:
                break
        return plan

    can_tile = micro > mlp_tile_tokens  # below one tile the tiled MLP runs the plain forward anyway
    if fallback:
        # Every loss chunk from the given one down to LEAN_MIN_LOSS_CHUNK (the logits chunk is the one term
        # that does not scale with the step's tokens), tiled and not: the plan that fits with the fewest
        # offloaded checkpoints, then untiled (no recomputed gate/up), then the largest chunk.
        chunks = [min(loss_chunk_tokens, micro)]
        while chunks[-1] // 2 >= LEAN_MIN_LOSS_CHUNK:
            chunks.append(chunks[-1] // 2)
        tilings = [False, True] if tile_mlp is None and can_tile else [bool(tile_mlp) and can_tile]
        plan = min((with_offload(tiled, chunk) for tiled in tilings for chunk in chunks),
                   key=lambda p: (not p.fits, p.offloaded_checkpoints, 0 if p.fits else p.predicted_peak,
                                  p.mlp_tile_tokens is not None, -p.loss_chunk_tokens))
    else:
        if tile_mlp is None:
            untiled_mlp = w * shape.intermediate * (4 * tokens + 3 * micro)  # 4 kept per token, 3 bwd temporaries
            tiled = can_tile and untiled_mlp > 0.10 * device_budget_bytes
        else:
            tiled = tile_mlp and can_tile
        plan = with_offload(tiled, min(loss_chunk_tokens, micro))
        if tile_mlp is None and not tiled and can_tile and (plan.offloaded_checkpoints or not plan.fits):
            plan = with_offload(True, plan.loss_chunk_tokens)  # tile before offloading: compute is cheaper than RAM
    # The head is rarely the peak, but its logits chunk is the one term that does not scale with T.
    while plan.peak_phase.startswith("head") and plan.predicted_peak > usable and plan.loss_chunk_tokens > 512:
        plan = build(plan.mlp_tile_tokens is not None, plan.loss_chunk_tokens // 2, plan.offloaded_checkpoints)
    return plan


def _terms(s: ModelShape, plan: LongContextPlan, w: int, layer_slots: int, reserve_bytes: int
           ) -> tuple[dict, dict]:
    T, t, H, V, U = plan.tokens, plan.micro_tokens, s.hidden, s.vocab, plan.checkpoint_bytes
    on_device = s.layers - plan.offloaded_checkpoints
    staging = U if plan.offloaded_checkpoints else 0  # the put in flight, or the prefetched next one
    fixed = {
        f"layer weight slots ({layer_slots} x {s.layer_numel / 1e6:.0f} M params)": layer_slots * s.layer_numel * w,
        "head weights (final norm" + (")" if s.tied else " + LM head)"): (H + (0 if s.tied else V * H)) * w,
        "embedding table (tied: the LM head)": V * H * w if s.tied else 0,
        "embedding rows of the batch": min(V, T) * H * w,
        "per-token ids, labels, positions, rotary cos/sin": T * (3 * 8 + 2 * s.head_dim * w),
        "CUDA context + cuBLAS/cuDNN workspaces (reserve)": reserve_bytes,
        "checkpoint offload staging (one in flight)": staging,
    }
    many = plan.grad_accum > 1
    phases = {}
    mlp_rows = min(plan.mlp_tile_tokens, t) if plan.mlp_tile_tokens else t
    phases["forward (no autograd)"] = {
        "checkpoints on the device": on_device * U,
        # The layer's outputs for every micro-batch, and one micro-batch's temporaries: the larger of the
        # HF RMSNorm (fp32 upcast + fp32 normalised + the cast back; the lean one works in row chunks), the
        # rotary step (normed, q, q*cos, rotate_half(q), q_embed) and the MLP (act, up, their product; per
        # tile when tiled), plus k and v.
        "layer outputs" + (" (every micro-batch)" if many else ""): T * w * H,
        "one layer's temporaries" + (" (one micro-batch)" if many else ""): (
            max(t * (2 * w * H if plan.lean_norms else (8 + w) * H), t * 5 * w * H, 3 * w * s.intermediate * mlp_rows)
            + t * 2 * w * s.kv_dim),
    }
    head_norm_kept = _norm_saved(H, w, plan.lean_norms, input_saved_elsewhere=True)
    head = {"checkpoints on the device": on_device * U,
            # The final hidden states of every micro-batch stay until the step's end; the gradients of the
            # micro-batches done so far wait for the last layer's backward.
            "final hidden" + (" (every micro-batch) + the earlier micro-batches' gradients" if many else ""):
                T * w * H + (T - t) * w * H,
            "its norm's saved tensors, normed, d_normed" + (" (one micro-batch)" if many else ""):
                t * (2 * w * H + head_norm_kept)}
    head.update({
        # Not at once: the chunk loop (logits w + fp32 log-softmax kept 4 + its fp32 gradients in and
        # out 4 + 4), then the final norm's backward (its gradient + HF's two fp32 temporaries).
        "loss chunk logits + fp32 log-softmax + grads, or norm backward": max(
            plan.loss_chunk_tokens * V * (w + 12), t * (w * H + (0 if plan.lean_norms else 8 * H))),
        "LM head gradient (fp32 + head accumulator)": V * H * (4 + w if s.tied else 8),
    })
    phases["head (final norm + chunked loss)"] = head
    # Backward starts at the last layer: every other device checkpoint still waits for its turn.
    backward = {"checkpoints on the device": max(0, on_device - 1) * U,
                "layer gradient (fp32 accumulator + autograd's + cast)": s.layer_numel * (4 + 2 * w),
                "tied LM-head gradient (fp32, until the embedding backward)": V * H * 4 if s.tied else 0}
    # Recorded for every micro-batch before the layer's backward (the engine's _record_layer).
    saved = layer_saved_bytes(s, T, w, mlp_tiled=plan.mlp_tile_tokens is not None, lean_norms=plan.lean_norms)
    grads = 2 * T * H * w  # the incoming gradients (the engine keeps them) + the residual stream's gradients
    # PyTorch's FlashAttention-2 backward: dq, dk, dv, an fp32 dq accumulator, and with GQA dk/dv
    # expanded to every query head before they are summed per group. cuDNN is taken to be no larger.
    # The backward runs one micro-batch at a time.
    gqa = s.kv_heads != s.heads
    sdpa_bwd = t * (w * s.q_dim + 2 * w * s.kv_dim + 4 * s.q_dim + (2 * w * s.q_dim if gqa else 0) + 4 * s.heads)
    phases["layer backward, attention half"] = {
        **backward, **{k: v for k, v in saved.items() if k in _ATTENTION_HALF},
        "gradients in flight (output, residual, attention output)": grads + t * w * s.q_dim,
        "SDPA backward (flash-2 dq/dk/dv, fp32 dq accum" + (", GQA dk/dv expanded)" if gqa else ")"): sdpa_bwd,
    }
    if plan.mlp_tile_tokens:
        mlp_work = (8 * min(plan.mlp_tile_tokens, t) * s.intermediate * w  # a tile's gate/act/up/product + grads
                    + 3 * H * s.intermediate * (4 + w))  # fp32 weight-gradient accumulators + a tile's partials
        mlp_name = f"MLP backward: one {plan.mlp_tile_tokens}-token tile + fp32 weight accumulators"
    else:
        mlp_work, mlp_name = 3 * t * s.intermediate * w, "MLP backward temporaries (untiled)"
    phases["layer backward, MLP half"] = {**backward, **saved, "gradients in flight (output, MLP input)": grads,
                                          mlp_name: mlp_work}
    return fixed, phases


def _add_notes(plan: LongContextPlan) -> None:
    if plan.seq_len > 65536:
        plan.notes.append(f"one document per row: a packed-row mask is [T, T] ({plan.seq_len ** 2 / GiB:.0f} GiB "
                          "as bool per row) and keeps SDPA off flash/cuDNN")
    if plan.offloaded_checkpoints:
        plan.notes.append(f"checkpoints 0..{plan.offloaded_checkpoints - 1} go to pinned host memory: "
                          f"{plan.host_pinned_bytes / GiB:.1f} GiB on top of the host store; each crosses PCIe "
                          f"twice per step ({plan.checkpoint_bytes / GiB:.2f} GiB, ~{plan.checkpoint_bytes / 25e9:.2f} "
                          "s at 25 GB/s, hidden behind a layer's compute)")
    if plan.host_budget is not None and plan.host_pinned_bytes > plan.host_budget:
        plan.notes.append(f"host: the offloaded checkpoints need {plan.host_pinned_bytes / GiB:.1f} GiB pinned, "
                          f"{plan.host_budget / GiB:.1f} GiB is free")
    if plan.predicted_peak > plan.usable:
        plan.notes.append(f"over budget with {plan.offloaded_checkpoints} checkpoints offloaded: offload more, "
                          "a shorter seq_len, lean RMSNorm, a smaller MLP tile or loss chunk")
