"""Synthetic EXL3 models: real architecture shapes, random weights, tokenizers."""

from __future__ import annotations

import json

import pytest
import torch

from exl3cli.convert.synthetic import (
    SHAPES,
    copy_tokenizer,
    linear_shapes,
    random_exl3_linear,
    write_synthetic_model,
)
from exl3cli.convert.synthetic_shapes import layer_modules
from exl3cli.engine.layers.linear import Exl3Linear
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.text.tokenizer import Tokenizer
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer

# Parameter counts published on the models' Hugging Face pages.
PUBLISHED_PARAMETERS = {
    "llama3-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "smollm2-135m": 134_515_008,
    "qwen3-30b-a3b": 30_532_122_624,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("shape", sorted(PUBLISHED_PARAMETERS))
def test_shapes_have_the_published_parameter_counts(shape):
    config = SHAPES[shape]
    layers = [m for i in range(config["num_hidden_layers"]) for m in layer_modules(config, i)]
    linears = sum(m.in_features * m.out_features for m in layers if m.kind != "norm")
    norms = sum(m.in_features for m in layers if m.kind == "norm") + config["hidden_size"]
    embed = config["vocab_size"] * config["hidden_size"]
    heads = 1 if config["tie_word_embeddings"] else 2  # the source's own head
    assert linears + heads * embed + norms == PUBLISHED_PARAMETERS[shape]
    assert sum(i * o for _, i, o in linear_shapes(config)) < linears or "llama" in shape \
        or "smollm" in shape  # MoE routers are 16-bit linears, not EXL3 ones


@pytest.mark.parametrize("shape, router, expert", [
    ("tiny-qwen3-moe", "model.layers.1.mlp.gate", "model.layers.1.mlp.experts.15.down_proj"),
    ("tiny-mixtral", "model.layers.1.block_sparse_moe.gate",
     "model.layers.1.block_sparse_moe.experts.3.w3"),
])
def test_moe_folders_store_routers_dense_and_experts_quantized(tmp_path, shape, router, expert):
    folder = write_synthetic_model(tmp_path, shape, bits=4.0, device="cpu", workers=2,
                                   shard_bytes=2**16)
    reader = WeightReader(folder)
    assert reader.get(router + ".weight").dtype == torch.float16
    assert not reader.has(router + ".trellis")
    assert reader.get(expert + ".trellis").shape[-1] == 64  # 4 bits
    assert len(list(folder.glob("model-*.safetensors"))) > 5  # several shards, all written
    if "qwen3" in shape:
        assert reader.get("model.layers.0.self_attn.q_norm.weight").shape == (64,)


def test_random_linear_keeps_activation_scale():
    gen = torch.Generator().manual_seed(0)
    layer = Exl3Linear(random_exl3_linear(576, 1536, 4, "mul1", gen), 576, 1536)
    x = torch.randn(16, 576, generator=gen)
    ratio = (layer(x).pow(2).mean() / x.pow(2).mean()).sqrt().item()
    assert 0.7 < ratio < 1.4


def test_fractional_bits_average_and_config(tmp_path):
    folder = write_synthetic_model(tmp_path, "tiny", bits=2.5, head_bits=5, codebook="mcg",
                                   num_layers=4)
    reader = WeightReader(folder)
    ks = [reader.get(f"model.layers.{i}.self_attn.o_proj.trellis").shape[-1] // 16
          for i in range(4)]
    assert sorted(ks) == [2, 2, 3, 3]
    assert reader.get("lm_head.trellis").shape[-1] == 80
    assert int(reader.get("lm_head.mcg")) == -877912083
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["tie_word_embeddings"] is False
    assert config["quantization_config"]["bits"] == 2.5
    assert config["quantization_config"]["codebook"] == "mcg"
    assert (folder / "quantization_config.json").is_file()


def test_copy_tokenizer_from_a_folder(tmp_path):
    source = write_tiny_tokenizer(tmp_path / "tok")
    folder = write_synthetic_model(tmp_path / "model", "tiny", bits=2, tokenizer_from=source)
    original = Tokenizer.from_folder(source)
    copied = Tokenizer.from_folder(folder)
    text = "Hello world, café!"
    assert copied.encode(text) == original.encode(text)
    with pytest.raises(FileNotFoundError):
        copy_tokenizer(tmp_path / "model" / "missing", tmp_path)


def test_unknown_shape_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown shape"):
        write_synthetic_model(tmp_path, "gpt-9")
