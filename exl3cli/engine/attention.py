"""Grouped-query self-attention with RoPE, optional q/k RMSNorm and sliding windows.

q, k and v come from one fused projection (a `Linear`: dense weights concatenated at
load time, so a decode step runs one matmul instead of three; or EXL3 layers side by
side), see engine/linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.engine.cache import KVCache
from exl3cli.engine.linear import Linear
from exl3cli.engine.norm import RMSNorm
from exl3cli.engine.rope import apply_rotary


@dataclass
class AttentionStep:
    """What every layer of one forward step shares: positions, rotary tables, masks.

    positions [B, T] are absolute token positions; `span` is how many key positions
    the step attends over (max over rows of cached length + T); `start` is the common
    cached length when all rows are aligned, else None.
    """

    positions: torch.Tensor
    cos: torch.Tensor  # [B, T, 1, head_dim]
    sin: torch.Tensor
    span: int
    start: int | None
    cache: KVCache | Any = None  # or a paged step (paged_attention.PagedBatch)
    _masks: dict[int | None, tuple[torch.Tensor | None, bool]] = field(default_factory=dict)

    def mask(self, window: int | None) -> tuple[torch.Tensor | None, bool]:
        """(boolean mask [B or 1, 1, T, span] or None, is_causal) for SDPA; cached."""
        if window not in self._masks:
            self._masks[window] = self._build_mask(window)
        return self._masks[window]

    def _build_mask(self, window: int | None) -> tuple[torch.Tensor | None, bool]:
        steps = self.positions.shape[1]
        if self.start is not None:
            last = self.start + steps - 1  # highest position any query has
            window_irrelevant = window is None or last < window
            if window_irrelevant and steps == 1:
                return None, False  # one query per row sees every cached key
            if window_irrelevant and self.start == 0:
                return None, True  # plain causal square, SDPA's fast path
        keys = torch.arange(self.span, device=self.positions.device)
        queries = self.positions[:, :, None]
        allowed = keys <= queries
        if window is not None:
            allowed &= keys > queries - window
        return allowed[:, None], False


class Attention(nn.Module):
    """One attention block; `window` is the sliding window of this layer or None."""

    def __init__(
        self,
        layer_index: int,
        qkv: Linear,
        o: Linear,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: RMSNorm | None,
        window: int | None,
    ):
        super().__init__()
        self.layer_index = layer_index
        self.qkv = qkv
        self.o = o
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.qk_norm = qk_norm
        self.window = window

    def forward(self, x: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        batch, steps, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x)
        qkv = qkv.view(batch, steps, heads + 2 * kv_heads, self.head_dim)
        # q and k heads are normalised and rotated together: one op each instead of two.
        qk = qkv[:, :, : heads + kv_heads]
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        qk = apply_rotary(qk, step.cos, step.sin)
        query = qk[:, :, :heads].transpose(1, 2)
        key = qk[:, :, heads:].transpose(1, 2)
        value = qkv[:, :, heads + kv_heads :].transpose(1, 2)
        if getattr(step.cache, "paged", False):  # per-sequence attention over pages
            out = step.cache.attend(self.layer_index, query, key, value, self.window)
            out = out.transpose(1, 2).reshape(batch, steps, heads * self.head_dim)
            return self.o(out)
        if step.cache is not None:
            key, value = step.cache.write(self.layer_index, key, value, step.positions, step.span)
        mask, is_causal = step.mask(self.window)
        if steps == 1 and (mask is None or (query.is_cuda and heads != kv_heads)):
            # One query per row: grouped matmuls, kv heads never repeated (SDPA's masked
            # GQA path would copy them for every query head).
            out = decode_attention(query, key, value, mask)
        else:
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, is_causal=is_causal,
                enable_gqa=heads != kv_heads,
            )
        out = out.transpose(1, 2).reshape(batch, steps, heads * self.head_dim)
        return self.o(out)


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per row over all keys: query [B, H, 1, D], key and value
    [B, KV, S, D], `mask` (boolean [B or 1, 1, 1, S], True = may attend) or None. The
    query heads that share a kv head are stacked as rows of one matmul, so kv heads are
    never copied; on CPU this beats SDPA's kernel for T = 1."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * dim**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).reshape(batch, heads, 1, dim)
