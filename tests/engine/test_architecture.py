from pathlib import Path

import pytest

from exl3cli.engine.spec.architecture import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ArchitectureSpec,
    available_architectures,
    get_architecture,
)
from exl3cli.engine.spec.config import ModelConfig
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


def test_the_readme_lists_every_supported_architecture():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    families = readme.split("Model families", 1)[1].split("\n\n", 1)[0]
    missing = [name for name in available_architectures() if f"`{name}`" not in families]
    assert not missing, f"README's family list lacks {missing}"


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


def test_fused_projection_names_apply_only_where_the_checkpoint_has_them():
    phi3 = get_architecture("Phi3ForCausalLM")
    fused = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"}
    names = phi3.tensor_names(fused.__contains__)  # a Hugging Face Phi-3 checkpoint
    assert names.qkv_fused == "model.layers.{i}.self_attn.qkv_proj"
    assert names.gate_up_fused == "model.layers.{i}.mlp.gate_up_proj"
    # An EXL3 folder stores q/k/v and gate/up split (EXL3-FORMAT.md section 2).
    split = phi3.tensor_names({"model.layers.0.self_attn.q_proj.trellis"}.__contains__)
    assert split.qkv_fused is None and split.gate_up_fused is None
    assert split.q_proj == "model.layers.{i}.self_attn.q_proj"


def test_rope_permutation_layouts():
    from exl3cli.engine.layers.rope import rope_permutation

    # Llama-style pairs over 4 of 8 dimensions: (0, 2), (1, 3) rotate; 4..7 pass.
    assert rope_permutation(8, 4, False).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    # Interleaved pairs (0, 1), (2, 3), ... over the whole head.
    assert rope_permutation(8, 8, True).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert rope_permutation(8, 8, False).tolist() == list(range(8))

