"""Named model shapes: random-init models for `bench`, the demo and tests (no weights needed).

Shapes follow the published Qwen2.5 and Llama-3 configs; `tiny` is ours, sized so that the embedded
default trains on two CPU cores in well under three minutes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    architecture: str  # HF class name in config.architectures
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

    def hf_config(self, vocab_size: int | None = None, max_position_embeddings: int | None = None):
        """A transformers config object for this shape."""
        from transformers import AutoConfig

        model_type = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}[self.architecture]
        kwargs = dict(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=vocab_size or self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=max_position_embeddings or self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            architectures=[self.architecture],
        )
        config = AutoConfig.for_model(model_type, **kwargs)
        # transformers moved rope_theta into rope_parameters in v5; set whichever this version reads.
        if getattr(config, "rope_parameters", None) is not None:
            config.rope_parameters["rope_theta"] = self.rope_theta
        else:
            config.rope_theta = self.rope_theta
        return config


PRESETS: dict[str, Preset] = {
    # vocab_size 0 = take the bundled tokenizer's size
    "tiny": Preset("Qwen2ForCausalLM", 128, 4, 4, 2, 384, 0, True, max_position_embeddings=4096),
    "0.5b": Preset("Qwen2ForCausalLM", 896, 24, 14, 2, 4864, 151936, True),
    "1.5b": Preset("Qwen2ForCausalLM", 1536, 28, 12, 2, 8960, 151936, True),
    "3b": Preset("Qwen2ForCausalLM", 2048, 36, 16, 2, 11008, 151936, True),
    "7b": Preset("Qwen2ForCausalLM", 3584, 28, 28, 4, 18944, 152064, False),
    "14b": Preset("Qwen2ForCausalLM", 5120, 48, 40, 8, 13824, 152064, False, rms_norm_eps=1e-5),
    "32b": Preset("Qwen2ForCausalLM", 5120, 64, 40, 8, 27648, 152064, False, rms_norm_eps=1e-5),
    "72b": Preset("Qwen2ForCausalLM", 8192, 80, 64, 8, 29568, 152064, False, rms_norm_eps=1e-5),
    "llama3-8b": Preset("LlamaForCausalLM", 4096, 32, 32, 8, 14336, 128256, False, rope_theta=500000.0,
                        max_position_embeddings=8192, rms_norm_eps=1e-5),
}
