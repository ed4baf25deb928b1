"""What one step keeps on the device, term by term: the one activation model. The lean plan (lean.py) plans
every phase with it; the short-context memory plan (memory.py) takes its recomputed and kept layers and its
checkpoints from it.

Where the bytes are, per token, for one recomputed layer (counted from what autograd saves for the
HF decoder layer with SDPA; test_lean_layers.py measures the saved tensors of a real layer against it):

    layer input (the checkpoint, now a leaf)     w*H
    input RMSNorm (HF)                           4*H fp32 upcast + w*H normalised + 4 (1/rms)
    q/k/v projections' input                     w*H
    q, k, v after rotary (SDPA's inputs)         w*(q + 2*kv)
    SDPA output (= o_proj input), logsumexp      w*q + 4*heads
    post-attention RMSNorm, MLP input            same as the input norm, w*H
    MLP intermediates                            4*w*I unchunked (gate, act, up, product); 0 chunked
    layer output (held by the engine)            w*H

A mixture-of-experts layer keeps, instead of the MLP intermediates (measured on HF's grouped-mm experts,
tests/engine/test_moe.py), per token and per routed pick (top_k of them): the gathered input and the weighted
expert output w*2H, the gate/up output, activation and product w*4I (gpt-oss's clamped SwiGLU: w*7I) and
40 bytes of indices; per token the router's fp32 softmax 4E and the logits the aux loss keeps w*E; a shared
expert as a dense MLP plus its gated output (w*(4*I_s + H)). Routed experts are never chunked.
HF's eager attention (no SDPA for the family: gpt-oss's sinks, Gemma 2's softcap) also keeps each head's
[T, T (+1 sink)] probabilities per row: quadratic in the sequence.

`w` is the compute dtype's width. For Qwen2.5-7B in bf16 that is 95 KB per token: 50 GB at 512K with
the MLP chunked (the unchunked MLP would add 152 KB/token, 79 GB). A checkpoint is w*H = 7 KB/token,
3.76 GB at 512K, 28 of them 105 GB: at long context they, not the layer, decide what fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain_cli.models.families import moe_spec


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
    # Mixture of experts (0 for a dense model); `intermediate` is then the routed width top_k * I_e + I_s.
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    gate_tensors: int = 2  # what an expert's gating keeps per intermediate unit: SwiGLU 2, gpt-oss 5
    dense_intermediate: int = 0  # a dense layer's MLP width between MoE layers (Qwen2/3-MoE), else 0
    eager: bool = False  # HF's eager attention (no SDPA): it keeps each head's [T, T] probabilities

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def mlp_saved_per_token(self, w: int) -> int:
        """What autograd keeps per token for the MLP beyond its input (the largest layer's kind)."""
        if not self.moe:
            return 4 * w * self.intermediate
        routed = self.top_k * (w * (2 * self.hidden + (2 + self.gate_tensors) * self.expert_intermediate) + 40)
        shared = w * (4 * self.shared_intermediate + self.hidden) if self.shared_intermediate else 0
        return max(routed + (4 + w) * self.experts + shared, 4 * w * self.dense_intermediate)

    def mlp_backward_per_token(self, w: int) -> int:
        """The MLP backward's temporaries per token (unchunked): gate/up gradients and their product."""
        if not self.moe:
            return 3 * w * self.intermediate
        return self.top_k * w * (3 * self.expert_intermediate + 2 * self.hidden) + 3 * w * self.shared_intermediate

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def of(cls, model: Any) -> "ModelShape":
        """From a ModelAdapter (exact layer size from its parameter specs) or an HF config."""
        config = getattr(model, "config", model).get_text_config()  # a VLM: its decoder's (the tower is not priced)
        h, heads = int(config.hidden_size), int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or h // heads)
        inter = int(config.intermediate_size)
        qk_norm = getattr(config, "model_type", "") in ("qwen3", "qwen3_moe")
        eager = getattr(config, "_attn_implementation", None) == "eager"
        spec = moe_spec(config)
        if spec is not None and not hasattr(model, "layer_specs"):
            from megatrain_cli.models.adapter import ModelAdapter  # a meta model: the exact layer sizes

            model = ModelAdapter(config)
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
        common = (int(config.num_hidden_layers), h)
        rest = (heads, kv_heads, head_dim, int(config.vocab_size), bool(getattr(config, "tie_word_embeddings", False)),
                qk_norm, numel)
        if spec is None:
            return cls(*common, inter, *rest, eager=eager)
        dense = getattr(config, "mlp_only_layers", None) or int(getattr(config, "decoder_sparse_step", 1) or 1) > 1
        return cls(*common, spec.top_k * spec.expert_intermediate + spec.shared_intermediate, *rest,
                   experts=spec.num_experts, top_k=spec.top_k, expert_intermediate=spec.expert_intermediate,
                   shared_intermediate=spec.shared_intermediate,
                   gate_tensors=5 if getattr(config, "swiglu_limit", None) else 2,
                   dense_intermediate=inter if dense else 0, eager=eager)


def checkpoint_bytes(tokens: int, hidden: int, width: int) -> int:
    """One activation checkpoint: a layer's input hidden states over `tokens` tokens."""
    return tokens * hidden * width


def _norm_saved(h: int, width: int, lean: bool, input_saved_elsewhere: bool) -> int:
    """Bytes per row an RMSNorm of width h keeps for backward (its output is counted by its reader)."""
    rstd = 4
    if lean:
        return rstd + (0 if input_saved_elsewhere else width * h)
    # HF: pow and the x*rstd product keep the fp32 upcast (the input itself when it already is fp32),
    # the weight product keeps the normalised tensor cast back to the input dtype.
    upcast = 0 if (width == 4 and input_saved_elsewhere) else 4 * h
    return upcast + width * h + rstd


def layer_saved_bytes(shape: ModelShape, tokens: int, width: int, *, mlp_chunked: bool, lean_norms: bool,
                      seq_len: int | None = None) -> dict[str, int]:
    """What autograd keeps for one recomputed decoder layer over `tokens` tokens (rows of `seq_len`; None: one
    row), by term."""
    s, w = shape, width
    per_token = {
        "layer input (the checkpoint, now a leaf)": w * s.hidden,
        "input RMSNorm": _norm_saved(s.hidden, w, lean_norms, input_saved_elsewhere=True),
        "q/k/v projections' input": w * s.hidden,
        "q, k, v after rotary (SDPA inputs)": w * (s.q_dim + 2 * s.kv_dim),
        "SDPA output + logsumexp": w * s.q_dim + 4 * s.heads,
        "post-attention RMSNorm": _norm_saved(s.hidden, w, lean_norms, input_saved_elsewhere=False),
        "MLP input": w * s.hidden,
        "MLP intermediates" + (" (routed experts + router)" if s.moe else ""):
            0 if mlp_chunked and not s.moe else s.mlp_saved_per_token(w),
        "layer output": w * s.hidden,
    }
    if s.qk_norm:  # q_norm / k_norm read the projections' outputs, which nothing else keeps
        per_token["q/k RMSNorms"] = (_norm_saved(s.head_dim, w, lean_norms, False) * (s.heads + s.kv_heads))
    saved = {k: v * tokens for k, v in per_token.items()}
    if s.eager:  # each row's [T, T + 1] probabilities per head (the +1: gpt-oss's sink column)
        seq = seq_len or tokens
        saved[EAGER] = tokens // seq * s.heads * seq * (seq + 1) * w
    return saved


EAGER = "eager attention probabilities (per head, [T, T])"


ATTENTION_HALF = ("layer input (the checkpoint, now a leaf)", "input RMSNorm", "q/k/v projections' input",
                   "q, k, v after rotary (SDPA inputs)", "SDPA output + logsumexp", "layer output",
                   "q/k RMSNorms", EAGER)


def backward_checkpoints(plan) -> tuple[int, int]:
    """(most checkpoints on the device during a layer's recompute / backward besides that layer's own
    input, most during the rebuild of a dropped one), the backward walking down from the last layer.
    Below layer j every device checkpoint still waits; rebuilding dropped j holds checkpoint j-1 on the
    device from the rebuild until its own recompute (engine/rebuild.py), one more when it was offloaded."""
    dropped, offloaded = set(plan.dropped_checkpoints), set(plan.offload_keys)
    layer = rebuild = below = 0  # below: device checkpoints under layer j
    for j in range(plan.num_checkpoints):
        alive = below + (j in dropped and j - 1 in offloaded)
        layer = max(layer, alive)
        rebuild = max(rebuild, alive if j in dropped else 0)
        below += j not in dropped and j not in offloaded
    return layer, rebuild


def device_terms(s: ModelShape, plan, w: int, layer_slots: int, reserve_bytes: int
           ) -> tuple[dict, dict]:
    T, t, H, V, U = plan.tokens, plan.micro_tokens, s.hidden, s.vocab, plan.checkpoint_bytes
    on_device = plan.device_checkpoints
    staging = U if plan.offloaded_checkpoints else 0  # the put in flight, or the prefetched next one
    fixed = {
        f"layer weight slots ({layer_slots} x {s.layer_numel / 1e6:.0f} M params)": layer_slots * s.layer_numel * w,
        "head weights (final norm" + (")" if s.tied else " + LM head)"): (H + (0 if s.tied else V * H)) * w,
        "embedding table (tied: the LM head)": V * H * w if s.tied else 0,
        "embedding rows of the batch": min(V, T) * H * w,
        "per-token ids, labels, positions, rotary cos/sin": T * (3 * 8 + 2 * s.head_dim * w),
        "CUDA context + cuBLAS/cuDNN workspaces (reserve)": reserve_bytes,
        "checkpoint offload staging (one in flight)": staging,
        # Planned beside the rest: exact byte counts allocated once (engine/resident.py), outside the headroom.
        "resident layers + head (master, moments, weights, gradient)": plan.resident_bytes,
    }
    many = plan.grad_accum > 1
    phases = {}
    mlp_rows = min(plan.mlp_chunk_tokens, t) if plan.mlp_chunk_tokens else t
    phases["forward (no autograd)"] = {
        "checkpoints on the device": on_device * U,
        # The layer's outputs for every micro-batch, and one micro-batch's temporaries: the larger of the
        # HF RMSNorm (fp32 upcast + fp32 normalised + the cast back; the lean one works in row chunks), the
        # rotary step (normed, q, q*cos, rotate_half(q), q_embed) and the MLP (act, up, their product; per
        # chunk when chunked), plus k and v.
        "layer outputs" + (" (every micro-batch)" if many else ""): T * w * H,
        "one layer's temporaries" + (" (one micro-batch)" if many else ""): (
            max(t * (2 * w * H if plan.lean_norms else (8 + w) * H), t * 5 * w * H,
                (t * s.mlp_saved_per_token(w)) if s.moe else 3 * w * s.intermediate * mlp_rows)
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
    in_backward, in_rebuild = backward_checkpoints(plan)
    if plan.dropped_checkpoints:  # the no-grad forward of the layer before, between two layers' backward
        phases["rebuild of a dropped checkpoint (no autograd)"] = {
            "checkpoints on the device (the one it is rebuilt from held)": in_rebuild * U,
            "the rebuilt checkpoint (the layer's outputs)": T * w * H,
            **{k: v for k, v in phases["forward (no autograd)"].items() if k.startswith("one layer's temporaries")},
            "gradient in flight (the next layer's input gradient)": T * w * H,
            "tied LM-head gradient (fp32, until the embedding backward)": V * H * 4 if s.tied else 0}
    # Backward starts at the last layer: every other device checkpoint still waits for its turn.
    backward = {"checkpoints on the device": in_backward * U,
                "layer gradient (fp32 accumulator + autograd's + cast)": s.layer_numel * (4 + 2 * w),
                "tied LM-head gradient (fp32, until the embedding backward)": V * H * 4 if s.tied else 0}
    # Recorded for every micro-batch before the layer's backward (the engine's _record_layer).
    saved = layer_saved_bytes(s, T, w, mlp_chunked=plan.mlp_chunk_tokens is not None, lean_norms=plan.lean_norms,
                              seq_len=plan.seq_len)
    grads = 2 * T * H * w  # the incoming gradients (the engine keeps them) + the residual stream's gradients
    # PyTorch's FlashAttention-2 backward: dq, dk, dv, an fp32 dq accumulator, and with GQA dk/dv
    # expanded to every query head before they are summed per group. cuDNN is taken to be no larger.
    # The backward runs one micro-batch at a time.
    gqa = s.kv_heads != s.heads
    sdpa_bwd = t * (w * s.q_dim + 2 * w * s.kv_dim + 4 * s.q_dim + (2 * w * s.q_dim if gqa else 0) + 4 * s.heads)
    phases["layer backward, attention half"] = {
        **backward, **{k: v for k, v in saved.items() if k in ATTENTION_HALF},
        "gradients in flight (output, residual, attention output)": grads + t * w * s.q_dim,
        "SDPA backward (flash-2 dq/dk/dv, fp32 dq accum" + (", GQA dk/dv expanded)" if gqa else ")"): sdpa_bwd,
    }
    if plan.mlp_chunk_tokens and not s.moe:
        mlp_work = (8 * min(plan.mlp_chunk_tokens, t) * s.intermediate * w  # a chunk's gate/act/up/product + grads
                    + 3 * H * s.intermediate * (4 + w))  # fp32 weight-gradient accumulators + a chunk's partials
        mlp_name = f"MLP backward: one {plan.mlp_chunk_tokens}-token chunk + fp32 weight accumulators"
    else:
        mlp_work, mlp_name = t * s.mlp_backward_per_token(w), "MLP backward temporaries (unchunked)"
    phases["layer backward, MLP half"] = {**backward, **saved, "gradients in flight (output, MLP input)": grads,
                                          mlp_name: mlp_work}
    return fixed, phases
