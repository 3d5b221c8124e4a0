"""Image bytes to the pixel tensor a vision tower reads, as transformers' image
processors make it: Pillow decodes (PNG, JPEG, WebP, ...), transparency is composited
onto white, the image is resized with Pillow's filter to the tower's size, then
rescaled (float64 times 1/255, stored as float32) and normalised per channel in float32.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exl3cli.errors import InvalidOption

# Pillow's resampling filters by the numbers preprocessor_config.json writes.
_FILTERS = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
# Past this many pixels an image is refused before decoding (a decompression bomb).
MAX_IMAGE_PIXELS = 64_000_000


def decode_image(data: bytes) -> Any:
    """A Pillow image in RGB from encoded bytes; InvalidOption when they are no image
    Pillow can read. Transparent images are composited onto white (as transformers'
    convert_to_rgb does)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            if opened.width * opened.height > MAX_IMAGE_PIXELS:
                raise InvalidOption(f"image of {opened.width}x{opened.height} pixels is too "
                                    f"large (at most {MAX_IMAGE_PIXELS} pixels)")
            opened.load()
            image = opened.copy()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        raise InvalidOption(f"image could not be decoded (PNG, JPEG or WebP expected): "
                            f"{error}") from None
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of encoded image bytes from their header (nothing decoded);
    InvalidOption as decode_image gives it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        raise InvalidOption(f"image could not be decoded (PNG, JPEG or WebP expected): "
                            f"{error}") from None
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidOption(f"image of {width}x{height} pixels is too large (at most "
                            f"{MAX_IMAGE_PIXELS} pixels)")
    return width, height


@dataclass(frozen=True)
class ImageProcessor:
    """Resize to (height, width), rescale, normalise: one image -> [3, H, W] float32."""

    height: int
    width: int
    resample: int = 2  # bilinear
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_folder(cls, folder: str | Path, defaults: dict[str, Any]) -> ImageProcessor:
        """preprocessor_config.json of `folder` over the family's `defaults` (what
        transformers' processor class assumes for keys the file leaves out)."""
        path = Path(folder) / "preprocessor_config.json"
        raw: dict[str, Any] = {}
        if path.is_file():
            raw = json.loads(path.read_text(encoding="utf-8"))
        merged = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
        if merged.get("do_pan_and_scan"):
            raise InvalidOption("preprocessor_config.json asks for pan-and-scan crops, which "
                                "are not supported")
        size = merged.get("size") or {}
        if "height" not in size or "width" not in size:
            raise InvalidOption(f"preprocessor_config.json size must give height and width, "
                                f"got {size!r}")
        return cls(
            height=int(size["height"]), width=int(size["width"]),
            resample=int(merged.get("resample", 2)),
            rescale_factor=float(merged.get("rescale_factor", 1 / 255)),
            image_mean=tuple(float(v) for v in merged.get("image_mean", (0.5,) * 3)),
            image_std=tuple(float(v) for v in merged.get("image_std", (0.5,) * 3)),
            do_resize=bool(merged.get("do_resize", True)),
            do_rescale=bool(merged.get("do_rescale", True)),
            do_normalize=bool(merged.get("do_normalize", True)),
        )

    def __call__(self, image: Any) -> torch.Tensor:
        """A Pillow RGB image (decode_image) -> pixel values [3, height, width]."""
        pixels = normalized_pixels(
            image, (self.width, self.height) if self.do_resize else None, self.resample,
            self.rescale_factor if self.do_rescale else None,
            (self.image_mean, self.image_std) if self.do_normalize else None)
        return torch.from_numpy(pixels)


def normalized_pixels(image: Any, size: tuple[int, int] | None, resample: int,
                      rescale_factor: float | None,
                      mean_std: tuple[Sequence[float], Sequence[float]] | None) -> np.ndarray:
    """A Pillow RGB image resized to `size` (width, height; None: as it is) with
    Pillow's filter `resample`, rescaled (float64 times the factor, stored as float32)
    and normalised per channel in float32: [3, height, width] float32, contiguous."""
    from PIL import Image

    if size is not None and image.size != size:
        image = image.resize(size, getattr(Image.Resampling, _FILTERS.get(resample, "BILINEAR")))
    pixels = np.asarray(image)
    if rescale_factor is not None:
        pixels = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if mean_std is not None:
        mean = np.array(mean_std[0], dtype=np.float32)
        std = np.array(mean_std[1], dtype=np.float32)
        pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))
