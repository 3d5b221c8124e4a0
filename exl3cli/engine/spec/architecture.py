"""Architectures as data: one `ArchitectureSpec` per model family.

A spec says which shared building blocks a family uses and where its tensors live in
the checkpoint; the engine (model.py) builds every family from the same blocks. Built-in
specs are provided by the `exl3_plugins.architectures` plugin through the
`exl3_architectures` hook, exactly like a third-party plugin would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from exl3cli.engine.spec.config import ModelConfig, load_model_config
from exl3cli.errors import ModelLoadError, UnsupportedArchitecture
from exl3cli.hookspecs import get_plugin_manager

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class TensorNames:
    """Checkpoint tensor names; `{i}` in layer names is the layer index."""

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    input_norm: str = "model.layers.{i}.input_layernorm.weight"
    post_attention_norm: str = "model.layers.{i}.post_attention_layernorm.weight"
    q_proj: str = "model.layers.{i}.self_attn.q_proj"
    k_proj: str = "model.layers.{i}.self_attn.k_proj"
    v_proj: str = "model.layers.{i}.self_attn.v_proj"
    o_proj: str = "model.layers.{i}.self_attn.o_proj"
    # Sandwich-norm families (Gemma 2/3) also norm the attention and MLP outputs.
    attention_out_norm: str = "model.layers.{i}.post_attention_layernorm.weight"
    mlp_out_norm: str = "model.layers.{i}.post_feedforward_layernorm.weight"
    q_norm: str = "model.layers.{i}.self_attn.q_norm.weight"
    k_norm: str = "model.layers.{i}.self_attn.k_norm.weight"
    # Per-head attention sink logits (gpt-oss), read when the spec has attention_sinks.
    sinks: str = "model.layers.{i}.self_attn.sinks"
    # Multi-head latent attention (DeepSeek-V2/V3), read when the spec has mla: queries
    # through q_proj or the q_a / q_a_layernorm / q_b latent; keys and values from the
    # kv_a_proj_with_mqa latent, normed and expanded by kv_b_proj.
    q_a_proj: str = "model.layers.{i}.self_attn.q_a_proj"
    q_a_norm: str = "model.layers.{i}.self_attn.q_a_layernorm.weight"
    q_b_proj: str = "model.layers.{i}.self_attn.q_b_proj"
    kv_a_proj: str = "model.layers.{i}.self_attn.kv_a_proj_with_mqa"
    kv_a_norm: str = "model.layers.{i}.self_attn.kv_a_layernorm.weight"
    kv_b_proj: str = "model.layers.{i}.self_attn.kv_b_proj"
    gate_proj: str = "model.layers.{i}.mlp.gate_proj"
    up_proj: str = "model.layers.{i}.mlp.up_proj"
    down_proj: str = "model.layers.{i}.mlp.down_proj"
    # Checkpoints that store q/k/v or gate/up as one matrix (Phi-3); EXL3 folders split
    # them back into the modules above, so these apply only where they are present.
    qkv_fused: str | None = None
    gate_up_fused: str | None = None


def _first_int(raw: Mapping[str, Any], keys: tuple[str, ...]) -> int:
    for key in keys:
        if raw.get(key):
            return int(raw[key])
    return 0


@dataclass(frozen=True)
class MoESpec:
    """A family's mixture-of-experts MLP: where its tensors are and which config.json
    keys hold its numbers. `{i}` is the layer index, `{e}` the expert index.

    scoring: "softmax" (probabilities over all experts, then top-k: Mixtral, Qwen),
    "sigmoid" (independent scores; the choice adds `score_bias`, the weights do not:
    DeepSeek-V3, GLM-4.5) or "topk_softmax" (top-k of the logits, softmax over those:
    gpt-oss). normalize: the chosen weights are divided by their sum; `normalize_key`
    in config.json overrides it when present. Grouped top-k (`n_group`, `topk_group`)
    and `routed_scaling_factor` are read from config.json when the family has them.

    sparse_layers: "all", "qwen" (`decoder_sparse_step` and `mlp_only_layers`) or
    "first_k_dense" (`first_k_dense_replace` dense layers first) or "interval" (ERNIE
    4.5: `moe_layer_start_index`..`moe_layer_end_index`, every `moe_layer_interval`-th
    layer); other layers get the
    dense MLP of TensorNames at `intermediate_size`.
    """

    router: str = "model.layers.{i}.mlp.gate"
    router_bias: bool = False
    gate_proj: str = "model.layers.{i}.mlp.experts.{e}.gate_proj"
    up_proj: str = "model.layers.{i}.mlp.experts.{e}.up_proj"
    down_proj: str = "model.layers.{i}.mlp.experts.{e}.down_proj"
    score_bias: str | None = None
    shared_gate_proj: str | None = None
    shared_up_proj: str | None = None
    shared_down_proj: str | None = None
    shared_expert_gate: str | None = None  # sigmoid(x . w) scales the shared expert
    # config.json names of the expert count (transformers 5 writes num_local_experts
    # for Qwen too; DeepSeek-style configs say n_routed_experts, ERNIE moe_num_experts)
    # and of the experts per token: the first present.
    experts_keys: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts",
                                     "moe_num_experts")
    top_k_keys: tuple[str, ...] = ("num_experts_per_tok", "moe_k")
    expert_size_key: str = "moe_intermediate_size"
    # config.json key of the shared expert's width, or "<key>*<count key>" (DeepSeek).
    shared_size_key: str | None = None
    scoring: str = "softmax"
    normalize: bool = True
    normalize_key: str | None = "norm_topk_prob"
    sparse_layers: str = "all"
    # The experts' activation when config.json's hidden_act does not say it (gpt-oss:
    # "swiglu_clamped" with swiglu_limit / swiglu_alpha).
    activation: str | None = None
    # Checkpoints that hold all experts of a layer in one tensor (gpt-oss): [experts,
    # in, out] with gate and up columns interleaved, biases at name + "_bias". The
    # loader and converter see them as the per-expert modules above (fused_experts.py).
    fused_gate_up: str | None = None
    fused_down: str | None = None

    def is_sparse(self, config: ModelConfig, i: int) -> bool:
        """Whether layer `i` runs the experts (else the dense MLP)."""
        raw = config.raw
        if self.sparse_layers == "all":
            return True
        if self.sparse_layers == "qwen":
            if i in (raw.get("mlp_only_layers") or []):
                return False
            step = int(raw.get("decoder_sparse_step") or 1)
            return self.num_experts(config) > 0 and (i + 1) % step == 0
        if self.sparse_layers == "first_k_dense":
            return i >= int(raw.get("first_k_dense_replace") or 0)
        if self.sparse_layers == "interval":  # ERNIE 4.5
            start = int(raw.get("moe_layer_start_index") or 0)
            end = int(raw.get("moe_layer_end_index", -1))
            end = config.num_layers - 1 if end == -1 else end
            every = int(raw.get("moe_layer_interval") or 1)
            return start <= i <= end and (i + 1) % every == 0
        raise ValueError(f"unknown sparse_layers policy {self.sparse_layers!r}")

    def num_experts(self, config: ModelConfig) -> int:
        """Routed experts per sparse layer (0 when config.json names none)."""
        return _first_int(config.raw, self.experts_keys)

    def top_k(self, config: ModelConfig) -> int:
        """Experts each token is routed to (0 when config.json names none)."""
        return _first_int(config.raw, self.top_k_keys)

    def shared_size(self, config: ModelConfig) -> int:
        """Width of the shared expert (0: none)."""
        if self.shared_size_key is None:
            return 0
        size = 1
        for key in self.shared_size_key.split("*"):
            size *= int(config.raw.get(key) or 0)
        return size


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one Hugging Face `architectures` name maps onto the engine's blocks.

    sliding_window: "none" (never), "all" (every layer when config.sliding_window is
    set, Mistral), "from_layer" (Qwen2/3: only with `use_sliding_window`, for layers
    at or above `max_window_layers`), or "pattern" (Gemma 2/3: every
    `sliding_pattern`-th layer is global, the rest slide; config.json's
    `sliding_window_pattern` overrides the number). A config's explicit `layer_types`
    always wins.

    The Gemma options all default to off, so the other families are unchanged:
    norm_unit_offset (RMSNorm scales by 1 + weight, in float32), embed_scale
    (embeddings times sqrt(hidden_size)), sandwich_norm (attention and MLP outputs are
    normed before their residual add). The attention scale (`query_pre_attn_scalar`),
    soft-caps and a separate rope for sliding layers come from config.json.

    moe: the family's mixture-of-experts MLP (MoESpec), None for dense families.

    config_defaults: transformers' values for config.json keys a family's checkpoints
    may leave out (engine/spec/config.py fills them in). alt_tensors: a second naming of the
    same checkpoint (the loader takes the one whose embedding is present).
    """

    name: str
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # None, "rms" (per-head RMSNorm on q and k, Qwen3) or "rms_full" (over all heads
    # of q, and of k, at once: OLMo 2/3)
    qk_norm: str | None = None
    qk_norm_key: str | None = None  # config.json flag that switches qk_norm on (GLM-4.5)
    sliding_window: str = "none"
    activation: str = "silu"
    norm_unit_offset: bool = False
    embed_scale: bool = False
    sandwich_norm: bool = False
    sliding_pattern: int = 0
    # Rope pairs dimensions (2j, 2j + 1) (GPT-J style: ERNIE 4.5, GLM) instead of
    # (j, j + d/2); the loader reorders q and k to the engine's layout.
    rope_interleaved: bool = False
    # No norm in front of attention and MLP, only on their outputs (the sandwich
    # names) before the residual add: EXAONE 4 (needs sandwich_norm too).
    post_norm: bool = False
    norm: str = "rms"  # or "layer": mean-centred LayerNorm without bias (Cohere)
    parallel_block: bool = False  # x + attn(norm(x)) + mlp(norm(x)) (Cohere)
    # config.json list with one flag per layer, 0 = no rope in that layer (SmolLM3).
    no_rope_key: str | None = None
    # With a sliding window, full-attention layers skip rope (EXAONE 4 32B, Cohere2).
    global_layers_without_rope: bool = False
    # A learned per-head logit that joins every softmax over keys and takes its share
    # of the probability with no value (gpt-oss).
    attention_sinks: bool = False
    # Multi-head latent attention (engine/layers/mla.py): the config's head_dim becomes
    # qk_nope_head_dim + qk_rope_head_dim with as many kv heads as query heads (keys
    # and values are expanded per head before caching), rope over the rope part.
    mla: bool = False
    tensors: TensorNames = field(default_factory=TensorNames)
    alt_tensors: TensorNames | None = None
    moe: MoESpec | None = None
    config_defaults: Mapping[str, Any] = field(default_factory=dict)

    def tensor_names(self, has: Callable[[str], bool]) -> TensorNames:
        """`tensors`, or `alt_tensors` when only its embedding is in the checkpoint;
        fused q/k/v and gate/up names only when layer 0 has them (a Hugging Face
        Phi-3 checkpoint, not an EXL3 folder)."""
        names = self.tensors
        alt = self.alt_tensors
        if alt is not None and not has(names.embed) and has(alt.embed):
            names = alt
        unfused = {key: None for key in ("qkv_fused", "gate_up_fused")
                   if getattr(names, key) and not has(getattr(names, key).format(i=0) + ".weight")}
        return replace(names, **unfused) if unfused else names

    def layer_uses_rope(self, config: ModelConfig, i: int) -> bool:
        """False for the layers config.json's `no_rope_layers` marks 0 (SmolLM3)."""
        flags = config.raw.get(self.no_rope_key) if self.no_rope_key else None
        if flags is None:
            return True
        if len(flags) != config.num_layers:
            raise ValueError(f"{self.no_rope_key} must list {config.num_layers} layers")
        return bool(flags[i])

    def uses_qk_norm(self, config: ModelConfig) -> bool:
        """Whether this model's attention norms q and k (per head, RMS)."""
        if self.qk_norm is None:
            return False
        return self.qk_norm_key is None or bool(config.raw.get(self.qk_norm_key))

    def layer_types(self, config: ModelConfig) -> list[str]:
        """Attention kind of every layer: FULL_ATTENTION or SLIDING_ATTENTION."""
        if config.sliding_window is None or self.sliding_window == "none":
            return [FULL_ATTENTION] * config.num_layers
        if config.layer_types:
            return list(config.layer_types)
        if self.sliding_window == "all":
            return [SLIDING_ATTENTION] * config.num_layers
        if self.sliding_window == "from_layer":
            if not config.raw.get("use_sliding_window", False):
                return [FULL_ATTENTION] * config.num_layers
            first = int(config.raw.get("max_window_layers", config.num_layers))
            return [
                SLIDING_ATTENTION if i >= first else FULL_ATTENTION
                for i in range(config.num_layers)
            ]
        if self.sliding_window == "pattern":
            raw = config.raw
            every = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
                        or self.sliding_pattern)
            if every < 1:
                raise ValueError(f"{self.name}: sliding window pattern must be >= 1")
            return [
                FULL_ATTENTION if (i + 1) % every == 0 else SLIDING_ATTENTION
                for i in range(config.num_layers)
            ]
        raise ValueError(f"unknown sliding_window policy {self.sliding_window!r}")


