"""Qwen2.5-VL's vision tower and patch merger against transformers' `model.visual` on
the processor's pixel_values of real images (fp32): window attention with windows cut
short at the grid's edges (batched in one call, or one call each), a full-attention
block, several images in one call."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from exl3cli.engine.models.vision.image_processor import decode_image
from exl3cli.engine.models.vision.patch_processor import PatchImageProcessor
from exl3cli.engine.models.vision.qwen2_5_vl_tower import (
    QwenVisionConfig,
    Segments,
    load_qwen_vision_tower,
    segment_attention,
    window_order,
)
from exl3cli.engine.models.weights import WeightReader
from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model
from tests.fixtures.tiny_vision import image_bytes

TOLERANCE = 1e-3
# Small enough to stay quick, large enough for several windows per image.
PROCESSOR = PatchImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 40)
IMAGES = [(64, 48, "PNG"), (200, 120, "JPEG"), (90, 300, "PNG"), (28, 28, "WEBP")]


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("qwen2_5_vl") / "model", "qwen2_5_vl")
    raw = json.loads((folder / "config.json").read_text())
    reader = WeightReader(folder)
    ours = load_qwen_vision_tower(
        QwenVisionConfig.from_dict(raw["vision_config"]),
        lambda name: reader.get(name, dtype=torch.float32).contiguous(), "visual.")
    return ours, tiny_reference_model("qwen2_5_vl")


def _pixels(images):
    done = [PROCESSOR(decode_image(image_bytes(w, h, fmt, seed=w + h))) for w, h, fmt in images]
    return torch.cat([p for p, _ in done]), [grid for _, grid in done]


@pytest.mark.parametrize("count", [1, 4])
def test_image_features_match_transformers(towers, count):
    ours, reference = towers
    pixels, grids = _pixels(IMAGES[:count] if count > 1 else IMAGES[1:2])
    with torch.no_grad():
        expected = reference.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        features = reference.get_image_features(pixels, torch.tensor(grids)).pooler_output
    got = ours(pixels, grids)
    assert got.shape == expected.shape == (sum(h * w for _, h, w in grids) // 4, 64)
    assert (got - expected).abs().max() < TOLERANCE  # measured ~1e-6
    assert torch.equal(torch.cat(features), expected)


def test_window_attention_matters(towers):
    """The same tower with every block on full attention is no longer transformers'."""
    ours, reference = towers
    pixels, grids = _pixels(IMAGES[1:2])
    with torch.no_grad():
        expected = reference.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    windowed = ours.config
    try:
        ours.config = replace(windowed, full_attention_blocks=tuple(range(windowed.depth)))
        full = ours(pixels, grids)
    finally:
        ours.config = windowed
    assert (full - expected).abs().max() > 0.01


def test_window_order_equals_transformers():
    from transformers.vision_utils import get_vision_window_index

    grids = [(1, 8, 6), (1, 4, 4), (2, 6, 10), (1, 2, 14)]
    order, lengths = window_order(grids, 2, 2)
    index, cumulative = get_vision_window_index(torch.tensor(grids), 2, 56, 14)
    assert torch.equal(order, index)
    assert lengths == torch.diff(cumulative).tolist()


@pytest.mark.parametrize("count", [1, 4])
def test_batched_windows_equal_one_call_per_window(towers, count):
    """Windows padded to one batched call (padding keys masked) give the per-window
    calls' features: windows cut short at the edges, several images at once."""
    ours, _ = towers
    pixels, grids = _pixels(IMAGES[:count] if count > 1 else IMAGES[1:2])
    batched = ours(pixels, grids)
    try:
        ours.batched_windows = False
        looped = ours(pixels, grids)
    finally:
        ours.batched_windows = True
    assert (batched - looped).abs().max() < 1e-5


def test_segments_gather_pad_and_keep_in_order():
    segments = Segments.batched([3, 1, 2], torch.device("cpu"))
    assert segments.index.tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 5]]
    assert segments.mask[:, 0, 0].tolist() == [[True] * 3, [True, False, False],
                                               [True, True, False]]
    assert torch.arange(9)[segments.keep].tolist() == [0, 1, 2, 3, 6, 7]
    even = Segments.batched([2, 2], torch.device("cpu"))
    assert even.mask is None and even.keep is None
    x = torch.randn(6, 2, 4)
    got = segment_attention(x, x, x, Segments.batched([3, 1, 2], torch.device("cpu")))
    want = segment_attention(x, x, x, Segments([3, 1, 2]))
    assert (got - want).abs().max() < 1e-6
