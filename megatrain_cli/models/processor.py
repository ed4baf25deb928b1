"""A vision-language model's processor (its tokenizer and image processor), read from the model's folder
with no network, or the small bundled one for the VLM presets.

Two kinds. Qwen2-VL-style dynamic resolution (`ImageTextProcessor`): the tokenizer and the image processor
as a pair, each image token expanded to its image's grid. A fixed count per image (`FixedImageProcessor`:
LLaVA, Gemma 3): the family's own processor from `AutoProcessor` expands each image marker (LLaVA's
`<image>`, Gemma 3's `<start_of_image>`) as it does for inference; nothing of its rule is re-implemented.

The bundled processor (assets/vlm/) is Qwen2-VL's image processor and the bundled byte-level tokenizer
plus the ChatML and vision tokens, with a ChatML template that renders image parts as Qwen2-VL's does
(<|vision_start|><|image_pad|><|vision_end|>), and an image processor bounded to small images (28..448
pixels a side) so that tests and the tiny demo stay fast. Rebuild it with `python -m
megatrain_cli.models.processor` (deterministic; a test checks the shipped token ids).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatrain_cli.models.tokenizer import BUNDLED_PROCESSOR_DIR, BUNDLED_TOKENIZER_PATH, EOS_TOKEN, PAD_TOKEN

VISION_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ImageTextProcessor:
    """The model's tokenizer and image processor (HF's own, from its folder), and the one rule that joins
    them: each image's marker holds one image token, which becomes as many as the image has features
    (Qwen2-VL: its grid's patches / merge_size^2; what Qwen2VLProcessor does). Kept as the pair rather
    than AutoProcessor because transformers builds Qwen2-VL's processor only with torchvision installed
    (its video processor); export writes the same files, so AutoProcessor loads them where it can."""

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.merge = int(getattr(image_processor, "merge_size", 0) or 0)
        if not self.merge:
            raise ValueError(f"{type(image_processor).__name__}: no merge_size, and no processor_config.json "
                             f"beside it: image data trains models with a dynamic-resolution image processor "
                             f"(Qwen2-VL's) or with their own processor's files (LLaVA, Gemma 3; docs/vlm.md)")
        self.image_token = next((t for t in ("<|image_pad|>", "<image>") if t in tokenizer.get_vocab()), None)
        if self.image_token is None:
            raise ValueError(f"the tokenizer {tokenizer.name_or_path!r} has no image token (<|image_pad|>)")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.marker = image_marker(tokenizer, self.image_token)

    def save_pretrained(self, directory: str) -> None:
        """The tokenizer's files and the image processor's (preprocessor_config.json), as AutoProcessor reads them."""
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)
        config = Path(directory) / "preprocessor_config.json"
        data = json.loads(config.read_text())
        data.setdefault("processor_class", "Qwen2VLProcessor")  # what AutoProcessor builds from these files
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    def images(self, paths: list[str]) -> dict:
        """The image processor's tensors for these files, in order (pixel_values, image_grid_thw)."""
        out = self.image_processor(images=_open(paths), return_tensors="pt")
        return {k: out[k] for k in ("pixel_values", "image_grid_thw")}

    def encode(self, text: str, paths: list[str]) -> tuple[list[int], dict | None]:
        """Ids of `text` (no special tokens added) with its image tokens expanded for these images."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not paths:
            return ids, None
        tensors = self.images(paths)
        counts = iter((tensors["image_grid_thw"].prod(-1) // self.merge ** 2).tolist())
        out = []
        for i in ids:
            out += [i] * next(counts) if i == self.image_token_id else [i]
        return out, tensors


class FixedImageProcessor:
    """A family's own HF processor (LLaVA's, Gemma 3's) behind ImageTextProcessor's interface: the chat
    template's image part is the marker, and the processor expands it (Gemma 3: begin-of-image, its
    `image_seq_length` soft tokens, end-of-image) into the model's image tokens; `image_token_id` is the token
    the features replace (the model's `image_token_id`), the one that never carries loss."""

    def __init__(self, processor):
        self.hf, self.tokenizer = processor, processor.tokenizer
        self.image_token = processor.image_token  # what the text holds per image (LLaVA: <image>; Gemma 3: boi)
        token = getattr(self.tokenizer, "image_token", None) or processor.image_token  # Gemma 3's soft token
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(token)
        self.marker = image_marker(self.tokenizer, self.image_token)

    def save_pretrained(self, directory: str) -> None:
        self.hf.save_pretrained(directory)

    def images(self, paths: list[str]) -> dict:
        """The image processor's tensors for these files, in order (pixel_values)."""
        out = self.hf.image_processor(images=_open(paths), return_tensors="pt")
        return {"pixel_values": out["pixel_values"]}

    def encode(self, text: str, paths: list[str]) -> tuple[list[int], dict | None]:
        """Ids of `text` (no special tokens added) with each image marker expanded by the processor."""
        if not paths:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        out = self.hf(text=[text], images=_open(paths), add_special_tokens=False, return_tensors="pt")
        return out["input_ids"][0].tolist(), {"pixel_values": out["pixel_values"]}


def _open(paths: list[str]) -> list:
    from PIL import Image

    opened = []
    for p in paths:  # the data checks read each header (data/images.py); a truncated body fails here
        try:
            opened.append(Image.open(p).convert("RGB"))
        except OSError as err:
            from megatrain_cli.data.errors import DataError

            raise DataError(f"image {p}: {err}; replace the file or remove its record") from None
    return opened


def load_processor(directory: str | Path | None, trust_remote_code: bool = False):
    """The processor of `directory` (local files only), or the bundled one when None: a family's own
    processor (processor_config.json: LLaVA, Gemma 3) unless its image processor is Qwen2-VL's dynamic one
    (which transformers' AutoProcessor builds only with torchvision installed)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    d = Path(directory) if directory is not None else BUNDLED_PROCESSOR_DIR
    if (d / "processor_config.json").is_file():
        try:
            hf = AutoProcessor.from_pretrained(str(d), local_files_only=True, trust_remote_code=trust_remote_code)
        except (ImportError, ValueError, OSError):  # Qwen2-VL's without torchvision: the pair below
            hf = None
        if hf is not None and not getattr(hf.image_processor, "merge_size", None):
            return FixedImageProcessor(hf)
    if not (d / "preprocessor_config.json").is_file():
        raise ValueError(f"no image processor in {d} (preprocessor_config.json): a vision-language model needs "
                         f"its processor's files beside its tokenizer; copy them from the model's release")
    tokenizer = AutoTokenizer.from_pretrained(str(d), local_files_only=True, trust_remote_code=trust_remote_code)
    images = AutoImageProcessor.from_pretrained(str(d), local_files_only=True, trust_remote_code=trust_remote_code)
    return ImageTextProcessor(tokenizer, images)


def image_marker(tokenizer, image_token: str) -> str:
    """The text one image is before it is expanded (Qwen2-VL: vision start, one image pad, vision end):
    what the chat template renders for an image part; the image token alone without a template."""
    probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\x00"}]}]
    plain = [{"role": "user", "content": [{"type": "text", "text": "\x00"}]}]
    try:
        before = tokenizer.apply_chat_template(probe, tokenize=False).split("\x00")[0]
        plain_before = tokenizer.apply_chat_template(plain, tokenize=False).split("\x00")[0]
    except Exception:  # noqa: BLE001 - no chat template (or one without parts): the image token alone
        return image_token
    marker = before[len(plain_before):] if before.startswith(plain_before) else ""
    return marker if image_token in marker else image_token


def build_bundled_processor(path: Path = BUNDLED_PROCESSOR_DIR) -> Path:
    """assets/vlm/: the bundled tokenizer + VISION_TOKENS, the chat template, Qwen2-VL's image processor."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_TOKENIZER_PATH), eos_token=EOS_TOKEN,
                                        pad_token=PAD_TOKEN, model_max_length=4096,
                                        clean_up_tokenization_spaces=False)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    images = Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=28 * 28,
                                      max_pixels=448 * 448)
    path.mkdir(parents=True, exist_ok=True)
    ImageTextProcessor(tokenizer, images).save_pretrained(str(path))
    return path


if __name__ == "__main__":
    print(f"wrote {build_bundled_processor()}")
