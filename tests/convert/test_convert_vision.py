"""`exl3 convert` of a Gemma 3 image-text model keeps the vision tower and projector
(16-bit, under ExLlamaV3's names: vision_tower.vision_model.*, multi_modal_projector.*);
the converted folder loads with its vision half and answers about an image. Qwen2.5-VL
(slow) keeps its tower under "visual."."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from exl3cli.convert.pipeline import ConvertOptions, convert_model
from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.engine.models.vision.gemma3 import exllamav3_name
from exl3cli.engine.models.weights import WeightReader
from tests.fixtures.tiny_vision import image_bytes, write_tiny_gemma3_vision

FAST = ConvertOptions(bits=4.0, head_bits=16, rows=8, cols=128, scale_search_tiles=4,
                      device="cpu")
PROMPT = "<start_of_turn>user\n<start_of_image> Describe it.<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_vision")
    src = write_tiny_gemma3_vision(root / "src")
    convert_model(src, root / "out", replace(FAST), root / "work")
    return src, root / "out"


def test_tower_and_projector_are_kept_under_exllamav3_names(folders):
    src, out = folders
    source, converted = WeightReader(src), WeightReader(out)
    wrapper = [k for k in source.keys() if not k.startswith("language_model.")]
    assert len(wrapper) > 20
    for name in wrapper:
        stored = exllamav3_name(name)
        assert stored.startswith(("vision_tower.vision_model.", "multi_modal_projector."))
        kept = converted.get(stored)
        assert kept.dtype == torch.float16
        assert torch.equal(kept, source.get(name).to(torch.float16))
    assert converted.has("vision_tower.vision_model.encoder.layers.1.mlp.fc2.weight")
    assert converted.has("multi_modal_projector.mm_input_projection_weight")


def test_converted_folder_reads_images(folders):
    src, out = folders
    original = TextModel.load(src, device="cpu", dtype=torch.float32)
    quantized = TextModel.load(out, device="cpu", dtype=torch.float32)
    assert quantized.vision is not None
    image = image_bytes(80, 60, "JPEG", seed=3)
    embedded = quantized.vision.encode(image)
    reference = original.vision.encode(image)
    assert (embedded - reference).abs().max() < 0.02 * reference.abs().max()  # fp16 tower
    ids_q = quantized.vision.prompt_ids(PROMPT, [image], quantized.tokenizer.encode)
    ids_o = original.vision.prompt_ids(PROMPT, [image], original.tokenizer.encode)
    got, expected = quantized.model(torch.tensor([ids_q])), original.model(torch.tensor([ids_o]))
    corr = torch.corrcoef(torch.stack([got.flatten(), expected.flatten()]))[0, 1].item()
    assert corr > 0.98, f"correlation {corr:.4f}"


@pytest.mark.slow
def test_qwen2_5_vl_converted_folder_keeps_its_tower_and_reads_images(tmp_path):
    """Qwen2.5-VL: the tower stays under "visual." (16-bit) and the converted folder
    answers about an image much as the source does."""
    from tests.fixtures.tiny_vision import write_tiny_qwen2_5_vl

    src = write_tiny_qwen2_5_vl(tmp_path / "src")
    convert_model(src, tmp_path / "out", replace(FAST), tmp_path / "work")
    source, converted = WeightReader(src), WeightReader(tmp_path / "out")
    tower = [k for k in source.keys() if k.startswith("visual.")]
    assert len(tower) > 20
    assert all(torch.equal(converted.get(k), source.get(k).to(torch.float16)) for k in tower)
    original = TextModel.load(src, device="cpu", dtype=torch.float32)
    quantized = TextModel.load(tmp_path / "out", device="cpu", dtype=torch.float32)
    image = image_bytes(80, 60, "JPEG", seed=3)
    prompt = (f"<|im_start|>user\n{original.vision.placeholder} Describe it.<|im_end|>\n"
              "<|im_start|>assistant\n")
    ids = [m.vision.prompt_ids(prompt, [image], m.tokenizer.encode)
           for m in (quantized, original)]
    got = quantized.model(torch.tensor([ids[0]]))
    expected = original.model(torch.tensor([ids[1]]))
    corr = torch.corrcoef(torch.stack([got.flatten(), expected.flatten()]))[0, 1].item()
    assert corr > 0.98, f"correlation {corr:.4f}"  # measured 0.993
