import json

import pytest
import torch

from exl3cli.engine.models.loader import default_dtype, load_causal_lm
from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import ModelLoadError, UnsupportedArchitecture
from tests.fixtures.tiny_model import write_tiny_model


def test_default_dtype_rules():
    def cfg(dtype):
        return ModelConfig.from_dict({"architectures": ["X"], "hidden_size": 8,
                                      "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "vocab_size": 4, "torch_dtype": dtype})
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert default_dtype(cfg("bfloat16"), cpu) == torch.bfloat16
    assert default_dtype(cfg("float16"), cpu) == torch.float32
    assert default_dtype(cfg("float32"), cpu) == torch.float32
    assert default_dtype(cfg("float16"), gpu) == torch.float16


def test_unknown_architecture_in_config(tmp_path):
    folder = write_tiny_model(tmp_path, "llama")
    data = json.loads((folder / "config.json").read_text())
    data["architectures"] = ["FalconMambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedArchitecture, match="FalconMambaForCausalLM"):
        load_causal_lm(folder, device="cpu")


def test_missing_tensor_or_files_is_a_load_error(tmp_path):
    folder = write_tiny_model(tmp_path, "llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_causal_lm(folder, device="cpu")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_causal_lm(tmp_path / "nowhere", device="cpu")


def test_float16_checkpoint_and_tied_embeddings_share_storage(tmp_path):
    folder = write_tiny_model(tmp_path, "llama", dtype="float16", tie_word_embeddings=True)
    model = load_causal_lm(folder, device="cpu")
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert model.lm_head_weight.data_ptr() == model.embed_weight.data_ptr()
    half = load_causal_lm(folder, device="cpu", dtype=torch.float16)
    ids = torch.tensor([[5, 6, 7]])
    assert (half(ids) - model(ids)).abs().max() < 0.05
