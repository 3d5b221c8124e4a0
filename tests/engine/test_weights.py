import json

import pytest
import torch
from safetensors.torch import save_file

from exl3cli.engine.models.weights import WeightReader
from exl3cli.errors import ModelLoadError


def test_single_file(tmp_path):
    save_file({"a": torch.arange(6, dtype=torch.float32).view(2, 3),
               "b": torch.ones(4, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    reader = WeightReader(tmp_path)
    assert sorted(reader.keys()) == ["a", "b"]
    assert reader.has("a") and not reader.has("c")
    assert torch.equal(reader.get("a"), torch.arange(6.0).view(2, 3))
    assert reader.get("b").dtype == torch.bfloat16
    converted = reader.get("b", dtype=torch.float32)
    assert converted.dtype == torch.float32 and torch.equal(converted, torch.ones(4))
    with pytest.raises(ModelLoadError, match="'c'"):
        reader.get("c")


def write_shards(folder):
    save_file({"x": torch.full((3,), 1.0)}, folder / "model-00001-of-00002.safetensors")
    save_file({"y": torch.full((2,), 2.0, dtype=torch.float16)},
              folder / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"x": "model-00001-of-00002.safetensors",
                                            "y": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_shards_with_index(tmp_path):
    write_shards(tmp_path)
    reader = WeightReader(tmp_path)
    assert sorted(reader.keys()) == ["x", "y"]
    assert torch.equal(reader.get("x"), torch.full((3,), 1.0))
    assert reader.get("y").dtype == torch.float16
    assert torch.equal(reader.get("y", dtype=torch.float32), torch.full((2,), 2.0))


def test_missing_shard_is_a_load_error(tmp_path):
    write_shards(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="00002"):
        WeightReader(tmp_path)


def test_folder_without_weights_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        WeightReader(tmp_path)


def test_corrupt_file_is_a_load_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ModelLoadError, match="cannot read"):
        WeightReader(tmp_path)
