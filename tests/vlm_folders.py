"""Tiny LLaVA and Gemma 3 model folders built here, as a release ships them: config.json, random weights
(safetensors) and the family's own processor files (HF's LlavaProcessor / Gemma3Processor over the bundled
offline tokenizer plus the family's image tokens, its chat template rendering an image part as the family's
marker, and its image processor at 28 px: 4 patches of 14). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

from megatrain_cli.models.tokenizer import BUNDLED_TOKENIZER_PATH, EOS_TOKEN, PAD_TOKEN

TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{% if message['content'] is string %}"
            "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
            "MARK{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
FEATURES_PER_IMAGE = 4  # 28 px / 14 px patches, squared (LLaVA: CLS dropped; Gemma 3: pooled to 4 tokens)


def _tokenizer(family: str):
    from transformers import PreTrainedTokenizerFast

    extra = {}
    if family == "gemma3":  # Gemma's tokenizer names these tokens; Gemma3Processor reads them
        extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok = PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_TOKENIZER_PATH), eos_token=EOS_TOKEN,
                                  pad_token=PAD_TOKEN, clean_up_tokenization_spaces=False,
                                  extra_special_tokens=extra)
    marker = "<start_of_image>" if family == "gemma3" else "<image>"
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>", marker,
                                                         *[t for t in extra.values() if t != marker]]})
    tok.chat_template = TEMPLATE.replace("MARK", marker)
    return tok


def _processor(family: str):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = _tokenizer(family)
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
        from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

        images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
        return Gemma3Processor(images, tok, chat_template=tok.chat_template, image_seq_length=FEATURES_PER_IMAGE)
    from transformers.models.llava.processing_llava import LlavaProcessor

    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(images, tok, chat_template=tok.chat_template, patch_size=14,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def config_for(family: str, tok):
    """The tiny configs of tests/engine/test_vision.py with this tokenizer's ids."""
    from tests.engine.test_vision import tiny_vlm_config

    config = tiny_vlm_config(family)
    ids = lambda t: tok.convert_tokens_to_ids(t)  # noqa: E731
    text = config.get_text_config()
    text.vocab_size = len(tok)
    text.pad_token_id, text.eos_token_id = tok.pad_token_id, tok.eos_token_id
    if family == "gemma3":
        config.image_token_id, config.boi_token_id = ids("<image_soft_token>"), ids("<start_of_image>")
        config.eoi_token_id = ids("<end_of_image>")
    else:
        config.image_token_id = ids("<image>")
    return config


def build_folder(family: str, out: Path) -> Path:
    """`out`: a tiny random `family` model with its processor, as AutoModelForImageTextToText loads it."""
    from transformers import AutoModelForImageTextToText

    processor = _processor(family)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config_for(family, processor.tokenizer), dtype=torch.float32)
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    return out
