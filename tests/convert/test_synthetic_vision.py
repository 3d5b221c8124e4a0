"""The synthetic Qwen2.5-VL-shaped EXL3 folder (convert/synthetic_vision.py): the
language model as trellis linears with q/k/v biases, the tower at 16 bits under
"visual.*" (ExLlamaV3's names), special tokens at the ids config.json names; it loads
with its vision half, spells an image as the processor does, and its logits with an
image in the prompt are finite."""

from __future__ import annotations

import json

import pytest
import torch

from exl3cli.convert.synthetic_vision import SPECIALS, VISION_SHAPES, write_synthetic_vision_model
from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.engine.models.weights import WeightReader
from tests.fixtures.tiny_vision import image_bytes


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_synthetic_vision_model(tmp_path_factory.mktemp("syn-vl") / "m",
                                        "qwen2.5-vl-tiny", bits=3.5, head_bits=6, workers=2)


@pytest.fixture(scope="module")
def loaded(folder):
    return TextModel.load(folder, device="cpu", dtype=torch.float32)


def test_tensors_are_named_and_stored_as_both_loaders_read_them(folder):
    config = json.loads((folder / "config.json").read_text())
    vision = config["vision_config"]
    reader = WeightReader(folder)
    keys = set(reader.keys())
    tower = sorted(k for k in keys if k.startswith("visual."))
    # patch embedding, 12 a block (norms, weights, biases), merger: all 16-bit
    assert len(tower) == 1 + 12 * vision["depth"] + 5
    assert all(reader.get(k).dtype == torch.float16 for k in tower)
    assert tuple(reader.get("visual.patch_embed.proj.weight").shape) == (128, 3, 2, 14, 14)
    assert tuple(reader.get("visual.merger.mlp.0.weight").shape) == (512, 512)
    for i in range(config["num_hidden_layers"]):
        for name in ("q_proj", "k_proj", "v_proj"):
            assert f"model.layers.{i}.self_attn.{name}.bias" in keys
        assert f"model.layers.{i}.mlp.down_proj.trellis" in keys
    assert "lm_head.trellis" in keys and "model.embed_tokens.weight" in keys
    assert not any(k.startswith("model.language_model.") for k in keys)
    assert config["quantization_config"]["bits"] == 3.5
    assert config["vision_config"]["spatial_patch_size"] == 14  # ExLlamaV3 requires it


def test_special_tokens_sit_at_the_config_ids(folder, loaded):
    config = json.loads((folder / "config.json").read_text())
    tok = loaded.tokenizer
    first = VISION_SHAPES["qwen2.5-vl-tiny"][2]
    assert [tok.token_to_id(name) for name in SPECIALS] == list(range(first, first + 14))
    assert tok.token_to_id("<|image_pad|>") == config["image_token_id"]
    assert tok.token_to_id("<|vision_start|>") == config["vision_start_token_id"]
    assert tok.id_to_token(config["vocab_size"] - 1) is not None  # every id has a token
    assert tok.encode("hi") == [ord("h"), ord("i")]


def test_folder_reads_an_image_with_finite_logits(loaded):
    assert loaded.vision is not None
    image = image_bytes(120, 64, "PNG", seed=5)  # 112 x 56 pixels: 4 x 2 tokens
    ids = loaded.chat_prompt([{"role": "user", "content": "What is it?", "images": [image]}])
    runs = loaded.model.images.runs(ids)
    assert [end - begin for begin, end in runs] == [8]
    tok = loaded.tokenizer
    assert ids[runs[0][0] - 1] == tok.token_to_id("<|vision_start|>")
    assert ids[runs[0][1]] == tok.token_to_id("<|vision_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.decode(ids[1:7]) == "system"
    embedded = loaded.vision.encode(image)
    assert embedded.shape == (8, 256) and 0.1 < float(embedded.std()) < 10
    logits = loaded.model(torch.tensor([ids]))
    assert torch.isfinite(logits).all() and float(logits.std()) > 0
