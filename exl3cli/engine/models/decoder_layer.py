"""One decoder layer built from a checkpoint's tensors, as its family's spec describes.

`build_decoder_layer` is shared by the loader (loader.py) and the quantizer's
calibration forward (convert/engine_layer.py), so a model is calibrated on the
activations it computes: attention (plain, fused [q | k | v], or multi-head latent),
q/k norms, rope head order, sliding windows and scales, a dense or MoE MLP, and the
family's norms (`family_norm`). `rope_head_order` / `fused_qkv_order` are the q/k head
permutation the engine's rope needs (LoRA adapters apply it too: adapters/lora.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from exl3cli.engine.layers.attention import Attention
from exl3cli.engine.layers.linear import permute_outputs
from exl3cli.engine.layers.mla import HeadSlice, LatentQKV, mla_softmax_scale
from exl3cli.engine.layers.mlp import GatedMLP
from exl3cli.engine.layers.moe import LinearFactory, MoEMLP, build_moe_mlp
from exl3cli.engine.layers.norm import FullWidthQKNorm, LayerNorm, RMSNorm
from exl3cli.engine.layers.rope import rope_permutation, rotary_dim
from exl3cli.engine.models.blocks import ParallelDecoderLayer
from exl3cli.engine.models.causal_lm import DecoderLayer
from exl3cli.engine.spec.architecture import SLIDING_ATTENTION, ArchitectureSpec, TensorNames
from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import ModelLoadError


def build_decoder_layer(
    config: ModelConfig,
    spec: ArchitectureSpec,
    names: TensorNames,
    i: int,
    layer_type: str,
    tensor: Callable[[str], torch.Tensor],
    linear: LinearFactory,
) -> DecoderLayer:
    """Layer `i` as `spec` describes it: norms read through `tensor(name)`, projections
    made by `linear(module prefixes, [(in, out)], bias)` (fused when several). The
    loader and the quantizer's calibration forward both build layers here, so the
    activations a model is calibrated on are the ones it computes."""

    def norm(name: str) -> RMSNorm | LayerNorm:
        return family_norm(config, spec, tensor(name))

    def pre_norm(name: str) -> nn.Module:  # post-norm families have none
        return nn.Identity() if spec.post_norm else norm(name)

    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    if spec.mla:
        qkv, o_proj = _latent_attention(config, names, i, tensor, linear, norm)
    elif names.qkv_fused:  # one stored [q | k | v] matrix
        qkv = linear([names.qkv_fused.format(i=i)], [(hidden, q_size + 2 * kv_size)],
                     spec.qkv_bias)
    else:
        qkv = linear(
            [n.format(i=i) for n in (names.q_proj, names.k_proj, names.v_proj)],
            [(hidden, q_size), (hidden, kv_size), (hidden, kv_size)], spec.qkv_bias,
        )
    if not spec.mla:
        o_proj = linear([names.o_proj.format(i=i)], [(q_size, hidden)], spec.o_bias)
    head_order = None if spec.mla else rope_head_order(config, spec)
    if head_order is not None:
        qkv = permute_outputs(qkv, fused_qkv_order(config, head_order))
    qk_norm: RMSNorm | FullWidthQKNorm | None = None
    if spec.uses_qk_norm(config) and spec.qk_norm == "rms_full":
        qk_norm = FullWidthQKNorm(tensor(names.q_norm.format(i=i)),
                                  tensor(names.k_norm.format(i=i)), config.num_heads,
                                  config.rms_norm_eps)
    elif spec.uses_qk_norm(config):
        # One [q heads + kv heads, head_dim] weight so q and k normalise in one op
        # (Cohere's per-head LayerNorm weights are already [heads, head_dim]).
        weight = torch.cat([
            tensor(names.q_norm.format(i=i)).expand(config.num_heads, -1),
            tensor(names.k_norm.format(i=i)).expand(config.num_kv_heads, -1),
        ])
        if head_order is not None:
            weight = weight[:, head_order.to(weight.device)].contiguous()
        qk_norm = family_norm(config, spec, weight)
    sliding = layer_type == SLIDING_ATTENTION
    scale = (None if config.query_pre_attn_scalar is None
             else float(config.query_pre_attn_scalar) ** -0.5)
    if spec.mla:
        scale = mla_softmax_scale(config.raw, config.head_dim)
    attention = Attention(
        i, qkv, o_proj, config.num_heads, config.num_kv_heads,
        config.head_dim, qk_norm, config.sliding_window if sliding else None, scale=scale,
        softcap=config.attn_logit_softcapping,
        # Only when the config gives sliding layers a rope of their own (Gemma 3).
        local_rope=config.sliding_rope_theta is not None and sliding,
        rope=spec.layer_uses_rope(config, i) and not (
            spec.global_layers_without_rope and config.sliding_window is not None
            and not sliding),
        sinks=tensor(names.sinks.format(i=i)).float() if spec.attention_sinks else None,
        position_query_scale=_position_query_scale(config),
    )
    act = config.hidden_act or spec.activation
    mlp: GatedMLP | MoEMLP
    if spec.moe is not None and spec.moe.is_sparse(config, i):
        mlp = build_moe_mlp(config, spec.moe, i, tensor, linear, act, spec.mlp_bias)
    else:
        gate_up = (
            linear([names.gate_up_fused.format(i=i)], [(hidden, 2 * inter)], spec.mlp_bias)
            if names.gate_up_fused else linear(
                [names.gate_proj.format(i=i), names.up_proj.format(i=i)],
                [(hidden, inter), (hidden, inter)], spec.mlp_bias,
            )
        )
        down = linear([names.down_proj.format(i=i)], [(inter, hidden)], spec.mlp_bias)
        mlp = GatedMLP(gate_up, down, act)
    if spec.parallel_block:
        return ParallelDecoderLayer(norm(names.input_norm.format(i=i)), attention, mlp)
    sandwich = ((norm(names.attention_out_norm.format(i=i)),
                 norm(names.mlp_out_norm.format(i=i))) if spec.sandwich_norm else (None, None))
    return DecoderLayer(
        pre_norm(names.input_norm.format(i=i)), attention,
        pre_norm(names.post_attention_norm.format(i=i)), mlp, *sandwich,
    )


def _latent_attention(config: ModelConfig, names: TensorNames, i: int,
                      tensor: Callable[[str], torch.Tensor], linear: LinearFactory,
                      norm: Callable[[str], nn.Module]) -> tuple[LatentQKV, HeadSlice]:
    """Layer `i`'s multi-head latent attention as a qkv projection and an o_proj
    (engine/layers/mla.py: keys and values expanded per head before caching)."""
    raw, hidden, heads = config.raw, config.hidden_size, config.num_heads
    nope, rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    v_dim = int(raw.get("v_head_dim") or nope)
    rank, q_rank = int(raw["kv_lora_rank"]), raw.get("q_lora_rank")
    bias = bool(raw.get("attention_bias"))
    q_width = heads * (nope + rope)
    q = q_a = q_norm = q_b = None
    if q_rank:
        q_a = linear([names.q_a_proj.format(i=i)], [(hidden, int(q_rank))], bias)
        q_norm = norm(names.q_a_norm.format(i=i))
        q_b = linear([names.q_b_proj.format(i=i)], [(int(q_rank), q_width)], False)
    else:
        q = linear([names.q_proj.format(i=i)], [(hidden, q_width)], False)
    qkv = LatentQKV(
        q, q_a, q_norm, q_b,
        linear([names.kv_a_proj.format(i=i)], [(hidden, rank + rope)], bias),
        norm(names.kv_a_norm.format(i=i)),
        linear([names.kv_b_proj.format(i=i)], [(rank, heads * (nope + v_dim))], False),
        heads, nope, rope, v_dim, bool(raw.get("rope_interleave", True)),
    )
    o = linear([names.o_proj.format(i=i)], [(heads * v_dim, hidden)], bias)
    return qkv, HeadSlice(o, heads, nope + rope, v_dim)


def _position_query_scale(config: ModelConfig) -> tuple[float, float] | None:
    """(beta, length) of Ministral 3's position-dependent query scale (its rope
    parameters' llama_4_scaling_beta), or None."""
    beta = config.rope_scaling.get("llama_4_scaling_beta")
    if not beta:
        return None
    length = config.rope_scaling.get("original_max_position_embeddings")
    if not length:
        raise ModelLoadError("llama_4_scaling_beta needs original_max_position_embeddings")
    return float(beta), float(length)


