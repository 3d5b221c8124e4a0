"""Attention arithmetic shared by the model's attention layer and the paged cache:
grouped-query scores with an optional soft-cap, masks and per-head sinks (PyTorch, any
device). The paged cache's CUDA kernels are tested against these."""

from __future__ import annotations

import torch


def softcapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         allowed: torch.Tensor | None, scale: float, softcap: float | None,
                         block: int = 512, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with scores softcap * tanh(q.k * scale / softcap) (Gemma 2; softcap
    None: q.k * scale) and optional per-head `sinks` [H] (gpt-oss: a logit in every
    softmax whose probability goes to no value): query
    [B, H, T, D], key and value [B, KV, S, D], `allowed` (boolean, [B or 1, 1, T, S] or
    [T, S]; None: every key) -> [B, H, T, D]. Query heads sharing a kv head are
    stacked as rows of one matmul, so kv heads are never copied; queries go `block` at
    a time so a long prompt never holds all T x S scores at once."""
    steps = query.shape[2]
    if steps > block:
        return torch.cat([
            softcapped_attention(
                query[:, :, start : start + block], key, value,
                None if allowed is None else allowed[..., start : start + block, :],
                scale, softcap, block, sinks,
            )
            for start in range(0, steps, block)
        ], dim=2)
    batch, heads, steps, dim = query.shape
    kv_heads, span = key.shape[1], key.shape[2]
    group = heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group * steps, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(batch, kv_heads, group, steps, span)
    if allowed is not None:
        allowed = allowed.reshape(-1, 1, 1, steps, span)
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(kv_heads, group))
    probs = probs.to(value.dtype)
    out = torch.matmul(probs.view(batch, kv_heads, group * steps, span), value)
    return out.reshape(batch, heads, steps, dim)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """float32 softmax over the last dim of scores [B, KV, G, T, S] (or [B, KV, G, S]),
    with sinks [KV, G] as one more logit per head whose probability is dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    scores = scores.float()
    shape = (1, *sinks.shape) + (1,) * (scores.dim() - 3)
    sink = sinks.float().view(shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
