"""Dynamic-resolution image preprocessing (Qwen2-VL, Qwen2.5-VL), as transformers'
Qwen2VLImageProcessor (Pillow backend) does it: the image is resized with Pillow
(bicubic) to the size `smart_resize` picks (each side a multiple of patch * merge
pixels, the area within [min_pixels, max_pixels], the aspect ratio kept as closely as
that allows), rescaled and normalised as image_processor.py does, then cut into
patch x patch squares, flattened merge-block by merge-block, each patch repeated over
the `temporal_patch_size` frames a still image stands for: [patches, C * T * P * P].
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exl3cli.engine.models.vision.image_processor import normalized_pixels
from exl3cli.errors import InvalidOption

# OpenAI CLIP's statistics: transformers' defaults for Qwen2-VL's processor.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """(height, width) for the model: multiples of `factor`, area within
    [min_pixels, max_pixels], the aspect ratio kept (transformers' smart_resize)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidOption(f"image of {width}x{height} pixels is too elongated (aspect "
                            f"ratio at most {MAX_ASPECT_RATIO})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class PatchImageProcessor:
    """One Pillow RGB image -> (patches [h * w, C * T * P * P] float32, grid (1, h, w)),
    h and w counted in patches."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = 3  # bicubic
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_folder(cls, folder: str | Path, defaults: dict[str, Any]) -> PatchImageProcessor:
        """preprocessor_config.json of `folder` over `defaults`; `min_pixels` and
        `max_pixels` win over size's shortest_edge / longest_edge, as transformers has it."""
        path = Path(folder) / "preprocessor_config.json"
        raw: dict[str, Any] = {}
        if path.is_file():
            raw = json.loads(path.read_text(encoding="utf-8"))
        merged = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
        size = merged.get("size") or {}
        low = merged.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
        high = merged.get("max_pixels", size.get("longest_edge", cls.max_pixels))
        processor = cls(
            min_pixels=int(low), max_pixels=int(high),
            patch_size=int(merged.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(merged.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(merged.get("merge_size", cls.merge_size)),
            resample=int(merged.get("resample", cls.resample)),
            rescale_factor=float(merged.get("rescale_factor", cls.rescale_factor)),
            image_mean=tuple(float(v) for v in merged.get("image_mean", CLIP_MEAN)),
            image_std=tuple(float(v) for v in merged.get("image_std", CLIP_STD)),
            do_resize=bool(merged.get("do_resize", True)),
            do_rescale=bool(merged.get("do_rescale", True)),
            do_normalize=bool(merged.get("do_normalize", True)),
        )
        if not 0 < processor.min_pixels <= processor.max_pixels:
            raise InvalidOption(f"preprocessor_config.json pixel bounds {low}..{high} are "
                                "not a range")
        return processor

    @property
    def factor(self) -> int:
        """Pixels per side of one merged token."""
        return self.patch_size * self.merge_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) an image of this size is given to the tower at."""
        if not self.do_resize:
            if width % self.factor or height % self.factor:
                raise InvalidOption(f"image of {width}x{height} pixels is not a multiple of "
                                    f"{self.factor} pixels per side (and resizing is off)")
            return width, height
        new_height, new_width = smart_resize(height, width, self.factor, self.min_pixels,
                                             self.max_pixels)
        return new_width, new_height

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of patches of an image of this size."""
        new_width, new_height = self.resized(width, height)
        return new_height // self.patch_size, new_width // self.patch_size

    def __call__(self, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """A Pillow RGB image (decode_image) -> (patches, (1, rows, columns))."""
        size = self.resized(*image.size)
        pixels = normalized_pixels(
            image, size if self.do_resize else None, self.resample,
            self.rescale_factor if self.do_rescale else None,
            (self.image_mean, self.image_std) if self.do_normalize else None)
        channels, height, width = pixels.shape
        patch, merge, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        rows, cols = height // patch, width // patch
        blocks = pixels.reshape(channels, rows // merge, merge, patch, cols // merge, merge, patch)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # (rows, cols, mh, mw, C, ph, pw)
        blocks = np.broadcast_to(blocks[:, :, :, :, :, None],
                                 (*blocks.shape[:5], frames, patch, patch))
        patches = np.ascontiguousarray(blocks).reshape(rows * cols,
                                                       channels * frames * patch * patch)
        return torch.from_numpy(patches), (1, rows, cols)
