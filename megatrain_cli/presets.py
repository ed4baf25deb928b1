"""Named model shapes: random-init models for `bench`, the demo and tests (no weights needed).

Shapes follow the published configs (Qwen2.5, Llama 3, Gemma 2 / 3, Phi-4, OLMo 2, and the mixture-of-experts
Qwen3-MoE, Mixtral and gpt-oss): the common fields
below, plus what a family's config sets beyond them (`extra`: head_dim, softcaps, sliding windows, two
RoPE bases, token ids), so that a preset builds the same modules the published checkpoint has;
tests/recipe/test_presets.py checks each parameter count against the published figure. `tiny` is ours, sized
so that the embedded default trains on two CPU cores in well under three minutes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    model_type: str  # transformers' model_type (AutoConfig.for_model)
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    extra: tuple[tuple[str, Any], ...] = ()  # further config fields, as (name, value) pairs
    # A vision-language model: its vision config and top-level fields (token ids), as (name, value) pairs;
    # the fields above are then its text config's.
    vision: tuple[tuple[str, Any], ...] = ()
    top: tuple[tuple[str, Any], ...] = ()

    @property
    def architecture(self) -> str:
        """The class transformers builds for this model_type (config.architectures[0]): causal LM, or
        image-text-to-text for a vision-language preset."""
        from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

        if self.vision:
            return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[self.model_type]
        return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.model_type]

    def hf_config(self, vocab_size: int | None = None, max_position_embeddings: int | None = None):
        """A transformers config object for this shape (a new one per call: callers may change it)."""
        from transformers import AutoConfig

        extra = copy.deepcopy(dict(self.extra))
        # One RoPE base unless the family sets its own parameters (Gemma 3: one per layer type).
        rope = extra.pop("rope_parameters", {"rope_type": "default", "rope_theta": self.rope_theta})
        text = dict(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=vocab_size or self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=max_position_embeddings or self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            **extra,
        )
        if self.vision:
            return AutoConfig.for_model(self.model_type, text_config=text, vision_config=dict(self.vision),
                                        architectures=[self.architecture], **dict(self.top))
        return AutoConfig.for_model(self.model_type, architectures=[self.architecture], **text)


GEMMA_TOKENS = (("pad_token_id", 0), ("eos_token_id", 1), ("bos_token_id", 2))
QWEN3_MOE = (("num_experts", 128), ("num_experts_per_tok", 8), ("norm_topk_prob", True), ("decoder_sparse_step", 1),
             ("mlp_only_layers", []), ("router_aux_loss_coef", 0.001))
GPT_OSS = (("head_dim", 64), ("num_experts_per_tok", 4), ("sliding_window", 128), ("attention_bias", True),
           ("swiglu_limit", 7.0), ("router_aux_loss_coef", 0.9),
           ("rope_parameters", {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0}),
           ("pad_token_id", 199999), ("eos_token_id", 200002))

# Qwen/Qwen2.5-VL-7B-Instruct: the 7B decoder with multimodal RoPE, a 32-layer vision tower (windowed attention
# but in 4 layers, RMSNorm, gated MLP) and its merger into the decoder's width.
QWEN25_VL_7B_VISION = (("depth", 32), ("hidden_size", 1280), ("intermediate_size", 3420), ("num_heads", 16),
                       ("out_hidden_size", 3584), ("patch_size", 14), ("spatial_merge_size", 2),
                       ("temporal_patch_size", 2), ("window_size", 112), ("fullatt_block_indexes", [7, 15, 23, 31]),
                       ("in_channels", 3), ("hidden_act", "silu"))
QWEN_VL_TOKENS = (("image_token_id", 151655), ("video_token_id", 151656), ("vision_start_token_id", 151652),
                  ("vision_end_token_id", 151653))
# The bundled processor's ids (models/processor.py; tests/recipe/test_presets.py checks them).
TINY_VL_TOKENS = (("image_token_id", 506), ("video_token_id", 507), ("vision_start_token_id", 504),
                  ("vision_end_token_id", 505))

PRESETS: dict[str, Preset] = {
    # vocab_size 0 = take the bundled tokenizer's size
    "tiny": Preset("qwen2", 128, 4, 4, 2, 384, 0, True, max_position_embeddings=4096),
    "0.5b": Preset("qwen2", 896, 24, 14, 2, 4864, 151936, True),
    "1.5b": Preset("qwen2", 1536, 28, 12, 2, 8960, 151936, True),
    "3b": Preset("qwen2", 2048, 36, 16, 2, 11008, 151936, True),
    "7b": Preset("qwen2", 3584, 28, 28, 4, 18944, 152064, False),
    "14b": Preset("qwen2", 5120, 48, 40, 8, 13824, 152064, False, rms_norm_eps=1e-5),
    "32b": Preset("qwen2", 5120, 64, 40, 8, 27648, 152064, False, rms_norm_eps=1e-5),
    "72b": Preset("qwen2", 8192, 80, 64, 8, 29568, 152064, False, rms_norm_eps=1e-5),
    "llama3-8b": Preset("llama", 4096, 32, 32, 8, 14336, 128256, False, rope_theta=500000.0,
                        max_position_embeddings=8192, rms_norm_eps=1e-5),
    # google/gemma-2-9b: local (4096-token window) and global layers alternating, attention and final
    # logit softcaps, queries scaled by 1/sqrt(256), sqrt(hidden)-scaled tied embeddings.
    "gemma2-9b": Preset("gemma2", 3584, 42, 16, 8, 14336, 256000, True, rope_theta=10000.0,
                        max_position_embeddings=8192,
                        extra=(("head_dim", 256), ("sliding_window", 4096), ("final_logit_softcapping", 30.0),
                               ("attn_logit_softcapping", 50.0), ("query_pre_attn_scalar", 256),
                               ("hidden_activation", "gelu_pytorch_tanh"), *GEMMA_TOKENS)),
    # google/gemma-3-12b text model: 5 local (1024-token window, RoPE base 10K) : 1 global (base 1M,
    # linear scaling x8) layers, q/k norms, no softcaps.
    "gemma3-12b": Preset("gemma3_text", 3840, 48, 16, 8, 15360, 262208, True, max_position_embeddings=131072,
                         extra=(("head_dim", 256), ("sliding_window", 1024), ("query_pre_attn_scalar", 256),
                                ("final_logit_softcapping", None), ("attn_logit_softcapping", None),
                                ("hidden_activation", "gelu_pytorch_tanh"),
                                ("rope_parameters", {
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1_000_000.0}}),
                                *GEMMA_TOKENS)),
    # microsoft/phi-4: Phi-3 architecture (fused qkv and gate_up projections), GQA 40:10, untied.
    "phi4-14b": Preset("phi3", 5120, 40, 40, 10, 17920, 100352, False, rope_theta=250000.0,
                       max_position_embeddings=16384, rms_norm_eps=1e-5,
                       extra=(("original_max_position_embeddings", 16384), ("sliding_window", None),
                              ("bos_token_id", 100257), ("eos_token_id", 100265), ("pad_token_id", 100349))),
    # allenai/OLMo-2-1124-7B: q/k norms over all heads, norms after attention and MLP, untied.
    "olmo2-7b": Preset("olmo2", 4096, 32, 32, 32, 11008, 100352, False, rope_theta=500000.0,
                       max_position_embeddings=4096,
                       extra=(("bos_token_id", None), ("eos_token_id", 100257), ("pad_token_id", 100277))),
    # Mixture of experts. Their config.json files keep output_router_logits false (HF's default); the engine
    # trains with the router aux loss at router_aux_loss_coef (engine/router_loss.py), as HF's training does.
    # Qwen/Qwen3-30B-A3B: 128 experts of width 768, top-8 renormalised, q/k norms, no shared expert.
    "qwen3-30b-a3b": Preset("qwen3_moe", 2048, 48, 32, 4, 6144, 151936, False, max_position_embeddings=40960,
                            extra=(("head_dim", 128), *QWEN3_MOE, ("moe_intermediate_size", 768))),
    # Qwen/Qwen3-235B-A22B: the same layer design, wider and deeper.
    "qwen3-235b-a22b": Preset("qwen3_moe", 4096, 94, 64, 4, 12288, 151936, False, max_position_embeddings=40960,
                              extra=(("head_dim", 128), *QWEN3_MOE, ("moe_intermediate_size", 1536))),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of width 14336, top-2, no sliding window.
    "mixtral-8x7b": Preset("mixtral", 4096, 32, 32, 8, 14336, 32000, False, rms_norm_eps=1e-5,
                           extra=(("num_local_experts", 8), ("num_experts_per_tok", 2), ("sliding_window", None),
                                  ("router_aux_loss_coef", 0.02))),
    # openai/gpt-oss-20b and -120b: 128-token window and full layers alternating, attention sinks, biased
    # q/k/v/o, router bias, clamped SwiGLU experts (width 2880) with biases, YaRN x32. The published
    # checkpoints hold the experts in MXFP4; loading dequantises them to bf16 (models/families.py).
    "gpt-oss-20b": Preset("gpt_oss", 2880, 24, 64, 8, 2880, 201088, False, max_position_embeddings=131072,
                          rms_norm_eps=1e-5, extra=(("num_local_experts", 32), *GPT_OSS)),
    # Vision-language: the tower trains too (model.freeze_vision); their tokenizer is the processor's.
    "qwen2-vl-tiny": Preset("qwen2_vl", 64, 2, 4, 2, 128, 0, False, max_position_embeddings=4096,
                            extra=(("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 3, 3]}),),
                            vision=(("depth", 2), ("embed_dim", 64), ("hidden_size", 64), ("num_heads", 4),
                                    ("mlp_ratio", 2), ("patch_size", 14), ("spatial_merge_size", 2),
                                    ("temporal_patch_size", 2), ("in_channels", 3)),
                            top=TINY_VL_TOKENS),
    "qwen2.5-vl-7b": Preset("qwen2_5_vl", 3584, 28, 28, 4, 18944, 152064, False, max_position_embeddings=128000,
                            extra=(("rope_parameters", {"rope_type": "default", "rope_theta": 1_000_000.0,
                                                        "mrope_section": [16, 24, 24]}),),
                            vision=QWEN25_VL_7B_VISION, top=QWEN_VL_TOKENS),
    "gpt-oss-120b": Preset("gpt_oss", 2880, 36, 64, 8, 2880, 201088, False, max_position_embeddings=131072,
                           rms_norm_eps=1e-5, extra=(("num_local_experts", 128), *GPT_OSS)),
}


def is_vision_preset(name: str | None) -> bool:
    """A vision-language preset: its tokenizer is the bundled processor's (models/processor.py)."""
    return name in PRESETS and bool(PRESETS[name].vision)
