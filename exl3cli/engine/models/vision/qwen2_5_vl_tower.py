"""Qwen2.5-VL's vision transformer and patch merger, in plain PyTorch.

patches [N, C * T * P * P] of images with grids (t, h, w) (patch_processor.py) ->
patch embedding (a Conv3d whose kernel is its stride: one matmul) -> blocks of RMSNorm,
attention with 2-D rotary positions (the height and width of each patch rotate a
quarter of each head's frequencies each) and SwiGLU with biases. Attention runs within
windows of `window_size` pixels (`window_tokens` merged tokens a side) except in the
`fullatt_block_indexes` blocks, which see a whole frame. The tokens are reordered
window by window (whole 2 x 2 merge blocks move together) before the blocks and put back
after the merger. The windows of a block are attended in one batched call (`Segments`:
windows padded to the longest, padding keys masked; a 1024 x 1024 image has about 100
windows), or one call per window (`batched_windows = False`, the plain reference) (RMSNorm, then an MLP over each merge block's 4 patches side by side,
to the language model's width): [sum of t * h * w / 4, out_hidden_size], image by image,
each image's tokens row-major over its merged grid.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.ops.reference import apply_rotary

# transformers' Qwen2_5_VLVisionConfig defaults, for keys a config.json leaves out.
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420,
    "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "window_size": 112, "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
Grid = tuple[int, int, int]  # (frames, patch rows, patch columns) of one image


@dataclass(frozen=True)
class QwenVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    window_size: int
    out_hidden_size: int
    full_attention_blocks: tuple[int, ...]
    activation: str
    rope_theta: float

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> QwenVisionConfig:
        merged = {**VISION_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
        if merged["hidden_act"] not in _ACTIVATIONS:
            raise ValueError(f"vision activation {merged['hidden_act']!r} is not supported")
        rope = merged.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope {rope.get('rope_type')!r} is not supported")
        config = cls(
            int(merged["depth"]), int(merged["hidden_size"]), int(merged["intermediate_size"]),
            int(merged["num_heads"]), int(merged["in_channels"]), int(merged["patch_size"]),
            int(merged["spatial_merge_size"]), int(merged["temporal_patch_size"]),
            int(merged["window_size"]), int(merged["out_hidden_size"]),
            tuple(int(i) for i in merged["fullatt_block_indexes"]), str(merged["hidden_act"]),
            float(rope.get("rope_theta", 10000.0)),
        )
        if config.head_dim % 4 or config.window_tokens < 1:
            raise ValueError("vision heads must split into 4 rotary parts and windows must "
                             "hold at least one merged token")
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window_tokens(self) -> int:
        """Merged tokens along each side of an attention window."""
        return self.window_size // self.merge_size // self.patch_size


class _Dense(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen2's RMSNorm: normalised in float32, then scaled in the input dtype."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def window_order(grids: Sequence[Grid], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(merge-block order [N / merge^2], window lengths in patches) of images with these
    grids: the merge blocks of each frame window by window (windows of `window` x
    `window` blocks, row-major; the last row and column of windows may be cut short),
    each window's blocks row-major (transformers' get_vision_window_index)."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    first = 0
    for frames, rows, cols in grids:
        rows, cols = rows // merge, cols // merge
        index = torch.arange(frames * rows * cols).reshape(frames, rows, cols)
        for f in range(frames):
            for top in range(0, rows, window):
                for left in range(0, cols, window):
                    block = index[f, top : top + window, left : left + window].reshape(-1)
                    order.append(block + first)
                    lengths.append(block.numel() * merge * merge)
        first += frames * rows * cols
    return torch.cat(order), lengths


def patch_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """[N, 2] (row, column) of every patch, patches ordered merge block by merge block
    as the processor flattens them; repeated for every frame."""
    out = []
    for frames, rows, cols in grids:
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        shape = (rows // merge, merge, cols // merge, merge)
        r = r.reshape(shape).transpose(1, 2).flatten()
        c = c.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([r, c], dim=-1).repeat(frames, 1))
    return torch.cat(out)


@dataclass(frozen=True)
class Segments:
    """Consecutive runs of a sequence that attend only within themselves (windows, or
    whole frames), laid out for one batched attention call: `index` [S, L] gathers
    each run padded to the longest L (a padding slot repeats the run's last row),
    `mask` [S, 1, 1, L] (None: no padding) hides padding keys, `keep` [S * L] selects
    the real rows back, in sequence order."""

    lengths: list[int]
    index: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    keep: torch.Tensor | None = None

    @classmethod
    def batched(cls, lengths: list[int], device: torch.device) -> Segments:
        if len(lengths) < 2:
            return cls(lengths)
        sizes = torch.tensor(lengths)
        starts = torch.cumsum(sizes, 0) - sizes
        slots = torch.arange(int(sizes.max()))
        valid = slots[None, :] < sizes[:, None]
        index = starts[:, None] + torch.minimum(slots[None, :], sizes[:, None] - 1)
        padded = not bool(valid.all())
        return cls(lengths, index.to(device),
                   valid[:, None, None, :].to(device) if padded else None,
                   valid.flatten().to(device) if padded else None)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      segments: Segments) -> torch.Tensor:
    """q, k, v [N, heads, head_dim] -> [N, heads, head_dim], each segment attending
    within itself (bidirectional)."""
    if len(segments.lengths) == 1 or segments.index is None:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, head_dim]
        parts = [F.scaled_dot_product_attention(*pieces) for pieces in
                 zip(q.split(segments.lengths, 1), k.split(segments.lengths, 1),
                     v.split(segments.lengths, 1), strict=True)]
        return torch.cat(parts, dim=1).transpose(0, 1)
    index = segments.index
    q, k, v = (t[index].transpose(1, 2) for t in (q, k, v))  # [S, heads, L, head_dim]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=segments.mask)
    out = out.transpose(1, 2).flatten(0, 1)  # [S * L, heads, head_dim]
    return out if segments.keep is None else out[segments.keep]


class QwenVisionBlock(nn.Module):
    """x + attention(norm1(x)) within each segment, then x + SwiGLU(norm2(x))."""

    def __init__(self, config: QwenVisionConfig, norm1: torch.Tensor, qkv: _Dense,
                 proj: _Dense, norm2: torch.Tensor, gate: _Dense, up: _Dense, down: _Dense):
        super().__init__()
        self.heads = config.num_heads
        self.act = _ACTIVATIONS[config.activation]
        self.register_buffer("norm1", norm1, persistent=False)
        self.register_buffer("norm2", norm2, persistent=False)
        self.qkv, self.proj, self.gate, self.up, self.down = qkv, proj, gate, up, down

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Segments) -> torch.Tensor:
        steps, hidden = x.shape
        qkv = self.qkv(_rms_norm(x, self.norm1)).view(steps, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.unbind(1)  # [N, heads, head_dim]
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        attended = segment_attention(q, k, v, segments).reshape(steps, hidden)
        x = x + self.proj(attended)
        normed = _rms_norm(x, self.norm2)
        return x + self.down(self.act(self.gate(normed)) * self.up(normed))


class QwenVisionTower(nn.Module):
    """(patches [N, C * T * P * P], grids) -> merged tokens [N / merge^2, out_hidden_size]."""

    def __init__(self, config: QwenVisionConfig, patch_weight: torch.Tensor,
                 blocks: list[QwenVisionBlock], merger_norm: torch.Tensor,
                 merger_in: _Dense, merger_out: _Dense):
        super().__init__()
        self.config = config
        self.register_buffer("patch_weight", patch_weight.reshape(patch_weight.shape[0], -1),
                             persistent=False)
        self.blocks = nn.ModuleList(blocks)
        self.register_buffer("merger_norm", merger_norm, persistent=False)
        self.merger_in, self.merger_out = merger_in, merger_out
        self.batched_windows = True  # False: one attention call per window (Segments)
        quarter = config.head_dim // 2
        self.inv_freq = 1.0 / config.rope_theta ** (
            torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        config = self.config
        unit = config.merge_size**2
        if patches.shape != (sum(t * h * w for t, h, w in grids), self.patch_weight.shape[1]):
            raise ValueError(f"patches {list(patches.shape)} do not match grids {list(grids)}")
        order, windows = window_order(grids, config.merge_size, config.window_tokens)
        # Whole merge blocks move together: patch i of block order[j] goes to j * unit + i.
        patch_order = (order[:, None] * unit + torch.arange(unit)).reshape(-1)
        x = F.linear(patches.to(self.patch_weight.device, self.patch_weight.dtype),
                     self.patch_weight)
        device = x.device
        x = x[patch_order.to(device)]
        positions = patch_positions(grids, config.merge_size)[patch_order].float()
        angles = (positions[:, :, None] * self.inv_freq).flatten(1)  # [N, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)[:, None].to(device)  # [N, 1, head_dim]
        cos, sin = angles.cos(), angles.sin()
        frames = [h * w for t, h, w in grids for _ in range(t)]
        # Frames (a few, of any sizes) one call each; windows (many, nearly all one size)
        # in one batched call.
        full = Segments(frames)
        windowed = Segments.batched(windows, device) if self.batched_windows else Segments(windows)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in config.full_attention_blocks else windowed)
        merged = _rms_norm(x, self.merger_norm).view(-1, unit * x.shape[-1])
        merged = self.merger_out(F.gelu(self.merger_in(merged)))
        return merged[torch.argsort(order).to(device)]


def load_qwen_vision_tower(config: QwenVisionConfig, tensor: Callable[[str], torch.Tensor],
                           prefix: str) -> QwenVisionTower:
    """The tower from tensors named as transformers names them under `prefix`
    ("visual." in hub checkpoints, "model.visual." in transformers' modules)."""

    def dense(name: str) -> _Dense:
        return _Dense(tensor(f"{prefix}{name}.weight"), tensor(f"{prefix}{name}.bias"))

    blocks = []
    for i in range(config.depth):
        at = f"blocks.{i}."
        blocks.append(QwenVisionBlock(
            config, tensor(f"{prefix}{at}norm1.weight"), dense(at + "attn.qkv"),
            dense(at + "attn.proj"), tensor(f"{prefix}{at}norm2.weight"),
            dense(at + "mlp.gate_proj"), dense(at + "mlp.up_proj"), dense(at + "mlp.down_proj"),
        ))
    return QwenVisionTower(
        config, tensor(prefix + "patch_embed.proj.weight"), blocks,
        tensor(prefix + "merger.ln_q.weight"), dense("merger.mlp.0"), dense("merger.mlp.2"),
    ).eval()
