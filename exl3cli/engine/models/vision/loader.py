"""The vision half of an image-text model folder, bound to its language model.

`load_vision(folder, model, tokenizer)` -> `VisionModel`, or None when the folder's
architecture reads text only. A VisionModel turns image bytes into token ids of the
prompt (`image_ids`, encoded once per distinct image) and a rendered chat with image
placeholders plus images into prompt ids (`prompt_ids`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exl3cli.engine.models.vision import gemma3, qwen2_5_vl
from exl3cli.engine.models.vision.image_processor import ImageProcessor, decode_image, image_size
from exl3cli.engine.models.vision.image_tokens import ImageTokens
from exl3cli.engine.models.vision.mrope import MRopeImageTokens
from exl3cli.engine.models.vision.patch_processor import PatchImageProcessor
from exl3cli.errors import InvalidOption, ModelLoadError


@dataclass(frozen=True)
class VisionFamily:
    """How exl3 reads one architecture's images: `load(raw config, tensor, has,
    token_text)` builds its tower (with `placeholder`, `image_token`, `embed_image`,
    `token_grid` and `expand`), `processor(folder)` its image processor, `tokens` the
    ImageTokens kind its language model takes, `stored_name` the name `exl3 convert`
    writes a tower tensor under (ExLlamaV3's layout, so the folder loads in both)."""

    load: Callable[..., Any]
    processor: Callable[[Path], Any]
    tokens: type[ImageTokens] = ImageTokens
    stored_name: Callable[[str], str] | None = None


# Architectures whose vision tower exl3 runs.
VISION_FAMILIES: dict[str, VisionFamily] = {
    gemma3.ARCHITECTURE: VisionFamily(
        gemma3.load_gemma3_vision,
        lambda folder: ImageProcessor.from_folder(folder, gemma3.PROCESSOR_DEFAULTS),
        stored_name=gemma3.exllamav3_name),
    qwen2_5_vl.ARCHITECTURE: VisionFamily(
        qwen2_5_vl.load_qwen2_5_vl_vision,
        lambda folder: PatchImageProcessor.from_folder(folder, {}),
        tokens=MRopeImageTokens, stored_name=qwen2_5_vl.exllamav3_name),
}


def stored_tensor_name(architecture: str, name: str) -> str:
    """The name `exl3 convert` writes a wrapper tensor (vision tower, projector) under."""
    family = VISION_FAMILIES.get(architecture)
    rename = family.stored_name if family is not None else None
    return rename(name) if rename is not None else name


def reads_images(raw_config: dict[str, Any]) -> bool:
    """Whether a config.json describes a model whose images exl3 can read."""
    architectures = raw_config.get("architectures") or []
    return (bool(architectures) and architectures[0] in VISION_FAMILIES
            and isinstance(raw_config.get("vision_config"), dict))


def folder_reads_images(folder: str | Path) -> bool:
    """reads_images for a model folder's config.json (False when it has none)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and reads_images(raw)


class VisionModel:
    """Tower + projector, image processor, and the model's ImageTokens."""

    def __init__(self, vision: Any, processor: ImageProcessor, tokens: ImageTokens,
                 image_token_id: int):
        self.vision = vision
        self.processor = processor
        self.tokens = tokens
        self.image_token_id = image_token_id
        self.placeholder: str = vision.placeholder

    @property
    def device(self) -> torch.device:
        return next(iter(self.vision.buffers())).device

    def encode(self, data: bytes) -> torch.Tensor:
        """Image bytes -> embeddings [tokens of the image, hidden] (no caching)."""
        return self.vision.embed_image(self.processor(decode_image(data)))

    def token_grid(self, data: bytes) -> tuple[int, int]:
        """(rows, columns) of an image's tokens, from its header (nothing decoded)."""
        return self.vision.token_grid(image_size(data), self.processor)

    def image_ids(self, data: bytes, grid: tuple[int, int] | None = None) -> list[int]:
        """The prompt ids of one image, encoding it only when it is not held yet."""
        digest = hashlib.sha256(data).hexdigest()
        return self.tokens.ids_for(digest, lambda: self.encode(data),
                                   grid or self.token_grid(data))

    def prompt_ids(self, text: str, images: Sequence[bytes],
                   encode: Callable[[str], list[int]]) -> list[int]:
        """Token ids of a rendered chat `text` in which `placeholder` marks where each
        of `images` goes (in order); `encode` tokenizes text."""
        found = text.count(self.placeholder)
        if found != len(images):
            raise InvalidOption(f"the prompt marks {found} image(s) ({self.placeholder}) "
                                f"but {len(images)} were given")
        grids = [self.token_grid(data) for data in images]
        ids = encode(self.vision.expand(text, grids))
        out: list[int] = []
        index = taken = 0
        while index < len(ids):
            if ids[index] != self.image_token_id:
                out.append(ids[index])
                index += 1
                continue
            per_image = grids[taken][0] * grids[taken][1] if taken < len(images) else 0
            run = ids[index : index + per_image]
            if taken >= len(images) or len(run) < per_image or any(
                    t != self.image_token_id for t in run) or (
                    index + per_image < len(ids) and ids[index + per_image] == self.image_token_id):
                raise InvalidOption("image soft tokens in the prompt do not match the images "
                                    "(is the image token typed in the text?)")
            out.extend(self.image_ids(images[taken], grids[taken]))
            taken += 1
            index += per_image
        if taken != len(images):
            raise InvalidOption("the tokenizer did not spell every image's tokens")
        return out


def read_image(value: Any, where: str = "image") -> bytes:
    """An image given to the Python API or the CLI: bytes, or a file path."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        try:
            return path.read_bytes()
        except OSError as error:
            raise InvalidOption(f"{where}: cannot read image file {path}: "
                                f"{error.strerror or error}") from None
    raise InvalidOption(f"{where} must be bytes or a file path, got {type(value).__name__}")


def place_images(messages: Sequence[dict[str, Any]], placeholder: str,
                 to_bytes: Callable[[Any, str], bytes]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Messages whose `images` are written as `placeholder`s ahead of their text (as
    Ollama places them), without the `images` key, and the images' bytes in prompt
    order; `to_bytes(value, where)` reads one image."""
    out: list[dict[str, Any]] = []
    images: list[bytes] = []
    for index, message in enumerate(messages):
        given = message.get("images") or []
        rest = {k: v for k, v in message.items() if k != "images"}
        if not given:
            out.append(rest)
            continue
        if not isinstance(given, (list, tuple)):
            raise InvalidOption(f"messages[{index}].images must be a list")
        images.extend(to_bytes(value, f"messages[{index}].images[{i}]")
                      for i, value in enumerate(given))
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise InvalidOption(f"messages[{index}].content must be a string")
        out.append({**rest, "content": placeholder * len(given) + content})
    return out, images


def load_vision(folder: str | Path, model: Any, tokenizer: Any,
                capacity: int | None = None) -> VisionModel | None:
    """The folder's vision model on the language model's device and dtype, attached to
    it (`model.images`); None for a text-only folder. ModelLoadError on a broken one."""
    from exl3cli.engine.models.weights import WeightReader

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if not reads_images(raw):
        return None
    family = VISION_FAMILIES[raw["architectures"][0]]
    reader = WeightReader(folder)
    device, dtype = model.device, model.dtype

    def tensor(name: str) -> torch.Tensor:
        return reader.get(name, dtype=dtype, device=device).contiguous()

    def token_text(token_id: int) -> str | None:
        return tokenizer.id_to_token(token_id)

    try:
        vision = family.load(raw, tensor, reader.has, token_text)
        processor = family.processor(folder)
    except (KeyError, ValueError, InvalidOption) as error:
        raise ModelLoadError(f"cannot load the vision tower of {folder}: {error}") from None
    image_token = tokenizer.token_to_id(vision.image_token)
    if image_token is None:
        raise ModelLoadError(f"the tokenizer has no {vision.image_token} token")
    tokens = family.tokens(model.config.vocab_size, capacity or 64)
    model.images = tokens
    return VisionModel(vision, processor, tokens, image_token)
