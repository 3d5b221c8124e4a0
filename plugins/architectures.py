"""Built-in architectures (registered through the exl3cli entry-point group).

Each family is data: the differences between them are parameters of one
ArchitectureSpec; the forward pass lives once in the engine.
"""

from __future__ import annotations

from dataclasses import fields, replace

from exl3cli.engine.spec.architecture import ArchitectureSpec, MoESpec, TensorNames
from exl3cli.hookspecs import hookimpl

# Llama 2, Llama 3, 3.1 and 3.2 (RoPE scaling comes from config.json), SmolLM2.
LLAMA = ArchitectureSpec(name="LlamaForCausalLM")

# Mistral: like Llama, with an optional sliding window on every layer.
MISTRAL = ArchitectureSpec(name="MistralForCausalLM", sliding_window="all")

# Qwen2 / Qwen2.5: bias on q, k and v; sliding window only with `use_sliding_window`.
QWEN2 = ArchitectureSpec(name="Qwen2ForCausalLM", qkv_bias=True, sliding_window="from_layer")

# Qwen3: no qkv bias, per-head RMSNorm on q and k, explicit head_dim in config.json.
QWEN3 = ArchitectureSpec(name="Qwen3ForCausalLM", qk_norm="rms", sliding_window="from_layer")

# Gemma's "sandwich": the norm in front of the MLP is pre_feedforward_layernorm, and
# post_attention_layernorm / post_feedforward_layernorm norm the block outputs.
_GEMMA_TENSORS = TensorNames(
    post_attention_norm="model.layers.{i}.pre_feedforward_layernorm.weight",
)

# Gemma 2: 1 + w norms, scaled embeddings, GELU-tanh, every other layer slides (from
# layer 0); score scale and soft-caps come from config.json.
GEMMA2 = ArchitectureSpec(
    name="Gemma2ForCausalLM", activation="gelu_pytorch_tanh", norm_unit_offset=True,
    embed_scale=True, sandwich_norm=True, sliding_window="pattern", sliding_pattern=2,
    tensors=_GEMMA_TENSORS,
)

# Gemma 3 (text): Gemma 2 plus q/k norms, no soft-caps, five sliding layers per global
# one and a separate rope theta for sliding layers.
GEMMA3 = ArchitectureSpec(
    name="Gemma3ForCausalLM", activation="gelu_pytorch_tanh", norm_unit_offset=True,
    embed_scale=True, sandwich_norm=True, qk_norm="rms", sliding_window="pattern",
    sliding_pattern=6, tensors=_GEMMA_TENSORS,
)


# Mixtral: Mistral attention, every layer a mixture of `num_local_experts` SwiGLU
# experts (w1 gate, w3 up, w2 down), top-k of the softmax, renormalised.
MIXTRAL = ArchitectureSpec(
    name="MixtralForCausalLM", sliding_window="all",
    moe=MoESpec(
        router="model.layers.{i}.block_sparse_moe.gate",
        gate_proj="model.layers.{i}.block_sparse_moe.experts.{e}.w1",
        up_proj="model.layers.{i}.block_sparse_moe.experts.{e}.w3",
        down_proj="model.layers.{i}.block_sparse_moe.experts.{e}.w2",
        expert_size_key="intermediate_size",
        normalize_key=None,
    ),
)

# Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention; experts plus a shared
# expert scaled by sigmoid(shared_expert_gate); top-k weights renormalised only with
# norm_topk_prob; `decoder_sparse_step` / `mlp_only_layers` keep some layers dense.
QWEN2_MOE = ArchitectureSpec(
    name="Qwen2MoeForCausalLM", qkv_bias=True, sliding_window="from_layer",
    moe=MoESpec(
        shared_gate_proj="model.layers.{i}.mlp.shared_expert.gate_proj",
        shared_up_proj="model.layers.{i}.mlp.shared_expert.up_proj",
        shared_down_proj="model.layers.{i}.mlp.shared_expert.down_proj",
        shared_expert_gate="model.layers.{i}.mlp.shared_expert_gate",
        shared_size_key="shared_expert_intermediate_size",
        normalize=False, sparse_layers="qwen",
    ),
)

