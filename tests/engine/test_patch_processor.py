"""Qwen2-VL / Qwen2.5-VL image preprocessing equals transformers' Qwen2VLImageProcessor
(Pillow backend): pixel_values and image_grid_thw, on real PNG, JPEG and WebP files of
several sizes (smaller than min_pixels, larger than max_pixels, elongated), written with
Pillow."""

from __future__ import annotations

import json

import pytest
import torch

from exl3cli.engine.models.vision.image_processor import decode_image, image_size
from exl3cli.engine.models.vision.patch_processor import PatchImageProcessor, smart_resize
from exl3cli.errors import InvalidOption
from tests.fixtures.tiny_vision import image_bytes

CASES = [  # (width, height, format, mode)
    (64, 48, "PNG", "RGB"), (200, 120, "JPEG", "RGB"), (33, 250, "PNG", "RGBA"),
    (640, 480, "JPEG", "RGB"), (123, 77, "WEBP", "RGB"), (20, 20, "PNG", "RGB"),
]
# Qwen2.5-VL's preprocessor_config.json keys (min_pixels / max_pixels), a small
# max_pixels so the larger files are scaled down; and transformers 5's size dict.
HUB_STYLE = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136,
             "max_pixels": 200704, "patch_size": 14, "temporal_patch_size": 2,
             "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711]}
SIZE_STYLE = {"size": {"shortest_edge": 56 * 56 * 4, "longest_edge": 28 * 28 * 64},
              "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3], "resample": 2}


def _theirs(settings):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(**{k: v for k, v in settings.items()
                                       if k != "image_processor_type"})


def _ours(tmp_path, settings):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    return PatchImageProcessor.from_folder(tmp_path, {})


@pytest.mark.parametrize("settings", [HUB_STYLE, SIZE_STYLE], ids=["min_max_pixels", "size"])
@pytest.mark.parametrize("case", CASES, ids=[f"{w}x{h}-{f}-{m}" for w, h, f, m in CASES])
def test_patches_and_grid_equal_transformers(tmp_path, case, settings):
    from PIL import Image

    width, height, fmt, mode = case
    path = tmp_path / f"image.{fmt.lower()}"
    path.write_bytes(image_bytes(width, height, fmt, seed=width * height, mode=mode))
    data = path.read_bytes()
    patches, grid = _ours(tmp_path, settings)(decode_image(data))
    out = _theirs(settings)(Image.open(path), return_tensors="pt")
    assert list(grid) == out["image_grid_thw"][0].tolist()
    assert patches.dtype == out["pixel_values"].dtype == torch.float32
    assert patches.shape == out["pixel_values"].shape
    assert torch.equal(patches, out["pixel_values"])
    processor = _ours(tmp_path, settings)
    assert processor.grid(*image_size(data)) == tuple(grid[1:])
    assert grid[1] * grid[2] == _theirs(settings).get_number_of_image_patches(height, width)


def test_defaults_are_transformers_when_the_file_says_nothing(tmp_path):
    from PIL import Image

    path = tmp_path / "photo.jpg"
    path.write_bytes(image_bytes(300, 200, "JPEG", seed=4))
    patches, grid = PatchImageProcessor.from_folder(tmp_path, {})(decode_image(path.read_bytes()))
    out = _theirs({})(Image.open(path), return_tensors="pt")
    assert list(grid) == out["image_grid_thw"][0].tolist() == [1, 14, 22]
    assert torch.equal(patches, out["pixel_values"])


@pytest.mark.parametrize("size", [(100, 100), (1000, 30), (29, 29), (5000, 4000)])
def test_smart_resize_equals_transformers(size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as reference,
    )

    height, width = size
    for bounds in ((3136, 1003520), (3136, 12845056), (100_000, 200_000)):
        assert smart_resize(height, width, 28, *bounds) == reference(height, width, 28, *bounds)


def test_elongated_and_unreadable_images_are_refused(tmp_path):
    processor = PatchImageProcessor()
    with pytest.raises(InvalidOption, match="elongated"):
        processor.grid(4020, 20)
    with pytest.raises(InvalidOption, match="could not be decoded"):
        image_size(b"not an image")
    (tmp_path / "preprocessor_config.json").write_text('{"min_pixels": 10, "max_pixels": 5}')
    with pytest.raises(InvalidOption, match="not a range"):
        PatchImageProcessor.from_folder(tmp_path, {})
