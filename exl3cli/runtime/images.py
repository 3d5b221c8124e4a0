"""Images in requests: Ollama's `images` (base64 strings, on /api/generate and on chat
messages) become bytes placed in the prompt by the model's vision half
(engine/models/vision/loader.VisionModel); a model that reads text only refuses them."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exl3cli.errors import InvalidOption


def request_has_images(req: dict[str, Any]) -> bool:
    """Whether a generate or chat request carries any image."""
    messages = req.get("messages") if isinstance(req.get("messages"), list) else []
    return bool(req.get("images")) or any(isinstance(m, dict) and m.get("images")
                                          for m in messages)


def refuse_images_unless_read(model: str, folder: str | Path) -> None:
    """InvalidOption (a 400) when the model in `folder` reads text only."""
    from exl3cli.engine.models.vision.loader import folder_reads_images

    if not folder_reads_images(folder):
        raise InvalidOption(f"model '{model}' does not support images (it reads text only)")


def image_bytes(value: Any, where: str) -> bytes:
    """One request image: bytes as they are, base64 text decoded."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if not isinstance(value, str):
        raise InvalidOption(f"{where} must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidOption(f"{where} is not valid base64") from None


def with_image_placeholders(text_model: Any, messages: list[dict[str, Any]]
                            ) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Messages whose base64 images are written as the model's image placeholders
    ahead of their text, and the images' bytes in prompt order (vision/loader.py)."""
    from exl3cli.engine.models.vision.loader import place_images

    if not any(message.get("images") for message in messages):
        return [{k: v for k, v in m.items() if k != "images"} for m in messages], []
    vision = getattr(text_model, "vision", None)
    if vision is None:
        raise InvalidOption("this model does not support images (it reads text only)")
    return place_images(messages, vision.placeholder, image_bytes)


def image_prompt_ids(text_model: Any, text: str, images: list[bytes],
                     encode: Callable[[str], list[int]]) -> list[int]:
    """Prompt ids of a rendered `text` holding one placeholder per image."""
    return text_model.vision.prompt_ids(text, images, encode)


def check_prompt_ids(text_model: Any, ids: Any, what: str = "prompt token") -> list[int]:
    """Ids from a request or a render: in the vocabulary, or images the model holds."""
    from exl3cli.engine.text.token_ids import check_token_ids

    images = getattr(text_model.model, "images", None)
    if images is not None:
        return images.check(ids, what)
    return check_token_ids(ids, text_model.model.config.vocab_size, what)