# Qwen3-MoE (Qwen3-30B-A3B, -235B-A22B): Qwen3 attention, experts without a shared one.
QWEN3_MOE = ArchitectureSpec(
    name="Qwen3MoeForCausalLM", qk_norm="rms", sliding_window="from_layer",
    moe=MoESpec(normalize=False, sparse_layers="qwen"),
)

# Phi-3 / Phi-3.5 (mini, medium): Llama blocks with q/k/v and gate/up stored fused
# (qkv_proj, gate_up_proj) in Hugging Face checkpoints; a sliding window on every
# layer; LongRoPE (rope_scaling "longrope") in the 128k variants.
PHI3 = ArchitectureSpec(
    name="Phi3ForCausalLM", sliding_window="all",
    tensors=TensorNames(
        o_proj="model.layers.{i}.self_attn.o_proj",
        qkv_fused="model.layers.{i}.self_attn.qkv_proj",
        gate_up_fused="model.layers.{i}.mlp.gate_up_proj",
    ),
)

# ERNIE 4.5 (0.3B): Llama blocks with GPT-J-style interleaved rope pairs. Its first
# checkpoints (remote code) and the EXL3 folders made from them name the class
# Ernie4_5_ForCausalLM, as ExLlamaV3 does; same config keys and tensors.
ERNIE4_5 = ArchitectureSpec(name="Ernie4_5ForCausalLM", rope_interleaved=True)
ERNIE4_5_REMOTE = replace(ERNIE4_5, name="Ernie4_5_ForCausalLM")

# ERNIE 4.5 MoE (21B-A3B, 300B-A47B): ERNIE 4.5 attention; experts chosen by softmax
# probability plus a per-expert correction bias (weights without it), renormalised;
# shared experts as wide as moe_num_shared_experts experts; MoE from
# moe_layer_start_index on, every moe_layer_interval-th layer.
ERNIE4_5_MOE = ArchitectureSpec(
    name="Ernie4_5_MoeForCausalLM", rope_interleaved=True,
    moe=MoESpec(
        score_bias="model.layers.{i}.mlp.moe_statics.e_score_correction_bias",
        shared_gate_proj="model.layers.{i}.mlp.shared_experts.gate_proj",
        shared_up_proj="model.layers.{i}.mlp.shared_experts.up_proj",
        shared_down_proj="model.layers.{i}.mlp.shared_experts.down_proj",
        shared_size_key="moe_intermediate_size*moe_num_shared_experts",
        normalize_key=None, sparse_layers="interval",
    ),
)

# GLM-4 (GLM-4-9B-0414, GLM-Z1): interleaved rope over half of each head, bias on
# q/k/v, gate/up stored fused, and the attention and MLP outputs normed before their
# residual adds (post_self_attn_layernorm, post_mlp_layernorm).
GLM4 = ArchitectureSpec(
    name="Glm4ForCausalLM", qkv_bias=True, rope_interleaved=True, sandwich_norm=True,
    tensors=TensorNames(
        attention_out_norm="model.layers.{i}.post_self_attn_layernorm.weight",
        mlp_out_norm="model.layers.{i}.post_mlp_layernorm.weight",
        gate_up_fused="model.layers.{i}.mlp.gate_up_proj",
    ),
)

# GLM-4.5 / 4.6 (Glm4MoeForCausalLM): Llama-style rope over part of each head, q/k/v
# bias when the checkpoint has it, q/k norms with use_qk_norm; DeepSeek-V3's router
# (sigmoid scores, a choice bias, grouped top-k, routed_scaling_factor), shared experts
# and first_k_dense_replace dense layers.
GLM4_MOE = ArchitectureSpec(
    name="Glm4MoeForCausalLM", qk_norm="rms", qk_norm_key="use_qk_norm",
    moe=MoESpec(
        score_bias="model.layers.{i}.mlp.gate.e_score_correction_bias",
        shared_gate_proj="model.layers.{i}.mlp.shared_experts.gate_proj",
        shared_up_proj="model.layers.{i}.mlp.shared_experts.up_proj",
        shared_down_proj="model.layers.{i}.mlp.shared_experts.down_proj",
        shared_size_key="moe_intermediate_size*n_shared_experts",
        scoring="sigmoid", sparse_layers="first_k_dense",
    ),
)