def available_architectures() -> dict[str, ArchitectureSpec]:
    """Every spec that installed plugins provide, keyed by Hugging Face name."""
    specs: dict[str, ArchitectureSpec] = {}
    # pluggy calls the most recently registered plugin first; let earlier ones
    # (built-ins) be overridden by later ones by applying results in reverse.
    for result in reversed(get_plugin_manager().hook.exl3_architectures()):
        specs.update(result or {})
    return specs


def get_architecture(hf_name: str) -> ArchitectureSpec:
    """The spec for `hf_name`; UnsupportedArchitecture when no plugin provides it."""
    specs = available_architectures()
    spec = specs.get(hf_name)
    if spec is None:
        known = ", ".join(sorted(specs)) or "none"
        raise UnsupportedArchitecture(
            f"unsupported model architecture {hf_name!r} (supported: {known})"
        )
    return spec


def family_config_defaults(data: dict) -> dict | None:
    """config_defaults of the spec that serves this config.json's architecture, if any."""
    architectures = data.get("architectures") or []
    spec = available_architectures().get(str(architectures[0])) if architectures else None
    return dict(spec.config_defaults) if spec is not None else None


def load_family_config(folder: str | Path) -> ModelConfig:
    """`<folder>/config.json` with its family's defaults for the keys it leaves out
    (and, for latent-attention families, the shapes their expanded heads have)."""
    config = load_model_config(folder, family_config_defaults)
    spec = available_architectures().get(config.architecture)
    return latent_attention_shapes(config) if spec is not None and spec.mla else config


def latent_attention_shapes(config: ModelConfig) -> ModelConfig:
    """An MLA model's config as the engine runs it: heads of qk_nope + qk_rope dims
    (rope over the qk_rope part), one kv head per query head."""
    raw = config.raw
    try:
        nope, rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError("config.json needs qk_nope_head_dim and qk_rope_head_dim for "
                             "multi-head latent attention") from exc
    head_dim = nope + rope
    partial = rope / head_dim
    return replace(config, head_dim=head_dim, num_kv_heads=config.num_heads,
                   partial_rotary_factor=partial,
                   rope_scaling={**config.rope_scaling, "partial_rotary_factor": partial})
