"""The SigLIP vision encoder (Gemma 3's vision tower), in plain PyTorch.

pixels [N, 3, H, W] -> patch embedding (a stride-`patch` convolution) + learned position
embeddings -> pre-norm encoder layers (LayerNorm, full bidirectional attention with
biases, LayerNorm, fc1 / gelu-tanh / fc2) -> post-layernorm -> [N, patches, hidden].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# transformers' SiglipVisionConfig defaults, for keys a config.json leaves out.
SIGLIP_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
    "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
}


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    eps: float

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SiglipConfig:
        merged = {**SIGLIP_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
        if merged["hidden_act"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"SigLIP activation {merged['hidden_act']!r} is not supported")
        if merged.get("vision_use_head"):
            raise ValueError("a SigLIP pooling head (vision_use_head) is not supported")
        return cls(int(merged["hidden_size"]), int(merged["intermediate_size"]),
                   int(merged["num_hidden_layers"]), int(merged["num_attention_heads"]),
                   int(merged["num_channels"]), int(merged["image_size"]),
                   int(merged["patch_size"]), float(merged["layer_norm_eps"]))

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class _Dense(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _LayerNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: SiglipConfig, norm1: _LayerNorm, qkv: _Dense, out: _Dense,
                 norm2: _LayerNorm, fc1: _Dense, fc2: _Dense):
        super().__init__()
        self.heads = config.num_heads
        self.norm1, self.qkv, self.out, self.norm2, self.fc1, self.fc2 = (
            norm1, qkv, out, norm2, fc1, fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, hidden = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, steps, 3, self.heads, hidden // self.heads)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        attended = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        x = x + self.out(attended.transpose(1, 2).reshape(batch, steps, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class SiglipVisionTower(nn.Module):
    """pixel_values [N, C, image_size, image_size] -> [N, patches, hidden]."""

    def __init__(self, config: SiglipConfig, patch_weight: torch.Tensor,
                 patch_bias: torch.Tensor, positions: torch.Tensor,
                 layers: list[SiglipEncoderLayer], post_norm: _LayerNorm):
        super().__init__()
        self.config = config
        self.register_buffer("patch_weight", patch_weight, persistent=False)
        self.register_buffer("patch_bias", patch_bias, persistent=False)
        self.register_buffer("positions", positions, persistent=False)
        self.layers = nn.ModuleList(layers)
        self.post_norm = post_norm

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        if tuple(pixel_values.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(f"SigLIP takes pixels [N, {self.config.num_channels}, {size}, "
                             f"{size}], got {list(pixel_values.shape)}")
        x = pixel_values.to(self.patch_weight.device, self.patch_weight.dtype)
        x = F.conv2d(x, self.patch_weight, self.patch_bias, stride=self.config.patch_size)
        x = x.flatten(2).transpose(1, 2) + self.positions
        for layer in self.layers:
            x = layer(x)
        return self.post_norm(x)


def load_siglip(config: SiglipConfig, tensor: Callable[[str], torch.Tensor],
                prefix: str) -> SiglipVisionTower:
    """The tower from tensors named as transformers names them under `prefix`
    (e.g. "vision_tower.vision_model."); `tensor(name)` reads one."""

    def dense(name: str) -> _Dense:
        return _Dense(tensor(f"{name}.weight"), tensor(f"{name}.bias"))

    def norm(name: str) -> _LayerNorm:
        return _LayerNorm(tensor(f"{name}.weight"), tensor(f"{name}.bias"), config.eps)

    layers = []
    for i in range(config.num_layers):
        at = f"{prefix}encoder.layers.{i}."
        qkv = _Dense(
            torch.cat([tensor(f"{at}self_attn.{p}_proj.weight") for p in "qkv"]),
            torch.cat([tensor(f"{at}self_attn.{p}_proj.bias") for p in "qkv"]),
        )
        layers.append(SiglipEncoderLayer(
            config, norm(at + "layer_norm1"), qkv, dense(at + "self_attn.out_proj"),
            norm(at + "layer_norm2"), dense(at + "mlp.fc1"), dense(at + "mlp.fc2"),
        ))
    positions = tensor(f"{prefix}embeddings.position_embedding.weight")
    if positions.shape[0] != config.patches_per_side**2:
        raise ValueError(f"SigLIP has {positions.shape[0]} position embeddings for "
                         f"{config.patches_per_side**2} patches")
    return SiglipVisionTower(
        config, tensor(f"{prefix}embeddings.patch_embedding.weight"),
        tensor(f"{prefix}embeddings.patch_embedding.bias"), positions, layers,
        norm(prefix + "post_layernorm"),
    ).eval()