def family_norm(config: ModelConfig, spec: ArchitectureSpec,
                weight: torch.Tensor) -> RMSNorm | LayerNorm:
    """The family's norm with `weight`: RMSNorm, or LayerNorm (Cohere, whose
    config.json names the epsilon layer_norm_eps)."""
    if spec.norm == "layer":
        return LayerNorm(weight, float(config.raw.get("layer_norm_eps") or 1e-5))
    return RMSNorm(weight, config.rms_norm_eps, unit_offset=spec.norm_unit_offset)


def rope_head_order(config: ModelConfig, spec: ArchitectureSpec) -> torch.Tensor | None:
    """How q/k head dimensions are reordered for the engine's rope (rope.py), or None
    when the checkpoint's order is already the engine's."""
    rotary = rotary_dim(config.head_dim, config.rope_scaling)
    if rotary == config.head_dim and not spec.rope_interleaved:
        return None
    return rope_permutation(config.head_dim, rotary, spec.rope_interleaved)


def fused_qkv_order(config: ModelConfig, head_order: torch.Tensor) -> torch.Tensor:
    """`head_order` applied to every q and k head of the fused [q | k | v] output."""
    dim, rotated = config.head_dim, config.num_heads + config.num_kv_heads
    heads = (torch.arange(rotated)[:, None] * dim + head_order[None]).reshape(-1)
    return torch.cat([heads, torch.arange(rotated * dim, (rotated + config.num_kv_heads) * dim)])
