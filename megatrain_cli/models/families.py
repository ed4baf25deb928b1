"""Which decoder-only families are verified, and the little each needs beyond its HF modules.

A family is VERIFIED when a parity test (tests/engine/test_families.py: a streamed step equals plain HF + torch
AdamW within 1e-5, 3 steps, clipping, accumulation, packed rows) covers it. Any other decoder-only causal
LM runs only with `model.allow_unverified: true`, with a warning; a model that is not a decoder-only causal
LM is refused (models/adapter.py finds its parts through HF's own API or says what it could not find).

The hooks are where HF computes outside the modules the engine binds: the LM head's logits (the engine
computes the loss in chunks itself) and, for mixture-of-experts families, the router's load-balancing loss
(HF adds it in the causal LM's forward from the router logits of every layer: `moe_spec` says where a layer's
router logits come from, engine/router_loss.py computes the loss over the streamed layers). The embedding's
scale is read from HF's scaled-embedding module (models/adapter.py); masks, rotary tables and per-layer-type
attention come from running HF's own decoder code (models/layer_inputs.py); a quantized checkpoint's
dequantising quantizer is `checkpoint_quantizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> what its parity test covers (printed by the refusal message).
VERIFIED: dict[str, str] = {
    "llama": "Llama 2/3",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3 (dense)",
    "mistral": "Mistral, sliding window included",
    "gemma2": "Gemma 2 (logit and attention softcaps, sqrt(hidden) input scale, local/global layers)",
    "gemma3_text": "Gemma 3 text (two RoPE bases, local/global layers)",
    "phi3": "Phi-3 / Phi-4 (fused qkv and gate_up)",
    "olmo2": "OLMo 2 (q/k norms, post-norms)",
}

# Mixture-of-experts families: their parity test (tests/engine/test_moe.py) also covers the router, the aux loss
# and an expert that gets no token.
VERIFIED_MOE: dict[str, str] = {
    "qwen3_moe": "Qwen3-MoE (top-k softmax router, renormalised top-k)",
    "qwen2_moe": "Qwen2-MoE (shared expert with sigmoid gate, dense layers between MoE layers)",
    "mixtral": "Mixtral",
    "gpt_oss": "gpt-oss (attention sinks, router bias, clamped SwiGLU experts with biases, local/global layers)",
}


class UnsupportedModel(ValueError):
    pass


def model_type(config: Any) -> str:
    return str(getattr(config, "model_type", "?"))


def check_verified(config: Any, allow_unverified: bool) -> str | None:
    """None for a verified family; the warning to print for an allowed unverified one; raises otherwise."""
    kind = model_type(config)
    if kind in VERIFIED or kind in VERIFIED_MOE:
        return None
    listed = ", ".join([*VERIFIED, *VERIFIED_MOE])
    if not allow_unverified:
        raise UnsupportedModel(f"model type {kind!r} has no parity test here (verified: {listed}); "
                               f"model.allow_unverified=true trains it anyway, unverified")
    return (f"warning: model type {kind!r} is not verified (verified: {listed}); its embedding and LM head "
            f"run as plain lookups / plain logits, so a family that scales them elsewhere trains wrongly")


def logit_softcap(config: Any) -> float | None:
    """cap * tanh(logits / cap) on the LM head's logits (Gemma 2/3's final_logit_softcapping)."""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


@dataclass(frozen=True)
class MoeSpec:
    """What the engine needs of a mixture-of-experts family beyond its HF modules: where a layer's router
    logits come from (the module class and output index HF's own `output_router_logits` recorder reads),
    and the numbers of HF's load-balancing loss (`load_balancing_loss_func`, the same in every family here)."""

    num_experts: int
    top_k: int
    aux_coef: float  # config.router_aux_loss_coef: HF adds coef * aux to the loss
    expert_intermediate: int  # one expert's hidden width
    shared_intermediate: int  # a shared expert's (Qwen2-MoE), else 0
    router_class: type
    router_output: int  # index of the logits in the router's output tuple
    router_name: str | None = None  # the recorder's module-name filter, if it has one


def moe_spec(config: Any) -> MoeSpec | None:
    """The family's MoE facts, or None for a dense model (its causal LM class records no router logits)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None
    recorder = (getattr(cls, "_can_record_outputs", None) or {}).get("router_logits")
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if recorder is None or not experts:
        return None
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return MoeSpec(int(experts), int(config.num_experts_per_tok), float(getattr(config, "router_aux_loss_coef", 0.0)),
                   int(inter), int(getattr(config, "shared_expert_intermediate_size", None) or 0),
                   getattr(recorder, "target_class", recorder), int(getattr(recorder, "index", 0)),
                   getattr(recorder, "layer_name", None))


def is_expert_param(name: str, shape: tuple[int, ...], spec: MoeSpec | None) -> bool:
    """A tensor holding one slice per routed expert (HF's 3-D `experts.gate_up_proj` and the like): a token
    uses top_k / num_experts of it. Not a shared expert's, not the router's."""
    return (spec is not None and ".experts." in f".{name}" and len(shape) >= 2 and shape[0] == spec.num_experts)


def grouped_experts(template: Any) -> int:
    """Make every experts module of a layer template run transformers' grouped-mm experts code (one
    grouped matrix multiply per projection for all experts; not the eager loop over experts), which is
    also what from_config picks by default in transformers 5.17 and 5.24. Returns how many modules."""
    count = 0
    for module in template.modules():
        if all(hasattr(module, a) for a in ("has_gate", "is_transposed", "config")):  # use_experts_implementation
            module.config._experts_implementation = "grouped_mm"
            count += 1
    return count


def checkpoint_quantizer(config: Any):
    """transformers' quantizer for a checkpoint stored quantized (config.quantization_config), set to
    DEQUANTIZE at load, or None for a plain checkpoint. gpt-oss ships its experts in MXFP4 (blocks + scales
    per expert tensor): with this quantizer transformers' own conversion rules (models/convert.py) turn each
    pair into the plain tensor (MXFP4 values are exact in bf16; they land in the fp32 masters), so the
    model is trained in bf16/fp32, never in MXFP4. Costs one dequantised tensor group in memory at a time.
    Raises UnsupportedModel for a quantization transformers cannot dequantize."""
    data = getattr(config, "quantization_config", None)
    if not data:
        return None
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    data = data if isinstance(data, dict) else data.to_dict()
    quantizer = AutoHfQuantizer.from_config(AutoQuantizationConfig.from_dict({**data, "dequantize": True}),
                                            pre_quantized=True)
    if not getattr(quantizer.quantization_config, "dequantize", False):
        raise UnsupportedModel(f"the checkpoint is quantized ({data.get('quant_method')}) and transformers cannot "
                               f"dequantize it at load; use a bf16/fp32 checkpoint")
    return quantizer
