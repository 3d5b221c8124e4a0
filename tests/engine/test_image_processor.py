"""Image preprocessing equals transformers' Gemma3 image processor (Pillow backend) on
real PNG, JPEG and WebP files of several sizes and modes, written with Pillow."""

from __future__ import annotations

import io

import pytest
import torch

from exl3cli.engine.models.vision.gemma3 import PROCESSOR_DEFAULTS
from exl3cli.engine.models.vision.image_processor import ImageProcessor, decode_image
from exl3cli.errors import InvalidOption
from tests.fixtures.tiny_vision import PREPROCESSOR, image_bytes

CASES = [  # (width, height, format, mode)
    (64, 48, "PNG", "RGB"), (896, 896, "PNG", "RGB"), (1000, 600, "JPEG", "RGB"),
    (37, 211, "JPEG", "RGB"), (300, 300, "WEBP", "RGB"), (120, 90, "PNG", "RGBA"),
    (50, 70, "WEBP", "RGBA"), (81, 81, "PNG", "L"),
]


def _file(tmp_path, width, height, fmt, mode, seed):
    """A real image file on disk (grayscale made from an RGB one)."""
    from PIL import Image

    data = image_bytes(width, height, fmt if mode != "L" else "PNG", seed=seed,
                       mode="RGBA" if mode == "RGBA" else "RGB")
    if mode == "L":
        buffer = io.BytesIO()
        Image.open(io.BytesIO(data)).convert("L").save(buffer, format=fmt)
        data = buffer.getvalue()
    path = tmp_path / f"image-{seed}.{fmt.lower()}"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("settings", [PREPROCESSOR, {
    **PREPROCESSOR, "size": {"height": 224, "width": 160}, "resample": 3}], ids=["bilinear", "bicubic"])
@pytest.mark.parametrize("case", CASES, ids=[f"{w}x{h}-{f}-{m}" for w, h, f, m in CASES])
def test_pixels_equal_transformers(tmp_path, tmp_path_factory, case, settings):
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    width, height, fmt, mode = case
    path = _file(tmp_path, width, height, fmt, mode, seed=width + height)
    folder = tmp_path_factory.mktemp("processor")
    (folder / "preprocessor_config.json").write_text(__import__("json").dumps(settings))
    ours = ImageProcessor.from_folder(folder, PROCESSOR_DEFAULTS)(decode_image(path.read_bytes()))
    theirs = Gemma3ImageProcessorPil(**{k: v for k, v in settings.items()
                                        if k != "image_processor_type"})(
        Image.open(path), return_tensors="pt")["pixel_values"][0]
    assert ours.shape == theirs.shape == (3, settings["size"]["height"],
                                          settings["size"]["width"])
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)


def test_defaults_are_transformers_when_the_file_says_nothing(tmp_path):
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = _file(tmp_path, 300, 200, "JPEG", "RGB", seed=4)
    ours = ImageProcessor.from_folder(tmp_path, PROCESSOR_DEFAULTS)(decode_image(path.read_bytes()))
    theirs = Gemma3ImageProcessorPil()(Image.open(path), return_tensors="pt")["pixel_values"][0]
    assert torch.equal(ours, theirs)


def test_bad_images_are_refused_clearly(tmp_path):
    with pytest.raises(InvalidOption, match="could not be decoded"):
        decode_image(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(InvalidOption, match="could not be decoded"):
        decode_image(b"")
    (tmp_path / "preprocessor_config.json").write_text('{"do_pan_and_scan": true}')
    with pytest.raises(InvalidOption, match="pan-and-scan"):
        ImageProcessor.from_folder(tmp_path, PROCESSOR_DEFAULTS)