# gpt-oss (20b, 120b): q/k/v/o with biases, a learned attention sink per head, sliding
# and full layers alternating (layer_types), YaRN; every layer a mixture whose router
# (with bias) takes the top-k logits and softmaxes them, experts with biases and the
# clamped SwiGLU. Hugging Face checkpoints store each layer's experts as one tensor;
# EXL3 folders split them (experts.{e}.gate_proj, ...), as ExLlamaV3 does.
GPT_OSS = ArchitectureSpec(
    name="GptOssForCausalLM", qkv_bias=True, o_bias=True, mlp_bias=True,
    attention_sinks=True, sliding_window="pattern", sliding_pattern=2,
    moe=MoESpec(
        router="model.layers.{i}.mlp.router", router_bias=True,
        expert_size_key="intermediate_size", scoring="topk_softmax", normalize_key=None,
        activation="swiglu_clamped",
        fused_gate_up="model.layers.{i}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{i}.mlp.experts.down_proj",
    ),
)

# EXAONE 4.0: per-head q/k norms and norms after attention and MLP instead of before
# them; with a sliding window (32B) three sliding layers per global one, which has no
# rope.
EXAONE4 = ArchitectureSpec(
    name="Exaone4ForCausalLM", qk_norm="rms", post_norm=True, sandwich_norm=True,
    sliding_window="pattern", sliding_pattern=4, global_layers_without_rope=True,
)

# OLMo 2 / OLMo 3: norms after attention and MLP, q and k normed over all their heads;
# OLMo 3 adds sliding layers (layer_types) with their own rope.
OLMO2 = ArchitectureSpec(name="Olmo2ForCausalLM", qk_norm="rms_full", post_norm=True,
                         sandwich_norm=True)
OLMO3 = ArchitectureSpec(name="Olmo3ForCausalLM", qk_norm="rms_full", post_norm=True,
                         sandwich_norm=True, sliding_window="pattern", sliding_pattern=4)

# SmolLM3: Llama blocks where every no_rope_layer_interval-th layer skips rope
# (config.json's no_rope_layers: 1 rotates, 0 does not).
SMOLLM3 = ArchitectureSpec(name="SmolLM3ForCausalLM", sliding_window="from_layer",
                           no_rope_key="no_rope_layers")

# Cohere (Command-R, Command-R+): one LayerNorm feeding attention and MLP side by side,
# interleaved rope pairs, per-head LayerNorm q/k norms with use_qk_norm, tied
# embeddings and logits times logit_scale. Cohere2 (Command-R7B, Command-A): three
# sliding layers per global one, whose attention has no rope.
COHERE = ArchitectureSpec(
    name="CohereForCausalLM", norm="layer", parallel_block=True, rope_interleaved=True,
    qk_norm="layer", qk_norm_key="use_qk_norm",
)
COHERE2 = ArchitectureSpec(
    name="Cohere2ForCausalLM", norm="layer", parallel_block=True, rope_interleaved=True,
    sliding_window="pattern", sliding_pattern=4, global_layers_without_rope=True,
)


def _moved(names: TensorNames, model: str, lm_head: str) -> TensorNames:
    """`names` with the "model." prefix replaced by `model` and the head at `lm_head`."""
    values = {f.name: getattr(names, f.name) for f in fields(names)}
    moved = {key: model + value.removeprefix("model.") for key, value in values.items()
             if value and value.startswith("model.")}
    return TensorNames(**{**values, **moved, "lm_head": lm_head})


