"""The architectures synthetic EXL3 folders can take (config.json dicts, public facts)
and the modules each layer of such a folder holds.

Public API:
- ``SHAPES``: name -> config.json dict: ``llama3-8b`` (= ``llama3.1-8b``, Llama 3.1 8B),
  ``llama3.2-1b``, ``smollm2-135m`` (hidden 576: stored padded to 640), ``qwen2.5-0.5b``, ``tiny``,
  ``qwen3-30b-a3b`` (Qwen3-30B-A3B: 128 experts, 8 per token, q/k norms),
  ``mixtral-8x7b`` (Mixtral-8x7B: 8 experts, 2 per token), ``tiny-qwen3-moe`` and
  ``tiny-mixtral`` (the same families at test sizes).
- ``layer_modules(config, i) -> list[Module]``: layer `i`'s modules in file order, named
  as both our loader and ExLlamaV3 read them: EXL3 linears (attention, dense MLP or every
  expert's gate/up/down), the MoE router as a 16-bit linear (ExLlamaV3 keeps it
  unquantized), and the norm vectors.
- ``linear_shapes(config) -> [(module, in_features, out_features)]``: every EXL3 linear
  of the decoder layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Module(NamedTuple):
    kind: str  # "exl3" (trellis linear), "dense" (16-bit linear), "norm" (a vector)
    name: str  # module name (linears) or full tensor name (norms)
    in_features: int  # norms: their length
    out_features: int  # norms: 0


def _llama_config(**fields: Any) -> dict[str, Any]:
    base = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "attention_bias": False,
        "mlp_bias": False, "initializer_range": 0.02, "pretraining_tp": 1,
        "use_cache": True,
    }
    base.update(fields)
    return base


def _qwen3_moe_config(**fields: Any) -> dict[str, Any]:
    base = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
        "attention_bias": False, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
        "rope_theta": 1000000.0, "rope_scaling": None, "use_cache": True,
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
    }
    base.update(fields)
    base.setdefault("max_window_layers", base["num_hidden_layers"])
    return base


def _mixtral_config(**fields: Any) -> dict[str, Any]:
    base = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "sliding_window": None,
        "rope_theta": 1000000.0, "use_cache": True, "output_router_logits": False,
        "router_aux_loss_coef": 0.02,
    }
    base.update(fields)
    return base


_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": _llama_config(  # Meta-Llama-3.1-8B
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        max_position_embeddings=131072, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], tie_word_embeddings=False,
    ),
    "llama3.2-1b": _llama_config(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        max_position_embeddings=131072, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], tie_word_embeddings=True,
    ),
    "smollm2-135m": _llama_config(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
        rope_theta=100000.0, max_position_embeddings=8192, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=True,
    ),
    # Qwen2.5(-Coder)-0.5B's sizes on the Llama architecture (no q/k/v bias: a few KiB,
    # nothing that moves a speed or memory figure); untied here, as EXL3 stores the head.
    "qwen2.5-0.5b": _llama_config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
        rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
        bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False,
    ),
    "tiny": _llama_config(  # hidden and intermediate not multiples of 128 on purpose
        hidden_size=192, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=32, vocab_size=320,
        rope_theta=10000.0, max_position_embeddings=2048, bos_token_id=256,
        eos_token_id=257, tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": _qwen3_moe_config(  # Qwen/Qwen3-30B-A3B
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, vocab_size=151936,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=False,
    ),
    "mixtral-8x7b": _mixtral_config(  # mistralai/Mixtral-8x7B-v0.1
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_local_experts=8,
        num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    ),
    # The MoE families at CPU-test sizes (bench/gpu_moe.sh's DRY=1 run, the tests).
    "tiny-qwen3-moe": _qwen3_moe_config(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=16, num_experts_per_tok=4, vocab_size=320,
        max_position_embeddings=2048, bos_token_id=256, eos_token_id=257,
        tie_word_embeddings=False,
    ),
    "tiny-mixtral": _mixtral_config(
        hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, vocab_size=320, max_position_embeddings=2048,
        bos_token_id=256, eos_token_id=257, tie_word_embeddings=False,
    ),
}
SHAPES["llama3.1-8b"] = SHAPES["llama3-8b"]

# family -> (MLP prefix, router, (gate, up, down) of expert {e}, expert count key,
# expert width key, q/k norms)
_MOE = {
    "Qwen3MoeForCausalLM": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"),
                            "num_experts", "moe_intermediate_size", True),
    "MixtralForCausalLM": ("block_sparse_moe", "gate", ("w1", "w3", "w2"),
                           "num_local_experts", "intermediate_size", False),
}


def layer_modules(config: dict[str, Any], i: int) -> list[Module]:
    """Layer `i`'s modules in file order (module docstring)."""
    hidden = config["hidden_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    layer = f"model.layers.{i}"
    attn = f"{layer}.self_attn"
    moe = _MOE.get(config["architectures"][0])
    modules = [
        Module("norm", f"{layer}.input_layernorm.weight", hidden, 0),
        Module("exl3", f"{attn}.q_proj", hidden, heads * head_dim),
        Module("exl3", f"{attn}.k_proj", hidden, kv * head_dim),
        Module("exl3", f"{attn}.v_proj", hidden, kv * head_dim),
        Module("exl3", f"{attn}.o_proj", heads * head_dim, hidden),
    ]
    if moe is not None and moe[5]:
        modules += [Module("norm", f"{attn}.q_norm.weight", head_dim, 0),
                    Module("norm", f"{attn}.k_norm.weight", head_dim, 0)]
    modules.append(Module("norm", f"{layer}.post_attention_layernorm.weight", hidden, 0))
    if moe is None:
        inter, mlp = config["intermediate_size"], f"{layer}.mlp"
        return modules + [Module("exl3", f"{mlp}.gate_proj", hidden, inter),
                          Module("exl3", f"{mlp}.up_proj", hidden, inter),
                          Module("exl3", f"{mlp}.down_proj", inter, hidden)]
    prefix, router, (gate, up, down), count_key, width_key, _ = moe
    experts, width = config[count_key], config[width_key]
    block = f"{layer}.{prefix}"
    modules.append(Module("dense", f"{block}.{router}", hidden, experts))
    for e in range(experts):
        modules += [Module("exl3", f"{block}.experts.{e}.{gate}", hidden, width),
                    Module("exl3", f"{block}.experts.{e}.{up}", hidden, width),
                    Module("exl3", f"{block}.experts.{e}.{down}", width, hidden)]
    return modules


def linear_shapes(config: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(module name, in_features, out_features) of every EXL3 linear of the layers."""
    return [(m.name, m.in_features, m.out_features)
            for i in range(config["num_hidden_layers"]) for m in layer_modules(config, i)
            if m.kind == "exl3"]
