"""Chats with images: LLaMA-Factory's layout and OpenAI's content parts, read into `Example`s whose text
holds one IMAGE placeholder per image, in order, and whose `images` are the files' resolved paths.

    LLaMA-Factory: {"messages": [{"role": "user", "content": "<image>What is this?"}, ...],
                    "images": ["imgs/cat.png"]}                  paths relative to the data file
    OpenAI parts:  {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/cat.png"},
                                                              {"type": "text", "text": "What is this?"}]}, ...]}

Every image is checked here, before anything is built: the file exists and is an image PIL can read
(the header only: `Image.verify`, no pixels decoded), and there are as many placeholders as images. Each
refusal names the record's line (or number), the path as written and where it was looked for.
"""

from __future__ import annotations

from pathlib import Path

from megatrain_cli.data.errors import DataError

IMAGE = "<image>"  # the placeholder, as LLaMA-Factory writes it; models/processor text replaces it
IMAGE_PART_TYPES = ("image",)  # {type: image, image: PATH}; an image_url part stays refused (formats.py)
IMAGES_FIELD = "images"


def has_images(record: dict, messages_field: str) -> bool:
    """The record carries images: an `images` field, or an image part in a message's content."""
    if IMAGES_FIELD in record and record[IMAGES_FIELD]:
        return True
    turns = record.get(messages_field)
    return isinstance(turns, list) and any(
        isinstance(t, dict) and isinstance(c := t.get("content", t.get("value")), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in c) for t in turns)


def source_dir(label: str) -> Path:
    """Where relative image paths start: the data file's folder (the working directory for other sources)."""
    from megatrain_cli.data.sources import BUILTIN_SOURCES

    builtin = BUILTIN_SOURCES.get(label.removeprefix("builtin:")) if label.startswith("builtin:") else None
    path = builtin or Path(label)
    return path.parent if path.is_file() else Path.cwd()


def image_turns(record: dict, messages_field: str, where: str, base: Path) -> tuple[list[dict], list[str]]:
    """(turns with text content, placeholders where images go; the images' resolved paths in order)."""
    turns = record.get(messages_field)
    listed = record.get(IMAGES_FIELD) or []
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise DataError(f"{where}: field {IMAGES_FIELD!r} should be a list of image paths, got {str(listed)[:60]}")
    out, from_parts = [], []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            out.append(turn)  # formats.read_message names what is wrong with it
            continue
        key = "content" if "content" in turn else "value"
        content = turn.get(key)
        if isinstance(content, list):
            texts = []
            for k, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    path = part.get(part["type"])
                    if not isinstance(path, str):
                        raise DataError(f"{where}: {messages_field}[{j}].{key}[{k}]: an image part needs its path "
                                        f"in {part['type']!r} ({{type: image, image: PATH}})")
                    from_parts.append(path)
                    texts.append(IMAGE)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                else:
                    raise DataError(f"{where}: {messages_field}[{j}].{key}[{k}]: expected a text or an image part, "
                                    f"got {str(part)[:60]}")
            turn = {**turn, key: "".join(texts)}
        out.append(turn)
    if listed and from_parts:
        raise DataError(f"{where}: images both in {IMAGES_FIELD!r} and as content parts: use one of the two")
    paths = listed or from_parts
    placeholders = sum(str(t.get("content", t.get("value", ""))).count(IMAGE) for t in out if isinstance(t, dict))
    if placeholders != len(paths):
        raise DataError(f"{where}: {placeholders} {IMAGE} placeholder(s) in {messages_field!r} but {len(paths)} "
                        f"image(s) in {IMAGES_FIELD!r}: write one {IMAGE} where each image goes, in order")
    return out, [check_image(p, where, base) for p in paths]


def check_image(path: str, where: str, base: Path) -> str:
    """The image's resolved path, after checking that PIL can read it (header only)."""
    from PIL import Image, UnidentifiedImageError

    full = (base / path).resolve() if not Path(path).is_absolute() else Path(path)
    if not full.is_file():
        raise DataError(f"{where}: image {path!r} not found (looked for {full}); image paths are relative to "
                        f"the data file: fix the path or remove the record")
    try:
        with Image.open(full) as im:
            im.verify()
    except Image.DecompressionBombError as err:  # PIL's guard against huge images, before decoding them
        raise DataError(f"{where}: {path!r} is too large to decode ({err}); resize it or remove the record") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise DataError(f"{where}: {path!r} is not an image PIL can read ({type(err).__name__}); give a PNG, JPEG "
                        f"or WebP file or remove the record") from None
    return str(full)
