"""Built-in architectures (registered through the exl3cli entry-point group).

Each family is data: the differences between them are parameters of one
ArchitectureSpec; the forward pass lives once in the engine.
"""

from __future__ import annotations

from exl3cli.engine.architecture import ArchitectureSpec
from exl3cli.plugins import hookimpl

# Llama 2, Llama 3, 3.1 and 3.2 (RoPE scaling comes from config.json), SmolLM2.
LLAMA = ArchitectureSpec(name="LlamaForCausalLM")

# Mistral: like Llama, with an optional sliding window on every layer.
MISTRAL = ArchitectureSpec(name="MistralForCausalLM", sliding_window="all")

# Qwen2 / Qwen2.5: bias on q, k and v; sliding window only with `use_sliding_window`.
QWEN2 = ArchitectureSpec(name="Qwen2ForCausalLM", qkv_bias=True, sliding_window="from_layer")

# Qwen3: no qkv bias, per-head RMSNorm on q and k, explicit head_dim in config.json.
QWEN3 = ArchitectureSpec(name="Qwen3ForCausalLM", qk_norm="rms", sliding_window="from_layer")


@hookimpl
def exl3_architectures() -> dict[str, ArchitectureSpec]:
    return {spec.name: spec for spec in (LLAMA, MISTRAL, QWEN2, QWEN3)}
