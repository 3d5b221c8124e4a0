import json

import pytest

from exl3cli.engine.spec.config import ModelConfig, load_model_config
from exl3cli.errors import ModelLoadError

LEGACY_LLAMA31 = {  # transformers 4.x layout, as published for Llama 3.1
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def write_config(folder, data):
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def test_legacy_layout_with_llama3_scaling(tmp_path):
    config = load_model_config(write_config(tmp_path, LEGACY_LLAMA31))
    assert config.architecture == "LlamaForCausalLM"
    assert config.head_dim == 128  # hidden / heads when head_dim is absent
    assert config.num_kv_heads == 8
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["original_max_position_embeddings"] == 8192
    assert config.torch_dtype == "bfloat16"
    assert config.eos_token_ids == [128001, 128008, 128009]
    assert config.bos_token_id == 128000


def test_transformers5_layout_rope_parameters_and_explicit_head_dim():
    data = {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 300, "dtype": "float32", "eos_token_id": 2,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8,
    }
    config = ModelConfig.from_dict(data)
    assert config.head_dim == 32 and config.rope_theta == 1000000.0
    assert config.rope_scaling == {"rope_type": "default"}
    assert config.layer_types == ["full_attention", "sliding_attention"]
    assert config.sliding_window == 8 and config.eos_token_ids == [2]
    assert config.torch_dtype == "float32"
    assert config.num_kv_heads == 2


def test_old_style_scaling_type_key_and_missing_kv_heads():
    data = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 10,
            "rope_scaling": {"type": "linear", "factor": 2.0}}
    config = ModelConfig.from_dict(data)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.num_kv_heads == 4  # multi-head attention when kv heads are absent
    assert config.rope_theta == 10000.0


def test_missing_config_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model_config(tmp_path)


def test_broken_or_incomplete_config_is_a_load_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model_config(tmp_path)
    write_config(tmp_path, {"architectures": ["LlamaForCausalLM"], "hidden_size": 8})
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        load_model_config(tmp_path)
    write_config(tmp_path, {**LEGACY_LLAMA31, "architectures": []})
    with pytest.raises(ModelLoadError, match="architectures"):
        load_model_config(tmp_path)


# Qwen2.5-VL-3B-Instruct's config.json as published (transformers 4.x): the language
# model's keys at the top level, M-RoPE as rope_scaling type "mrope".
HUB_QWEN2_5_VL = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
    "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 70,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 2048},
}


def test_qwen2_5_vl_hub_config_reads_mrope_as_sections_over_default_rope():
    config = ModelConfig.from_dict(HUB_QWEN2_5_VL)
    assert config.rope_scaling == {"rope_type": "default"}
    assert config.mrope_section == [16, 24, 24]
    assert config.rope_theta == 1000000.0 and config.head_dim == 128
    assert config.tie_word_embeddings and config.hidden_size == 2048


def test_qwen2_5_vl_transformers5_text_config_takes_the_family_defaults(tmp_path):
    from exl3cli.engine.spec.architecture import get_architecture, load_family_config

    data = {"architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "tie_word_embeddings": True,
            "text_config": {"hidden_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "vocab_size": 300,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                "mrope_section": [2, 3, 3]}}}
    config = load_family_config(write_config(tmp_path, data))
    assert config.mrope_section == [2, 3, 3] and config.rope_theta == 1e4
    assert config.rms_norm_eps == 1e-5  # Qwen2_5_VLTextConfig's, not the engine's 1e-6
    assert config.max_position_embeddings == 32768 and config.tie_word_embeddings
    spec = get_architecture(config.architecture)
    assert spec.qkv_bias and spec.layer_types(config) == ["full_attention"] * 2
