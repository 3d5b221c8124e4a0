import pytest

from exl3cli.engine.architecture import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ArchitectureSpec,
    available_architectures,
    get_architecture,
)
from exl3cli.engine.config import ModelConfig
from exl3cli.errors import UnsupportedArchitecture


def config(**extra):
    data = {"architectures": ["X"], "hidden_size": 8, "num_hidden_layers": 4,
            "num_attention_heads": 2, "vocab_size": 10, **extra}
    return ModelConfig.from_dict(data)


def test_builtin_specs_come_through_the_plugin_hook():
    specs = available_architectures()
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM"):
        assert specs[name].name == name
    assert get_architecture("Qwen2ForCausalLM").qkv_bias
    assert get_architecture("Qwen3ForCausalLM").qk_norm == "rms"
    assert not get_architecture("LlamaForCausalLM").qkv_bias


def test_unknown_architecture_has_a_one_line_message():
    with pytest.raises(UnsupportedArchitecture) as info:
        get_architecture("GPTBigFooForCausalLM")
    message = str(info.value)
    assert "GPTBigFooForCausalLM" in message and "LlamaForCausalLM" in message
    assert "\n" not in message


def test_sliding_window_policies():
    mistral = ArchitectureSpec("M", sliding_window="all")
    qwen = ArchitectureSpec("Q", sliding_window="from_layer")
    llama = ArchitectureSpec("L")
    assert mistral.layer_types(config(sliding_window=16)) == [SLIDING_ATTENTION] * 4
    assert mistral.layer_types(config()) == [FULL_ATTENTION] * 4
    assert llama.layer_types(config(sliding_window=16)) == [FULL_ATTENTION] * 4
    # Qwen: only with use_sliding_window, from max_window_layers on.
    assert qwen.layer_types(config(sliding_window=16)) == [FULL_ATTENTION] * 4
    on = config(sliding_window=16, use_sliding_window=True, max_window_layers=2)
    assert qwen.layer_types(on) == [FULL_ATTENTION] * 2 + [SLIDING_ATTENTION] * 2
    # An explicit layer_types list wins over the policy.
    explicit = config(sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2)
    assert qwen.layer_types(explicit)[0] == SLIDING_ATTENTION


def test_moe_families_and_their_sparse_layers():
    for name in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        assert get_architecture(name).moe is not None
    assert get_architecture("LlamaForCausalLM").moe is None
    qwen = get_architecture("Qwen3MoeForCausalLM").moe
    cfg = config(num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [qwen.is_sparse(cfg, i) for i in range(4)] == [False, True, False, False]
    # transformers 5 writes Qwen's expert count as num_local_experts.
    assert qwen.num_experts(config(num_local_experts=6)) == 6
    assert not qwen.is_sparse(config(), 0)  # no experts at all: dense
    shared = get_architecture("Qwen2MoeForCausalLM").moe
    assert shared.shared_size(config(shared_expert_intermediate_size=48)) == 48
    assert get_architecture("MixtralForCausalLM").moe.shared_size(config()) == 0
