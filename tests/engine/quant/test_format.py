"""The EXL3 folder contract: tensor names/dtypes/shapes, shards, index, configs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from exl3cli.codec import dequantize_linear
from exl3cli.codec.format import (
    Exl3FolderWriter,
    exl3_linear_layout,
    make_quantization_config,
    padded_size,
    read_exl3_linear,
    read_quantization_config,
    write_exl3_linear,
)
from exl3cli.convert.synthetic import quantize_linear_plain, random_exl3_linear
from exl3cli.engine.models.weights import WeightReader
from exl3cli.errors import ModelLoadError

# EXL3-FORMAT.md section 2: the marker values as written in the spec.
MUL1_MARKER = -2082680531
MCG_MARKER = -877912083


def _random_linear(pin: int, pout: int, k: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(pin + pout + k)
    return {
        "trellis": torch.randint(-(2**15), 2**15, (pin // 16, pout // 16, 16 * k),
                                 generator=gen, dtype=torch.int32).to(torch.int16),
        "suh": torch.randn(pin, generator=gen),
        "svh": torch.randn(pout, generator=gen),
    }


def test_padded_size_rounds_up_to_128():
    assert [padded_size(n) for n in (1, 64, 128, 129, 576, 4096)] == [128, 128, 128, 256, 640,
                                                                     4096]


@pytest.mark.parametrize("codebook, marker", [("mul1", MUL1_MARKER), ("mcg", MCG_MARKER),
                                              ("3inst", None)])
def test_write_exl3_linear_names_dtypes_shapes(codebook, marker):
    t = _random_linear(256, 128, 3)
    bias = torch.randn(100)
    tensors = write_exl3_linear("model.layers.3.mlp.down_proj", t["trellis"], t["suh"], t["svh"],
                                codebook, bias)
    prefix = "model.layers.3.mlp.down_proj"
    expected = {f"{prefix}.trellis", f"{prefix}.suh", f"{prefix}.svh", f"{prefix}.bias"}
    if marker is not None:
        expected.add(f"{prefix}.{codebook}")
    assert set(tensors) == expected
    assert tensors[f"{prefix}.trellis"].dtype == torch.int16
    assert tensors[f"{prefix}.trellis"].shape == (16, 8, 48)
    assert tensors[f"{prefix}.suh"].dtype == torch.float16
    assert tensors[f"{prefix}.suh"].shape == (256,)
    assert tensors[f"{prefix}.svh"].shape == (128,)
    assert tensors[f"{prefix}.bias"].dtype == torch.float16
    if marker is not None:
        mark = tensors[f"{prefix}.{codebook}"]
        assert mark.dtype == torch.int32 and mark.shape == () and int(mark) == marker
    # The layout function describes exactly what the writer produced.
    layout = exl3_linear_layout(200, 100, 3, codebook, bias=True)
    assert {f"{prefix}.{s}": spec for s, spec in layout.items()} == {
        name: (value.dtype, tuple(value.shape)) for name, value in tensors.items()
    }


def test_write_exl3_linear_rejects_bad_inputs():
    t = _random_linear(128, 128, 2)
    with pytest.raises(ValueError, match="multiples of 128"):
        write_exl3_linear("m", t["trellis"][:4], t["suh"][:64], t["svh"])
    with pytest.raises(ValueError, match="entries"):
        write_exl3_linear("m", t["trellis"], t["suh"][:100], t["svh"])
    with pytest.raises(ValueError, match="mul1"):
        half = torch.zeros(8, 8, 40, dtype=torch.int16)  # K = 2.5
        write_exl3_linear("m", half, t["suh"], t["svh"], "mcg")


def test_folder_writer_cuts_shards_at_module_boundaries(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128,
              "tie_word_embeddings": True}
    writer = Exl3FolderWriter(tmp_path, config, shard_bytes=20_000)
    modules = []
    for i in range(4):
        t = _random_linear(128, 256, 4)  # 16 KiB of trellis: one module per shard
        name = f"model.layers.{i}.mlp.up_proj"
        writer.add_linear(name, t["trellis"], t["suh"], t["svh"], "mul1",
                          bias=torch.randn(256))
        modules.append(name)
    writer.add_dense_linear("model.layers.0.mlp.down_proj", torch.randn(64, 96, dtype=torch.float32))
    writer.add_tensor("model.norm.weight", torch.ones(128, dtype=torch.float32))
    writer.add_tensor("model.embed_tokens.weight", torch.ones(10, 128, dtype=torch.bfloat16))
    qconfig = make_quantization_config(4.0, 6, "mul1", calibration={"rows": 10, "cols": 2048})
    writer.close(qconfig)

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not list(tmp_path.glob("*.tmp"))
    total = 0
    keys_in = {}
    for shard in shards:
        with safe_open(str(tmp_path / shard), "pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                total += tensor.numel() * tensor.element_size()
                keys_in[key] = shard
                assert index["weight_map"][key] == shard
    assert set(keys_in) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == total
    for name in modules:  # a module's tensors never straddle two shards
        assert len({keys_in[k] for k in keys_in if k.startswith(name + ".")}) == 1
        assert {k.rsplit(".", 1)[1] for k in keys_in if k.startswith(name + ".")} == {
            "trellis", "suh", "svh", "mul1", "bias"}

    reader = WeightReader(tmp_path)
    assert reader.get("model.layers.0.mlp.down_proj.weight").dtype == torch.float16
    assert reader.get("model.layers.0.mlp.down_proj.weight").shape == (64, 96)
    assert reader.get("model.norm.weight").dtype == torch.float16  # float32 -> float16
    assert reader.get("model.embed_tokens.weight").dtype == torch.bfloat16  # kept

    written = json.loads((tmp_path / "config.json").read_text())
    assert written["tie_word_embeddings"] is False
    assert written["hidden_size"] == 128
    q = written["quantization_config"]
    assert q["quant_method"] == "exl3" and q["bits"] == 4.0 and q["head_bits"] == 6
    assert q["codebook"] == "mul1" and q["calibration"] == {"rows": 10, "cols": 2048}
    assert q["out_scales"] in ("always", "never", "auto") and isinstance(q["version"], str)

    sidecar = json.loads((tmp_path / "quantization_config.json").read_text())
    assert sidecar["quant_method"] == "exl3"
    storage = sidecar["tensor_storage"]
    up = storage["model.layers.2.mlp.up_proj"]
    assert up["quant_format"] == "exl3" and up["bits_per_weight"] == 4
    assert up["stored_tensors"]["model.layers.2.mlp.up_proj.trellis"] == {
        "shape": [8, 16, 64], "n_bytes": 8 * 16 * 64 * 2, "dtype": "I16"}
    assert "quant_format" not in storage["model.layers.0.mlp.down_proj"]


def test_single_shard_has_no_index(tmp_path):
    writer = Exl3FolderWriter(tmp_path, {"architectures": ["X"]})
    writer.add_tensor("model.norm.weight", torch.ones(8))
    writer.close(make_quantization_config(2.5, 16))
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert WeightReader(tmp_path).has("model.norm.weight")
    with pytest.raises(ValueError, match="twice"):
        writer2 = Exl3FolderWriter(tmp_path / "b", {})
        writer2.add_tensor("a.weight", torch.ones(2))
        writer2.add_tensor("a.weight", torch.ones(2))


def test_read_quantization_config_prefers_config_then_sidecar(tmp_path):
    assert read_quantization_config(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert read_quantization_config(tmp_path) is None
    (tmp_path / "quantization_config.json").write_text(json.dumps({"bits": 3.0}))
    assert read_quantization_config(tmp_path) == {"bits": 3.0}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"bits": 5.0}}))
    assert read_quantization_config(tmp_path) == {"bits": 5.0}


def test_read_exl3_linear_detects_storage_and_legacy_signs(tmp_path):
    writer = Exl3FolderWriter(tmp_path, {})
    t = _random_linear(128, 128, 2)
    writer.add_linear("q", t["trellis"], t["suh"], t["svh"], "3inst")
    writer.add_dense_linear("d", torch.randn(4, 4))
    writer.add_tensor("legacy.trellis", t["trellis"])
    writer.add_tensor("legacy.su", torch.zeros(8, dtype=torch.int16))
    writer.add_tensor("legacy.sv", torch.zeros(8, dtype=torch.int16))
    writer.add_tensor("broken.trellis", t["trellis"])
    writer.close({})
    reader = WeightReader(tmp_path)
    assert read_exl3_linear(reader, "d") is None
    assert set(read_exl3_linear(reader, "q")) == {"trellis", "suh", "svh"}
    assert set(read_exl3_linear(reader, "legacy")) == {"trellis", "su", "sv"}
    with pytest.raises(ModelLoadError, match="suh"):
        read_exl3_linear(reader, "broken")


def test_random_linear_matches_layout():
    tensors = random_exl3_linear(576, 1536, 4)
    layout = exl3_linear_layout(576, 1536, 4, "mul1")
    assert {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()} == layout
    assert layout["trellis"][1] == (40, 96, 64)  # 576 -> 640 padded inputs


def test_quantize_linear_plain_round_trip_at_4_bits():
    torch.manual_seed(3)
    weight = torch.randn(96, 64) * torch.linspace(0.5, 2.0, 64)  # uneven column scales
    tensors = quantize_linear_plain(weight, 4, "mul1", bias=torch.randn(96))
    assert tensors["trellis"].shape == (8, 8, 64)
    assert tensors["bias"].shape == (96,)
    rebuilt = dequantize_linear(tensors, 64, 96).t()
    relative = ((rebuilt - weight).pow(2).mean() / weight.pow(2).mean()).item()
    # Unit-Gaussian MSE at K=4 is ~0.0045 (QTIP bound 0.0039); allow some margin.
    assert relative < 0.008
