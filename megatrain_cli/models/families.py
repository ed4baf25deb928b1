"""Which decoder-only families are verified, and the little each needs beyond its HF modules.

A family is VERIFIED when a parity test (tests/test_families.py: a streamed step equals plain HF + torch
AdamW within 1e-5, 3 steps, clipping, accumulation, packed rows) covers it. Any other decoder-only causal
LM runs only with `model.allow_unverified: true`, with a warning; a model that is not a decoder-only causal
LM is refused (models/adapter.py finds its parts through HF's own API or says what it could not find).

The one hook is where HF computes outside the modules the engine binds: the LM head's logits (the engine
computes the loss in chunks itself). The embedding's scale is read from HF's scaled-embedding module
(models/adapter.py); masks, rotary tables and per-layer-type attention come from running HF's own
decoder code (models/layer_inputs.py).
"""

from __future__ import annotations

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


class UnsupportedModel(ValueError):
    pass


def model_type(config: Any) -> str:
    return str(getattr(config, "model_type", "?"))


def check_verified(config: Any, allow_unverified: bool) -> str | None:
    """None for a verified family; the warning to print for an allowed unverified one; raises otherwise."""
    kind = model_type(config)
    if kind in VERIFIED:
        return None
    listed = ", ".join(VERIFIED)
    if not allow_unverified:
        raise UnsupportedModel(f"model type {kind!r} has no parity test here (verified: {listed}); "
                               f"model.allow_unverified=true trains it anyway, unverified")
    return (f"warning: model type {kind!r} is not verified (verified: {listed}); its embedding and LM head "
            f"run as plain lookups / plain logits, so a family that scales them elsewhere trains wrongly")


def logit_softcap(config: Any) -> float | None:
    """cap * tanh(logits / cap) on the LM head's logits (Gemma 2/3's final_logit_softcapping)."""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None
