"""Grouped-query self-attention with RoPE, optional q/k RMSNorm and sliding windows,
and Gemma's options: a score scale other than head_dim**-0.5, tanh soft-capping of the
scores, a separate rope for sliding layers.

q, k and v come from one fused projection (a `Linear`: dense weights concatenated at
load time, so a decode step runs one matmul instead of three; or EXL3 layers side by
side), see engine/layers/linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.engine.kvcache.attention_cache import AttentionCache
from exl3cli.engine.kvcache.attention_math import softcapped_attention
from exl3cli.engine.layers.linear import Linear
from exl3cli.engine.layers.norm import RMSNorm
from exl3cli.ops import cpu_kernels
from exl3cli.ops.reference import apply_rotary


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
    # The step's cache (PagedBatch, FixedDecodeStep, ...), or None: no cache.
    cache: AttentionCache | None = None
    # Rope tables of sliding layers when they have their own rope (Gemma 3), else None.
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None
    # [B, T] image run of each position (-1: text) when the step holds image tokens:
    # those attend bidirectionally within their run (Gemma 3), else None.
    blocks: torch.Tensor | None = None
    _masks: dict[int | None, tuple[torch.Tensor | None, bool]] = field(default_factory=dict)
    # What one fused decode layer hands the next (engine/layers/fused_layer.py, the
    # "norm" fold of ops/layer_fold.py): (producer, its output, the next q/k/v input).
    carry: Any = None

    def rope(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for a layer: the sliding layers' own tables when `local`."""
        if local:
            if self.local_cos is None or self.local_sin is None:
                raise ValueError("this step has no rope tables for sliding layers")
            return self.local_cos, self.local_sin
        return self.cos, self.sin

    def mask(self, window: int | None) -> tuple[torch.Tensor | None, bool]:
        """(boolean mask [B or 1, 1, T, span] or None, is_causal) for SDPA; cached."""
        if window not in self._masks:
            self._masks[window] = self._build_mask(window)
        return self._masks[window]

    def _build_mask(self, window: int | None) -> tuple[torch.Tensor | None, bool]:
        steps = self.positions.shape[1]
        if self.start is not None and self.blocks is None:
            last = self.start + steps - 1  # highest position any query has
            window_irrelevant = window is None or last < window
            if window_irrelevant and steps == 1:
                return None, False  # one query per row sees every cached key
            if window_irrelevant and self.start == 0:
                return None, True  # plain causal square, SDPA's fast path
        keys = torch.arange(self.span, device=self.positions.device)
        queries = self.positions[:, :, None]
        allowed = keys <= queries
        if self.blocks is not None and self.start == 0 and self.span == steps:
            same = self.blocks[:, :, None] == self.blocks[:, None, :]
            allowed = allowed | (same & (self.blocks[:, :, None] >= 0))
        if window is not None:
            allowed &= keys > queries - window
        return allowed[:, None], False


