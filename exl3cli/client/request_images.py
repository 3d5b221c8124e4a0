"""Images in requests: Ollama's `images` (base64 strings, on /api/generate and on chat
messages) become bytes placed in the prompt by the model's vision half
(engine/vision/loader.VisionModel); a model that reads text only refuses them."""

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
    from exl3cli.engine.vision.loader import folder_reads_images

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
    """Messages whose images are written as the model's image placeholders ahead of
    their text (as Ollama places them), and the images in prompt order. Messages
    keep no `images` key (chat templates never see bytes)."""
    out: list[dict[str, Any]] = []
    images: list[bytes] = []
    for index, message in enumerate(messages):
        given = message.get("images")
        if not given:
            out.append({k: v for k, v in message.items() if k != "images"})
            continue
        vision = getattr(text_model, "vision", None)
        if vision is None:
            raise InvalidOption("this model does not support images (it reads text only)")
        if not isinstance(given, list):
            raise InvalidOption(f"messages[{index}].images must be a list")
        images.extend(image_bytes(value, f"messages[{index}].images[{i}]")
                      for i, value in enumerate(given))
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise InvalidOption(f"messages[{index}].content must be a string")
        out.append({**{k: v for k, v in message.items() if k != "images"},
                    "content": vision.placeholder * len(given) + content})
    return out, images


def image_prompt_ids(text_model: Any, text: str, images: list[bytes],
                     encode: Callable[[str], list[int]]) -> list[int]:
    """Prompt ids of a rendered `text` holding one placeholder per image."""
    return text_model.vision.prompt_ids(text, images, encode)


def check_prompt_ids(text_model: Any, ids: Any, what: str = "prompt token") -> list[int]:
    """Ids from a request or a render: in the vocabulary, or images the model holds."""
    from exl3cli.engine.token_ids import check_token_ids

    images = getattr(text_model.model, "images", None)
    if images is not None:
        return images.check(ids, what)
    return check_token_ids(ids, text_model.model.config.vocab_size, what)