# Gemma 3 4B and up ship as image-text models: the text model is Gemma 3 under
# "language_model." (checkpoints written before transformers 4.52, which EXL3 folders
# keep) or "model.language_model." (after); the vision tower is not loaded (text only).
# Their config.json nests the text model's keys in text_config and leaves out those at
# transformers' Gemma3TextConfig defaults, filled in here.
GEMMA3_MULTIMODAL = ArchitectureSpec(
    name="Gemma3ForConditionalGeneration", activation="gelu_pytorch_tanh",
    norm_unit_offset=True, embed_scale=True, sandwich_norm=True, qk_norm="rms",
    sliding_window="pattern", sliding_pattern=6,
    tensors=_moved(_GEMMA_TENSORS, "language_model.model.", "language_model.lm_head.weight"),
    alt_tensors=_moved(_GEMMA_TENSORS, "model.language_model.", "lm_head.weight"),
    config_defaults={
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "tie_word_embeddings": True,
    },
)


# Qwen2.5-VL (3B, 7B, 32B, 72B) ships as an image-text model: a Qwen2 language model
# whose rope is M-RoPE (temporal, height and width positions over the frequency
# sections of mrope_section; for text every position is the same on all three, plain
# rope) under "model." (hub checkpoints, and what transformers 5 saves) or
# "model.language_model." (transformers' module names); the vision tower ("visual.") is
# engine/models/vision/qwen2_5_vl.py. Config keys transformers 5's text_config leaves
# out take Qwen2_5_VLTextConfig's defaults.
QWEN2_5_VL = ArchitectureSpec(
    name="Qwen2_5_VLForConditionalGeneration", qkv_bias=True, sliding_window="from_layer",
    alt_tensors=_moved(TensorNames(), "model.language_model.", "lm_head.weight"),
    config_defaults={
        "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "use_sliding_window": False, "max_window_layers": 80,
    },
)


# DeepSeek-V3 / R1 / V3.1 (and Kimi K2's architecture): multi-head latent attention
# (engine/layers/mla.py; keys and values expanded per head before caching), YaRN with mscale;
# GLM-4.5's router (sigmoid scores, choice bias, grouped top-k, routed scaling), shared
# experts and first_k_dense_replace dense layers.
DEEPSEEK_V3 = ArchitectureSpec(
    name="DeepseekV3ForCausalLM", mla=True,
    moe=MoESpec(
        score_bias="model.layers.{i}.mlp.gate.e_score_correction_bias",
        shared_gate_proj="model.layers.{i}.mlp.shared_experts.gate_proj",
        shared_up_proj="model.layers.{i}.mlp.shared_experts.up_proj",
        shared_down_proj="model.layers.{i}.mlp.shared_experts.down_proj",
        shared_size_key="moe_intermediate_size*n_shared_experts",
        scoring="sigmoid", sparse_layers="first_k_dense",
    ),
)

# Ministral 3 (3B, 8B, 14B; text): Mistral blocks (explicit head_dim, YaRN) whose
# rotated queries are scaled by 1 + beta * log(1 + floor(position / original context))
# when its rope parameters give llama_4_scaling_beta (engine/layers/attention.py).
MINISTRAL3 = ArchitectureSpec(name="Ministral3ForCausalLM", sliding_window="all")

# Mistral 3 (Mistral Small 3.1 / 3.2, Ministral 3, Magistral) ships as an image-text
# model: the text model (Mistral, or Ministral 3 with its query scale) under
# "language_model." (what save_pretrained writes) or "model.language_model."; the
# vision tower and projector are not loaded (text only) and convert copies them.
MISTRAL3_MULTIMODAL = ArchitectureSpec(
    name="Mistral3ForConditionalGeneration", sliding_window="all",
    tensors=_moved(TensorNames(), "language_model.model.", "language_model.lm_head.weight"),
    alt_tensors=_moved(TensorNames(), "model.language_model.", "lm_head.weight"),
)


@hookimpl
def exl3_architectures() -> dict[str, ArchitectureSpec]:
    specs = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, GEMMA3_MULTIMODAL, MIXTRAL,
             QWEN2_MOE, QWEN3_MOE, PHI3, ERNIE4_5, ERNIE4_5_REMOTE, ERNIE4_5_MOE, GLM4,
             GLM4_MOE, EXAONE4, OLMO2, OLMO3, SMOLLM3,
             COHERE, COHERE2, GPT_OSS, MINISTRAL3, MISTRAL3_MULTIMODAL,
             DEEPSEEK_V3, QWEN2_5_VL)
    return {spec.name: spec for spec in specs}