class Attention(nn.Module):
    """One attention block; `window` is the sliding window of this layer or None.

    `scale` (None: head_dim**-0.5) multiplies q.k; it is folded into the query, so every
    attention kernel (fused CPU ops, paged, SDPA) applies it unchanged. `softcap` maps
    scores to softcap * tanh(scores / softcap) before the mask: only the eager
    `softcapped_attention` (kvcache.attention_math) does that, never the fused kernels (contiguous
    or paged). `local_rope`: this layer rotates with the step's sliding-layer tables;
    `rope=False`: it does not rotate at all. `sinks` [heads] (gpt-oss): one more logit
    per head in every softmax over keys, with no value; like `softcap`, only the eager
    path applies it (and the paged steps' PyTorch references). `position_query_scale`
    (beta, length) (Ministral 3): rotated queries are multiplied by
    1 + beta * log(1 + floor(position / length)).
    """

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
        *,
        scale: float | None = None,
        softcap: float | None = None,
        local_rope: bool = False,
        rope: bool = True,
        sinks: torch.Tensor | None = None,
        position_query_scale: tuple[float, float] | None = None,
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
        self.scale = scale
        self.softcap = softcap
        self.local_rope = local_rope
        self.rope = rope  # False: this layer's q and k are not rotated (SmolLM3's NoPE)
        self.register_buffer("sinks", None if sinks is None else sinks.float(), persistent=False)
        self.position_query_scale = position_query_scale
        # The query multiplier that turns SDPA's head_dim**-0.5 into `scale`.
        self._query_factor = None if scale is None else scale * head_dim**0.5
        self._fused: bool | None = None  # see _use_fused

    def forward(self, x: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        batch, steps, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x)
        qkv = qkv.view(batch, steps, heads + 2 * kv_heads, self.head_dim)
        fused = self._use_fused(qkv)
        # q and k heads are normalised and rotated together: one op each instead of two.
        qk = qkv[:, :, : heads + kv_heads]
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        cos, sin = step.rope(self.local_rope)
        if not self.rope:
            pass
        elif fused:  # in place on the fresh projection (or norm) output: one pass
            rows = batch * steps
            qk = cpu_kernels.rotary_cpu(
                qk.reshape(rows, -1, self.head_dim) if qk.is_contiguous()
                else qkv.view(rows, heads + 2 * kv_heads, self.head_dim),
                cos.reshape(rows, self.head_dim), sin.reshape(rows, self.head_dim),
                heads + kv_heads,
            )[:, : heads + kv_heads].view(batch, steps, heads + kv_heads, self.head_dim)
        else:
            qk = apply_rotary(qk, cos, sin)
        if self.position_query_scale is not None:
            beta, length = self.position_query_scale
            factor = 1 + beta * torch.log1p(torch.floor(step.positions / length))
            qk = torch.cat([qk[:, :, :heads] * factor[:, :, None, None].to(qk.dtype),
                            qk[:, :, heads:]], dim=2)
        return self.o(self.attend(qk, qkv[:, :, heads + kv_heads :], step))

    def attend(self, qk: torch.Tensor, value: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        """Cache write and attention for rotated q and k heads qk [B, T, H + KV, D] and
        value [B, T, KV, D]: the input of the o projection, [B, T, H * D]."""
        batch, steps = qk.shape[:2]
        heads = self.num_heads
        query = qk[:, :, :heads].transpose(1, 2)
        key = qk[:, :, heads:].transpose(1, 2)
        value = value.transpose(1, 2)
        if self.softcap is not None or self.sinks is not None:
            out = self._attend_softcapped(query, key, value, step)
            return out.transpose(1, 2).reshape(batch, steps, heads * self.head_dim)
        if self._query_factor is not None:
            query = query * self._query_factor
        if step.cache is not None:  # per-sequence attention over pages
            out = step.cache.attend(self.layer_index, query, key, value, self.window)
            return out.transpose(1, 2).reshape(batch, steps, heads * self.head_dim)
        # No cache: every row is a whole sequence from position 0 (prompts, evaluation).
        mask, is_causal = step.mask(self.window)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=is_causal,
            enable_gqa=heads != self.num_kv_heads,
        )
        return out.transpose(1, 2).reshape(batch, steps, heads * self.head_dim)

    def _attend_softcapped(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           step: AttentionStep) -> torch.Tensor:
        """`attend` with soft-capped scores and/or sinks: [B, H, T, D]."""
        scale = self.scale if self.scale is not None else self.head_dim**-0.5
        if step.cache is not None:
            extra = {} if self.sinks is None else {"sinks": self.sinks}
            return step.cache.attend(self.layer_index, query, key, value, self.window,
                                     softcap=self.softcap, scale=scale, **extra)
        mask, is_causal = step.mask(self.window)
        if is_causal:  # the plain square that SDPA would mask itself
            steps = query.shape[2]
            mask = torch.ones(steps, steps, dtype=torch.bool, device=query.device).tril()
        return softcapped_attention(query, key, value, mask, scale, self.softcap,
                                    sinks=self.sinks)

    def _use_fused(self, qkv: torch.Tensor) -> bool:
        """Fused CPU ops (cpu_kernels) for float32 on CPU; the answer is kept per module.
        Not when q/k/v need a gradient: the fused rotary has no backward."""
        if (qkv.dtype != torch.float32 or qkv.device.type != "cpu" or self.head_dim > 512
                or qkv.requires_grad):
            return False
        if self._fused is None:
            self._fused = cpu_kernels.available()
        return self._fused
