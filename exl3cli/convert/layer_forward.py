"""One decoder layer run on calibration activations, exposing every linear's input.

The converter needs the input of each linear (for its Hessian) and must swap a
layer's weights for their quantized versions between steps, so it runs the layer
from plain weight tensors rather than through the engine's modules (whose storage
the EXL3 loader may change). Numerics follow the engine: RMSNorm, RoPE tables and
rotation from ``exl3cli.engine``, SDPA with causal (and sliding-window) masks.
Families with Gemma's options (``unsupported_features``) go through ``engine_layer``.

Weights use the converter's orientation ``(in, out)`` (``y = x W``), float32.

Public API:
- ``LayerRunner(config, spec, device)``: ``.rms_norm(x, weight)``,
  ``.attention_core(x_norm, layer_index, q, k, v, biases, qk_norms) -> [R, C, H*D]``
  (the input of o_proj), ``.gated(x_norm, gate, up, biases) -> [R, C, I]`` (the input
  of down_proj), ``.linear(x, w, bias)``. Rows are processed in chunks to bound memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exl3cli.engine.layers.mlp import ACTIVATIONS
from exl3cli.engine.layers.rope import RotaryEmbedding
from exl3cli.engine.spec.architecture import SLIDING_ATTENTION, ArchitectureSpec
from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import ConversionError, UnsupportedArchitecture
from exl3cli.ops.reference import apply_rotary


def unsupported_features(config: ModelConfig, spec: ArchitectureSpec) -> list[str]:
    """What this raw-weight runner cannot reproduce (Gemma 2/3, mixtures of experts): running such a model
    through it would calibrate every layer on wrong activations, so the converter
    runs those families through ``engine_layer.EngineLayerForward`` instead."""
    checks = {
        "sandwich norms": spec.sandwich_norm,
        "scaled embeddings": spec.embed_scale,
        "1 + weight norms": spec.norm_unit_offset,
        "query_pre_attn_scalar": config.query_pre_attn_scalar is not None,
        "attention soft-capping": config.attn_logit_softcapping is not None,
        "final logit soft-capping": config.final_logit_softcapping is not None,
        "a separate rope for sliding layers": config.sliding_rope_theta is not None,
        "mixture of experts": spec.moe is not None,
        "interleaved rope pairs": spec.rope_interleaved,
        "partial rotary embeddings": config.partial_rotary_factor != 1.0,
        "layers without rope": spec.global_layers_without_rope or not all(
            spec.layer_uses_rope(config, i) for i in range(config.num_layers)),
        "q/k norms over all heads": spec.qk_norm == "rms_full",
        "attention sinks": spec.attention_sinks,
    }
    return [name for name, present in checks.items() if present]


class LayerRunner:
    """Stateless helpers bound to one model's shapes, norms and rotary tables."""

    def __init__(self, config: ModelConfig, spec: ArchitectureSpec, device: torch.device,
                 row_chunk: int = 16):
        self.config = config
        self.spec = spec
        self.device = device
        self.row_chunk = row_chunk
        missing = unsupported_features(config, spec)
        if missing:
            raise ConversionError(
                f"LayerRunner: {', '.join(missing)} of {spec.name} not supported yet; "
                "the converter runs such layers through engine_layer.EngineLayerForward"
            )
        self.layer_types = spec.layer_types(config)
        act = config.hidden_act or spec.activation
        if act not in ACTIVATIONS:
            raise UnsupportedArchitecture(f"unsupported activation {act!r}")
        self.act = ACTIVATIONS[act]
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling,
            config.max_position_embeddings, device, torch.float32,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = x @ w
        return y + bias if bias is not None else y

    def attention_core(
        self,
        x_norm: torch.Tensor,
        layer_index: int,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        biases: tuple[torch.Tensor | None, ...] = (None, None, None),
        qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention output before o_proj, for x_norm [R, C, hidden]."""
        cfg = self.config
        rows, cols, _ = x_norm.shape
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        positions = torch.arange(cols, device=self.device)[None, :]
        cos, sin = self.rotary.lookup(positions, cols)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        window = cfg.sliding_window if self.layer_types[layer_index] == SLIDING_ATTENTION else None
        mask = None
        if window is not None and cols > window:
            q_pos = torch.arange(cols, device=self.device)[:, None]
            k_pos = torch.arange(cols, device=self.device)[None, :]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        out = []
        for start in range(0, rows, self.row_chunk):
            x = x_norm[start : start + self.row_chunk]
            n = x.shape[0]
            q = self.linear(x, qkv[0], biases[0]).view(n, cols, heads, dim)
            k = self.linear(x, qkv[1], biases[1]).view(n, cols, kv_heads, dim)
            v = self.linear(x, qkv[2], biases[2]).view(n, cols, kv_heads, dim)
            if qk_norms is not None:
                q = F.rms_norm(q, (dim,), qk_norms[0], cfg.rms_norm_eps)
                k = F.rms_norm(k, (dim,), qk_norms[1], cfg.rms_norm_eps)
            q = apply_rotary(q, cos, sin).transpose(1, 2)
            k = apply_rotary(k, cos, sin).transpose(1, 2)
            v = v.transpose(1, 2)
            attn = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=heads != kv_heads,
            )
            out.append(attn.transpose(1, 2).reshape(n, cols, heads * dim))
        return torch.cat(out)

    def gated(
        self,
        x_norm: torch.Tensor,
        gate: torch.Tensor,
        up: torch.Tensor,
        biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    ) -> torch.Tensor:
        """act(x gate) * (x up): the input of down_proj."""
        out = []
        for start in range(0, x_norm.shape[0], self.row_chunk):
            x = x_norm[start : start + self.row_chunk]
            out.append(self.act(self.linear(x, gate, biases[0])) * self.linear(x, up, biases[1]))
        return torch.cat(out)
